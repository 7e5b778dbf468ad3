//! The block-verification kernel as a Burn backend extension, and the types of its signature.

use burn::backend::{
    Backend, ExtensionType, backend_extension,
    tensor::{FloatTensor, IntTensor},
};
use burn::tensor::Shape;

use super::kernel;

/// The schemes the block-verification kernel implements ([`crate::Scheme::SingleDraft`] runs
/// as [`KernelScheme::SpecInfer`]: same plan with K = 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelScheme {
    /// [`crate::Scheme::SingleDraft`] and [`crate::Scheme::SpecInfer`].
    SpecInfer,
    /// [`crate::Scheme::SpecTr`].
    SpecTr,
    /// [`crate::Scheme::SequentialImportance`], for `V <=` [`super::IS_MAX_VOCAB`].
    SequentialImportance,
}

impl KernelScheme {
    /// The kernel's comptime scheme code.
    #[cfg_attr(not(feature = "cube"), allow(dead_code))]
    pub(super) fn code(self) -> u32 {
        match self {
            Self::SpecInfer => kernel::SCHEME_SPECINFER,
            Self::SpecTr => kernel::SCHEME_SPECTR,
            Self::SequentialImportance => kernel::SCHEME_IS,
        }
    }
}

/// The four outputs of [`SpecDecKernels::specdec_verify_blocks`], as backend primitives (the
/// fields of [`super::DeviceBlockOutcome`]).
#[derive(ExtensionType)]
#[extension_type(fusion: cfg(all(feature = "cube", feature = "fusion")))]
pub struct BlockVerdicts<B: Backend> {
    /// `[B, L + 1]`, see [`super::DeviceBlockOutcome::tokens`].
    pub tokens: IntTensor<B>,
    /// `[B]`, see [`super::DeviceBlockOutcome::accepted`].
    pub accepted: IntTensor<B>,
    /// `[B, K]`, see [`super::DeviceBlockOutcome::survivors`].
    pub survivors: IntTensor<B>,
    /// `[B]`, see [`super::DeviceBlockOutcome::status`].
    pub status: IntTensor<B>,
}

/// The block-verification kernel as a Burn backend extension: `CubeBackend` runs it, Burn's
/// `Dispatch` routes to it, and `Fusion<CubeBackend>` (generated) registers each call as a
/// custom operation of the fused stream.
///
/// Call it through [`super::verify_blocks`], which validates the inputs and checks the device first;
/// the method assumes valid input. It is forward only and has no tensor-op reference: on other
/// devices [`super::verify_blocks`] returns [`crate::SpecDecError::NoDeviceKernel`] and callers verify on the
/// host ([`crate::verify_block`]).
#[backend_extension(
    Cube: cfg(feature = "cube"),
    Fusion: cfg(all(feature = "cube", feature = "fusion")),
)]
pub trait SpecDecKernels: Backend {
    /// Verifies `B` blocks of `K` drafted continuations of length `L` with `scheme`, one
    /// sequence per cube (see [`super::verify_blocks`]).
    ///
    /// # Shapes
    /// - `target_probs`: `[B, K, L + 1, V]` float (any float dtype: cast to f32)
    /// - `draft_probs`: `[B, K, L, V]` float (cast to f32)
    /// - `drafts`: `[B, K, L]` int
    /// - `uniforms`: `[B, L + 1, K + 2]` float (cast to f32)
    /// - returns `tokens [B, L + 1]`, `accepted [B]`, `survivors [B, K]`, `status [B]`, in
    ///   `drafts`' int dtype
    #[fusion(meta = verdicts_meta)]
    // Without a CubeCL runtime, the generated `Dispatch` method only panics.
    #[cfg_attr(not(feature = "cube"), allow(unused_variables))]
    fn specdec_verify_blocks(
        target_probs: FloatTensor<Self>,
        draft_probs: FloatTensor<Self>,
        drafts: IntTensor<Self>,
        uniforms: FloatTensor<Self>,
        scheme: KernelScheme,
    ) -> BlockVerdicts<Self>;
}

/// The output shapes of [`SpecDecKernels::specdec_verify_blocks`] from `target_probs`
/// (`[B, K, L + 1, V]`): `[B, L + 1]`, `[B]`, `[B, K]`, `[B]`.
pub fn verdict_shapes(target_probs: &Shape) -> [Shape; 4] {
    let (batch, k, positions) = (target_probs[0], target_probs[1], target_probs[2]);
    [
        Shape::new([batch, positions]),
        Shape::new([batch]),
        Shape::new([batch, k]),
        Shape::new([batch]),
    ]
}

/// Fusion's output metadata: the shapes of [`verdict_shapes`] in `drafts`' int dtype.
#[cfg(all(feature = "cube", feature = "fusion"))]
fn verdicts_meta(
    target_probs: &burn::backend::fusion::custom::TensorSpec,
    _draft_probs: &burn::backend::fusion::custom::TensorSpec,
    drafts: &burn::backend::fusion::custom::TensorSpec,
    _uniforms: &burn::backend::fusion::custom::TensorSpec,
    _scheme: &KernelScheme,
) -> BlockVerdictsMetadata {
    use burn::backend::fusion::custom::TensorSpec;
    let [tokens, accepted, survivors, status] = verdict_shapes(&target_probs.shape);
    let spec = |shape| TensorSpec::new(shape, drafts.dtype);
    BlockVerdictsMetadata {
        tokens: spec(tokens),
        accepted: spec(accepted),
        survivors: spec(survivors),
        status: spec(status),
    }
}
