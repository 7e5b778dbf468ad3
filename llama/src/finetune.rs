//! Fine-tuning (or training from scratch) of a Llama model on a text corpus: AdamW, linear
//! warm-up then cosine decay, gradient accumulation, validation perplexity, checkpoints that
//! resume the same run, and a loss curve — with Cut Cross-Entropy or Burn's plain loss
//! ([`LossKind`]).
//!
//! Batches are random windows of the training tokens drawn from a generator seeded by
//! `(seed, step)`, so a run resumed from a checkpoint sees the same batches as one that never
//! stopped.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_kernels_core::AttentionImpl;
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};

pub use crate::attention::TrainAttention;
use crate::checkpoint::{CheckpointError, checkpointed_grads};
use crate::data_parallel::{self, Replicas, Single, Workers};
pub use crate::distill::{TeacherOptions, teacher_samples};
use crate::model::Llama;
use crate::precision::Precision;
use crate::train::{LossKind, next_token_loss, soft_label_loss};

mod saved;
use saved::{MODEL_FILE, OPTIMIZER_FILE, ckpt_err, read_state, save_checkpoint};
pub use saved::{checkpoint_dir, load_model, load_trained};

/// What went wrong in a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The configuration cannot run (zero steps, a window longer than the corpus, …).
    #[error("invalid training configuration: {0}")]
    Config(String),
    /// The loss rejected its input.
    #[error(transparent)]
    Loss(#[from] burn_cce::CceError),
    /// A layer of a layer-checkpointed step could not run.
    #[error("layer checkpointing: {0}")]
    Layer(crate::model::ForwardError),
    /// Reading or writing a checkpoint.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },
    /// A data-parallel replica stopped.
    #[error("data parallelism: {0}")]
    Replica(String),
}

impl From<CheckpointError> for TrainError {
    fn from(e: CheckpointError) -> Self {
        match e {
            CheckpointError::Loss(e) => TrainError::Loss(e),
            CheckpointError::Forward(e) => TrainError::Layer(e),
        }
    }
}

/// Hyper-parameters of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Tokens per sequence (each window holds `seq + 1` tokens: inputs and shifted targets).
    pub seq: usize,
    /// Micro-batches whose gradients are summed into one optimizer step.
    pub grad_accum: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Steps of linear warm-up from 0 to `lr`.
    pub warmup: usize,
    /// The cosine decay ends at `lr · min_lr_ratio`.
    pub min_lr_ratio: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f32,
    /// Validation every this many steps (and after the last); 0: only after the last.
    pub val_every: usize,
    /// Validation windows (of `seq + 1` tokens, evenly spaced over the held-out tokens).
    pub val_windows: usize,
    /// Seed of the batch sampler.
    pub seed: u64,
    /// Train against a teacher's full next-token distributions ([`soft_label_loss`]); [`train`]
    /// must then be given the teacher. Part of the configuration so that a resumed run keeps
    /// its objective.
    #[serde(default)]
    pub soft_labels: bool,
    /// The precision of the forward and backward ([`Precision::Bf16`]: bf16 compute, f32 master
    /// weights and optimizer state); the checkpointed weights stay f32 either way.
    #[serde(default)]
    pub precision: Precision,
    /// Layer checkpointing ([`crate::checkpoint`]): a step keeps each layer's input instead of
    /// its activations and recomputes a layer at a time in the backward (~⅓ more compute).
    /// Not with `soft_labels`. A run may resume with it switched.
    #[serde(default)]
    pub layer_checkpointing: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            steps: 200,
            batch: 4,
            seq: 128,
            grad_accum: 1,
            lr: 1e-4,
            warmup: 20,
            min_lr_ratio: 0.1,
            weight_decay: 0.01,
            val_every: 50,
            val_windows: 16,
            seed: 0,
            soft_labels: false,
            precision: Precision::F32,
            layer_checkpointing: false,
        }
    }
}

impl TrainConfig {
    /// The learning rate of step `step` (0-based): linear warm-up to `lr` over `warmup` steps,
    /// then cosine decay to `lr · min_lr_ratio` at the last step.
    pub fn lr_at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.steps.saturating_sub(self.warmup).max(1) as f64;
        let t = ((step - self.warmup) as f64 / span).min(1.0);
        let floor = self.lr * self.min_lr_ratio;
        floor + (self.lr - floor) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
    }

    fn validate(&self, corpus: &Corpus) -> Result<(), TrainError> {
        let bad = |why: String| Err(TrainError::Config(why));
        if self.steps == 0 || self.batch == 0 || self.grad_accum == 0 {
            return bad("steps, batch and grad_accum must be at least 1".into());
        }
        if self.seq < 1 {
            return bad("seq must be at least 1".into());
        }
        for (name, tokens) in [("training", &corpus.train), ("validation", &corpus.val)] {
            if tokens.len() < self.seq + 1 {
                return bad(format!(
                    "the {name} split has {} tokens, fewer than one window of seq + 1 = {}",
                    tokens.len(),
                    self.seq + 1
                ));
            }
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad(format!("lr must be positive, got {}", self.lr));
        }
        if self.layer_checkpointing && self.soft_labels {
            return bad("layer checkpointing does not cover distillation (soft_labels)".into());
        }
        Ok(())
    }
}

/// Token ids of a corpus, split into training and held-out validation tokens.
#[derive(Debug, Clone)]
pub struct Corpus {
    pub train: Vec<u32>,
    pub val: Vec<u32>,
    /// Windows start at multiples of this (1: anywhere). A corpus of independent samples of
    /// `seq + 1` tokens each sets it to that length, so no window straddles two samples.
    pub align: usize,
}

impl Corpus {
    /// Splits `tokens` so that the last `val_fraction` of them are held out.
    pub fn split(tokens: Vec<u32>, val_fraction: f64) -> Self {
        let cut = ((tokens.len() as f64) * (1.0 - val_fraction.clamp(0.0, 1.0))) as usize;
        let mut train = tokens;
        let val = train.split_off(cut.min(train.len()));
        Self {
            train,
            val,
            align: 1,
        }
    }

    /// Independent samples of one length (e.g. a teacher's generations): the last
    /// `val_fraction` of the samples (at least one) are held out, and windows are whole samples
    /// when the training window (`seq + 1`) has the samples' length.
    ///
    /// # Errors
    /// [`TrainError::Config`] for no samples or samples of different lengths.
    pub fn from_samples(samples: Vec<Vec<u32>>, val_fraction: f64) -> Result<Self, TrainError> {
        let len = samples.first().map_or(0, Vec::len);
        if len == 0 || samples.iter().any(|s| s.len() != len) {
            return Err(TrainError::Config(
                "samples must be non-empty and of one length".into(),
            ));
        }
        let n_val = ((samples.len() as f64 * val_fraction.clamp(0.0, 1.0)).ceil() as usize)
            .clamp(1, samples.len());
        let cut = samples.len() - n_val;
        Ok(Self {
            train: samples[..cut].concat(),
            val: samples[cut..].concat(),
            align: len,
        })
    }

    /// Start of window `i` of `n` spread evenly over `tokens` (aligned down to `align`).
    fn even_start(&self, tokens: &[u32], window: usize, i: usize, n: usize) -> usize {
        let span = tokens.len() - window;
        let s = if n == 1 { 0 } else { span * i / (n - 1) };
        s - s % self.align.max(1)
    }
}

/// One line of the run's log: the training loss of a step, and the validation loss where
/// one was measured after it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepLog {
    /// 1-based: the number of optimizer steps taken.
    pub step: usize,
    pub lr: f64,
    /// Mean training loss of the step's micro-batches (nats per token).
    pub loss: f64,
    /// Mean validation loss (nats per token) and its perplexity.
    pub val_loss: Option<f64>,
}

/// The `[batch, seq + 1]` windows of micro-batch `micro` of step `step`.
fn batch_windows(
    cfg: &TrainConfig,
    tokens: &[u32],
    align: usize,
    step: usize,
    micro: usize,
) -> Vec<i64> {
    let mut rng = StdRng::seed_from_u64(
        cfg.seed ^ (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ micro as u64,
    );
    let align = align.max(1);
    let last_start = (tokens.len() - (cfg.seq + 1)) / align;
    (0..cfg.batch)
        .flat_map(|_| {
            let s = rng.random_range(0..=last_start) * align;
            tokens[s..s + cfg.seq + 1].iter().map(|&t| t as i64)
        })
        .collect()
}

/// Mean next-token loss of `model` over the validation windows (no gradient).
pub fn validation_loss(
    model: &Llama,
    corpus: &Corpus,
    cfg: &TrainConfig,
    attention: &dyn AttentionImpl,
    kind: LossKind,
) -> Result<f64, TrainError> {
    let inner = cfg.precision.compute_view(&model.valid());
    let device = inner.embed.val().device();
    let n = cfg.val_windows.max(1);
    let mut total = 0.0;
    for w in 0..n {
        let s = corpus.even_start(&corpus.val, cfg.seq + 1, w, n);
        let ids: Vec<i64> = corpus.val[s..s + cfg.seq + 1]
            .iter()
            .map(|&t| t as i64)
            .collect();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, cfg.seq + 1]), &device);
        let loss = next_token_loss(&inner, tokens, attention, kind, -100)?;
        total += loss.into_scalar::<f64>();
    }
    Ok(total / n as f64)
}

/// What every replica's gradient step reads.
#[derive(Clone, Copy)]
pub(crate) struct StepContext<'a> {
    pub(crate) corpus: &'a Corpus,
    pub(crate) cfg: &'a TrainConfig,
    pub(crate) kind: LossKind,
    pub(crate) teacher: Option<&'a Llama>,
    pub(crate) attention: &'a dyn AttentionImpl,
    pub(crate) val_attention: &'a dyn AttentionImpl,
}

/// The gradients of `model`'s loss on rows `rows` of every micro-batch of step `step` (the
/// mean over the micro-batches), and that mean loss.
pub(crate) fn replica_grads(
    model: &Llama,
    ctx: &StepContext<'_>,
    step: usize,
    rows: std::ops::Range<usize>,
) -> Result<(GradientsParams, f64), TrainError> {
    let (cfg, corpus) = (ctx.cfg, ctx.corpus);
    let device = model.embed.val().device();
    let window = cfg.seq + 1;
    let mut acc = GradientsAccumulator::<Llama>::new();
    let mut loss_sum = 0.0;
    for micro in 0..cfg.grad_accum {
        let ids = batch_windows(cfg, &corpus.train, corpus.align, step, micro);
        let ids = ids[rows.start * window..rows.end * window].to_vec();
        let tokens =
            Tensor::<2, Int>::from_data(TensorData::new(ids, [rows.len(), window]), &device);
        // Mean over micro-batches: each one's gradient is scaled before they are summed.
        let scale = 1.0 / cfg.grad_accum as f32;
        if cfg.layer_checkpointing && ctx.teacher.is_none() {
            let (loss, grads) = checkpointed_grads(
                model,
                cfg.precision,
                tokens,
                ctx.attention,
                ctx.kind,
                -100,
                scale,
            )?;
            loss_sum += loss.into_scalar::<f64>();
            acc.accumulate(model, grads);
            continue;
        }
        // f32: the model itself; bf16: its parameters cast inside the graph, so the
        // gradients below reach the f32 master parameters (crate::precision).
        let view = cfg.precision.compute_view(model);
        let loss = match ctx.teacher {
            Some(teacher) => {
                soft_label_loss(&view, teacher, tokens, ctx.attention, ctx.val_attention)
            }
            None => next_token_loss(&view, tokens, ctx.attention, ctx.kind, -100)?,
        };
        // The loss is read after the backward is queued: reading it first would leave the
        // device idle while the host builds the backward.
        let grads = (loss.clone() * scale).backward();
        loss_sum += loss.into_scalar::<f64>();
        acc.accumulate(model, GradientsParams::from_grads(grads, model));
    }
    Ok((acc.grads(), loss_sum / cfg.grad_accum as f64))
}

/// Trains `model` for `cfg.steps` optimizer steps, calling `on_step` after each; the run stops
/// early when `on_step` returns `false`.
///
/// With `teacher` (given exactly when `cfg.soft_labels` is set), the training loss is
/// [`soft_label_loss`] against the teacher's next-token distributions (a draft's distillation;
/// `kind` then only sets the validation loss, which stays the cross-entropy of the held-out
/// tokens so that runs compare). The teacher runs on the inner backend with `val_attention`.
///
/// `checkpoint = Some((dir, every, resume))` writes the model, the optimizer state and the log
/// to `dir` every `every` steps and after the last step taken; with `resume`, a checkpoint
/// already in `dir` is loaded first (its configuration must equal `cfg`) and the run continues
/// from its step with the same batches.
///
/// # Errors
/// Invalid configuration (a teacher without `soft_labels`, or the flag without one, included),
/// a checkpoint that cannot be read or written, the loss's errors.
#[allow(clippy::too_many_arguments)]
pub fn train(
    model: Llama,
    corpus: &Corpus,
    cfg: &TrainConfig,
    kind: LossKind,
    teacher: Option<&Llama>,
    attention: &dyn AttentionImpl,
    val_attention: &dyn AttentionImpl,
    checkpoint: Option<(&Path, usize, bool)>,
    on_step: impl FnMut(&StepLog) -> bool,
) -> Result<(Llama, Vec<StepLog>), TrainError> {
    train_data_parallel(
        model,
        &[],
        corpus,
        cfg,
        kind,
        teacher,
        attention,
        val_attention,
        checkpoint,
        on_step,
    )
}

/// [`train`] data-parallel over `devices` (training devices, with autodiff; none or one: the
/// model's device alone): replica `r` is the model forked to `devices[r]`, trains on rows
/// `r · batch / n ..` of every micro-batch of the global batch (`cfg.batch` sequences), and
/// the replicas' gradients are averaged by Burn's all-reduce before every optimizer step
/// ([`crate::data_parallel`]), so the run follows the one-device run of the same global batch.
/// Validation and checkpoints use the first replica; the returned model is the first replica's.
///
/// # Errors
/// Those of [`train`]; [`TrainError::Config`] for a global batch that does not split evenly
/// over the devices; [`TrainError::Replica`] when a replica's thread panicked.
#[allow(clippy::too_many_arguments)]
pub fn train_data_parallel(
    model: Llama,
    devices: &[Device],
    corpus: &Corpus,
    cfg: &TrainConfig,
    kind: LossKind,
    teacher: Option<&Llama>,
    attention: &dyn AttentionImpl,
    val_attention: &dyn AttentionImpl,
    checkpoint: Option<(&Path, usize, bool)>,
    on_step: impl FnMut(&StepLog) -> bool,
) -> Result<(Llama, Vec<StepLog>), TrainError> {
    let ctx = StepContext {
        corpus,
        cfg,
        kind,
        teacher,
        attention,
        val_attention,
    };
    train_parallel(model, devices, ctx, checkpoint, on_step)
}

fn train_parallel(
    mut model: Llama,
    devices: &[Device],
    ctx: StepContext<'_>,
    checkpoint: Option<(&Path, usize, bool)>,
    on_step: impl FnMut(&StepLog) -> bool,
) -> Result<(Llama, Vec<StepLog>), TrainError> {
    let cfg = ctx.cfg;
    cfg.validate(ctx.corpus)?;
    data_parallel::check_devices(devices, cfg.batch)?;
    if cfg.soft_labels != ctx.teacher.is_some() {
        return Err(TrainError::Config(match cfg.soft_labels {
            true => "soft_labels is set but no teacher was given".into(),
            false => "a teacher was given but soft_labels is not set".into(),
        }));
    }
    let mut optim = AdamWConfig::new()
        .with_weight_decay(cfg.weight_decay)
        .init();
    let mut log = Vec::new();
    if let Some((dir, _, true)) = checkpoint
        && let Some(state) = read_state(dir, cfg)?
    {
        model = model
            .try_load_file(dir.join(MODEL_FILE))
            .map_err(|e| ckpt_err(dir, e))?;
        optim = optim
            .load(dir.join(OPTIMIZER_FILE))
            .map_err(|e| ckpt_err(dir, e))?;
        log = state.log;
    }
    if devices.len() <= 1 {
        let mut single = Single::new(model, optim, ctx);
        run_steps(&mut single, &ctx, checkpoint, &mut log, on_step)?;
        return Ok((single.into_model(), log));
    }
    let teacher = ctx.teacher.cloned();
    std::thread::scope(|scope| {
        let mut workers = Workers::spawn(scope, model, optim, devices, ctx, teacher);
        match run_steps(&mut workers, &ctx, checkpoint, &mut log, on_step) {
            Ok(()) => Ok((workers.finish()?, log)),
            Err(e) => Err(workers.abandon(e)),
        }
    })
}

/// The steps after those in `log`: each replica step, validation and checkpoints as [`train`]
/// describes, `on_step` after each.
fn run_steps(
    replicas: &mut dyn Replicas,
    ctx: &StepContext<'_>,
    checkpoint: Option<(&Path, usize, bool)>,
    log: &mut Vec<StepLog>,
    mut on_step: impl FnMut(&StepLog) -> bool,
) -> Result<(), TrainError> {
    let cfg = ctx.cfg;
    for step in log.len()..cfg.steps {
        let lr = cfg.lr_at(step);
        let loss = replicas.step(step, lr)?;
        let done = step + 1;
        let validate = done == cfg.steps || (cfg.val_every > 0 && done % cfg.val_every == 0);
        let val_loss = match validate {
            true => Some(validation_loss(
                &replicas.model()?,
                ctx.corpus,
                cfg,
                ctx.val_attention,
                ctx.kind,
            )?),
            false => None,
        };
        let entry = StepLog {
            step: done,
            lr,
            loss,
            val_loss,
        };
        let go_on = on_step(&entry);
        log.push(entry);
        if let Some((dir, every, _)) = checkpoint
            && (done == cfg.steps || !go_on || (every > 0 && done % every == 0))
        {
            save_checkpoint(dir, &replicas.model()?, &replicas.optimizer()?, cfg, log)?;
        }
        if !go_on {
            break;
        }
    }
    Ok(())
}

/// The corpus text: one file, or every `.txt` of a folder in name order, each followed by a
/// blank line; at most `max_chars` characters (0: all).
///
/// # Errors
/// A missing or unreadable path, or a folder without `.txt` files, as text.
pub fn read_corpus(path: &Path, max_chars: usize) -> Result<String, String> {
    let files: Vec<PathBuf> = if path.is_dir() {
        let mut v: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| format!("{}: {e}", path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "txt"))
            .collect();
        v.sort();
        v
    } else {
        vec![path.to_path_buf()]
    };
    if files.is_empty() {
        return Err(format!("{}: no .txt files", path.display()));
    }
    let mut text = String::new();
    for f in files {
        text += &std::fs::read_to_string(&f).map_err(|e| format!("{}: {e}", f.display()))?;
        text += "\n\n";
        if max_chars > 0 && text.len() >= max_chars {
            let cut = (0..=max_chars).rev().find(|&i| text.is_char_boundary(i));
            text.truncate(cut.unwrap_or(0));
            break;
        }
    }
    Ok(text)
}
