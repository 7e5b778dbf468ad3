//! Recording a differentiable op of two float inputs whose backward needs both inputs (the
//! GEMM, the SwiGLU gate, RMSNorm): one place for the autodiff bookkeeping.
//!
//! The inputs are kept through Burn's checkpointer (`prep.checkpoint`, read back in the
//! backward with `retrieve_node_output`), not in the op's state: without gradient
//! checkpointing that keeps them alive exactly as before; with it
//! (`Device::autodiff().gradient_checkpointing()`, Burn's `BalancedCheckpointing`) an input made
//! by a memory-bound op with a retro-forward (the SwiGLU gate, RMSNorm: [`binary_recomputable`])
//! is dropped after the forward and recomputed from its own inputs when the backward needs it.

use burn::backend::Backend;
use burn::backend::autodiff::{
    Autodiff, NodeId,
    checkpoint::{retro_forward::RetroForward, strategy::CheckpointStrategy},
    ops::{Backward, OpsKind},
};
use burn::backend::tensor::FloatTensor;

/// `forward(a, b)` on the inner backend, recorded as the compute-bound `op` over the parents
/// `[a, b]` with the state `(a, b)` as checkpointed node ids where either parent is tracked.
pub(crate) fn binary<B, C, Op>(
    op: Op,
    a: FloatTensor<Autodiff<B, C>>,
    b: FloatTensor<Autodiff<B, C>>,
    forward: impl FnOnce(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>>
where
    B: Backend,
    C: CheckpointStrategy,
    Op: Backward<B, 2, State = (NodeId, NodeId)>,
{
    let kind = op
        .prepare::<C>([a.node(), b.node()])
        .compute_bound()
        .stateful();
    run(kind, a, b, forward)
}

/// [`binary`] for a memory-bound op that `retro` recomputes: under gradient checkpointing its
/// output is not kept for the ops that read it, but recomputed in their backward.
pub(crate) fn binary_recomputable<B, C, Op, R>(
    op: Op,
    retro: R,
    a: FloatTensor<Autodiff<B, C>>,
    b: FloatTensor<Autodiff<B, C>>,
    forward: impl FnOnce(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>>
where
    B: Backend,
    C: CheckpointStrategy,
    Op: Backward<B, 2, State = (NodeId, NodeId)>,
    R: RetroForward,
{
    let kind = op
        .prepare::<C>([a.node(), b.node()])
        .memory_bound()
        .retro_forward(retro)
        .parents([&a, &b])
        .stateful();
    run(kind, a, b, forward)
}

/// Runs `forward` on the inner tensors and finishes the prepared op: tracked, with `(a, b)`
/// checkpointed as its state.
fn run<B, C, Op>(
    kind: OpsKind<Op, B, (NodeId, NodeId), C, 2>,
    a: FloatTensor<Autodiff<B, C>>,
    b: FloatTensor<Autodiff<B, C>>,
    forward: impl FnOnce(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>>
where
    B: Backend,
    C: CheckpointStrategy,
    Op: Backward<B, 2, State = (NodeId, NodeId)>,
{
    match kind {
        OpsKind::Tracked(mut prep) => {
            let state = (prep.checkpoint(&a), prep.checkpoint(&b));
            let out = forward(a.into_parts().0, b.into_parts().0);
            prep.finish(state, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(a.into_parts().0, b.into_parts().0)),
    }
}
