//! GEMMs of half-precision operands by a chosen kernel (this crate's Hopper kernel,
//! [`hopper`], or one of cubek's), differentiable: the model's projections in f16/bf16
//! (training and batched decode) and burn-cce's chunk GEMMs.
//!
//! Burn 0.23.0-pre.1's matmul autotunes every problem over all of cubek's kernels; on Hopper
//! some of those fail at launch for f16/bf16 (see [`launch`]) and the failure spreads to the
//! matmul's inputs, so a bf16 training step or a batch-128 f16 decode step ended with unwritten
//! outputs on an H200 (2026-11-28). [`matmul`] and [`linear`] run f16/bf16 products through
//! [`GemmKernels::gemm`] instead: one fixed kernel ([`default_kernel`]: [`GemmKernel::Wgmma`]
//! unless chosen otherwise), checked at its first launch per problem, with fallbacks. f32
//! products keep Burn's autotuned matmul, which runs.
//!
//! On an H200 (2026-11-29) the Hopper kernel ran SmolLM2's training products 1.1–3.1× faster
//! than cubek's fastest (`SpecializedTma`), 0.34–0.70× cuBLAS, and a bf16 training step at
//! 8 × 2048 tokens 1.58× faster (`bench/results/2026-11-29/nvidia-h200-s38-wgmma-gemm.md`).

mod autodiff;
pub mod hopper;
pub mod launch;

use burn::backend::{Backend, Dispatch, backend_extension, tensor::FloatTensor};
use burn::tensor::{DType, Shape, Tensor};

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::route::{Grad, route};

/// `a · b` of 2-D tensors: [`GemmKernels::gemm`] (a fixed kernel, f32 accumulation) where
/// both are f16 or both bf16 on a CubeCL device of this build, with or without autodiff, and
/// `a` has at least [`FIXED_MIN_ROWS`] rows (fewer: Burn's autotuned matmul, inside the op);
/// Burn's matmul otherwise (f32, other backends).
///
/// # Shapes
/// - `a`: `[m, k]`, `b`: `[k, n]` (any strides: a transposed view is read in place); returns
///   `[m, n]` in `a`'s dtype
///
/// # Panics
/// When the inner dimensions differ (as Burn's matmul).
pub fn matmul(a: Tensor<2>, b: Tensor<2>) -> Tensor<2> {
    let ([m, k], [k2, n]) = (a.dims(), b.dims());
    assert_eq!(k, k2, "gemm: [{m}, {k}] · [{k2}, {n}]");
    let half = matches!(a.dtype(), DType::F16 | DType::BF16);
    if !half || m * n * k == 0 {
        // Not logged as a fallback: Burn's autotuned matmul is the right kernel for f32.
        return a.matmul(b);
    }
    let unsupported =
        (a.dtype() != b.dtype()).then(|| format!("a is {:?}, b is {:?}", a.dtype(), b.dtype()));
    if !route("gemm", &a.device(), Grad::Differentiable, unsupported) {
        return a.matmul(b);
    }
    Tensor::from_dispatch(Dispatch::gemm(a.into_dispatch(), b.into_dispatch()))
}

/// `x · w` over the last dimension of `x` ([`matmul`] of its rows): a projection.
///
/// # Shapes
/// - `x`: `[batch, seq, k]`, `w`: `[k, n]`; returns `[batch, seq, n]`
pub fn linear(x: Tensor<3>, w: Tensor<2>) -> Tensor<3> {
    let [b, s, k] = x.dims();
    let n = w.dims()[1];
    if !matches!(x.dtype(), DType::F16 | DType::BF16) {
        return x.matmul(w.unsqueeze());
    }
    matmul(x.reshape([b * s, k]), w).reshape([b, s, n])
}

/// A GEMM by a fixed kernel, as a Burn backend extension: `CubeBackend` launches it,
/// `Fusion<CubeBackend>` defers it as a custom operation, and `Autodiff<B>` differentiates it
/// (`dA = dC · Bᵀ`, `dB = Aᵀ · dC`, by the same op). Call it through [`matmul`].
#[backend_extension(
    Cube: cfg(feature = "cube"),
    Fusion: cfg(all(feature = "cube", feature = "fusion")),
    Autodiff,
)]
pub trait GemmKernels: Backend {
    /// `a · b` with f32 accumulation, by [`GemmKernel::DEFAULT`] (then the portable kernels)
    /// for f16/bf16 inputs of one dtype; Burn's matmul for anything else.
    ///
    /// # Shapes
    /// - `a`: `[m, k]`, `b`: `[k, n]` (any strides), or batches of them with the same leading
    ///   dimensions; returns `[.., m, n]` in `a`'s dtype, contiguous
    #[fusion(dtype = a, shape = gemm_shape(a, b))]
    fn gemm(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// The kernel's index in [`GemmKernel::ALL`] that [`default_kernel`] names.
static DEFAULT_KERNEL: AtomicUsize = AtomicUsize::new(usize::MAX);

/// The kernel [`GemmKernels::gemm`] (so [`matmul`], [`linear`] and burn-cce's
/// `GemmStrategy::Fixed`) runs: [`GemmKernel::DEFAULT`] unless [`set_default_kernel`] chose
/// another, or the environment variable `BURN_KERNELS_GEMM` names one ([`GemmKernel::name`]).
pub fn default_kernel() -> GemmKernel {
    let mut index = DEFAULT_KERNEL.load(Ordering::Relaxed);
    if index == usize::MAX {
        let named = std::env::var("BURN_KERNELS_GEMM").ok();
        let chosen = named
            .as_deref()
            .and_then(GemmKernel::from_name)
            .unwrap_or(GemmKernel::DEFAULT);
        if let Some(name) = named.filter(|n| GemmKernel::from_name(n).is_none()) {
            log::warn!(
                "BURN_KERNELS_GEMM={name} names no GEMM kernel; {} runs",
                chosen.name()
            );
        }
        index = GemmKernel::ALL
            .iter()
            .position(|&k| k == chosen)
            .expect("listed");
        DEFAULT_KERNEL.store(index, Ordering::Relaxed);
    }
    GemmKernel::ALL[index]
}

/// Makes `kernel` the one [`default_kernel`] names, for the whole process (benchmarks compare
/// kernels in one run this way).
pub fn set_default_kernel(kernel: GemmKernel) {
    let index = GemmKernel::ALL
        .iter()
        .position(|&k| k == kernel)
        .expect("listed");
    DEFAULT_KERNEL.store(index, Ordering::Relaxed);
}

/// The shape of `a · b` for (batches of) matrices.
pub fn gemm_shape(a: &Shape, b: &Shape) -> Shape {
    let mut dims = a.to_vec();
    let n = b[b.num_dims() - 1];
    *dims.last_mut().expect("a matrix") = n;
    Shape::from(dims)
}

/// Rows of `a` below which [`GemmKernels::gemm`] on `CubeBackend` leaves the product to Burn's
/// autotuned matmul: the fixed kernels' tensor-core tiles need 16 rows, and below that
/// [`launch::fixed_gemm`] falls to its unit kernel, which read a decode step's weights at
/// 22 GB/s (Llama-3-8B shape at batch 2: 5.4 ms a `[2, 4096] · [4096, 14336]` projection, 96%
/// of a 1.77 s step on an H100, 2026-12-06, against 135 ms a step with Burn's matmul on
/// 2026-11-27). Decode batches are such products.
pub const FIXED_MIN_ROWS: usize = 16;

#[cfg(feature = "cube")]
mod cube_backend {
    use super::{GemmKernels, default_kernel, launch::fixed_gemm};
    use crate::route::count_launch;
    use burn::backend::{ops::FloatTensorOps, tensor::FloatTensor};
    use burn::tensor::DType;
    use burn_cubecl::CubeBackend;

    impl GemmKernels for CubeBackend {
        fn gemm(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
            count_launch("gemm");
            let dtype = a.dtype;
            let shape = a.meta.shape();
            let rows = shape[shape.len().saturating_sub(2)];
            if matches!(dtype, DType::F16 | DType::BF16)
                && b.dtype == dtype
                && rows >= super::FIXED_MIN_ROWS
                && let Some(c) = fixed_gemm(a.clone(), b.clone(), dtype, default_kernel(), false)
            {
                return c;
            }
            Self::float_matmul(a, b)
        }
    }
}

/// The cubek tensor-core GEMM kernels a caller can name (burn-cce's `GemmStrategy::Kernel`, the
/// bench's sweeps): the ones Burn's matmul autotuner chooses among, with the `mma` tile
/// instruction (and the TMA kernels on `cmma` too, which Burn's autotune also tries), and
/// cubek's tile-DSL routines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmKernel {
    /// Double-buffered, cyclic global-to-shared loading (cubek `DoubleCyclicMma`).
    DoubleCyclic,
    /// The same with producer/consumer plane specialization.
    DoubleCyclicSpecialized,
    /// Single-buffered, cyclic loading.
    SimpleCyclic,
    /// Single-buffered, several tile rows per plane.
    SimpleCyclicMultiRow,
    /// Ordered double buffering, 4 rows.
    OrderedDouble4,
    /// Ordered double buffering, 8 rows.
    OrderedDouble8,
    /// Specialized (producer/consumer planes), cyclic loading.
    SpecializedCyclic,
    /// Single-buffered, loads by the tensor memory accelerator (Hopper and later).
    SimpleTma,
    /// The same, several tile rows per plane.
    SimpleTmaMultiRow,
    /// Specialized, loads by the tensor memory accelerator.
    SpecializedTma,
    /// cubek's tile-DSL routines (`cubek::matmul::kernels`) under cubek's own autotune tables:
    /// the cube-staged boxes, filled by the tensor memory accelerator and on the warpgroup MMA
    /// where the device has them (Hopper). What Burn's `tile-kernels-only` feature runs. Each
    /// new GEMM shape is tuned once per process (and cached by CubeCL's autotune cache).
    /// Devices without the tensor memory accelerator run [`GemmKernel::DoubleCyclic`]. On an
    /// H200 (2026-11-27, Gemma-2 gradient) 219.5 ms against the default's 186.3 ms.
    TileDsl,
    /// [`GemmKernel::SimpleTma`] on the `cmma` tile instruction, as Burn's autotune also tries.
    SimpleTmaCmma,
    /// [`GemmKernel::SimpleTmaMultiRow`] on the `cmma` tile instruction.
    SimpleTmaMultiRowCmma,
    /// [`GemmKernel::SpecializedTma`] on the `cmma` tile instruction.
    SpecializedTmaCmma,
    /// This crate's Hopper kernel ([`hopper`]): warpgroup MMAs fed by TMA
    /// through a 4-stage ring, split K for few output tiles; matrices (not batches) of f16/bf16
    /// with one contiguous dimension each. Where it cannot run (before Hopper, Vulkan, batches),
    /// [`GemmKernel::SpecializedTma`] runs instead.
    Wgmma,
}

impl GemmKernel {
    /// The kernel of a fixed-kernel GEMM ([`gemm::matmul`](crate::gemm::matmul), burn-cce's
    /// `GemmStrategy::Fixed`; [`default_kernel`] may name another): this crate's Hopper kernel,
    /// which falls back to [`GemmKernel::SpecializedTma`] (the fastest of cubek's ten in a sweep
    /// on an H100, 2026-11-25) where it cannot run, and that one to
    /// [`GemmKernel::DoubleCyclic`] on devices without the tensor memory accelerator (before
    /// Hopper, Vulkan).
    pub const DEFAULT: GemmKernel = GemmKernel::Wgmma;

    /// Every kernel, for sweeps.
    pub const ALL: [GemmKernel; 15] = [
        GemmKernel::DoubleCyclic,
        GemmKernel::DoubleCyclicSpecialized,
        GemmKernel::SimpleCyclic,
        GemmKernel::SimpleCyclicMultiRow,
        GemmKernel::OrderedDouble4,
        GemmKernel::OrderedDouble8,
        GemmKernel::SpecializedCyclic,
        GemmKernel::SimpleTma,
        GemmKernel::SimpleTmaMultiRow,
        GemmKernel::SpecializedTma,
        GemmKernel::TileDsl,
        GemmKernel::SimpleTmaCmma,
        GemmKernel::SimpleTmaMultiRowCmma,
        GemmKernel::SpecializedTmaCmma,
        GemmKernel::Wgmma,
    ];

    /// The kernel whose [`GemmKernel::name`] is `name`.
    pub fn from_name(name: &str) -> Option<GemmKernel> {
        GemmKernel::ALL.into_iter().find(|k| k.name() == name)
    }

    /// A short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            GemmKernel::DoubleCyclic => "double-cyclic",
            GemmKernel::DoubleCyclicSpecialized => "double-cyclic-spec",
            GemmKernel::SimpleCyclic => "simple-cyclic",
            GemmKernel::SimpleCyclicMultiRow => "simple-cyclic-rows",
            GemmKernel::OrderedDouble4 => "ordered-double-4",
            GemmKernel::OrderedDouble8 => "ordered-double-8",
            GemmKernel::SpecializedCyclic => "specialized-cyclic",
            GemmKernel::SimpleTma => "simple-tma",
            GemmKernel::SimpleTmaMultiRow => "simple-tma-rows",
            GemmKernel::SpecializedTma => "specialized-tma",
            GemmKernel::TileDsl => "tile-dsl",
            GemmKernel::SimpleTmaCmma => "simple-tma-cmma",
            GemmKernel::SimpleTmaMultiRowCmma => "simple-tma-rows-cmma",
            GemmKernel::SpecializedTmaCmma => "specialized-tma-cmma",
            GemmKernel::Wgmma => "wgmma",
        }
    }
}
