//! Data parallelism's gradient step: the replicas' gradients averaged parameter by parameter with
//! Burn's all-reduce (`Tensor::all_reduce`, which runs NCCL between CUDA devices and transfers
//! elsewhere), so that every replica can take the same optimizer step. Each replica computes its
//! gradients on its slice of the global batch; with a loss that is a mean over equally many
//! tokens per slice, the average of the slices' gradients is the global batch's gradient.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::distributed::ReduceOperation;

use crate::model::Llama;

/// The float parameters of a model by rank (the Llama model has rank-1 norms and rank-2
/// matrices).
#[derive(Default)]
struct ParamsByRank {
    rank1: Vec<ParamId>,
    rank2: Vec<ParamId>,
    other: usize,
}

impl ModuleVisitor for ParamsByRank {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        match D {
            1 => self.rank1.push(param.id),
            2 => self.rank2.push(param.id),
            _ => self.other += 1,
        }
    }
}

/// The mean of `grads` (one per replica of `model`, each on its replica's device) for every
/// float parameter, on the first replica's device: what the first replica's optimizer step
/// takes. Parameters without a gradient in every replica are left out.
///
/// # Panics
/// When `grads` is empty, or `model` has float parameters of a rank other than 1 or 2.
pub fn all_reduce_mean(model: &Llama, mut grads: Vec<GradientsParams>) -> GradientsParams {
    assert!(!grads.is_empty(), "no replica gradients to average");
    let mut params = ParamsByRank::default();
    model.visit(&mut params);
    assert_eq!(params.other, 0, "parameters of rank other than 1 and 2");
    let mut out = GradientsParams::new();
    for id in params.rank1 {
        reduce_param::<1>(id, &mut grads, &mut out);
    }
    for id in params.rank2 {
        reduce_param::<2>(id, &mut grads, &mut out);
    }
    out
}

/// Moves the mean of every replica's gradient of `id` into `out` (the first replica's copy).
fn reduce_param<const D: usize>(
    id: ParamId,
    grads: &mut [GradientsParams],
    out: &mut GradientsParams,
) {
    let members: Option<Vec<Tensor<D>>> = grads.iter_mut().map(|g| g.remove::<D>(id)).collect();
    if let Some(members) = members
        && let Some(first) = Tensor::all_reduce(members, ReduceOperation::Mean)
            .into_iter()
            .next()
    {
        out.register::<D>(id, first);
    }
}
