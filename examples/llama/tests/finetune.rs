//! The fine-tuning loop on a tiny random-weight model (CPU): the loss falls and validation
//! improves, a run resumed from a checkpoint continues exactly the uninterrupted one, CCE and
//! the plain loss give the same curve, and a bad configuration is a typed error.

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{DType, backend::Backend};
use burn_kernels_core::ReferenceAttention;
use burn_llama::config::LlamaConfig;
use burn_llama::finetune::{Corpus, StepLog, TrainConfig, TrainError, train};
use burn_llama::model::Llama;
use burn_llama::train::LossKind;

type B = Autodiff<NdArray<f32>>;

fn tiny() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 61,
        hidden_size: 32,
        intermediate_size: 48,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        max_seq_len: 64,
        ..LlamaConfig::smollm2_135m()
    }
}

/// A learnable sequence: a fixed cycle of 13 ids with every 7th token random.
fn corpus() -> Corpus {
    let mut state = 12345u64;
    let tokens = (0..3000u32)
        .map(|i| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if i % 7 == 6 {
                (state >> 33) as u32 % 61
            } else {
                (i * 5) % 13 + 3
            }
        })
        .collect();
    Corpus::split(tokens, 0.1)
}

/// A random model; the backend's generator is process-wide and the tests run in parallel, so
/// a test that needs two equal models clones one.
fn model(seed: u64) -> Llama<B> {
    let device = Default::default();
    B::seed(&device, seed);
    Llama::random(&tiny(), &device, DType::F32)
}

fn cfg(steps: usize) -> TrainConfig {
    TrainConfig {
        steps,
        batch: 4,
        seq: 24,
        grad_accum: 2,
        lr: 3e-3,
        warmup: 3,
        val_every: 0,
        val_windows: 8,
        ..TrainConfig::default()
    }
}

fn try_run(
    m: Llama<B>,
    c: &TrainConfig,
    kind: LossKind,
    ckpt: Option<(&std::path::Path, usize, bool)>,
    stop_after: Option<usize>,
) -> Result<Vec<StepLog>, TrainError> {
    let stop = |s: &StepLog| stop_after.is_none_or(|n| s.step < n);
    let attention = &ReferenceAttention;
    train(m, &corpus(), c, kind, attention, attention, ckpt, stop).map(|(_, log)| log)
}

fn run(
    m: Llama<B>,
    c: &TrainConfig,
    kind: LossKind,
    ckpt: Option<(&std::path::Path, usize, bool)>,
    stop_after: Option<usize>,
) -> Vec<StepLog> {
    try_run(m, c, kind, ckpt, stop_after).expect("trains")
}

#[test]
fn loss_falls_and_validation_improves() {
    let c = TrainConfig {
        val_every: 10,
        ..cfg(40)
    };
    let log = run(model(1), &c, LossKind::cce(), None, None);
    assert_eq!(log.len(), 40);
    let mean = |s: &[StepLog]| s.iter().map(|l| l.loss).sum::<f64>() / s.len() as f64;
    let (first, last) = (mean(&log[..5]), mean(&log[35..]));
    // The cycle is learnable: the loss must fall by more than a third of its start.
    assert!(
        last < 0.67 * first,
        "training loss {first:.3} -> {last:.3} (uniform: {:.3})",
        (61f64).ln()
    );
    let vals: Vec<f64> = log.iter().filter_map(|l| l.val_loss).collect();
    assert_eq!(vals.len(), 4, "validation at steps 10, 20, 30, 40");
    assert!(
        vals[3] < vals[0],
        "validation loss did not improve: {vals:?}"
    );
    assert!(log.iter().all(|l| l.loss.is_finite()));
}

#[test]
fn resume_continues_the_same_run() {
    let dir = std::env::temp_dir().join(format!("burn-llama-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let c = cfg(6);
    let m = model(2);
    let straight = run(m.clone(), &c, LossKind::cce(), None, None);
    let first = run(m, &c, LossKind::cce(), Some((&dir, 0, true)), Some(3));
    assert_eq!(first.len(), 3);
    // Another initialization: everything must come from the checkpoint.
    let resumed = run(model(99), &c, LossKind::cce(), Some((&dir, 0, true)), None);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(resumed.len(), 6, "the log continues the checkpoint's");
    assert_same_curve(&straight, &resumed, 1e-5, ("uninterrupted", "resumed"));
}

/// Same steps, and training losses within `rel` of each other at every step.
fn assert_same_curve(a: &[StepLog], b: &[StepLog], rel: f64, names: (&str, &str)) {
    assert_eq!(
        a.len(),
        b.len(),
        "{} and {} logs differ in length",
        names.0,
        names.1
    );
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.step, y.step);
        assert!(
            (x.loss - y.loss).abs() <= rel * x.loss.abs(),
            "step {}: {} {} vs {} {}",
            x.step,
            names.0,
            x.loss,
            names.1,
            y.loss
        );
    }
}

#[test]
fn cce_and_plain_give_the_same_curve() {
    let c = cfg(8);
    let m = model(3);
    let cce = run(m.clone(), &c, LossKind::cce(), None, None);
    let plain = run(m, &c, LossKind::Plain, None, None);
    assert_eq!(cce.len(), 8);
    assert_same_curve(&cce, &plain, 1e-4, ("cce", "plain"));
}

#[test]
fn bad_configuration_is_a_typed_error() {
    let c = TrainConfig {
        seq: 10_000,
        ..cfg(1)
    };
    let err = try_run(model(4), &c, LossKind::cce(), None, None)
        .expect_err("a window longer than the corpus is rejected");
    assert!(matches!(err, TrainError::Config(_)), "{err}");
}
