//! Data parallelism's gradient averaging on the CPU: the global batch split over two replicas
//! (the same CPU device twice, which Burn's all-reduce serves with transfers), each replica's
//! gradients of its half, averaged by `all_reduce_mean`, equal the gradients of the whole batch
//! in one replica, parameter by parameter.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_kernels_core::ReferenceAttention;
use burn_kernels_testing::compare::to_f32;
use burn_kernels_testing::{Tolerance, assert_close};
use burn_llama::data_parallel::all_reduce_mean;
use burn_llama::model::Llama;
use burn_llama::train::{LossKind, next_token_loss};

use crate::finetune::tiny;

/// The gradients of the mean next-token loss of `model` on `rows` (each `seq + 1` ids).
fn grads(model: &Llama, rows: &[Vec<i64>], kind: LossKind) -> GradientsParams {
    let device = model.embed.val().device();
    let (n, len) = (rows.len(), rows[0].len());
    let ids: Vec<i64> = rows.iter().flatten().copied().collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [n, len]), &device);
    let loss = next_token_loss(model, tokens, &ReferenceAttention, kind, -100).expect("loss");
    GradientsParams::from_grads(loss.backward(), model)
}

#[derive(Default)]
struct Ids(Vec<(ParamId, usize)>);

impl ModuleVisitor for Ids {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.0.push((param.id, D));
    }
}

fn values(g: &GradientsParams, id: ParamId, rank: usize) -> Vec<f32> {
    match rank {
        1 => to_f32(g.get::<1>(id).expect("a gradient").into_data()),
        _ => to_f32(g.get::<2>(id).expect("a gradient").into_data()),
    }
}

#[test]
fn two_replicas_average_to_the_whole_batch() {
    let device = Device::flex().autodiff();
    device.seed(7);
    let model = Llama::random(&tiny(), &device, DType::F32);
    // Six rows of 13 tokens (ids below the tiny vocabulary's 61): three per replica.
    let mut state = 99u64;
    let rows: Vec<Vec<i64>> = (0..6)
        .map(|_| {
            (0..13)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 33) % 53) as i64
                })
                .collect()
        })
        .collect();
    for kind in [LossKind::Plain, LossKind::cce()] {
        let whole = grads(&model, &rows, kind);
        let replica = model.clone().fork(&device);
        let halves = vec![
            grads(&model, &rows[..3], kind),
            grads(&replica, &rows[3..], kind),
        ];
        let mean = all_reduce_mean(&model, halves);
        let mut ids = Ids::default();
        model.visit(&mut ids);
        assert!(ids.0.len() > 10, "{} parameters", ids.0.len());
        for (id, rank) in ids.0 {
            let (got, want) = (values(&mean, id, rank), values(&whole, id, rank));
            assert!(
                want.iter().any(|x| *x != 0.0),
                "parameter {id}: zero gradient"
            );
            // The averaged halves and the whole batch sum the same terms in another order.
            assert_close(
                &format!("{kind:?} parameter {id}"),
                &got,
                &want,
                Tolerance::for_reduction(DType::F32, 6 * 12),
            );
        }
    }
}
