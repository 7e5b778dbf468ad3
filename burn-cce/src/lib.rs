//! # burn-cce: Cut Cross-Entropy for Burn
//!
//! Cut Cross-Entropy (Wijmans et al., 2024) computes the cross-entropy loss of a linear
//! classifier and its gradients without materializing the `N × V` logit matrix.
//!
//! - [`linear_cross_entropy`]: loss of `softmax(E·Cᵀ + b)` against targets, with ignore
//!   index, softcap, reductions, next-token shift, gradient filtering and vocabulary sorting,
//!   differentiable by Burn's autodiff with respect to `E`, `C` and `b`. On `CubeBackend` the
//!   vocabulary is processed in chunks (see the `chunked` module docs): the `N × V` logit
//!   matrix is never held; other backends run the plain reference.
//! - [`LinearCrossEntropyLoss`]: the same as a loss object for a model's training step.
//! - [`logsumexp`]: the row-wise log-sum-exp the loss is built on.
//!
//! ```
//! use burn::backend::{Autodiff, NdArray};
//! use burn::tensor::{Int, Tensor};
//! use burn_cce::{CceOptions, linear_cross_entropy};
//!
//! type B = Autodiff<NdArray>;
//! let device = Default::default();
//! let hidden = Tensor::<B, 3>::ones([2, 3, 4], &device).require_grad(); // [batch, seq, D]
//! let classifier = Tensor::<B, 2>::ones([10, 4], &device).require_grad(); // [V, D]
//! let targets = Tensor::<B, 2, Int>::from_ints([[1, 2, -100], [3, 4, 5]], &device);
//! let out = linear_cross_entropy(hidden.clone(), classifier, targets, None, &CceOptions::default())
//!     .unwrap();
//! // Equal logits: the loss is ln(10) for each of the 5 scored tokens.
//! let loss = out.loss.clone().into_scalar();
//! assert!((loss - 10f32.ln()).abs() < 1e-5);
//! let grads = out.loss.backward();
//! assert_eq!(hidden.grad(&grads).unwrap().dims(), [2, 3, 4]);
//! ```
//!
//! ```
//! use burn::backend::NdArray;
//! use burn::tensor::Tensor;
//! use burn_cce::{LseOptions, logsumexp};
//!
//! let device = Default::default();
//! let logits = Tensor::<NdArray, 2>::from_floats([[0.0, 0.0], [1.0, 3.0]], &device);
//! let lse = logsumexp(logits, 1, LseOptions::default()).unwrap(); // shape [2, 1]
//! let v = lse.into_data().to_vec::<f32>().unwrap();
//! assert!((v[0] - 2f32.ln()).abs() < 1e-6);
//! ```

mod backward;
pub mod chunked;
mod cpu;
mod error;
mod forward;
pub mod kernels;
pub mod live;
mod loss;
mod options;
pub mod reference;

pub use error::CceError;
pub use loss::{CceOutput, LinearCrossEntropyLoss, linear_cross_entropy};
pub use options::{CceOptions, FilterEps, GemmKernel, GemmStrategy, LceParams, Reduction};

use burn::tensor::{
    Int, Tensor, TensorPrimitive,
    backend::Backend,
    ops::{FloatTensor, IntTensor},
};

/// Gradients of the linear cross-entropy: `(dE, dC, db)`.
pub type LceGrads<B> = (FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>);

/// Backends that run the Cut Cross-Entropy ops.
///
/// `CubeBackend` runs the CubeCL kernels, `Autodiff<B>` adds their backward passes, and the
/// CPU reference backend (`NdArray`) uses the default methods, which are the tensor-op
/// reference in [`reference`]. Another backend can opt in with an empty `impl`.
pub trait CceBackend: Backend {
    /// Row-wise log-sum-exp with f32 accumulation.
    ///
    /// # Shapes
    /// - `logits`: `[rows, cols]`, `cols ≥ 1`
    /// - returns `[rows]`, in the dtype of `logits`
    ///
    /// With `softcap = Some(c)` each logit `x` is first mapped to `c·tanh(x / c)`, `c > 0`.
    /// Callers go through [`logsumexp`], which validates the arguments.
    fn logsumexp_rows(logits: FloatTensor<Self>, softcap: Option<f32>) -> FloatTensor<Self> {
        let x = Tensor::<Self, 2>::from_primitive(TensorPrimitive::Float(logits));
        reference::logsumexp(x, 1, softcap)
            .squeeze_dim::<1>(1)
            .into_primitive()
            .tensor()
    }

    /// Linear cross-entropy forward on valid tokens: the per-token log-sum-exp of the
    /// (soft-capped) logits `E·Cᵀ + b` and the (soft-capped) logit of each target, in f32.
    /// The loss of token `i` is `lse[i] − target_logit[i]`.
    ///
    /// # Shapes
    /// - `e`: `[n, D]`, `c`: `[V, D]`, `bias`: `[V]` (all one float dtype)
    /// - `targets`: `[n]`, every value in `[0, V)` (ignored tokens are already removed)
    /// - returns `(lse [n], target_logit [n])`, f32
    fn linear_ce_forward(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        targets: IntTensor<Self>,
        params: &LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (lse, target) = reference::linear_ce_forward(
            f2::<Self>(e),
            f2::<Self>(c),
            bias.map(f1::<Self>),
            Tensor::<Self, 1, Int>::from_primitive(targets),
            params.softcap,
        );
        (
            lse.into_primitive().tensor(),
            target.into_primitive().tensor(),
        )
    }

    /// Gradients of `Σᵢ dout[i]·lossᵢ` with respect to `e`, `c` and `bias`.
    ///
    /// # Shapes
    /// - `e`, `c`, `bias`, `targets` as in [`CceBackend::linear_ce_forward`]
    /// - `lse`, `dout`: `[n]` f32
    /// - returns `(dE [n, D], dC [V, D], db [V])` in the input dtype
    ///
    /// The reference ignores `filter_eps` (it is the exact gradient).
    fn linear_ce_backward(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        params: &LceParams,
    ) -> LceGrads<Self> {
        let (de, dc, db) = reference::linear_ce_backward(
            f2::<Self>(e),
            f2::<Self>(c),
            bias.map(f1::<Self>),
            Tensor::<Self, 1, Int>::from_primitive(targets),
            f1::<Self>(lse),
            f1::<Self>(dout),
            params.softcap,
        );
        (
            de.into_primitive().tensor(),
            dc.into_primitive().tensor(),
            db.map(|db| db.into_primitive().tensor()),
        )
    }

    /// Per-token losses `lse − target_logit` and the log-sum-exp, both `[n]` f32. Autodiff
    /// backends register [`CceBackend::linear_ce_backward`] as the gradient of the loss; the
    /// log-sum-exp is not differentiable.
    fn linear_ce_loss(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        targets: IntTensor<Self>,
        params: &LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (lse, target) = Self::linear_ce_forward(e, c, bias, targets, params);
        let loss = f1::<Self>(lse.clone()) - f1::<Self>(target);
        (loss.into_primitive().tensor(), lse)
    }

    /// Bytes in use in `device`'s memory pool, where the backend tracks them (`CubeBackend`:
    /// CubeCL's `bytes_in_use`); `None` elsewhere. See [`track_live_peak`].
    fn memory_in_use(_device: &Self::Device) -> Option<u64> {
        None
    }
}

/// Runs `run` and returns the most device memory in use at once during it beyond what was in
/// use before, in bytes, and the step that reached it, as read by the chunked forward and
/// backward after each of their allocations (see [`live`]); `None` where the backend does not
/// track memory or `run` did not go through the chunked path. For benchmarks and tests: each
/// reading queries the pool.
pub fn track_live_peak<B: CceBackend>(
    device: &B::Device,
    run: impl FnOnce(),
) -> Option<live::LivePeak> {
    let before = B::memory_in_use(device)?;
    live::track_live_peak(run).map(|peak| live::LivePeak {
        bytes: peak.bytes.saturating_sub(before),
        ..peak
    })
}

fn f1<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn f2<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Autodiff backends running the Cut Cross-Entropy ops.
pub trait CceAutodiffBackend: CceBackend + burn::tensor::backend::AutodiffBackend {}
impl<B: CceBackend + burn::tensor::backend::AutodiffBackend> CceAutodiffBackend for B {}

/// Options of [`logsumexp`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LseOptions {
    /// Gemma-2 style logit soft-capping, `c·tanh(x / c)` before the reduction; `c > 0`.
    pub softcap: Option<f32>,
}

/// `log Σ exp(x)` along `dim`, keeping the dimension (its size becomes 1).
///
/// Accumulates in f32 whatever the input dtype; rows of `-inf` give `-inf`, a `+inf` gives
/// `+inf`. Differentiable on autodiff backends.
///
/// # Shapes
/// - `x`: `[d0, …, d(D−1)]` with `d(dim) ≥ 1`
/// - returns `[d0, …, 1 (at dim), …, d(D−1)]`
///
/// # Errors
/// [`CceError::DimOutOfRange`] when `dim ≥ D`, [`CceError::EmptyDimension`] when the reduced
/// dimension has size 0, [`CceError::InvalidSoftcap`] for a non-positive or non-finite softcap.
pub fn logsumexp<B: CceBackend, const D: usize>(
    x: Tensor<B, D>,
    dim: usize,
    options: LseOptions,
) -> Result<Tensor<B, D>, CceError> {
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
    let flat = x.reshape([rows, cols]).into_primitive().tensor();
    let out = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::logsumexp_rows(
        flat,
        options.softcap,
    )));
    let mut kept = moved;
    kept[last] = 1;
    let out = out.reshape(kept);
    Ok(if dim == last {
        out
    } else {
        out.swap_dims(dim, last)
    })
}
