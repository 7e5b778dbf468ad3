//! The GEMM's gradient: `dA = dC · Bᵀ` and `dB = Aᵀ · dC`, each by the inner backend's
//! [`GemmKernels::gemm`] on transposed views (no copies).

use burn::backend::TensorMetadata;
use burn::backend::autodiff::{
    Autodiff, NodeId,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops},
};
use burn::backend::tensor::FloatTensor;

use super::GemmKernels;

impl<B: GemmKernels, C: CheckpointStrategy> GemmKernels for Autodiff<B, C> {
    fn gemm(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::tracked::binary::<B, C, _>(GemmBackward, a, b, B::gemm)
    }
}

/// Parents `[a, b]`; both inputs are kept by the checkpointer (see [`crate::tracked`]).
#[derive(Debug)]
struct GemmBackward;

impl<B: GemmKernels> Backward<B, 2> for GemmBackward {
    type State = (NodeId, NodeId);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [a_node, b_node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (a, b) = ops.state;
        let a: FloatTensor<B> = checkpointer.retrieve_node_output(a);
        let b: FloatTensor<B> = checkpointer.retrieve_node_output(b);
        // The last two dimensions: matrices, or batches of them.
        let t = |x: FloatTensor<B>| {
            let rank = x.shape().num_dims();
            B::float_swap_dims(x, rank - 2, rank - 1)
        };
        if let Some(node) = b_node {
            grads.register::<B>(node.id, B::gemm(t(a), grad.clone()));
        }
        if let Some(node) = a_node {
            grads.register::<B>(node.id, B::gemm(grad, t(b)));
        }
    }
}
