//! Plain tensor-op references: the test oracle and the path for devices without kernels.

use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor, activation::log_softmax};

use crate::Reduction;

/// `c·tanh(x / c)` when `softcap = Some(c)`, else `x`.
pub fn softcap<const D: usize>(x: Tensor<D>, softcap: Option<f32>) -> Tensor<D> {
    match softcap {
        Some(c) => (x / c).tanh() * c,
        None => x,
    }
}

/// Log-sum-exp along `dim` (kept, size 1), computed in f32 and returned in the input dtype.
///
/// # Shapes
/// - `x`: `[…, n, …]` with `n ≥ 1` at `dim`; returns `[…, 1, …]`
pub fn logsumexp<const D: usize>(x: Tensor<D>, dim: usize, cap: Option<f32>) -> Tensor<D> {
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
pub fn logsumexp_rows_backward(
    x: Tensor<2>,
    lse: Tensor<1>,
    grad: Tensor<1>,
    cap: Option<f32>,
) -> Tensor<2> {
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

/// Classifier logits `E·Cᵀ (+ b)` in f32, soft-capped, and the raw (pre-cap) logits.
///
/// # Shapes
/// - `e`: `[n, D]`, `c`: `[V, D]`, `bias`: `[V]`; returns two `[n, V]` tensors
pub fn logits_f32(
    e: Tensor<2>,
    c: Tensor<2>,
    bias: Option<Tensor<1>>,
    cap: Option<f32>,
) -> (Tensor<2>, Tensor<2>) {
    let raw = e.cast(DType::F32).matmul(c.cast(DType::F32).transpose());
    let raw = match bias {
        Some(b) => raw + b.cast(DType::F32).unsqueeze_dim::<2>(0),
        None => raw,
    };
    (softcap(raw.clone(), cap), raw)
}

/// Forward of the linear cross-entropy on valid tokens, in f32: the per-token log-sum-exp of
/// the (soft-capped) logits and the (soft-capped) logit of each target. The loss is their
/// difference. Materializes `n × V`: this is the oracle, not the fast path.
///
/// # Shapes
/// - `e`: `[n, D]`, `c`: `[V, D]`, `bias`: `[V]`, `targets`: `[n]` in `[0, V)`
/// - returns `(lse [n], target_logit [n])`, both f32
pub fn linear_ce_forward(
    e: Tensor<2>,
    c: Tensor<2>,
    bias: Option<Tensor<1>>,
    targets: Tensor<1, Int>,
    cap: Option<f32>,
) -> (Tensor<1>, Tensor<1>) {
    let (logits, _) = logits_f32(e, c, bias, cap);
    let lse = logsumexp(logits.clone(), 1, None).squeeze_dim::<1>(1);
    let target = logits
        .gather(1, targets.unsqueeze_dim::<2>(1))
        .squeeze_dim::<1>(1);
    (lse, target)
}

/// Gradients of `Σᵢ gradᵢ · lossᵢ` with `lossᵢ = lseᵢ − logitᵢ[targetᵢ]`, without filtering:
/// `G = (softmax − onehot) · grad · cap'`, `dE = G·C`, `dC = Gᵀ·E`, `db = Σᵢ G`.
///
/// # Shapes
/// - `e`: `[n, D]`, `c`: `[V, D]`, `bias`: `[V]`, `targets`: `[n]`, `lse`, `grad`: `[n]` f32
/// - returns `(dE [n, D], dC [V, D], db [V])` in the dtypes of `e`, `c` and `bias`
pub fn linear_ce_backward(
    e: Tensor<2>,
    c: Tensor<2>,
    bias: Option<Tensor<1>>,
    targets: Tensor<1, Int>,
    lse: Tensor<1>,
    grad: Tensor<1>,
    cap: Option<f32>,
) -> (Tensor<2>, Tensor<2>, Option<Tensor<1>>) {
    let [vocab, _] = c.dims();
    let (e_dtype, c_dtype) = (e.dtype(), c.dtype());
    let bias_dtype = bias.as_ref().map(|b| b.dtype());
    let g = logit_grad(e.clone(), c.clone(), bias, targets, lse, grad, cap);
    let de = g.clone().matmul(c.cast(DType::F32)).cast(e_dtype);
    let dbias = bias_dtype.map(|dt| g.clone().sum_dim(0).reshape([vocab]).cast(dt));
    let dc = g.transpose().matmul(e.cast(DType::F32)).cast(c_dtype);
    (de, dc, dbias)
}

/// The gradient of `Σᵢ gradᵢ · lossᵢ` with respect to the raw logits, in f32:
/// `G = (softmax − onehot) · grad · cap'`.
///
/// # Shapes
/// - as [`linear_ce_backward`]; returns `[n, V]`
pub fn logit_grad(
    e: Tensor<2>,
    c: Tensor<2>,
    bias: Option<Tensor<1>>,
    targets: Tensor<1, Int>,
    lse: Tensor<1>,
    grad: Tensor<1>,
    cap: Option<f32>,
) -> Tensor<2> {
    let [n, _] = e.dims();
    let [vocab, _] = c.dims();
    let device = e.device();
    let (logits, raw) = logits_f32(e, c, bias, cap);
    let softmax = (logits - lse.cast(DType::F32).unsqueeze_dim::<2>(1)).exp();
    let onehot = Tensor::<2>::zeros([n, vocab], &device).scatter(
        1,
        targets.unsqueeze_dim::<2>(1),
        Tensor::ones([n, 1], &device),
        IndexingUpdateOp::Add,
    );
    let g = (softmax - onehot) * grad.cast(DType::F32).unsqueeze_dim::<2>(1);
    match cap {
        Some(cap) => {
            let t = (raw / cap).tanh();
            g * (t.clone() * t).neg().add_scalar(1.0)
        }
        None => g,
    }
}

/// Burn's plain cross-entropy path: logits in the input dtype, log-softmax, gather, masked
/// reduction, all differentiable by autodiff. The baseline in benchmarks and, run in f32, the
/// ground truth in tests. Materializes `N × V` several times over. f16/bf16 logits come from
/// core's fixed-kernel GEMM ([`burn_kernels_core::gemm::matmul`]): Burn 0.23.0-pre.1's
/// autotuned matmul fails on Hopper at the gradient `dE = dLogits · C` (`m ≥ 4n`).
///
/// # Shapes
/// - `e`: `[N, D]`, `c`: `[V, D]`, `bias`: `[V]`, `targets`: `[N]` (values in `[0, V)` or
///   `ignore_index`)
/// - returns `[1]` for `Mean`/`Sum`, `[N]` for `None` (0 at ignored tokens), in f32
pub fn plain_linear_cross_entropy(
    e: Tensor<2>,
    c: Tensor<2>,
    bias: Option<Tensor<1>>,
    targets: Tensor<1, Int>,
    ignore_index: i64,
    cap: Option<f32>,
    reduction: Reduction,
) -> Tensor<1> {
    let logits = burn_kernels_core::gemm::matmul(e, c.transpose());
    let logits = match bias {
        Some(b) => logits + b.unsqueeze_dim::<2>(0),
        None => logits,
    };
    let logp = log_softmax(softcap(logits, cap), 1);
    let ignored = targets.clone().equal_elem(ignore_index);
    let safe = targets.mask_fill(ignored.clone(), 0);
    let nll = logp
        .gather(1, safe.unsqueeze_dim::<2>(1))
        .squeeze_dim::<1>(1)
        .cast(DType::F32)
        .neg()
        .mask_fill(ignored.clone(), 0.0);
    match reduction {
        Reduction::None => nll,
        Reduction::Sum => nll.sum(),
        Reduction::Mean => {
            let valid = ignored.bool_not().int().sum().into_scalar::<i64>().max(1) as f64;
            nll.sum() / valid
        }
    }
}
