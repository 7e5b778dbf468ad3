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
//! [`Scheme::Optimal`] and [`Scheme::WeightedImportance`] (an LP per position) have no kernel:
//! they return
//! [`SpecDecError::UnsupportedOnDevice`], and callers verify on the host instead.
//!
//! The kernel is the Burn backend extension [`SpecDecKernels`] (`CubeBackend`, and
//! `Fusion<CubeBackend>` where Burn fuses): [`verify_blocks`] validates its inputs, asks
//! `burn_kernels_core::route::route` whether the tensors' device runs kernels, and calls it
//! through Burn's `Dispatch`. Unlike the other ops of these crates it has no tensor-op
//! reference: the host verifier ([`crate::verify_block`]) is the fallback, and it is the
//! caller's, so on a device without the kernel (Burn's `Flex` CPU backend, a device with
//! autodiff, a build without a CubeCL runtime feature) [`verify_blocks`] returns
//! [`SpecDecError::NoDeviceKernel`].

// The kernels build without a CubeCL runtime too; only the `CubeBackend` implementation
// (behind the `cube` feature) launches them.
#[cfg_attr(not(feature = "cube"), allow(dead_code))]
mod cube;
#[cfg_attr(not(feature = "cube"), allow(dead_code))]
mod importance;
#[cfg_attr(not(feature = "cube"), allow(dead_code))]
mod kernel;
#[cfg_attr(not(feature = "cube"), allow(dead_code))]
mod rows;
// Apart from the crate's `Result` alias, which the `ExtensionType` derive would pick up.
mod extension;

use burn::backend::Dispatch;
use burn::tensor::{Int, Tensor};
use burn_kernels_core::route::{Grad, cube_device, route};

use crate::error::{Result, SpecDecError};
use crate::{Scheme, uniforms_per_token};

#[cfg(all(feature = "cube", feature = "fusion"))]
pub use extension::BlockVerdictsMetadata;
pub use extension::{BlockVerdicts, KernelScheme, SpecDecKernels, verdict_shapes};
pub use kernel::{STATUS_BAD_ROW, STATUS_BAD_TOKEN};

/// Token written after the end of a block in [`DeviceBlockOutcome::tokens`].
pub const PAD_TOKEN: i32 = -1;

/// The name [`verify_blocks`] routes and counts launches under
/// (`burn_kernels_core::route::launches`).
pub const OP_NAME: &str = "specdec_verify";

/// The verdicts on a batch of blocks (the device counterpart of [`crate::BlockOutcome`]).
#[derive(Clone, Debug)]
pub struct DeviceBlockOutcome {
    /// `[B, L + 1]`: the `accepted + 1` emitted tokens of each sequence (accepted draft tokens,
    /// then a residual or bonus token), then [`PAD_TOKEN`].
    pub tokens: Tensor<2, Int>,
    /// `[B]`: number of accepted draft tokens, `0..=L`.
    pub accepted: Tensor<1, Int>,
    /// `[B, K]`: 1 for the drafts whose first `accepted` tokens are the accepted tokens, else 0.
    pub survivors: Tensor<2, Int>,
    /// `[B]`: 0, or a bit set of [`STATUS_BAD_ROW`] (a row the walk used is not a
    /// distribution) and [`STATUS_BAD_TOKEN`] (a drafted token outside the vocabulary or with
    /// zero draft probability), where the host would return an error. The other outputs of
    /// such a sequence are written but meaningless.
    pub status: Tensor<1, Int>,
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
/// The four tensors live on one device, which must run this crate's kernels (a CubeCL device
/// of a runtime this build enables, without autodiff). There is no tensor-op fallback: on any
/// other device the call returns [`SpecDecError::NoDeviceKernel`], and callers verify on the
/// host with [`crate::verify_block`].
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
///   and `status [B]`, in `drafts`' int dtype.
///
/// Non-f32 float inputs are cast to f32 first. Scratch memory: `V` floats per sequence, times
/// `3K` for [`Scheme::SequentialImportance`].
///
/// # Errors
/// [`SpecDecError::UnsupportedOnDevice`] for [`Scheme::Optimal`],
/// [`SpecDecError::DeviceVocabTooLarge`] for [`Scheme::SequentialImportance`] with
/// `V > IS_MAX_VOCAB`,
/// [`SpecDecError::SingleDraftOnly`] for [`Scheme::SingleDraft`] with `K != 1`,
/// [`SpecDecError::NoDrafts`] (`K = 0`), [`SpecDecError::EmptyVocabulary`] (`V = 0`),
/// [`SpecDecError::ShapeMismatch`] when the shapes disagree (`drafts` fixes `B, K, L`,
/// `target_probs` fixes `V`), [`SpecDecError::TooLarge`] when a buffer exceeds 32-bit
/// indexing, and [`SpecDecError::NoDeviceKernel`] on a device without the kernel (checked
/// after the others). Invalid values are reported per sequence in
/// [`DeviceBlockOutcome::status`].
pub fn verify_blocks(
    scheme: Scheme,
    target_probs: Tensor<4>,
    draft_probs: Tensor<4>,
    drafts: Tensor<3, Int>,
    uniforms: Tensor<3>,
) -> Result<DeviceBlockOutcome> {
    let [batch, k, l] = drafts.dims();
    let kernel_scheme = kernel_scheme(scheme, k)?;
    if k == 0 {
        return Err(SpecDecError::NoDrafts);
    }
    let v = target_probs.dims()[3];
    if v == 0 {
        return Err(SpecDecError::EmptyVocabulary);
    }
    if kernel_scheme == KernelScheme::SequentialImportance && v > IS_MAX_VOCAB {
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
    let rows = scratch_rows(kernel_scheme, k);
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

    // Everything the kernel cannot take is a typed error above, so nothing is `unsupported`
    // here: the route only asks whether the device runs kernels at all.
    let device = drafts.device();
    if !route(OP_NAME, &device, Grad::ForwardOnly, None) {
        let reason = if cube_device(&device).is_none() {
            "not a CubeCL device of a runtime this build enables (the crate's cuda, vulkan or \
             wgpu feature)"
        } else {
            "the device has autodiff and the kernel is forward only"
        };
        return Err(SpecDecError::NoDeviceKernel {
            device: format!("{device:?}"),
            reason,
        });
    }

    let out = Dispatch::specdec_verify_blocks(
        target_probs.into_dispatch(),
        draft_probs.into_dispatch(),
        drafts.into_dispatch(),
        uniforms.into_dispatch(),
        kernel_scheme,
    );
    Ok(DeviceBlockOutcome {
        tokens: Tensor::from_dispatch(out.tokens),
        accepted: Tensor::from_dispatch(out.accepted),
        survivors: Tensor::from_dispatch(out.survivors),
        status: Tensor::from_dispatch(out.status),
    })
}

/// Scratch rows of `V` floats per sequence: the work row, plus two candidate slots of `K` rows
/// and `K - 1` reserve-estimate rows for importance sampling.
fn scratch_rows(scheme: KernelScheme, k: usize) -> usize {
    if scheme == KernelScheme::SequentialImportance {
        3 * k
    } else {
        1
    }
}

/// The kernel's scheme; errors for schemes without a kernel.
fn kernel_scheme(scheme: Scheme, k: usize) -> Result<KernelScheme> {
    match scheme {
        Scheme::SingleDraft if k != 1 => Err(SpecDecError::SingleDraftOnly { drafts: k }),
        Scheme::SingleDraft | Scheme::SpecInfer => Ok(KernelScheme::SpecInfer),
        Scheme::SpecTr => Ok(KernelScheme::SpecTr),
        Scheme::SequentialImportance => Ok(KernelScheme::SequentialImportance),
        Scheme::Optimal(_) | Scheme::WeightedImportance(_) => {
            Err(SpecDecError::UnsupportedOnDevice { scheme })
        }
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

#[cfg(feature = "cube")]
mod cube_backend {
    use burn::backend::cubecl::dtype_to_storage_type;
    use burn::backend::tensor::{FloatTensor, IntTensor};
    use burn::tensor::{DType, Shape};
    use burn_cubecl::{
        CubeBackend,
        kernel::{cast, into_contiguous},
        ops::numeric::{empty_device_contiguous_dtype, zeros_client},
        tensor::CubeTensor,
    };
    use burn_kernels_core::route::count_launch;
    use cubecl::prelude::*;

    use super::{BlockVerdicts, KernelScheme, OP_NAME, SpecDecKernels, kernel, scratch_rows};
    use crate::uniforms_per_token;

    impl SpecDecKernels for CubeBackend {
        fn specdec_verify_blocks(
            target_probs: FloatTensor<Self>,
            draft_probs: FloatTensor<Self>,
            drafts: IntTensor<Self>,
            uniforms: FloatTensor<Self>,
            scheme: KernelScheme,
        ) -> BlockVerdicts<Self> {
            launch(target_probs, draft_probs, drafts, uniforms, scheme)
        }
    }

    /// Allocates the outputs and launches the kernel (nothing to launch for `B = 0`).
    fn launch(
        target_probs: CubeTensor,
        draft_probs: CubeTensor,
        drafts: CubeTensor,
        uniforms: CubeTensor,
        scheme: KernelScheme,
    ) -> BlockVerdicts<CubeBackend> {
        let [batch, k, positions, v] = target_probs.meta.shape().dims::<4>();
        let l = positions - 1;
        let client = target_probs.client.clone();
        let device = target_probs.device.clone();
        let int_dtype = drafts.dtype;
        let alloc = |shape: Shape, dtype: DType| {
            empty_device_contiguous_dtype(client.clone(), device.clone(), shape, dtype)
        };
        let [tokens, accepted, survivors, status] =
            super::verdict_shapes(target_probs.meta.shape());
        let out = BlockVerdicts {
            tokens: alloc(tokens, int_dtype),
            accepted: alloc(accepted, int_dtype),
            survivors: alloc(survivors, int_dtype),
            status: alloc(status, int_dtype),
        };
        if batch == 0 {
            return out;
        }

        // With L = 0 the draft tensors are empty; the kernel never reads them, but a binding
        // needs a buffer.
        let (draft_probs, drafts) = if l == 0 {
            let zeros = |dtype| {
                zeros_client(
                    client.clone(),
                    device.clone(),
                    Shape::new([1, 1, 1, 1]),
                    dtype,
                )
            };
            (zeros(DType::F32), zeros(int_dtype))
        } else {
            (draft_probs, drafts)
        };
        let target = f32_contiguous(target_probs);
        let draft = f32_contiguous(draft_probs);
        let uniforms = f32_contiguous(uniforms);
        let drafts = into_contiguous(drafts);
        let rows = scratch_rows(scheme, k);
        let scratch = alloc(Shape::new([batch * rows * v]), DType::F32);
        debug_assert_eq!(uniforms.meta.shape()[2], uniforms_per_token(k));

        let units = cube_units(&client, v);
        count_launch(OP_NAME);
        kernel::verify_blocks_kernel::launch(
            &client,
            grid(&client, batch),
            CubeDim::new_1d(units),
            target.into_tensor_arg(),
            draft.into_tensor_arg(),
            drafts.into_tensor_arg(),
            uniforms.into_tensor_arg(),
            scratch.into_tensor_arg(),
            out.tokens.clone().into_tensor_arg(),
            out.accepted.clone().into_tensor_arg(),
            out.survivors.clone().into_tensor_arg(),
            out.status.clone().into_tensor_arg(),
            batch,
            k,
            l,
            v,
            scheme.code(),
            k,
            units as usize,
            rows,
            dtype_to_storage_type(int_dtype),
        );
        out
    }

    /// `t` as a contiguous f32 tensor.
    fn f32_contiguous(t: CubeTensor) -> CubeTensor {
        let t = if t.dtype == DType::F32 {
            t
        } else {
            cast(t, DType::F32)
        };
        into_contiguous(t)
    }

    /// Units per cube: a power of two (the tree reductions halve evenly), 32 to 256.
    fn cube_units(client: &Client, vocab: usize) -> u32 {
        let max_units = client.properties().hardware.max_cube_dim.0.min(256);
        (vocab.min(1 << 16) as u32)
            .next_power_of_two()
            .clamp(32, max_units.max(32))
    }

    /// One cube per sequence; sequences beyond one grid dimension spill into the second.
    fn grid(client: &Client, sequences: usize) -> CubeCount {
        let max_x = client.properties().hardware.max_cube_count.0.min(65_535) as usize;
        let cubes_x = sequences.clamp(1, max_x);
        CubeCount::Static(cubes_x as u32, sequences.div_ceil(cubes_x) as u32, 1)
    }
}
