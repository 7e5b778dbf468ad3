//! Recording a differentiable op of two float inputs whose backward needs both inputs (the
//! GEMM, the SwiGLU gate, RMSNorm): one place for the autodiff bookkeeping.

use burn::backend::Backend;
use burn::backend::autodiff::{
    Autodiff,
    checkpoint::strategy::CheckpointStrategy,
    ops::{Backward, OpsKind},
};
use burn::backend::tensor::FloatTensor;

/// `forward(a, b)` on the inner backend, recorded as `op` over the parents `[a, b]` with the
/// state `(a, b)` (shared handles, no copies) where either parent is tracked.
pub(crate) fn binary<B, C, Op>(
    op: Op,
    a: FloatTensor<Autodiff<B, C>>,
    b: FloatTensor<Autodiff<B, C>>,
    forward: impl FnOnce(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>>
where
    B: Backend,
    C: CheckpointStrategy,
    Op: Backward<B, 2, State = (FloatTensor<B>, FloatTensor<B>)>,
{
    let (a, a_node) = a.into_parts();
    let (b, b_node) = b.into_parts();
    match op.prepare::<C>([a_node, b_node]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let out = forward(a.clone(), b.clone());
            prep.finish((a, b), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(a, b)),
    }
}
