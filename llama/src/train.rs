//! The language-modelling loss of a training step, with Cut Cross-Entropy or Burn's plain
//! cross-entropy on the same model.

use burn::tensor::{Int, Tensor};
use burn_cce::{CceError, CceOptions, LinearCrossEntropyLoss, Reduction, reference};
use burn_kernels_core::{AttentionImpl, FullKvCache};

use crate::model::Llama;

/// How the next-token loss is computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossKind {
    /// burn-cce's linear cross-entropy: the logits are never materialized.
    Cce(CceOptions),
    /// Logits `[batch, seq, vocab]` in the model dtype, log-softmax, gather: Burn's plain path.
    Plain,
}

impl LossKind {
    /// CCE with default options (mean over tokens, f32 dE accumulation, burn-cce's automatic
    /// block sizes: the loss's memory near dE + dC).
    pub fn cce() -> Self {
        LossKind::Cce(CceOptions::default())
    }

    /// CCE with [`CceOptions::for_training`]: the default options in 256 MiB working blocks,
    /// what `finetune` runs. Faster in a training step; in f32 on CUDA two runs of 50 steps
    /// were not bitwise equal (H200, 2026-11-30: final losses 2.3353 and 2.3288, where the
    /// automatic sizes gave 2.3306 twice; cause not isolated).
    pub fn cce_for_training() -> Self {
        LossKind::Cce(CceOptions::for_training())
    }
}

/// Mean next-token cross-entropy of `tokens` under `model`: position `t` predicts token
/// `t + 1`.
///
/// # Shapes
/// - `tokens`: `[batch, seq]`, `seq ≥ 2`; returns `[1]` (f32)
///
/// # Errors
/// The loss's typed errors (token ids outside the vocabulary, …).
pub fn next_token_loss(
    model: &Llama,
    tokens: Tensor<2, Int>,
    attention: &dyn AttentionImpl,
    kind: LossKind,
    ignore_index: i64,
) -> Result<Tensor<1>, CceError> {
    next_token_loss_with_targets(model, tokens.clone(), tokens, attention, kind, ignore_index)
}

/// [`next_token_loss`] with targets given apart from the model inputs, so that padding can be
/// marked with `ignore_index` in `targets` while `tokens` holds valid ids: position `t` of
/// `tokens` is scored against `targets[t + 1]`.
///
/// # Shapes
/// - `tokens`, `targets`: `[batch, seq]`, `seq ≥ 2`; returns `[1]` (f32)
///
/// # Errors
/// The loss's typed errors (target ids outside the vocabulary, …).
pub fn next_token_loss_with_targets(
    model: &Llama,
    tokens: Tensor<2, Int>,
    targets: Tensor<2, Int>,
    attention: &dyn AttentionImpl,
    kind: LossKind,
    ignore_index: i64,
) -> Result<Tensor<1>, CceError> {
    let mut cache = FullKvCache::new(model.config.num_layers);
    let hidden = model.forward(tokens, &[], &mut cache, attention);
    hidden_loss(hidden, model.classifier(), targets, kind, ignore_index)
}

/// The mean next-token loss of final hidden states against `targets` (position `t` scored
/// against `targets[t + 1]`), with the classifier `[vocab, hidden]`.
pub(crate) fn hidden_loss(
    hidden: Tensor<3>,
    classifier: Tensor<2>,
    targets: Tensor<2, Int>,
    kind: LossKind,
    ignore_index: i64,
) -> Result<Tensor<1>, CceError> {
    match kind {
        LossKind::Cce(options) => {
            let options = CceOptions {
                shift: true,
                ignore_index,
                reduction: Reduction::Mean,
                ..options
            };
            LinearCrossEntropyLoss::new(options).forward(hidden, classifier, targets)
        }
        LossKind::Plain => {
            let [b, s, h] = hidden.dims();
            let inputs = hidden
                .slice([0..b, 0..s - 1, 0..h])
                .reshape([b * (s - 1), h]);
            let targets = targets.slice([0..b, 1..s]).reshape([b * (s - 1)]);
            Ok(reference::plain_linear_cross_entropy(
                inputs,
                classifier,
                None,
                targets,
                ignore_index,
                None,
                Reduction::Mean,
            ))
        }
    }
}

/// Distillation against a teacher's full next-token distributions: the mean over positions of
/// `KL(teacher ‖ student)`, where [`next_token_loss`] scores only the token that follows. At
/// every position the student learns the teacher's whole row, which is what a speculative
/// draft is accepted on (`sum min(p, q)`), instead of one sample of it. The teacher runs
/// without gradient on the inner backend.
///
/// Both models see `tokens[.., ..seq - 1]` (the last token has no successor in the window, as in
/// [`next_token_loss`]) and must share the vocabulary. Logits `[batch, seq - 1, vocab]` are
/// materialized for both, so memory grows with `batch · seq · vocab`.
///
/// # Shapes
/// - `tokens`: `[batch, seq]`, `seq ≥ 2`; returns `[1]` (f32, nats per position)
///
/// # Panics
/// If `seq < 2` or the vocabularies differ.
pub fn soft_label_loss(
    student: &Llama,
    teacher: &Llama,
    tokens: Tensor<2, Int>,
    attention: &dyn AttentionImpl,
    teacher_attention: &dyn AttentionImpl,
) -> Tensor<1> {
    use burn::tensor::activation::log_softmax;
    let [b, s] = tokens.dims();
    assert!(s >= 2, "a window needs at least two tokens");
    assert_eq!(
        student.config.vocab_size, teacher.config.vocab_size,
        "student and teacher vocabularies"
    );
    let inputs = tokens.slice([0..b, 0..s - 1]);
    let mut cache = FullKvCache::new(teacher.config.num_layers);
    let hidden = teacher.forward(inputs.clone().inner(), &[], &mut cache, teacher_attention);
    let log_p = log_softmax(teacher.logits(hidden), 2);
    // Constants of the loss: p and sum p log p (the teacher's negative entropy).
    let p = log_p.clone().exp();
    let neg_entropy = Tensor::<1>::from_inner((p.clone() * log_p).sum());
    let p = Tensor::<3>::from_inner(p);
    let mut cache = FullKvCache::new(student.config.num_layers);
    let hidden = student.forward(inputs, &[], &mut cache, attention);
    // A bf16 student (mixed precision) scores against the teacher's f32 distributions in f32.
    let logits = student.logits(hidden);
    let logits = match logits.dtype() == p.dtype() {
        true => logits,
        false => logits.cast(p.dtype()),
    };
    let log_q = log_softmax(logits, 2);
    let cross = (p * log_q).sum().neg();
    (cross + neg_entropy) / (b * (s - 1)) as f32
}
