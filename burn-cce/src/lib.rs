//! # burn-cce: Cut Cross-Entropy for Burn
//!
//! Cut Cross-Entropy (Wijmans et al., 2024) computes the cross-entropy loss of a linear
//! classifier and its gradients without materializing the `N × V` logit matrix.
//!
//! This first release provides the row-wise log-sum-exp op the loss is built on: a CubeCL
//! kernel with f32 accumulation and optional softcap, its plain tensor-op reference, and a
//! backward pass registered with Burn's autodiff.
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
mod cpu;
mod error;
mod forward;
pub mod kernels;
pub mod reference;

pub use error::CceError;

use burn::tensor::{Tensor, TensorPrimitive, backend::Backend, ops::FloatTensor};

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
