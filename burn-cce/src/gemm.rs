//! The chunk GEMMs: cubek's tensor-core kernels launched directly with the output in f32 (f32
//! accumulation from f16/bf16 inputs; core's [`fixed_gemm`], which checks each kernel's first
//! launch and falls back where the CUDA runtime refuses it), or Burn's autotuned matmul.

use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, FloatDType};
use burn_cubecl::{
    CubeBackend,
    kernel::matmul::{MatmulStrategy, matmul},
    tensor::CubeTensor,
};
pub(crate) use burn_kernels_core::gemm::launch::dims2;
use burn_kernels_core::gemm::launch::fixed_gemm;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::GemmStrategy;
use crate::live;

type Cb = CubeBackend;

/// Rows `range` of a matrix (a view).
pub(crate) fn rows_of(t: CubeTensor, range: std::ops::Range<usize>) -> CubeTensor {
    let [_, cols] = dims2(&t);
    Cb::float_slice(
        t,
        &[
            burn::tensor::Slice::from(range),
            burn::tensor::Slice::from(0..cols),
        ],
    )
}

/// The transposed view of a matrix.
pub(crate) fn transpose(t: CubeTensor) -> CubeTensor {
    Cb::float_transpose(t)
}

/// Classifier rows `range` of `c`, transposed (`[D, len]`, a view): the right operand of a
/// chunk's logits `E · C_chunkᵀ`.
pub(crate) fn classifier_t(c: &CubeTensor, range: std::ops::Range<usize>) -> CubeTensor {
    transpose(rows_of(c.clone(), range))
}

/// `t` in `dtype` (the same tensor when it already is).
pub(crate) fn cast(t: CubeTensor, dtype: DType) -> CubeTensor {
    if t.dtype == dtype {
        t
    } else {
        Cb::float_cast(t, FloatDType::from(dtype))
    }
}

/// `lhs · rhs` with the output in `dtype` (f32 accumulation inside the GEMM), by the kernel
/// `strategy` selects. Falls back to casting the inputs when the runtime's matmul rejects the
/// mixed-precision setup.
pub(crate) fn matmul_to(
    lhs: CubeTensor,
    rhs: CubeTensor,
    dtype: DType,
    strategy: GemmStrategy,
    tf32: bool,
    step: &'static str,
) -> CubeTensor {
    static WARNED: AtomicBool = AtomicBool::new(false);
    let kernel = strategy.kernel();
    // Each exit reads the live memory with the inputs still held (see `crate::live`).
    if let Some(kernel) = kernel
        && let Some(out) = fixed_gemm(lhs.clone(), rhs.clone(), dtype, kernel, tf32)
    {
        live::sample(&out, step);
        return out;
    }
    let out = match matmul(
        lhs.clone(),
        rhs.clone(),
        None,
        MatmulStrategy::default(),
        dtype,
    ) {
        Ok(out) => out,
        Err(err) => {
            if !WARNED.swap(true, Ordering::Relaxed) {
                log::warn!(
                    "burn-cce: mixed-precision matmul unavailable ({err:?}); casting the inputs"
                );
            }
            Cb::float_matmul(cast(lhs, dtype), cast(rhs, dtype))
        }
    };
    live::sample(&out, step);
    out
}
