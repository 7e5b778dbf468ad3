//! Plain tensor-op references: the test oracle and the path for backends without kernels.

use burn::tensor::{DType, Tensor, backend::Backend};

/// `c·tanh(x / c)` when `softcap = Some(c)`, else `x`.
pub fn softcap<B: Backend, const D: usize>(x: Tensor<B, D>, softcap: Option<f32>) -> Tensor<B, D> {
    match softcap {
        Some(c) => (x / c).tanh() * c,
        None => x,
    }
}

/// Log-sum-exp along `dim` (kept, size 1), computed in f32 and returned in the input dtype.
///
/// # Shapes
/// - `x`: `[…, n, …]` with `n ≥ 1` at `dim`; returns `[…, 1, …]`
pub fn logsumexp<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    dim: usize,
    cap: Option<f32>,
) -> Tensor<B, D> {
    let dtype = x.dtype();
    let x = softcap(x.cast(DType::F32), cap);
    let max = x.clone().max_dim(dim);
    // An infinite row maximum is replaced by 0 so that rows of -inf give -inf and a +inf
    // gives +inf, instead of inf - inf = NaN.
    let shift = max.clone().mask_fill(max.is_inf(), 0.0);
    let lse = (x - shift.clone()).exp().sum_dim(dim).log() + shift;
    lse.cast(dtype)
}

/// Gradient of [`logsumexp`] over the last dimension of `[rows, cols]` logits.
///
/// # Shapes
/// - `x`: `[rows, cols]`, `lse`: `[rows]`, `grad`: `[rows]`; returns `[rows, cols]`
pub fn logsumexp_rows_backward<B: Backend>(
    x: Tensor<B, 2>,
    lse: Tensor<B, 1>,
    grad: Tensor<B, 1>,
    cap: Option<f32>,
) -> Tensor<B, 2> {
    let dtype = x.dtype();
    let x = x.cast(DType::F32);
    let capped = softcap(x.clone(), cap);
    let lse = lse.cast(DType::F32).unsqueeze_dim::<2>(1);
    let grad = grad.cast(DType::F32).unsqueeze_dim::<2>(1);
    let softmax = (capped - lse).exp();
    let dx = softmax * grad;
    let dx = match cap {
        // d/dx c·tanh(x/c) = 1 − tanh²(x/c)
        Some(c) => {
            let t = (x / c).tanh();
            dx * (t.clone() * t).neg().add_scalar(1.0)
        }
        None => dx,
    };
    dx.cast(dtype)
}
