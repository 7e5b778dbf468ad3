//! The GEMM's gradient: `dA = dC · Bᵀ` and `dB = Aᵀ · dC`, each by the inner backend's
//! [`GemmKernels::gemm`] on transposed views (no copies).

use burn::backend::TensorMetadata;
use burn::backend::autodiff::{
    Autodiff,
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

/// Parents `[a, b]`; the state keeps both inputs (shared handles, no copies).
#[derive(Debug)]
struct GemmBackward;

impl<B: GemmKernels> Backward<B, 2> for GemmBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [a_node, b_node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (a, b) = ops.state;
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
