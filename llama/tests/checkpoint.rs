//! Layer checkpointing (`burn_llama::checkpoint`) gives the loss and every parameter's gradient
//! of the plain step (one forward kept whole, one backward), tied and untied, with Cut
//! Cross-Entropy and the plain loss, in f32 and bf16 (f32 master weights), on the CPU and on
//! every enabled runtime.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_kernels_core::ReferenceAttention;
use burn_kernels_testing::compare::{assert_rel_l2, rounding_rel_l2, to_f32};
use burn_kernels_testing::{Tolerance, assert_close, assert_product_close, testgen};
use burn_llama::checkpoint::{CheckpointError, checkpointed_grads};
use burn_llama::config::LlamaConfig;
use burn_llama::finetune::TrainAttention;
use burn_llama::model::{ForwardError, Llama};
use burn_llama::precision::Precision;
use burn_llama::train::{LossKind, next_token_loss};

/// Head dim 64 (where the CUDA flash kernels take the attention), 3 layers, grouped heads.
fn config(tied: bool) -> LlamaConfig {
    LlamaConfig {
        vocab_size: 211,
        hidden_size: 128,
        intermediate_size: 96,
        num_layers: 3,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 64,
        max_seq_len: 128,
        tie_word_embeddings: tied,
        ..LlamaConfig::smollm2_135m()
    }
}

/// Seeded token ids, `[batch, seq]`.
fn tokens(batch: usize, seq: usize, vocab: usize, device: &Device) -> Tensor<2, Int> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let ids: Vec<i64> = (0..batch * seq)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % vocab as u64) as i64
        })
        .collect();
    Tensor::from_data(TensorData::new(ids, [batch, seq]), device)
}

/// Every float parameter: its id, rank and a name.
#[derive(Default)]
struct Params(Vec<(ParamId, usize, String)>);

impl ModuleVisitor for Params {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let name = format!("param {} (rank {D})", self.0.len());
        self.0.push((param.id, D, name));
    }
}

fn host(grads: &GradientsParams, id: ParamId, rank: usize) -> Option<Vec<f32>> {
    match rank {
        1 => grads.get::<1>(id).map(|t| to_f32(t.into_data())),
        2 => grads.get::<2>(id).map(|t| to_f32(t.into_data())),
        _ => unreachable!("Llama's parameters are vectors and matrices"),
    }
}

fn case(device: &Device, tied: bool, precision: Precision, kind: LossKind) {
    let cfg = config(tied);
    device.seed(7);
    let model = Llama::random(&cfg, device, DType::F32);
    let (batch, seq) = (2, 37);
    let ids = tokens(batch, seq, cfg.vocab_size, device);
    let attention = TrainAttention::for_precision(precision).build();
    let scale = 0.5;

    let view = precision.compute_view(&model);
    let loss = next_token_loss(&view, ids.clone(), attention.as_ref(), kind, -100).unwrap();
    let full = GradientsParams::from_grads((loss.clone() * scale).backward(), &model);
    let (ck_loss, ck) = checkpointed_grads(
        &model,
        precision,
        ids,
        attention.as_ref(),
        kind,
        -100,
        scale,
    )
    .unwrap();

    let what = format!("tied {tied}, {precision:?}, {kind:?}");
    let dtype = precision.compute_dtype();
    assert_close(
        &format!("loss ({what})"),
        &to_f32(ck_loss.into_data()),
        &to_f32(loss.into_data()),
        Tolerance::for_reduction(dtype, cfg.vocab_size),
    );
    let mut params = Params::default();
    model.visit(&mut params);
    assert_eq!(params.0.len(), 2 + 9 * cfg.num_layers + usize::from(!tied));
    for (id, rank, name) in params.0 {
        let name = format!("{name} ({what})");
        let expected = host(&full, id, rank).unwrap_or_else(|| panic!("{name}: no full gradient"));
        let actual =
            host(&ck, id, rank).unwrap_or_else(|| panic!("{name}: no checkpointed gradient"));
        assert!(
            expected.iter().any(|&x| x != 0.0) && actual.iter().all(|x| x.is_finite()),
            "{name}: a real gradient"
        );
        match dtype {
            // Each gradient sums over the batch's tokens (and a matrix's over the other side).
            DType::F32 => {
                assert_product_close(&name, &actual, &expected, dtype, batch * seq, device)
            }
            // The two orders round the residual stream's gradient (bf16) at different points
            // (the full step sums a layer's two contributions in one fused kernel): bounded by
            // two roundings a layer and two for the head and the embedding.
            _ => {
                let roundings = 2 * cfg.num_layers as u32 + 2;
                assert_rel_l2(&name, &actual, &expected, rounding_rel_l2(dtype, roundings));
            }
        }
    }
}

fn checkpointed_step_matches_full(device: &Device) {
    for tied in [true, false] {
        case(device, tied, Precision::F32, LossKind::cce());
    }
    case(device, true, Precision::F32, LossKind::Plain);
    // Where the runtime has bf16 (not wgpu / lavapipe).
    if device.supports_dtype(DType::BF16) {
        case(device, true, Precision::Bf16, LossKind::cce());
    }
}

#[test]
fn cpu_checkpointed_step_matches_full() {
    checkpointed_step_matches_full(&Device::flex().autodiff());
}

/// A sequence past the model's context is a typed error before anything runs, as without
/// checkpointing ([`Llama::try_forward`]).
#[test]
fn context_too_long_is_a_typed_error() {
    let device = Device::flex().autodiff();
    let cfg = config(true);
    let model = Llama::random(&cfg, &device, DType::F32);
    let max = model.max_positions();
    let got = checkpointed_grads(
        &model,
        Precision::F32,
        tokens(1, max + 1, cfg.vocab_size, &device),
        &ReferenceAttention,
        LossKind::cce(),
        -100,
        1.0,
    );
    match got {
        Err(CheckpointError::Forward(ForwardError::ContextTooLong { needed, max: m })) => {
            assert_eq!((needed, m), (max + 1, max));
        }
        Err(e) => panic!("expected ContextTooLong, got {e}"),
        Ok(_) => panic!("expected ContextTooLong, the step ran"),
    }
}

testgen! {
    backend: [],
    autodiff: [checkpointed_step_matches_full],
}
