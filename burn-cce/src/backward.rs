//! Autodiff: each op's forward runs on the inner backend, its gradient is registered here.
//!
//! The backward passes see only the inner backend's primitives: the loss's gradient is the
//! inner backend's [`CceKernels::linear_ce_backward`] (`_bias`), the log-sum-exp's is
//! `softmax(x)·grad` in primitive ops.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, NodeGuard, Ops, OpsKind},
};
use burn::backend::{
    AutodiffBackend, Backend, Scalar, TensorMetadata,
    tensor::{FloatTensor, IntTensor},
};
use burn::tensor::{DType, FloatDType, Shape};

use crate::{CceKernels, LceParams, PassKernels};

impl<B: CceKernels, C: CheckpointStrategy> CceKernels for Autodiff<B, C> {
    fn logsumexp_rows(logits: FloatTensor<Self>, softcap: Option<f32>) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct LogsumexpRowsBackward;

        impl<B: CceKernels> Backward<B, 1> for LogsumexpRowsBackward {
            // The input, the output, and the softcap: the gradient is softmax(x)·grad.
            type State = (FloatTensor<B>, FloatTensor<B>, Option<f32>);

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let [node] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let (x, lse, softcap) = ops.state;
                if let Some(node) = node {
                    grads.register::<B>(
                        node.id,
                        logsumexp_rows_backward::<B>(x, lse, grad, softcap),
                    );
                }
            }
        }

        let (x, node) = logits.into_parts();
        match LogsumexpRowsBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let lse = B::logsumexp_rows(x.clone(), softcap);
                prep.finish((x, lse.clone(), softcap), lse)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::logsumexp_rows(x, softcap)),
        }
    }

    fn linear_ce_forward(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (lse, target) =
            B::linear_ce_forward(e.into_primitive(), c.into_primitive(), targets, params);
        (Self::from_inner(lse), Self::from_inner(target))
    }

    fn linear_ce_forward_bias(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        targets: IntTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (lse, target) = B::linear_ce_forward_bias(
            e.into_primitive(),
            c.into_primitive(),
            bias.into_primitive(),
            targets,
            params,
        );
        (Self::from_inner(lse), Self::from_inner(target))
    }

    fn linear_ce_backward(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (de, dc) = B::linear_ce_backward(
            e.into_primitive(),
            c.into_primitive(),
            targets,
            lse.into_primitive(),
            dout.into_primitive(),
            params,
        );
        (Self::from_inner(de), Self::from_inner(dc))
    }

    fn linear_ce_backward_bias(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (de, dc, db) = B::linear_ce_backward_bias(
            e.into_primitive(),
            c.into_primitive(),
            bias.into_primitive(),
            targets,
            lse.into_primitive(),
            dout.into_primitive(),
            params,
        );
        (
            Self::from_inner(de),
            Self::from_inner(dc),
            Self::from_inner(db),
        )
    }

    fn linear_ce_loss_train(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (loss, lse, de_unit) =
            B::linear_ce_loss_train(e.into_primitive(), c.into_primitive(), targets, params);
        (
            Self::from_inner(loss),
            Self::from_inner(lse),
            Self::from_inner(de_unit),
        )
    }

    fn linear_ce_backward_train(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        de_unit: FloatTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (de, dc) = B::linear_ce_backward_train(
            e.into_primitive(),
            c.into_primitive(),
            targets,
            lse.into_primitive(),
            dout.into_primitive(),
            de_unit.into_primitive(),
            params,
        );
        (Self::from_inner(de), Self::from_inner(dc))
    }

    fn linear_ce_loss(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let train = e.is_tracked() && grad_in_forward(&e, &params);
        let (e, e_node) = e.into_parts();
        let (c, c_node) = c.into_parts();
        let (loss, lse, de_unit) = if train {
            let (loss, lse, de_unit) =
                B::linear_ce_loss_train(e.clone(), c.clone(), targets.clone(), params);
            (loss, lse, Some(de_unit))
        } else {
            let (loss, lse) = B::linear_ce_loss(e.clone(), c.clone(), targets.clone(), params);
            (loss, lse, None)
        };
        let state = (e, c, None, targets, lse.clone(), params, de_unit);
        let loss = track_loss::<B, C, 2>([e_node, c_node], state, loss);
        (loss, Self::from_inner(lse))
    }

    fn linear_ce_loss_bias(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        targets: IntTensor<Self>,
        params: LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (e, e_node) = e.into_parts();
        let (c, c_node) = c.into_parts();
        let (bias, bias_node) = bias.into_parts();
        let (loss, lse) =
            B::linear_ce_loss_bias(e.clone(), c.clone(), bias.clone(), targets.clone(), params);
        let state = (e, c, Some(bias), targets, lse.clone(), params, None);
        let loss = track_loss::<B, C, 3>([e_node, c_node, bias_node], state, loss);
        (loss, Self::from_inner(lse))
    }
}

/// `loss` as one [`LinearCeBackward`] op over the parents `nodes` (`[e, c]` or `[e, c, bias]`),
/// keeping `state` for the backward where a parent is tracked.
fn track_loss<B: CceKernels, C: CheckpointStrategy, const N: usize>(
    nodes: [NodeGuard; N],
    state: LceState<B>,
    loss: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    match LinearCeBackward::<N>
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(state, loss),
        OpsKind::UnTracked(prep) => prep.finish(loss),
    }
}

/// The linear cross-entropy as one autodiff op. Parents: `[e, c]` or `[e, c, bias]`; the
/// state keeps the inputs (no copies: the handles are shared) and the log-sum-exp, and the
/// backward recomputes the logits chunk by chunk.
#[derive(Debug)]
struct LinearCeBackward<const N: usize>;

type LceState<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    IntTensor<B>,
    FloatTensor<B>,
    LceParams,
    Option<FloatTensor<B>>,
);

impl<B: CceKernels, const N: usize> Backward<B, N> for LinearCeBackward<N> {
    type State = LceState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let dout = grads.consume::<B>(&ops.node);
        let (e, c, bias, targets, lse, params, de_unit) = ops.state;
        let (de, dc, db) = match (bias, de_unit) {
            (None, Some(de_unit)) => {
                let (de, dc) =
                    B::linear_ce_backward_train(e, c, targets, lse, dout, de_unit, params);
                (de, dc, None)
            }
            (None, None) => {
                let (de, dc) = B::linear_ce_backward(e, c, targets, lse, dout, params);
                (de, dc, None)
            }
            (Some(bias), _) => {
                let (de, dc, db) =
                    B::linear_ce_backward_bias(e, c, bias, targets, lse, dout, params);
                (de, dc, Some(db))
            }
        };
        for (parent, grad) in ops.parents.into_iter().zip([Some(de), Some(dc), db]) {
            if let (Some(node), Some(grad)) = (parent, grad) {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Whether the loss of `e` takes the training forward ([`CceKernels::linear_ce_loss_train`]):
/// the fused passes asked for or automatic, and inputs they may take
/// ([`crate::kernels::fused::inputs_unsupported`]); the device's checks are the kernels' own
/// (where they decline, the chunked passes run).
fn grad_in_forward<T: TensorMetadata>(e: &T, params: &LceParams) -> bool {
    matches!(params.passes, PassKernels::Fused | PassKernels::Auto)
        && crate::kernels::fused::inputs_unsupported(e.dtype(), e.shape()[1]).is_none()
}

/// Gradient of the row-wise log-sum-exp of `[rows, cols]` logits: `softmax(cap(x))·grad·cap'`,
/// computed in f32 and returned in `x`'s dtype (the tensor-op
/// [`crate::reference::logsumexp_rows_backward`] in primitive ops).
///
/// # Shapes
/// - `x`: `[rows, cols]`, `lse`: `[rows]`, `grad`: `[rows]`; returns `[rows, cols]`
fn logsumexp_rows_backward<B: Backend>(
    x: FloatTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
    cap: Option<f32>,
) -> FloatTensor<B> {
    let dtype: DType = x.dtype();
    let rows = x.shape()[0];
    let column = |t: FloatTensor<B>| {
        B::float_reshape(B::float_cast(t, FloatDType::F32), Shape::new([rows, 1]))
    };
    let x = B::float_cast(x, FloatDType::F32);
    // tanh(x / c), when capped.
    let tanh = cap.map(|c| B::float_tanh(B::float_div_scalar(x.clone(), Scalar::from(c))));
    let capped = match (&tanh, cap) {
        (Some(t), Some(c)) => B::float_mul_scalar(t.clone(), Scalar::from(c)),
        _ => x,
    };
    let softmax = B::float_exp(B::float_sub(capped, column(lse)));
    let dx = B::float_mul(softmax, column(grad));
    // d/dx c·tanh(x/c) = 1 − tanh²(x/c)
    let dx = match tanh {
        Some(t) => {
            let slope = B::float_add_scalar(
                B::float_neg(B::float_mul(t.clone(), t)),
                Scalar::from(1.0f32),
            );
            B::float_mul(dx, slope)
        }
        None => dx,
    };
    B::float_cast(dx, FloatDType::from(dtype))
}
