//! Batched block verification on the device: [`verify_blocks`] runs [`crate::verify_block`] for
//! every sequence of a batch in one CubeCL kernel (any CubeCL runtime: CUDA, wgpu/Vulkan, ...).
//!
//! One cube verifies one sequence. It walks the positions of the block and the surviving drafts
//! exactly as the host does, computing each position's plan (residual chains, SpecTr's `rho` by
//! bisection, the importance-sampling candidates and their reserve fixed point) with each unit
//! owning a contiguous chunk of the vocabulary, and the scalar decisions identically in every unit. The
//! uniforms are consumed in the host's layout (crate docs, "Randomness consumption"), so the
//! same uniforms give the same tokens. The device computes in `f32` where the host uses `f64`:
//! a decision can differ only when a uniform lies within rounding distance (about 1e-6
//! relative) of its threshold, or when two importance-sampling candidates tie to rounding.
//!
//! [`Scheme::Optimal`] (an LP per position) has no kernel: it returns
//! [`SpecDecError::UnsupportedOnDevice`], and callers verify on the host instead.

mod cube;
mod kernel;

use burn::tensor::{DType, Int, Shape, Tensor, backend::Backend};
use burn_cubecl::{
    BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, kernel::into_contiguous,
    ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::prelude::*;

use crate::error::{Result, SpecDecError};
use crate::{Scheme, uniforms_per_token};

pub use kernel::{STATUS_BAD_ROW, STATUS_BAD_TOKEN};

type Cb<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// Token written after the end of a block in [`DeviceBlockOutcome::tokens`].
pub const PAD_TOKEN: i32 = -1;

/// The verdicts on a batch of blocks (the device counterpart of [`crate::BlockOutcome`]).
#[derive(Clone, Debug)]
pub struct DeviceBlockOutcome<B: Backend> {
    /// `[B, L + 1]`: the `accepted + 1` emitted tokens of each sequence (accepted draft tokens,
    /// then a residual or bonus token), then [`PAD_TOKEN`].
    pub tokens: Tensor<B, 2, Int>,
    /// `[B]`: number of accepted draft tokens, `0..=L`.
    pub accepted: Tensor<B, 1, Int>,
    /// `[B, K]`: 1 for the drafts whose first `accepted` tokens are the accepted tokens, else 0.
    pub survivors: Tensor<B, 2, Int>,
    /// `[B]`: 0, or a bit set of [`STATUS_BAD_ROW`] (a row the walk used is not a
    /// distribution) and [`STATUS_BAD_TOKEN`] (a drafted token outside the vocabulary or with
    /// zero draft probability), where the host would return an error. The other outputs of
    /// such a sequence are written but meaningless.
    pub status: Tensor<B, 1, Int>,
}

/// Largest vocabulary the importance-sampling kernel runs. On lavapipe it produced wrong tokens
/// at V = 16384 (a residual token 0) and above ~17k (unwritten outputs), for reasons not yet
/// understood, while thousands of sequences at V ≤ 1000 matched the host: larger vocabularies
/// get [`SpecDecError::DeviceVocabTooLarge`] and verify on the host.
pub const IS_MAX_VOCAB: usize = 1024;

/// Verifies `B` blocks of `K` drafted continuations of length `L` with `scheme`, one sequence
/// per cube; sequence `b` gets the verdict of [`crate::verify_block`] on its rows with the
/// uniforms `uniforms[b]` (module docs for the precision caveat).
///
/// # Shapes
/// - `target_probs`: `[B, K, L + 1, V]` float; row `(b, k, j)` is (proportional to) the
///   target's distribution after prefix `b` and draft `k`'s first `j` tokens. Rows are
///   normalised in the kernel.
/// - `draft_probs`: `[B, K, L, V]` float; row `(b, k, j)` is the distribution draft token
///   `drafts[b, k, j]` was drawn from.
/// - `drafts`: `[B, K, L]` int, tokens in `0..V`.
/// - `uniforms`: `[B, L + 1, K + 2]` float in `[0, 1)`; position `j` consumes
///   `uniforms[b, j, 0..K_j + 2]` (`K_j` surviving drafts, in the layout of
///   [`crate::uniforms_per_token`]) and the bonus token `uniforms[b, L, 0]`.
/// - returns [`DeviceBlockOutcome`]: `tokens [B, L + 1]`, `accepted [B]`, `survivors [B, K]`
///   and `status [B]`, in the backend's int dtype.
///
/// Non-f32 float inputs are cast to f32 first. Scratch memory: `V` floats per sequence, times
/// `3K` for [`Scheme::ImportanceSampling`].
///
/// # Errors
/// [`SpecDecError::UnsupportedOnDevice`] for [`Scheme::Optimal`],
/// [`SpecDecError::DeviceVocabTooLarge`] for [`Scheme::ImportanceSampling`] with
/// `V > IS_MAX_VOCAB`,
/// [`SpecDecError::SingleDraftOnly`] for [`Scheme::SingleDraft`] with `K != 1`,
/// [`SpecDecError::NoDrafts`] (`K = 0`), [`SpecDecError::EmptyVocabulary`] (`V = 0`),
/// [`SpecDecError::ShapeMismatch`] when the shapes disagree (`drafts` fixes `B, K, L`,
/// `target_probs` fixes `V`), and [`SpecDecError::TooLarge`] when a buffer exceeds 32-bit
/// indexing. Invalid values are reported per sequence in [`DeviceBlockOutcome::status`].
pub fn verify_blocks<R, F, I, BT>(
    scheme: Scheme,
    target_probs: Tensor<Cb<R, F, I, BT>, 4>,
    draft_probs: Tensor<Cb<R, F, I, BT>, 4>,
    drafts: Tensor<Cb<R, F, I, BT>, 3, Int>,
    uniforms: Tensor<Cb<R, F, I, BT>, 3>,
) -> Result<DeviceBlockOutcome<Cb<R, F, I, BT>>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let [batch, k, l] = drafts.dims();
    let code = scheme_code(scheme, k)?;
    if k == 0 {
        return Err(SpecDecError::NoDrafts);
    }
    let v = target_probs.dims()[3];
    if v == 0 {
        return Err(SpecDecError::EmptyVocabulary);
    }
    if code == kernel::SCHEME_IS && v > IS_MAX_VOCAB {
        return Err(SpecDecError::DeviceVocabTooLarge {
            scheme,
            vocab: v,
            max: IS_MAX_VOCAB,
        });
    }
    check_shape("target_probs", &target_probs.dims(), &[batch, k, l + 1, v])?;
    check_shape("draft_probs", &draft_probs.dims(), &[batch, k, l, v])?;
    check_shape(
        "uniforms",
        &uniforms.dims(),
        &[batch, l + 1, uniforms_per_token(k)],
    )?;
    let rows = if code == kernel::SCHEME_IS { 3 * k } else { 1 };
    let largest = [
        batch * k * (l + 1) * v,
        batch * rows * v,
        batch * (l + 1) * uniforms_per_token(k),
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    if largest > u32::MAX as usize {
        return Err(SpecDecError::TooLarge {
            what: "device buffer elements",
            needed: largest as u128,
            limit: u32::MAX as u128,
        });
    }

    let device = drafts.device();
    let int_dtype = drafts.dtype();
    if batch == 0 {
        return Ok(DeviceBlockOutcome {
            tokens: Tensor::empty([0, l + 1], (&device, int_dtype)),
            accepted: Tensor::empty([0], (&device, int_dtype)),
            survivors: Tensor::empty([0, k], (&device, int_dtype)),
            status: Tensor::empty([0], (&device, int_dtype)),
        });
    }

    // With L = 0 the draft tensors are empty; the kernel never reads them, but a binding
    // needs a buffer.
    let (draft_probs, drafts) = if l == 0 {
        (
            Tensor::<Cb<R, F, I, BT>, 1>::zeros([1], (&device, DType::F32)).reshape([1, 1, 1, 1]),
            Tensor::<Cb<R, F, I, BT>, 1, Int>::zeros([1], (&device, int_dtype)).reshape([1, 1, 1]),
        )
    } else {
        (draft_probs, drafts)
    };
    let target = f32_primitive(target_probs);
    let draft = f32_primitive(draft_probs);
    let uniforms = f32_primitive(uniforms);
    let drafts = into_contiguous(drafts.into_primitive());
    let client = target.client.clone();
    let cube_device = target.device.clone();

    let alloc = |shape: Vec<usize>, dtype: DType| {
        empty_device_contiguous_dtype::<R>(
            client.clone(),
            cube_device.clone(),
            Shape::from(shape),
            dtype,
        )
    };
    let scratch = alloc(vec![batch * rows * v], DType::F32);
    let tokens = alloc(vec![batch, l + 1], int_dtype);
    let accepted = alloc(vec![batch], int_dtype);
    let survivors = alloc(vec![batch, k], int_dtype);
    let status = alloc(vec![batch], int_dtype);

    let units = cube_units(&client, v);
    kernel::verify_blocks_kernel::launch::<R>(
        &client,
        grid(&client, batch),
        CubeDim::new_1d(units),
        target.into_tensor_arg(),
        draft.into_tensor_arg(),
        drafts.into_tensor_arg(),
        uniforms.into_tensor_arg(),
        scratch.into_tensor_arg(),
        tokens.clone().into_tensor_arg(),
        accepted.clone().into_tensor_arg(),
        survivors.clone().into_tensor_arg(),
        status.clone().into_tensor_arg(),
        batch,
        k,
        l,
        v,
        code,
        k,
        units as usize,
        rows,
        int_dtype.into(),
    );

    Ok(DeviceBlockOutcome {
        tokens: Tensor::from_primitive(tokens),
        accepted: Tensor::from_primitive(accepted),
        survivors: Tensor::from_primitive(survivors),
        status: Tensor::from_primitive(status),
    })
}

/// The kernel's scheme code; errors for schemes without a kernel.
fn scheme_code(scheme: Scheme, k: usize) -> Result<u32> {
    match scheme {
        Scheme::SingleDraft if k != 1 => Err(SpecDecError::SingleDraftOnly { drafts: k }),
        Scheme::SingleDraft | Scheme::SpecInfer => Ok(kernel::SCHEME_SPECINFER),
        Scheme::SpecTr => Ok(kernel::SCHEME_SPECTR),
        Scheme::ImportanceSampling => Ok(kernel::SCHEME_IS),
        Scheme::Optimal(_) => Err(SpecDecError::UnsupportedOnDevice { scheme }),
    }
}

fn check_shape(tensor: &'static str, found: &[usize], expected: &[usize]) -> Result<()> {
    if found == expected {
        Ok(())
    } else {
        Err(SpecDecError::ShapeMismatch {
            tensor,
            expected: expected.to_vec(),
            found: found.to_vec(),
        })
    }
}

fn f32_primitive<R, F, I, BT, const D: usize>(t: Tensor<Cb<R, F, I, BT>, D>) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let t = if t.dtype() == DType::F32 {
        t
    } else {
        t.cast(DType::F32)
    };
    into_contiguous(t.into_primitive().tensor())
}

/// Units per cube: a power of two (the tree reductions halve evenly), 32 to 256.
fn cube_units<R: Runtime>(client: &ComputeClient<R>, vocab: usize) -> u32 {
    let max_units = client.properties().hardware.max_cube_dim.0.min(256);
    (vocab.min(1 << 16) as u32)
        .next_power_of_two()
        .clamp(32, max_units.max(32))
}

/// One cube per sequence; sequences beyond one grid dimension spill into the second.
fn grid<R: Runtime>(client: &ComputeClient<R>, sequences: usize) -> CubeCount {
    let max_x = client.properties().hardware.max_cube_count.0.min(65_535) as usize;
    let cubes_x = sequences.clamp(1, max_x);
    CubeCount::Static(cubes_x as u32, sequences.div_ceil(cubes_x) as u32, 1)
}
