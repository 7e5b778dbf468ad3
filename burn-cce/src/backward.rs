//! Autodiff: each op's forward runs on the inner backend, its gradient is registered here.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::{Tensor, TensorPrimitive, ops::FloatTensor};

use crate::{CceBackend, reference};

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
}
