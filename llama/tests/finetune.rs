//! The fine-tuning loop on a tiny random-weight model (CPU): the loss falls and validation
//! improves, a run resumed from a checkpoint continues exactly the uninterrupted one, CCE and
//! the plain loss give the same curve, a bad configuration is a typed error, and draft
//! distillation on the teacher's samples raises speculative acceptance.

use burn::module::Module;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_kernels_core::{FullKvCache, ReferenceAttention};
use burn_llama::config::LlamaConfig;
use burn_llama::finetune::{
    Corpus, StepLog, TeacherOptions, TrainConfig, TrainError, load_model, load_trained,
    teacher_samples, train,
};
use burn_llama::model::Llama;
use burn_llama::spec::truncated_draft;
use burn_llama::train::{LossKind, soft_label_loss};
use burn_specdec::{Scheme, Verifier};

/// The training device: Burn's CPU backend with autodiff.
fn train_device() -> Device {
    Device::flex().autodiff()
}

pub(crate) fn tiny() -> LlamaConfig {
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
pub(crate) fn corpus() -> Corpus {
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
fn model(seed: u64) -> Llama {
    let device = train_device();
    device.seed(seed);
    Llama::random(&tiny(), &device, DType::F32)
}

pub(crate) fn cfg(steps: usize) -> TrainConfig {
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
    m: Llama,
    c: &TrainConfig,
    kind: LossKind,
    ckpt: Option<(&std::path::Path, usize, bool)>,
    stop_after: Option<usize>,
) -> Result<Vec<StepLog>, TrainError> {
    let stop = |s: &StepLog| stop_after.is_none_or(|n| s.step < n);
    let attention = &ReferenceAttention;
    train(
        m,
        &corpus(),
        c,
        kind,
        None,
        attention,
        attention,
        ckpt,
        stop,
    )
    .map(|(_, log)| log)
}

fn run(
    m: Llama,
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

/// The f32 gradient of the master parameter `p`, flattened.
fn master_grad<const D: usize>(p: &Tensor<D>, grads: &burn::tensor::Gradients) -> Vec<f32> {
    let g = p.grad(grads).expect("a gradient on the master parameter");
    assert_eq!(g.dtype(), DType::F32, "master gradients are f32");
    g.into_data().try_to_vec::<f32>().unwrap()
}

/// One step's gradient in bf16 mixed precision against the f32 step's, on the same batch: the
/// view computes in bf16, the gradients reach the f32 master parameters in f32, point the same
/// way (cosine > 0.999) within bf16's precision (relative L2 under 3%), and are not the f32
/// gradients themselves (the step did compute in bf16). Then an 8-step run in bf16 follows the
/// f32 run's loss curve within 2% at every step.
#[test]
fn bf16_mixed_precision_step_follows_f32() {
    use burn_llama::precision::Precision;
    use burn_llama::train::next_token_loss;
    let m = model(5);
    let view = Precision::Bf16.compute_view(&m);
    assert_eq!(view.embed.val().dtype(), DType::BF16);
    assert_eq!(view.layers[1].w_down.val().dtype(), DType::BF16);
    assert_eq!(m.embed.val().dtype(), DType::F32, "the master stays f32");
    let ids: Vec<i64> = (0..2 * 17).map(|i| ((i * 7 + 3) % 61) as i64).collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, 17]), &train_device());
    let grads_of = |view: &Llama| {
        let loss = next_token_loss(
            view,
            tokens.clone(),
            &ReferenceAttention,
            LossKind::cce(),
            -100,
        )
        .expect("loss");
        let grads = loss.backward();
        vec![
            master_grad(&m.embed.val(), &grads),
            master_grad(&m.layers[0].wq.val(), &grads),
            master_grad(&m.layers[1].w_down.val(), &grads),
            master_grad(&m.norm.gamma.val(), &grads),
        ]
    };
    let f32_grads = grads_of(&m);
    let bf16_grads = grads_of(&view);
    for (i, (a, b)) in bf16_grads.iter().zip(&f32_grads).enumerate() {
        let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
        let na: f64 = a.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
        let nb: f64 = b.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
        let diff: f64 = a
            .iter()
            .zip(b)
            .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(nb > 0.0, "parameter {i}: zero f32 gradient");
        assert!(
            dot / (na * nb) > 0.999,
            "parameter {i}: cosine {}",
            dot / (na * nb)
        );
        assert!(diff / nb < 3e-2, "parameter {i}: relative L2 {}", diff / nb);
        assert!(
            diff > 0.0,
            "parameter {i}: bf16 gradient equals the f32 one"
        );
    }
    let c = cfg(8);
    let bf16 = TrainConfig {
        precision: Precision::Bf16,
        ..c.clone()
    };
    let f32_log = run(m.clone(), &c, LossKind::cce(), None, None);
    let bf16_log = run(m, &bf16, LossKind::cce(), None, None);
    assert_same_curve(&f32_log, &bf16_log, 2e-2, ("f32", "bf16"));
}

/// Next-token distributions of `m` at every position of `samples` (equal lengths), in f64.
fn rows(m: &Llama, samples: &[Vec<u32>]) -> Vec<Vec<f64>> {
    let device = Device::flex();
    let (n, len) = (samples.len(), samples[0].len());
    let ids: Vec<i64> = samples.iter().flatten().map(|&t| t as i64).collect();
    let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [n, len]), &device);
    let mut cache = FullKvCache::new(m.config.num_layers);
    let logits = m.logits(m.forward(input, &[], &mut cache, &ReferenceAttention));
    let v = logits.dims()[2];
    let data = logits.into_data().try_to_vec::<f32>().expect("f32");
    data.chunks(v)
        .map(|r| {
            let max = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let w: Vec<f64> = r.iter().map(|&l| f64::from(l - max).exp()).collect();
            let s: f64 = w.iter().sum();
            w.iter().map(|x| x / s).collect()
        })
        .collect()
}

/// Mean probability that single-draft speculative sampling accepts `draft`'s token, over every
/// position of `samples`, with the teacher as target (both at temperature 1): 1 − TV(p, q).
fn acceptance(teacher: &Llama, draft: &Llama, samples: &[Vec<u32>]) -> f64 {
    let (p, q) = (rows(teacher, samples), rows(draft, samples));
    let total: f64 = p
        .iter()
        .zip(&q)
        .map(|(p, q)| {
            Verifier::new(Scheme::SingleDraft, p, &[q.as_slice()])
                .expect("valid rows")
                .acceptance_probability()
        })
        .sum();
    total / p.len() as f64
}

/// Windows of `len` tokens of the corpus's training text at a few uneven offsets.
fn windows(len: usize) -> Vec<Vec<u32>> {
    let train = corpus().train;
    [0, 101, 517, 1999]
        .iter()
        .map(|&s| train[s..s + len].to_vec())
        .collect()
}

/// The teacher of the distillation tests: trained on the cycle, so its rows are peaked and a
/// truncated copy of it does not match them.
fn cycle_teacher() -> Llama {
    let device = train_device();
    device.seed(5);
    let random = Llama::random(
        &LlamaConfig {
            num_layers: 3,
            ..tiny()
        },
        &device,
        DType::F32,
    );
    let attention = &ReferenceAttention;
    let (teacher, _) = train(
        random,
        &corpus(),
        &cfg(40),
        LossKind::cce(),
        None,
        attention,
        attention,
        None,
        |_| true,
    )
    .expect("teacher trains");
    teacher
}

/// `soft_label_loss` is the mean `KL(teacher ‖ student)` over the window's positions but the
/// last, computed here on the host in f64; it is zero for the teacher itself, and its gradient
/// reaches the student.
#[test]
fn soft_label_loss_is_the_mean_kl() {
    let teacher_ad = model(21);
    let teacher = teacher_ad.valid();
    let student = model(22);
    let w = windows(11);
    let device = train_device();
    let ids: Vec<i64> = w.iter().flatten().map(|&t| t as i64).collect();
    let tokens = || Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [4, 11]), &device);
    let att = &ReferenceAttention;
    let loss = soft_label_loss(&student, &teacher, tokens(), att, att);
    let got = loss.clone().into_scalar::<f64>();

    let inputs: Vec<Vec<u32>> = w.iter().map(|x| x[..10].to_vec()).collect();
    let (p, q) = (rows(&teacher, &inputs), rows(&student.valid(), &inputs));
    assert_eq!(p.len(), 40);
    let kl: f64 = p
        .iter()
        .zip(&q)
        .map(|(p, q)| p.iter().zip(q).map(|(a, b)| a * (a / b).ln()).sum::<f64>())
        .sum::<f64>()
        / p.len() as f64;
    assert!(kl > 0.01, "random models differ: KL {kl}");
    assert!(
        (got - kl).abs() <= 1e-4 * kl.max(1.0),
        "soft_label_loss {got} vs host KL {kl}"
    );

    let grads = loss.backward();
    let grad = student
        .embed
        .grad(&grads)
        .expect("the student's embedding gets a gradient");
    let norm = grad.abs().sum().into_scalar::<f64>();
    assert!(norm > 0.0, "gradient norm {norm}");

    let same = soft_label_loss(&teacher_ad, &teacher, tokens(), att, att).into_scalar::<f64>();
    assert!(same.abs() < 1e-5, "KL of the teacher to itself {same}");
}

/// Distillation against the teacher's rows (`finetune --soft-labels`) raises the truncated
/// draft's acceptance on held-out text, and its logged training loss (the KL) falls.
#[test]
fn soft_label_distillation_raises_acceptance() {
    let teacher = cycle_teacher();
    let inner = teacher.valid();
    let draft = truncated_draft(&teacher, 1).expect("1 layer");
    let held_out: Vec<Vec<u32>> = {
        let val = corpus().val;
        (0..6).map(|i| val[i * 40..i * 40 + 25].to_vec()).collect()
    };
    let before = acceptance(&inner, &draft.valid(), &held_out);
    let c = TrainConfig {
        soft_labels: true,
        ..cfg(60)
    };
    // The objective is part of the configuration: a teacher without the flag, or the flag
    // without a teacher, is a typed error.
    for (flag, teacher) in [(false, Some(&inner)), (true, None)] {
        let bad = TrainConfig {
            soft_labels: flag,
            ..cfg(1)
        };
        let att = &ReferenceAttention;
        let err = train(
            draft.clone(),
            &corpus(),
            &bad,
            LossKind::cce(),
            teacher,
            att,
            att,
            None,
            |_| true,
        )
        .expect_err("a mismatched objective is rejected");
        assert!(matches!(err, TrainError::Config(_)), "{err}");
    }
    let (trained, log) = train(
        draft,
        &corpus(),
        &c,
        LossKind::cce(),
        Some(&inner),
        &ReferenceAttention,
        &ReferenceAttention,
        None,
        |_| true,
    )
    .expect("trains");
    assert_eq!(log.len(), 60);
    let after = acceptance(&inner, &trained.valid(), &held_out);
    let (first, last) = (log[0].loss, log[59].loss);
    eprintln!("soft labels: acceptance {before:.4} -> {after:.4}, KL {first:.4} -> {last:.4}");
    assert!(
        after > before + 0.02,
        "acceptance {before:.4} -> {after:.4}"
    );
    assert!(last < 0.7 * first, "KL {first:.4} -> {last:.4}");
    assert!(log.iter().all(|s| s.loss >= -1e-6), "a KL is not negative");
}

/// Draft distillation as `finetune --init-layers 1 --teacher-samples N` runs it: the teacher's
/// samples have the requested shape and start with corpus windows; training the truncated draft
/// on them raises its speculative acceptance against the teacher on held-out samples; and the
/// saved checkpoint loads back (from the run folder) as the same draft.
#[test]
fn distilled_draft_accepts_more_and_reloads() {
    let device = Device::flex();
    // A random model's distributions are nearly uniform (any draft matches them); a teacher
    // trained on the cycle is peaked, and its first layer alone is not.
    let teacher = cycle_teacher();
    let source = corpus().train;
    let opts = TeacherOptions {
        samples: 120,
        prompt_len: 4,
        sample_len: 25,
        batch: 32,
        temperature: 1.0,
        seed: 7,
    };
    let mut seen = Vec::new();
    let samples = teacher_samples(&teacher.valid(), &source, &opts, &ReferenceAttention, |n| {
        seen.push(n)
    })
    .expect("samples");
    assert_eq!(seen, vec![32, 64, 96, 120], "progress after each batch");
    assert_eq!(samples.len(), 120);
    for s in &samples {
        assert_eq!(s.len(), 25);
        assert!(
            source.windows(4).any(|w| w == &s[..4]),
            "a sample must start with a corpus window"
        );
        assert!(s.iter().all(|&t| (t as usize) < 61));
    }
    let corpus = Corpus::from_samples(samples.clone(), 0.1).expect("equal lengths");
    assert_eq!(corpus.align, 25);
    assert_eq!((corpus.train.len(), corpus.val.len()), (108 * 25, 12 * 25));
    let held_out = &samples[108..];

    let draft = truncated_draft(&teacher, 1).expect("1 layer");
    let before = acceptance(&teacher.valid(), &draft.valid(), held_out);
    let dir = std::env::temp_dir().join(format!("burn-llama-distill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let c = TrainConfig {
        seq: 24,
        val_every: 0,
        ..cfg(60)
    };
    let ckpt = dir.join("checkpoint");
    let (trained, log) = train(
        draft,
        &corpus,
        &c,
        LossKind::cce(),
        None,
        &ReferenceAttention,
        &ReferenceAttention,
        Some((&ckpt, 0, false)),
        |_| true,
    )
    .expect("trains");
    assert_eq!(log.len(), 60);
    let after = acceptance(&teacher.valid(), &trained.valid(), held_out);
    eprintln!("acceptance on held-out teacher samples {before:.4} -> {after:.4}");
    assert!(
        after > before + 0.02,
        "acceptance on held-out teacher samples {before:.4} -> {after:.4}"
    );

    // The run folder (or its checkpoint/) loads as the trained draft, logits for logits.
    let loaded = load_model(&dir, &device, DType::F32).expect("loads");
    assert_eq!(loaded.layers.len(), 1);
    let ids = Tensor::<2, Int>::from_data(
        TensorData::new(
            samples[0].iter().map(|&t| i64::from(t)).collect::<Vec<_>>(),
            [1, 25],
        ),
        &device,
    );
    let logits = |m: &Llama| {
        let mut cache = FullKvCache::new(m.config.num_layers);
        m.logits(m.forward(ids.clone(), &[], &mut cache, &ReferenceAttention))
            .into_data()
            .try_to_vec::<f32>()
            .expect("f32")
    };
    assert_eq!(logits(&loaded), logits(&trained.valid()));
    let missing = load_trained(&dir.join("nothing"), &device, DType::F32);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(matches!(missing, Err(TrainError::Checkpoint { .. })));
}

#[test]
fn bad_distillation_input_is_a_typed_error() {
    let ragged = Corpus::from_samples(vec![vec![1, 2, 3], vec![1, 2]], 0.1);
    assert!(matches!(ragged, Err(TrainError::Config(_))));
    assert!(matches!(
        Corpus::from_samples(Vec::new(), 0.1),
        Err(TrainError::Config(_))
    ));
    let teacher = model(6).valid();
    let opts = TeacherOptions {
        samples: 4,
        prompt_len: 8,
        sample_len: 8,
        batch: 2,
        temperature: 1.0,
        seed: 0,
    };
    let err = teacher_samples(
        &teacher,
        &corpus().train,
        &opts,
        &ReferenceAttention,
        |_| {},
    )
    .expect_err("a prompt as long as the sample");
    assert!(matches!(err, TrainError::Config(_)), "{err}");
}

#[test]
fn layer_checkpointing_trains_the_same_curve() {
    // Two micro-batches a step (the scaled gradients of each summed), 8 steps, validation at
    // the end: the checkpointed step's gradients equal the plain one's up to f32 rounding, so
    // the runs stay together.
    let m = model(4);
    let c = TrainConfig {
        val_every: 4,
        ..cfg(8)
    };
    let layers = TrainConfig {
        layer_checkpointing: true,
        ..c.clone()
    };
    let plain = run(m.clone(), &c, LossKind::cce(), None, None);
    let checkpointed = run(m, &layers, LossKind::cce(), None, None);
    assert_same_curve(
        &plain,
        &checkpointed,
        1e-4,
        ("plain", "layer checkpointing"),
    );
    for (a, b) in plain.iter().zip(&checkpointed) {
        if let (Some(x), Some(y)) = (a.val_loss, b.val_loss) {
            assert!(
                (x - y).abs() <= 1e-4 * x,
                "step {}: validation {x} vs {y}",
                a.step
            );
        }
    }
    assert!(
        plain.last().unwrap().loss < 0.9 * plain[0].loss,
        "the run trains"
    );
}

#[test]
fn layer_checkpointing_refuses_distillation() {
    let c = TrainConfig {
        layer_checkpointing: true,
        soft_labels: true,
        ..cfg(2)
    };
    let teacher = model(5);
    let err = train(
        model(6),
        &corpus(),
        &c,
        LossKind::cce(),
        Some(&teacher),
        &ReferenceAttention,
        &ReferenceAttention,
        None,
        |_| true,
    )
    .expect_err("refused");
    assert!(
        matches!(&err, TrainError::Config(why) if why.contains("distillation")),
        "{err}"
    );
}
