//! Gradients in buckets: each replica flattens its gradients into a few large buffers (on its
//! own thread), the coordinator all-reduces each buffer once, and each replica cuts its copy
//! of the means back into parameters. One collective a bucket instead of one a parameter, and
//! the host work of flattening and cutting runs on the replicas' threads in parallel.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::distributed::ReduceOperation;
use burn::tensor::{DType, Tensor};

use crate::model::Llama;

/// One parameter's place in a bucket.
#[derive(Debug, Clone)]
struct Slot {
    id: ParamId,
    shape: Vec<usize>,
}

impl Slot {
    fn len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The float parameters of a model (rank 1 and 2: the Llama model's norms and matrices) in
/// buckets of consecutive parameters of one dtype, each at most a given number of bytes (a
/// larger parameter alone).
#[derive(Debug, Clone)]
pub(crate) struct BucketPlan {
    buckets: Vec<(DType, Vec<Slot>)>,
}

/// A replica's gradients flattened by a [`BucketPlan`]: one 1-D tensor a bucket, and whether
/// each parameter had a gradient (zeros stand in for a missing one).
pub(crate) struct Flattened {
    pub(crate) buckets: Vec<Tensor<1>>,
    pub(crate) present: Vec<bool>,
}

#[derive(Default)]
struct Params {
    slots: Vec<(Slot, DType)>,
    other: usize,
}

impl ModuleVisitor for Params {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if D == 1 || D == 2 {
            let val = param.val();
            let slot = Slot {
                id: param.id,
                shape: val.dims().to_vec(),
            };
            self.slots.push((slot, val.dtype()));
        } else {
            self.other += 1;
        }
    }
}

impl BucketPlan {
    /// The plan for `model`'s float parameters with buckets of at most `bucket_bytes`.
    ///
    /// # Panics
    /// When `model` has float parameters of a rank other than 1 or 2.
    pub(crate) fn new(model: &Llama, bucket_bytes: usize) -> Self {
        let mut params = Params::default();
        model.visit(&mut params);
        assert_eq!(params.other, 0, "parameters of rank other than 1 and 2");
        let mut buckets: Vec<(DType, Vec<Slot>)> = Vec::new();
        let mut bytes = 0;
        for (slot, dtype) in params.slots {
            let size = slot.len() * dtype.size();
            match buckets.last_mut() {
                Some((d, slots)) if *d == dtype && bytes + size <= bucket_bytes => {
                    slots.push(slot);
                    bytes += size;
                }
                _ => {
                    buckets.push((dtype, vec![slot]));
                    bytes = size;
                }
            }
        }
        Self { buckets }
    }

    /// `grads` flattened into the plan's buckets (taken out of `grads`).
    pub(crate) fn flatten(&self, mut grads: GradientsParams) -> Flattened {
        let device = self.device_of(&grads);
        let mut present = Vec::new();
        let buckets = self
            .buckets
            .iter()
            .map(|(dtype, slots)| {
                let parts: Vec<Tensor<1>> = slots
                    .iter()
                    .map(|slot| {
                        let flat = take(&mut grads, slot);
                        present.push(flat.is_some());
                        flat.map_or_else(
                            || {
                                let device = device.as_ref().expect("a gradient in the replica");
                                Tensor::<1>::zeros([slot.len()], device).cast(*dtype)
                            },
                            |t| t.cast(*dtype),
                        )
                    })
                    .collect();
                match parts.len() {
                    1 => parts.into_iter().next().expect("one part"),
                    _ => Tensor::cat(parts, 0),
                }
            })
            .collect();
        Flattened { buckets, present }
    }

    /// The device of the replica's gradients (any one's), for stand-ins of missing ones.
    fn device_of(&self, grads: &GradientsParams) -> Option<burn::tensor::Device> {
        self.buckets
            .iter()
            .flat_map(|(_, slots)| slots)
            .find_map(|slot| match slot.shape.len() {
                1 => grads.get::<1>(slot.id).map(|t| t.device()),
                _ => grads.get::<2>(slot.id).map(|t| t.device()),
            })
    }

    /// The parameters' gradients cut out of `buckets` (this plan's, on one device), for the
    /// parameters `keep` marks.
    pub(crate) fn unflatten(&self, buckets: Vec<Tensor<1>>, keep: &[bool]) -> GradientsParams {
        let mut out = GradientsParams::new();
        let mut keep = keep.iter();
        for ((_, slots), bucket) in self.buckets.iter().zip(buckets) {
            let mut offset = 0;
            for slot in slots {
                let len = slot.len();
                let part = match slots.len() {
                    1 => bucket.clone(),
                    _ => bucket.clone().slice(offset..offset + len),
                };
                offset += len;
                if !keep.next().copied().unwrap_or(false) {
                    continue;
                }
                match slot.shape[..] {
                    [_] => out.register::<1>(slot.id, part),
                    [a, b] => out.register::<2>(slot.id, part.reshape([a, b])),
                    _ => unreachable!("parameters of rank 1 and 2 only"),
                }
            }
        }
        out
    }

    /// Every replica's flattened gradients averaged: one all-reduce a bucket; each replica's
    /// means on its device, and the parameters every replica had a gradient for.
    ///
    /// # Panics
    /// When `replicas` is empty.
    pub(crate) fn all_reduce_mean(replicas: Vec<Flattened>) -> (Vec<Vec<Tensor<1>>>, Vec<bool>) {
        assert!(!replicas.is_empty(), "no replica gradients to average");
        let n = replicas.len();
        let mut keep = replicas[0].present.clone();
        for r in &replicas[1..] {
            for (k, p) in keep.iter_mut().zip(&r.present) {
                *k &= *p;
            }
        }
        let mut per_replica: Vec<Vec<Tensor<1>>> = vec![Vec::new(); n];
        let mut columns: Vec<std::vec::IntoIter<Tensor<1>>> = replicas
            .into_iter()
            .map(|r| r.buckets.into_iter())
            .collect();
        loop {
            let members: Option<Vec<Tensor<1>>> = columns.iter_mut().map(Iterator::next).collect();
            let Some(members) = members else { break };
            let means = Tensor::all_reduce(members, ReduceOperation::Mean);
            for (mine, mean) in per_replica.iter_mut().zip(means) {
                mine.push(mean);
            }
        }
        (per_replica, keep)
    }
}

/// The gradient of `slot` flattened, taken out of `grads`.
fn take(grads: &mut GradientsParams, slot: &Slot) -> Option<Tensor<1>> {
    match slot.shape.len() {
        1 => grads.remove::<1>(slot.id),
        _ => grads.remove::<2>(slot.id).map(|t| t.flatten::<1>(0, 1)),
    }
}
