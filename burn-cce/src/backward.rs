//! Autodiff: each op's forward runs on the inner backend, its gradient is registered here.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{
    Tensor, TensorPrimitive,
    ops::{FloatTensor, IntTensor},
};

use crate::{CceBackend, LceParams, reference};

impl<B: CceBackend, C: CheckpointStrategy> CceBackend for Autodiff<B, C> {
    fn logsumexp_rows(logits: FloatTensor<Self>, softcap: Option<f32>) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct LogsumexpRowsBackward;

        impl<B: CceBackend> Backward<B, 1> for LogsumexpRowsBackward {
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
                    let f2 = |t| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t));
                    let f1 = |t| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t));
                    let dx = reference::logsumexp_rows_backward(f2(x), f1(lse), f1(grad), softcap);
                    grads.register::<B>(node.id, dx.into_primitive().tensor());
                }
            }
        }

        match LogsumexpRowsBackward
            .prepare::<C>([logits.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let lse = B::logsumexp_rows(logits.primitive.clone(), softcap);
                prep.finish((logits.primitive, lse.clone(), softcap), lse)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::logsumexp_rows(logits.primitive, softcap)),
        }
    }

    fn linear_ce_loss(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        targets: IntTensor<Self>,
        params: &LceParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let lse_out = |lse: FloatTensor<B>| Autodiff::<B, C>::from_inner(lse);
        match bias {
            None => {
                let (loss, lse) = tracked_loss::<B, C, 2>(
                    [&e, &c],
                    e.primitive.clone(),
                    c.primitive.clone(),
                    None,
                    targets,
                    params,
                );
                (loss, lse_out(lse))
            }
            Some(b) => {
                let (loss, lse) = tracked_loss::<B, C, 3>(
                    [&e, &c, &b],
                    e.primitive.clone(),
                    c.primitive.clone(),
                    Some(b.primitive.clone()),
                    targets,
                    params,
                );
                (loss, lse_out(lse))
            }
        }
    }

    fn memory_in_use(device: &Self::Device) -> Option<u64> {
        B::memory_in_use(device)
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
);

impl<B: CceBackend, const N: usize> Backward<B, N> for LinearCeBackward<N> {
    type State = LceState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let dout = grads.consume::<B>(&ops.node);
        let (e, c, bias, targets, lse, params) = ops.state;
        let (de, dc, db) = B::linear_ce_backward(e, c, bias, targets, lse, dout, &params);
        for (parent, grad) in ops.parents.into_iter().zip([Some(de), Some(dc), db]) {
            if let (Some(node), Some(grad)) = (parent, grad) {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

fn tracked_loss<B: CceBackend, C: CheckpointStrategy, const N: usize>(
    parents: [&FloatTensor<Autodiff<B, C>>; N],
    e: FloatTensor<B>,
    c: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    targets: IntTensor<B>,
    params: &LceParams,
) -> (FloatTensor<Autodiff<B, C>>, FloatTensor<B>) {
    let (lse, target) =
        B::linear_ce_forward(e.clone(), c.clone(), bias.clone(), targets.clone(), params);
    let loss = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(lse.clone()))
        - Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(target));
    let loss = loss.into_primitive().tensor();
    match LinearCeBackward::<N>
        .prepare::<C>(parents.map(|t| t.node.clone()))
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let state = (e, c, bias, targets, lse.clone(), *params);
            (prep.finish(state, loss), lse)
        }
        OpsKind::UnTracked(prep) => (prep.finish(loss), lse),
    }
}
