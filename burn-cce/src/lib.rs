//! # burn-cce: Cut Cross-Entropy for Burn
//!
//! Cut Cross-Entropy (Wijmans et al., 2024) computes the cross-entropy loss of a linear
//! classifier and its gradients without materializing the `N × V` logit matrix.
//!
//! - [`linear_cross_entropy`]: loss of `softmax(E·Cᵀ + b)` against targets, with ignore
//!   index, softcap, reductions, next-token shift, gradient filtering and vocabulary sorting,
//!   differentiable by Burn's autodiff with respect to `E`, `C` and `b`. On a CubeCL device the
//!   vocabulary is processed in chunks (see the `chunked` module docs): the `N × V` logit
//!   matrix is never held; other devices run the plain reference.
//! - [`LinearCrossEntropyLoss`]: the same as a loss object for a model's training step.
//! - [`logsumexp`]: the row-wise log-sum-exp the loss is built on.
//!
//! The kernels are a Burn backend extension, [`CceKernels`]: `CubeBackend` runs them, Burn's
//! `Dispatch` routes to it, `Fusion<CubeBackend>` registers each call as a custom operation of
//! the fused stream, and `Autodiff<B>` registers their backward passes. The public functions
//! decide with [`burn_kernels_core::route::route`] whether the kernels or the tensor-op
//! [`reference`](mod@reference) run (the latter on Burn's `Flex` CPU backend, for example, which Burn
//! differentiates itself).
//!
//! ```
//! use burn::tensor::{Device, Int, Tensor};
//! use burn_cce::{CceOptions, linear_cross_entropy};
//!
//! let device = Device::flex().autodiff();
//! let hidden = Tensor::<3>::ones([2, 3, 4], &device).require_grad(); // [batch, seq, D]
//! let classifier = Tensor::<2>::ones([10, 4], &device).require_grad(); // [V, D]
//! let targets = Tensor::<2, Int>::from_ints([[1, 2, -100], [3, 4, 5]], &device);
//! let out = linear_cross_entropy(hidden.clone(), classifier, targets, None, &CceOptions::default())
//!     .unwrap();
//! // Equal logits: the loss is ln(10) for each of the 5 scored tokens.
//! let loss = out.loss.clone().into_scalar::<f32>();
//! assert!((loss - 10f32.ln()).abs() < 1e-5);
//! let grads = out.loss.backward();
//! assert_eq!(hidden.grad(&grads).unwrap().dims(), [2, 3, 4]);
//! ```
//!
//! ```
//! use burn::tensor::{Device, Tensor};
//! use burn_cce::{LseOptions, logsumexp};
//!
//! let device = Device::flex();
//! let logits = Tensor::<2>::from_floats([[0.0, 0.0], [1.0, 3.0]], &device);
//! let lse = logsumexp(logits, 1, LseOptions::default()).unwrap(); // shape [2, 1]
//! let v = lse.into_data().try_into_vec_as::<f32>().unwrap();
//! assert!((v[0] - 2f32.ln()).abs() < 1e-6);
//! ```

mod backward;
mod blocks;
mod chunked;
pub mod diagnostics;
mod epilogue;
pub use epilogue::{
    HOPPER_ADD_LAUNCHES, HOPPER_COMPENSATED_LAUNCHES, HOPPER_GRAD_LAUNCHES, HOPPER_LSE_LAUNCHES,
    HOPPER_SCORE_LAUNCHES, REDUCTION_CHUNK,
};
mod error;
#[cfg(feature = "cube")]
mod forward;
mod gemm;
pub mod kernels;
pub mod live;
mod loss;
mod options;
pub mod reference;

pub use error::CceError;
pub use loss::{CceOutput, LinearCrossEntropyLoss, linear_cross_entropy};
pub use options::{
    CceOptions, DeCarry, FilterEps, GemmKernel, GemmStrategy, LceParams, PassKernels, Reduction,
    TRAINING_BLOCK_BYTES,
};

use burn::backend::{
    Backend, Dispatch, backend_extension,
    tensor::{FloatTensor, IntTensor},
};
use burn::tensor::{Device, Shape, Tensor};
use burn_kernels_core::route::{Grad, route};

/// The Cut Cross-Entropy kernels as a Burn backend extension.
///
/// `CubeBackend` runs the CubeCL kernels (the chunked path of `chunked`), `Fusion<CubeBackend>`
/// defers them as custom operations, and `Autodiff<B>` registers the gradient of
/// [`CceKernels::logsumexp_rows`] and of the loss ([`CceKernels::linear_ce_loss`],
/// [`CceKernels::linear_ce_loss_bias`]) through [`CceKernels::linear_ce_backward`] and
/// [`CceKernels::linear_ce_backward_bias`]. The other ops are not differentiated (their outputs
/// carry no gradient on an autodiff device).
///
/// Call them through [`linear_cross_entropy`] and [`logsumexp`], which validate the arguments
/// and decide whether the kernels run; the methods here assume valid input. The ops with a
/// bias are separate methods (`_bias`): a backend extension takes no optional tensor.
#[backend_extension(
    Cube: cfg(feature = "cube"),
    Fusion: cfg(all(feature = "cube", feature = "fusion")),
    Autodiff,
)]
pub trait CceKernels: Backend {
    /// Row-wise log-sum-exp with f32 accumulation.
    ///
    /// # Shapes
    /// - `logits`: `[rows, cols]`, `cols ≥ 1`
    /// - returns `[rows]`, in the dtype of `logits`
    ///
    /// With `softcap = Some(c)` each logit `x` is first mapped to `c·tanh(x / c)`, `c > 0`.
    #[fusion(dtype = logits, shape = rows_shape(logits))]
    #[cfg_attr(not(feature = "cube"), allow(unused_variables))]
    fn logsumexp_rows(logits: FloatTensor<Self>, softcap: Option<f32>) -> FloatTensor<Self>;

    /// Linear cross-entropy forward on valid tokens, without a bias: the per-token log-sum-exp
    /// of the (soft-capped) logits `E·Cᵀ` and the (soft-capped) logit of each target, in f32.
    /// The loss of token `i` is `lse[i] − target_logit[i]`.
    ///
    /// # Shapes
    /// - `e`: `[n, D]`, `c`: `[V, D]` (one float dtype)
    /// - `targets`: `[n]`, every value in `[0, V)` (ignored tokens are already removed)
    /// - returns `(lse [n], target_logit [n])`, f32
    #[fusion(meta = |e, _c, _targets, _params| (token_spec(e), token_spec(e)))]
    #[cfg_attr(not(feature = "cube"), allow(unused_variables))]
    fn linear_ce_forward(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// [`CceKernels::linear_ce_forward`] with logits `E·Cᵀ + b`, `bias`: `[V]` in `e`'s dtype.
    #[fusion(meta = |e, _c, _bias, _targets, _params| (token_spec(e), token_spec(e)))]
    #[cfg_attr(not(feature = "cube"), allow(unused_variables))]
    fn linear_ce_forward_bias(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        targets: IntTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// Gradients of `Σᵢ dout[i]·lossᵢ` with respect to `e` and `c` (no bias).
    ///
    /// # Shapes
    /// - `e`, `c`, `targets` as in [`CceKernels::linear_ce_forward`]
    /// - `lse`, `dout`: `[n]` f32
    /// - returns `(dE [n, D], dC [V, D])` in the dtypes of `e` and `c`
    #[fusion(meta = |e, c, _targets, _lse, _dout, _params| (e.clone(), c.clone()))]
    #[cfg_attr(not(feature = "cube"), allow(unused_variables))]
    fn linear_ce_backward(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// [`CceKernels::linear_ce_backward`] with a bias: returns `(dE, dC, db [V])`, `db` in the
    /// bias's dtype.
    #[fusion(meta = |e, c, bias, _targets, _lse, _dout, _params| {
        (e.clone(), c.clone(), bias.clone())
    })]
    #[allow(clippy::too_many_arguments)]
    #[cfg_attr(not(feature = "cube"), allow(unused_variables))]
    fn linear_ce_backward_bias(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// Per-token losses `lse − target_logit` and the log-sum-exp, both `[n]` f32, without a
    /// bias. On an autodiff backend the loss is differentiable with respect to `e` and `c`
    /// ([`CceKernels::linear_ce_backward`] is its gradient); the log-sum-exp is not.
    #[fusion(meta = |e, _c, _targets, _params| (token_spec(e), token_spec(e)))]
    #[cfg_attr(not(feature = "cube"), allow(unused_variables))]
    fn linear_ce_loss(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// [`CceKernels::linear_ce_loss`] with a bias (differentiable with respect to it too).
    #[fusion(meta = |e, _c, _bias, _targets, _params| (token_spec(e), token_spec(e)))]
    #[cfg_attr(not(feature = "cube"), allow(unused_variables))]
    fn linear_ce_loss_bias(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        targets: IntTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// [`CceKernels::linear_ce_loss`] for training with [`PassKernels::Fused`] (or
    /// [`PassKernels::Auto`]): also returns
    /// `dE₁ = ∂ lossᵢ / ∂Eᵢ` (dE for a unit loss gradient, `[n, D]` in `e`'s dtype), summed in
    /// the same walk over the vocabulary as the log-sum-exp (an online softmax), so that
    /// [`CceKernels::linear_ce_backward_train`] only scales it and computes dC. Where the fused
    /// kernels decline the inputs, `dE₁` is an unwritten buffer that the backward ignores (it
    /// declines them too and runs the chunked backward). Not differentiated itself: the
    /// autodiff loss calls it where `e` is tracked.
    #[fusion(meta = |e, _c, _targets, _params| (token_spec(e), token_spec(e), e.clone()))]
    #[cfg_attr(not(feature = "cube"), allow(unused_variables))]
    fn linear_ce_loss_train(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// [`CceKernels::linear_ce_backward`] after [`CceKernels::linear_ce_loss_train`]:
    /// `dE = dout ⊙ dE₁` (in place where `de_unit` is not shared) and dC from one walk over the
    /// tokens.
    ///
    /// # Shapes
    /// As [`CceKernels::linear_ce_backward`], and `de_unit`: `[n, D]` in `e`'s dtype.
    #[fusion(meta = |e, c, _targets, _lse, _dout, _de_unit, _params| (e.clone(), c.clone()))]
    #[allow(clippy::too_many_arguments)]
    #[cfg_attr(not(feature = "cube"), allow(unused_variables))]
    fn linear_ce_backward_train(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        de_unit: FloatTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// The output shape of [`CceKernels::logsumexp_rows`]: `[rows]`.
pub fn rows_shape(logits: &Shape) -> Shape {
    Shape::new([logits[0]])
}

/// A per-token f32 output (`[n]`) of embeddings `[n, D]`, for Fusion's output metadata.
#[cfg(all(feature = "cube", feature = "fusion"))]
fn token_spec(
    e: &burn::backend::fusion::custom::TensorSpec,
) -> burn::backend::fusion::custom::TensorSpec {
    burn::backend::fusion::custom::TensorSpec::new(
        Shape::new([e.shape[0]]),
        burn::tensor::DType::F32,
    )
}

/// Bytes in use in the memory pools of `device`'s current stream where it is a CubeCL device
/// (CubeCL's `bytes_in_use`: every slice whose handle is alive, without page rounding);
/// `None` elsewhere. See [`track_live_peak`].
pub fn memory_in_use(device: &Device) -> Option<u64> {
    burn_kernels_core::route::memory_in_use(device)
}

/// Runs `run` and returns the most device memory in use at once during it beyond what was in
/// use before, in bytes, and the step that reached it, as read by the chunked forward and
/// backward after each of their allocations (see [`live`]); `None` where the device is not a
/// CubeCL device or `run` did not go through the chunked path. The device is synchronized
/// before and at the end of `run` (inside the tracking), so that work Burn's fusion deferred
/// runs where it is measured. For benchmarks and tests: each reading queries the pool.
pub fn track_live_peak(device: &Device, run: impl FnOnce()) -> Option<live::LivePeak> {
    let _ = device.sync();
    let before = memory_in_use(device)?;
    live::track_live_peak(|| {
        run();
        let _ = device.sync();
    })
    .map(|peak| live::LivePeak {
        bytes: peak.bytes.saturating_sub(before),
        ..peak
    })
}

/// Options of [`logsumexp`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LseOptions {
    /// Gemma-2 style logit soft-capping, `c·tanh(x / c)` before the reduction; `c > 0`.
    pub softcap: Option<f32>,
}

/// `log Σ exp(x)` along `dim`, keeping the dimension (its size becomes 1).
///
/// Accumulates in f32 whatever the input dtype; rows of `-inf` give `-inf`, a `+inf` gives
/// `+inf`. Differentiable on autodiff devices. Runs the CubeCL kernel on a CubeCL device, the
/// tensor-op [`reference::logsumexp`] elsewhere.
///
/// # Shapes
/// - `x`: `[d0, …, d(D−1)]` with `d(dim) ≥ 1`
/// - returns `[d0, …, 1 (at dim), …, d(D−1)]`
///
/// # Errors
/// [`CceError::DimOutOfRange`] when `dim ≥ D`, [`CceError::EmptyDimension`] when the reduced
/// dimension has size 0, [`CceError::InvalidSoftcap`] for a non-positive or non-finite softcap.
pub fn logsumexp<const D: usize>(
    x: Tensor<D>,
    dim: usize,
    options: LseOptions,
) -> Result<Tensor<D>, CceError> {
    if dim >= D {
        return Err(CceError::DimOutOfRange { dim, rank: D });
    }
    let dims = x.dims();
    if dims[dim] == 0 {
        return Err(CceError::EmptyDimension {
            dim,
            shape: dims.to_vec(),
        });
    }
    if let Some(c) = options.softcap
        && !(c.is_finite() && c > 0.0)
    {
        return Err(CceError::InvalidSoftcap(c));
    }
    let unsupported = kernel_dtype_unsupported(x.dtype());
    if !route("logsumexp", &x.device(), Grad::Differentiable, unsupported) {
        return Ok(reference::logsumexp(x, dim, options.softcap));
    }

    // The kernel reduces the last dimension of a [rows, cols] matrix.
    let last = D - 1;
    let x = if dim == last {
        x
    } else {
        x.swap_dims(dim, last)
    };
    let moved = x.dims();
    let cols = moved[last];
    let rows = moved[..last].iter().product::<usize>();
    let flat = x.reshape([rows, cols]);
    let out = Tensor::<1>::from_dispatch(Dispatch::logsumexp_rows(
        flat.into_dispatch(),
        options.softcap,
    ));
    let mut kept = moved;
    kept[last] = 1;
    let out = out.reshape(kept);
    Ok(if dim == last {
        out
    } else {
        out.swap_dims(dim, last)
    })
}

/// Why the kernels cannot take inputs of `dtype`, if they cannot: they read f32, f16 and bf16.
pub(crate) fn kernel_dtype_unsupported(dtype: burn::tensor::DType) -> Option<String> {
    use burn::tensor::DType;
    (!matches!(dtype, DType::F32 | DType::F16 | DType::BF16))
        .then(|| format!("the kernels take f32, f16 or bf16 inputs, not {dtype:?}"))
}
