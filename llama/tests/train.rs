//! A training step of SmolLM2-135M (real weights) with Cut Cross-Entropy gives the same loss and
//! gradients as with Burn's plain cross-entropy, on the CPU and on every enabled runtime.

use crate::common::checkpoint;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_kernels_core::ReferenceAttention;
use burn_kernels_testing::{Tolerance, assert_close, compare::to_f32, testgen};
use burn_llama::model::Llama;
use burn_llama::train::{LossKind, next_token_loss};

/// Two rows of 24 tokens of the committed text; the second row's last 4 targets are
/// padding (ignored).
fn batch() -> (Vec<i64>, [usize; 2]) {
    const PAD: i64 = -100;
    let text = include_str!("../data/paragraph.txt");
    let ids = checkpoint().tokenizer.encode(text).expect("tokenizes");
    let mut rows: Vec<i64> = ids[..48].iter().map(|&t| t as i64).collect();
    for t in &mut rows[44..] {
        *t = PAD;
    }
    (rows, [2, 24])
}

struct Step {
    loss: Vec<f32>,
    /// (name, gradient, reduction length) of the parameters compared.
    grads: Vec<(&'static str, Vec<f32>, usize)>,
}

fn step(device: &Device, kind: LossKind) -> Step {
    let model = Llama::from_checkpoint(checkpoint(), device, DType::F32).expect("checkpoint");
    let (ids, shape) = batch();
    // The embedding lookup cannot take the ignore index: padded positions read token 0, and
    // their targets are ignored by the loss.
    let inputs: Vec<i64> = ids.iter().map(|&t| t.max(0)).collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(inputs, shape), device);
    let targets = Tensor::<2, Int>::from_data(TensorData::new(ids, shape), device);
    let loss = loss_with_targets(&model, tokens, targets, kind);
    let grads = loss.backward();
    let vocab = model.config.vocab_size;
    let last = model.layers.len() - 1;
    let host = |t: Tensor<2>| to_f32(t.into_data());
    Step {
        loss: to_f32(loss.into_data()),
        grads: vec![
            (
                "embed (tied classifier)",
                host(model.embed.grad(&grads).expect("embed grad")),
                vocab,
            ),
            (
                "layers[last].w_down",
                host(model.layers[last].w_down.grad(&grads).expect("w_down")),
                vocab,
            ),
            (
                "layers[0].wq",
                host(model.layers[0].wq.grad(&grads).expect("wq")),
                vocab,
            ),
        ],
    }
}

/// The loss with inputs and targets given separately (targets carry the ignore index).
fn loss_with_targets(
    model: &Llama,
    tokens: Tensor<2, Int>,
    targets: Tensor<2, Int>,
    kind: LossKind,
) -> Tensor<1> {
    burn_llama::train::next_token_loss_with_targets(
        model,
        tokens,
        targets,
        &ReferenceAttention,
        kind,
        -100,
    )
    .expect("valid batch")
}

fn cce_matches_plain(device: &Device) {
    let plain = step(device, LossKind::Plain);
    let cce = step(device, LossKind::cce());
    let vocab = checkpoint().config.vocab_size;
    println!("loss: plain {:?} cce {:?}", plain.loss, cce.loss);
    assert!(
        plain.loss[0].is_finite() && plain.loss[0] > 0.5,
        "a real loss"
    );
    assert_close(
        "loss",
        &cce.loss,
        &plain.loss,
        Tolerance::for_reduction(DType::F32, vocab),
    );
    for ((name, p, len), (_, c, _)) in plain.grads.iter().zip(&cce.grads) {
        assert!(
            p.iter().any(|&x| x != 0.0),
            "{name}: the gradient is not all zero"
        );
        burn_kernels_testing::assert_matmul_close(name, c, p, *len, device);
    }
}

#[test]
fn cpu_cce_training_step_matches_plain() {
    cce_matches_plain(&Device::flex().autodiff());
}

#[test]
fn next_token_loss_shifts() {
    // The public helper that shifts one token tensor agrees with explicit targets.
    let device = Device::flex().autodiff();
    let model = Llama::from_checkpoint(checkpoint(), &device, DType::F32).expect("checkpoint");
    let (ids, _) = batch();
    let row: Vec<i64> = ids[..16].to_vec();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(row.clone(), [1, 16]), &device);
    let a = next_token_loss(
        &model,
        tokens.clone(),
        &ReferenceAttention,
        LossKind::cce(),
        -100,
    )
    .unwrap();
    let b = next_token_loss(&model, tokens, &ReferenceAttention, LossKind::Plain, -100).unwrap();
    assert_close(
        "shifted loss",
        &to_f32(a.into_data()),
        &to_f32(b.into_data()),
        Tolerance::for_reduction(DType::F32, 49152),
    );
}

testgen! {
    backend: [],
    autodiff: [cce_matches_plain],
}
