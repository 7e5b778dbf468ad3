//! The public loss: validation, shift, compaction of ignored tokens, reduction.

use burn::backend::Dispatch;
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor, TensorData};
use burn_kernels_core::route::{Grad, route};

use crate::{CceError, CceKernels, CceOptions, Reduction, kernel_dtype_unsupported, reference};

/// The result of [`linear_cross_entropy`].
#[derive(Debug, Clone)]
pub struct CceOutput {
    /// `[1]` for [`Reduction::Mean`] and [`Reduction::Sum`], `[N]` for [`Reduction::None`]
    /// (flattened leading dims, 0 at ignored tokens); f32.
    pub loss: Tensor<1>,
    /// With [`CceOptions::return_lse`]: the per-token log-sum-exp, `[N]` f32, 0 at ignored
    /// tokens; not differentiable.
    pub lse: Option<Tensor<1>>,
}

/// Cross-entropy of the linear classifier `softmax(E·Cᵀ + b)` against `targets`, without
/// materializing the logits where the kernels run.
///
/// Differentiable with respect to `embeddings`, `classifier` and `bias` on autodiff devices.
/// On a CubeCL device the chunked kernels of [`CceKernels`] run (with their own backward on
/// an autodiff device); elsewhere (Burn's `Flex` CPU backend, or a configuration the kernels
/// do not take) the tensor-op [`reference::linear_ce_forward`], which Burn differentiates.
/// Ignored tokens (`targets == ignore_index`, and with `shift` the last position of each
/// sequence) are removed before the kernels run; the mean divides by the number of tokens
/// left. When every token is ignored the loss is 0 (never NaN) and carries no gradient.
///
/// # Shapes
/// - `embeddings`: `[…, D]` (rank `DE ≥ 2`; leading dims are flattened to `N`), f32/f16/bf16
/// - `classifier`: `[V, D]` (cast to the embeddings' dtype if it differs)
/// - `targets`: `[…]`, the embeddings' leading dims (rank `DE − 1`); with `shift`, the
///   second-to-last embeddings dim is the sequence
/// - `bias`: `[V]`
///
/// # Errors
/// Shape mismatches ([`CceError::HiddenSizeMismatch`], [`CceError::TargetShapeMismatch`],
/// [`CceError::BiasShapeMismatch`]), [`CceError::EmptyVocabulary`], a target outside
/// `[0, V)` that is not the ignore index ([`CceError::TargetOutOfRange`]), and invalid
/// options ([`CceError::InvalidSoftcap`], [`CceError::InvalidFilterEps`]). Reading the
/// targets synchronizes with the device once.
pub fn linear_cross_entropy<const DE: usize, const DT: usize>(
    embeddings: Tensor<DE>,
    classifier: Tensor<2>,
    targets: Tensor<DT, Int>,
    bias: Option<Tensor<1>>,
    options: &CceOptions,
) -> Result<CceOutput, CceError> {
    let e_dims = embeddings.dims();
    let t_dims = targets.dims();
    let [vocab, _] = classifier.dims();
    let d = check_inputs(
        &e_dims,
        &t_dims,
        classifier.dims(),
        bias.as_ref().map(|b| b.dims()),
        options,
    )?;

    let total: usize = t_dims.iter().product();
    let seq = e_dims[DE - 2].max(1);
    let host: Vec<i64> = targets
        .to_data()
        .try_into_vec_as::<i64>()
        .expect("targets convert to i64");
    let (valid, valid_targets) = kept_targets(&host, seq, vocab, options)?;

    let device = embeddings.device();
    let dtype = embeddings.dtype();
    let n = valid.len();
    if n == 0 {
        let len = if options.reduction == Reduction::None {
            total
        } else {
            1
        };
        let zeros = Tensor::<1>::zeros([len], (&device, DType::F32));
        return Ok(CceOutput {
            loss: zeros,
            lse: options
                .return_lse
                .then(|| Tensor::zeros([total], (&device, DType::F32))),
        });
    }

    let e = embeddings.reshape([total, d]);
    let keep = Tensor::<1, Int>::from_data(TensorData::new(valid, [n]), &device);
    let e = if n == total {
        e
    } else {
        e.select(0, keep.clone())
    };
    let classifier = if classifier.dtype() == dtype {
        classifier
    } else {
        classifier.cast(dtype)
    };
    let bias = bias.map(|b| if b.dtype() == dtype { b } else { b.cast(dtype) });
    let targets = Tensor::<1, Int>::from_data(TensorData::new(valid_targets, [n]), &device);
    let params = options.params(dtype);

    let unsupported = kernel_dtype_unsupported(dtype);
    let (loss, lse) = if route(
        "linear_cross_entropy",
        &device,
        Grad::Differentiable,
        unsupported,
    ) {
        let (e, c, t) = (
            e.into_dispatch(),
            classifier.into_dispatch(),
            targets.into_dispatch(),
        );
        let (loss, lse) = match bias {
            None => Dispatch::linear_ce_loss(e, c, t, params),
            Some(b) => Dispatch::linear_ce_loss_bias(e, c, b.into_dispatch(), t, params),
        };
        (
            Tensor::<1>::from_dispatch(loss),
            Tensor::<1>::from_dispatch(lse),
        )
    } else {
        let (lse, target) =
            reference::linear_ce_forward(e, classifier, bias, targets, params.softcap);
        (lse.clone() - target, lse.detach())
    };
    let scatter = |values: Tensor<1>| {
        if n == total {
            values
        } else {
            Tensor::<1>::zeros([total], (&device, DType::F32)).select_assign(
                0,
                keep.clone(),
                values,
                IndexingUpdateOp::Add,
            )
        }
    };
    let loss = match options.reduction {
        Reduction::Mean => loss.sum() / n as f32,
        Reduction::Sum => loss.sum(),
        Reduction::None => scatter(loss),
    };
    Ok(CceOutput {
        loss,
        lse: options.return_lse.then(|| scatter(lse)),
    })
}

/// The shape and option checks of [`linear_cross_entropy`]; returns the hidden size.
fn check_inputs(
    e_dims: &[usize],
    t_dims: &[usize],
    [vocab, c_d]: [usize; 2],
    bias_dims: Option<[usize; 1]>,
    options: &CceOptions,
) -> Result<usize, CceError> {
    if e_dims.len() < 2
        || t_dims.len() + 1 != e_dims.len()
        || t_dims[..] != e_dims[..e_dims.len() - 1]
    {
        return Err(CceError::TargetShapeMismatch {
            targets: t_dims.to_vec(),
            embeddings: e_dims.to_vec(),
        });
    }
    let d = e_dims[e_dims.len() - 1];
    if c_d != d {
        return Err(CceError::HiddenSizeMismatch {
            embeddings: d,
            classifier: c_d,
        });
    }
    if vocab == 0 {
        return Err(CceError::EmptyVocabulary);
    }
    if let Some(b) = bias_dims
        && b != [vocab]
    {
        return Err(CceError::BiasShapeMismatch {
            bias: b.to_vec(),
            vocab,
        });
    }
    if let Some(c) = options.softcap
        && !(c.is_finite() && c > 0.0)
    {
        return Err(CceError::InvalidSoftcap(c));
    }
    if let crate::FilterEps::Value(v) = options.filter_eps
        && !(v.is_finite() && v >= 0.0)
    {
        return Err(CceError::InvalidFilterEps(v));
    }
    Ok(d)
}

/// The positions of `host` (flattened targets, rows of `seq`) that are scored, and their
/// targets: with `options.shift` position `t` is scored against `t + 1` of its row (the last of
/// a row has none); the ignore index is skipped; a target outside `[0, vocab)` is an error.
fn kept_targets(
    host: &[i64],
    seq: usize,
    vocab: usize,
    options: &CceOptions,
) -> Result<(Vec<i64>, Vec<i64>), CceError> {
    let total = host.len();
    let mut valid = Vec::with_capacity(total);
    let mut valid_targets = Vec::with_capacity(total);
    for pos in 0..total {
        let target = if options.shift {
            if pos % seq + 1 < seq {
                host[pos + 1]
            } else {
                continue;
            }
        } else {
            host[pos]
        };
        if target == options.ignore_index {
            continue;
        }
        if target < 0 || target as usize >= vocab {
            let position = if options.shift { pos + 1 } else { pos };
            return Err(CceError::TargetOutOfRange {
                position,
                value: target,
                vocab,
            });
        }
        valid.push(pos as i64);
        valid_targets.push(target);
    }
    Ok((valid, valid_targets))
}

/// [`linear_cross_entropy`] as a loss object: build it once from options, call it in the
/// training step with the final hidden states, the classifier (LM head) weight and the
/// targets, get a scalar loss to call `backward()` on.
///
/// ```
/// use burn::tensor::{Device, Int, Tensor};
/// use burn_cce::{CceOptions, LinearCrossEntropyLoss};
///
/// let device = Device::flex().autodiff();
/// let loss_fn = LinearCrossEntropyLoss::new(CceOptions { shift: true, ..Default::default() });
/// let hidden = Tensor::<3>::ones([1, 4, 8], &device);
/// let lm_head = Tensor::<2>::ones([16, 8], &device).require_grad();
/// let tokens = Tensor::<2, Int>::from_ints([[3, 1, 4, 1]], &device);
/// let loss = loss_fn.forward(hidden, lm_head.clone(), tokens).unwrap();
/// assert!((loss.clone().into_scalar::<f32>() - 16f32.ln()).abs() < 1e-5);
/// let grads = loss.backward();
/// assert!(lm_head.grad(&grads).is_some());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LinearCrossEntropyLoss {
    /// The options every call uses.
    pub options: CceOptions,
}

impl LinearCrossEntropyLoss {
    /// A loss with these options.
    pub fn new(options: CceOptions) -> Self {
        Self { options }
    }

    /// The loss of `hidden` against `targets` under the classifier `weight` (`[V, D]`).
    ///
    /// # Shapes
    /// As [`linear_cross_entropy`]; returns `[1]` or, with [`Reduction::None`], `[N]`.
    ///
    /// # Errors
    /// As [`linear_cross_entropy`].
    pub fn forward<const DE: usize, const DT: usize>(
        &self,
        hidden: Tensor<DE>,
        weight: Tensor<2>,
        targets: Tensor<DT, Int>,
    ) -> Result<Tensor<1>, CceError> {
        linear_cross_entropy(hidden, weight, targets, None, &self.options).map(|out| out.loss)
    }
}
