//! End to end, part 1: one fine-tuning step (forward, loss, backward, AdamW update) of a
//! random-weight SmolLM2-135M-shaped model, with Cut Cross-Entropy and with Burn's plain loss,
//! the decomposed attention or Burn's fused one, in f32 or bf16 mixed precision: step time and
//! peak memory at growing batch sizes. The plain loss holds the logits (`batch · seq · 49152`
//! values) and their gradient, CCE does not; the decomposed attention saves `batch · 9 · seq²`
//! scores per layer for the backward, the fused one a log-sum-exp per query and head. Generation with the inference features is part 2, [`super::generate`]
//! (`e2e-generate`, which `--suite e2e` runs too).
//!
//! FLOPs: ~6 · parameters · tokens for the model (the 28M-parameter embedding counted once, as
//! the tied classifier) plus 6 · tokens · vocab · hidden for the classifier GEMMs.

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_cce::CceOptions;
use burn_kernels_core::gemm::{self, GemmKernel};
use burn_llama::checkpoint::checkpointed_grads;
use burn_llama::finetune::TrainAttention;
use burn_llama::precision::Precision;
use burn_llama::train::{LossKind, next_token_loss};
use burn_llama::{Llama, LlamaConfig};
use serde_json::json;

use std::path::{Path, PathBuf};

use super::cce::chunked;
use super::{E2eCheckpointing, SuiteOptions, run_python_peer};
use crate::harness::{Candidate, Problem, Suite, params};

pub fn suite(opts: SuiteOptions) -> Suite {
    let (cfg, seq, defaults): (LlamaConfig, usize, &[usize]) = if opts.quick {
        let tiny = super::tiny_llama(2, 4096);
        (tiny, 32, &[1, 2])
    } else {
        (LlamaConfig::smollm2_135m(), 1024, &[4, 8, 16])
    };
    let seq = opts.seq.unwrap_or(seq);
    let batches = if opts.batches.is_empty() {
        defaults
    } else {
        &opts.batches[..]
    };
    let problems = batches
        .iter()
        .map(|&b| {
            let peers = (!opts.quick).then(|| opts.peers_dir.clone());
            problem(
                cfg.clone(),
                b,
                seq,
                peers,
                opts.e2e_phases,
                opts.e2e_profile_step,
                opts.e2e_checkpointing,
            )
        })
        .collect();
    Suite {
        name: "e2e",
        description: "fine-tuning step (forward, loss, backward, AdamW) of a random-weight \
                      SmolLM2-135M shape: Cut Cross-Entropy vs Burn's plain loss, the \
                      decomposed f32 attention vs Burn's fused attention (backward from the \
                      saved log-sum-exp), f32 vs bf16 mixed precision (f32 master weights); \
                      peak MB = bytes one step allocates exact-size",
        baseline: "plain loss",
        problems,
        measure_memory: true,
        plot: None,
    }
}

/// The candidates of a step: name, loss, attention, precision. The baseline is the step as the
/// example trained before fused attention (plain loss, the decomposed f32 attention, f32). They
/// run baseline first, then the f32 step with the recomputing attention backward, the bf16
/// steps, the PyTorch peers and the other f32 steps (the slowest to tune), so a run cut short
/// by a time limit keeps the comparisons that matter. The f16/bf16 GEMMs run on the named kernel
/// ([`GemmKernel::DEFAULT`], or cubek's `mma` kernel for comparison).
type Variant = (
    &'static str,
    fn() -> LossKind,
    TrainAttention,
    Precision,
    GemmKernel,
);
const VARIANTS: [Variant; 17] = [
    (
        "cce",
        LossKind::cce_for_training,
        TrainAttention::Reference,
        Precision::F32,
        GemmKernel::DEFAULT,
    ),
    (
        "cce + recompute attn",
        LossKind::cce_for_training,
        TrainAttention::Recompute,
        Precision::F32,
        GemmKernel::DEFAULT,
    ),
    (
        "plain loss",
        plain,
        TrainAttention::Reference,
        Precision::F32,
        GemmKernel::DEFAULT,
    ),
    (
        "cce + fused attn",
        LossKind::cce_for_training,
        TrainAttention::Fused,
        Precision::F32,
        GemmKernel::DEFAULT,
    ),
    (
        "plain + fused attn",
        plain,
        TrainAttention::Fused,
        Precision::F32,
        GemmKernel::DEFAULT,
    ),
    (
        "cce + fused attn, bf16",
        LossKind::cce_for_training,
        TrainAttention::Fused,
        Precision::Bf16,
        GemmKernel::DEFAULT,
    ),
    (
        "plain + fused attn, bf16",
        plain,
        TrainAttention::Fused,
        Precision::Bf16,
        GemmKernel::DEFAULT,
    ),
    (
        "cce + recompute attn, bf16",
        LossKind::cce_for_training,
        TrainAttention::Recompute,
        Precision::Bf16,
        GemmKernel::DEFAULT,
    ),
    (
        "plain + recompute attn, bf16",
        plain,
        TrainAttention::Recompute,
        Precision::Bf16,
        GemmKernel::DEFAULT,
    ),
    (
        "cce (fused passes) + recompute attn, bf16",
        cce_fused_passes,
        TrainAttention::Recompute,
        Precision::Bf16,
        GemmKernel::DEFAULT,
    ),
    (
        "cce (chunked passes) + recompute attn, bf16",
        cce_chunked_passes,
        TrainAttention::Recompute,
        Precision::Bf16,
        GemmKernel::DEFAULT,
    ),
    (
        "cce + recompute attn, bf16, one f32 dE",
        cce_whole_de,
        TrainAttention::Recompute,
        Precision::Bf16,
        GemmKernel::DEFAULT,
    ),
    (
        "cce + recompute attn, bf16, 64 MiB blocks",
        cce_blocks_64,
        TrainAttention::Recompute,
        Precision::Bf16,
        GemmKernel::DEFAULT,
    ),
    (
        "cce + recompute attn, bf16, 128 MiB blocks",
        cce_blocks_128,
        TrainAttention::Recompute,
        Precision::Bf16,
        GemmKernel::DEFAULT,
    ),
    (
        "cce + recompute attn, bf16, automatic blocks",
        cce_automatic_blocks,
        TrainAttention::Recompute,
        Precision::Bf16,
        GemmKernel::DEFAULT,
    ),
    (
        "cce + recompute attn, bf16, cubek gemm",
        LossKind::cce_for_training,
        TrainAttention::Recompute,
        Precision::Bf16,
        GemmKernel::SpecializedTma,
    ),
    (
        "plain + recompute attn, bf16, cubek gemm",
        plain,
        TrainAttention::Recompute,
        Precision::Bf16,
        GemmKernel::SpecializedTma,
    ),
];

fn plain() -> LossKind {
    LossKind::Plain
}

/// CCE with one f32 dE accumulator (`N·D·4` bytes, 38 MB at 8 × 2048 tokens of SmolLM2)
/// instead of a second pass over row blocks, which recomputes every logit once more: within a
/// training step's memory, is the pass worth its bytes?
/// CCE for training with the fused passes (`PassKernels::Fused`: the training forward with dE
/// in the vocabulary walk, the dC walk in the backward).
fn cce_fused_passes() -> LossKind {
    LossKind::Cce(CceOptions {
        passes: burn_cce::PassKernels::Fused,
        ..CceOptions::for_training()
    })
}

/// CCE for training with the chunked passes in 256 MiB blocks (the default where the fused
/// passes do not run: f32, hidden sizes above 576, devices before sm90).
fn cce_chunked_passes() -> LossKind {
    LossKind::Cce(chunked(CceOptions::for_training()))
}

fn cce_whole_de() -> LossKind {
    LossKind::Cce(CceOptions {
        de_block_rows: Some(usize::MAX),
        ..chunked(CceOptions::default())
    })
}

/// CCE with `mib` MiB working blocks in every pass (wide vocabulary chunks: fewer launches,
/// and dE in one f32 accumulator where a chunk is at least the hidden size wide).
fn cce_blocks(mib: usize) -> LossKind {
    LossKind::Cce(CceOptions {
        chunk_bytes: Some(mib << 20),
        ..chunked(CceOptions::default())
    })
}

fn cce_blocks_64() -> LossKind {
    cce_blocks(64)
}

fn cce_blocks_128() -> LossKind {
    cce_blocks(128)
}

/// CCE's chunked passes with burn-cce's automatic block sizes (the default `cce` rows use
/// [`CceOptions::for_training`]: the fused passes where they run, else 256 MiB blocks): the
/// loss's memory near dE + dC.
fn cce_automatic_blocks() -> LossKind {
    LossKind::Cce(chunked(CceOptions::default()))
}

fn problem(
    cfg: LlamaConfig,
    batch: usize,
    seq: usize,
    peers: Option<PathBuf>,
    phases: bool,
    profile_step: Option<usize>,
    checkpointing: Option<E2eCheckpointing>,
) -> Problem {
    let tokens = (batch * seq) as f64;
    let (h, v) = (cfg.hidden_size as f64, cfg.vocab_size as f64);
    let per_layer = h * (cfg.num_heads * cfg.head_dim) as f64 * 2.0
        + h * (cfg.num_kv_heads * cfg.head_dim) as f64 * 2.0
        + 3.0 * h * cfg.intermediate_size as f64;
    let flops = 6.0 * tokens * (per_layer * cfg.num_layers as f64 + v * h);
    Problem {
        label: format!("train step batch {batch} x {seq}"),
        params: params([
            ("batch", json!(batch)),
            ("seq", json!(seq)),
            ("layers", json!(cfg.num_layers)),
            ("vocab", json!(cfg.vocab_size)),
        ]),
        flops: Some(flops),
        bytes: None,
        tokens: Some(tokens),
        setup: Box::new(move |device| {
            let device = match checkpointing {
                Some(E2eCheckpointing::Ops) => device.clone().autodiff().gradient_checkpointing(),
                _ => device.clone().autodiff(),
            };
            let layers = checkpointing == Some(E2eCheckpointing::Layers);
            let (f32_steps, bf16_steps): (Vec<&Variant>, Vec<&Variant>) =
                VARIANTS.iter().partition(|v| v.3 == Precision::F32);
            // The baseline, then the f32 step with the fast attention backward.
            let (first, other_f32): (Vec<&Variant>, Vec<&Variant>) = f32_steps
                .into_iter()
                .partition(|v| v.0 == "plain loss" || v.2 == TrainAttention::Recompute);
            let step = |&(name, kind, attention, precision, gemm_kernel): &Variant| {
                device.seed(0);
                let model = Llama::random(&cfg, &device, DType::F32);
                let ids: Vec<i64> = (0..batch * (seq + 1))
                    .map(|i| ((i * 7919) % cfg.vocab_size) as i64)
                    .collect();
                let tokens =
                    Tensor::<2, Int>::from_data(TensorData::new(ids, [batch, seq + 1]), &device);
                let attention = attention.build();
                let mut state = Some((model, AdamWConfig::new().init()));
                let mut clock = phases.then(|| PhaseClock::new(name, device.clone()));
                let mut profiled = ProfiledStep::new(profile_step, name, device.clone());
                Candidate::timed_here(name, move || {
                    gemm::set_default_kernel(gemm_kernel);
                    let _profiling = profiled.next_step();
                    let (model, mut optim) = state.take().expect("state is put back");
                    let mut lap = PhaseClock::lap_of(&mut clock);
                    let grads = if layers {
                        // Forwards and backwards interleave layer by layer: `--e2e-phases`
                        // records them together as the backward (forward + loss shows 0).
                        let (_, grads) = checkpointed_grads(
                            &model,
                            precision,
                            tokens.clone(),
                            attention.as_ref(),
                            kind(),
                            -100,
                            1.0,
                        )
                        .expect("valid tokens");
                        grads
                    } else {
                        let view = precision.compute_view(&model);
                        let loss = next_token_loss(
                            &view,
                            tokens.clone(),
                            attention.as_ref(),
                            kind(),
                            -100,
                        )
                        .expect("valid tokens");
                        lap(0);
                        GradientsParams::from_grads(loss.backward(), &model)
                    };
                    lap(1);
                    let model = optim.step(1e-5, model, grads);
                    lap(2);
                    state = Some((model, optim));
                })
            };
            first
                .into_iter()
                .chain(bf16_steps)
                .map(step)
                .chain(peers.iter().flat_map(|dir| torch_peers(dir, batch, seq)))
                .chain(other_f32.into_iter().map(step))
                .collect()
        }),
    }
}

/// The PyTorch fine-tuning step (`peers/train_torch.py`: transformers' Llama, bf16 autocast,
/// SDPA, fused AdamW) with its own loss and with Liger's and Apple's fused linear cross-entropy.
fn torch_peers(dir: &Path, batch: usize, seq: usize) -> Vec<Candidate<'static>> {
    [
        ("hf", "pytorch bf16 (hf loss)"),
        ("liger", "pytorch bf16 + liger flce"),
        ("cce", "pytorch bf16 + apple cce"),
    ]
    .into_iter()
    .map(|(loss, label)| {
        let script = dir.join("train_torch.py");
        Candidate::timed_elsewhere(label, move || {
            let (b, s) = (batch.to_string(), seq.to_string());
            run_python_peer(&script, &["--batch", &b, "--seq", &s, "--loss", loss])
        })
    })
    .collect()
}

/// `--e2e-profile-step N`: step N of a candidate (counting every call: warm-up, memory and timed
/// ones) runs between `cuProfilerStart` and
/// `cuProfilerStop` (each after a device synchronization), so a CUDA profiler started with
/// `--profile-from-start off` records that step's kernels and nothing of warm-up or autotuning.
struct ProfiledStep {
    target: Option<usize>,
    steps: usize,
    name: &'static str,
    device: burn::tensor::Device,
}

/// Stops the profiler (after a synchronization) when the profiled step ends.
struct Profiling(burn::tensor::Device);

impl ProfiledStep {
    fn new(target: Option<usize>, name: &'static str, device: burn::tensor::Device) -> Self {
        Self {
            target,
            steps: 0,
            name,
            device,
        }
    }

    /// Counts a step; for the chosen one, starts the profiler and returns its guard.
    fn next_step(&mut self) -> Option<Profiling> {
        self.steps += 1;
        if self.target != Some(self.steps) {
            return None;
        }
        crate::harness::sync(&self.device);
        eprintln!(
            "  profile | {}: step {} under the CUDA profiler",
            self.name, self.steps
        );
        cuda_profiler(true);
        Some(Profiling(self.device.clone()))
    }
}

impl Drop for Profiling {
    fn drop(&mut self) {
        crate::harness::sync(&self.0);
        cuda_profiler(false);
    }
}

/// `cuProfilerStart`/`Stop` on the primary context CubeCL uses (device 0); a log line where it
/// fails or the build has no CUDA.
fn cuda_profiler(start: bool) {
    #[cfg(feature = "cuda")]
    {
        use cudarc::driver::{CudaContext, profiler_start, profiler_stop};
        let result = CudaContext::new(0).and_then(|ctx| {
            ctx.bind_to_thread()?;
            if start {
                profiler_start()
            } else {
                profiler_stop()
            }
        });
        if let Err(e) = result {
            eprintln!("  profile | the CUDA profiler call failed: {e:?}");
        }
    }
    #[cfg(not(feature = "cuda"))]
    eprintln!(
        "  profile | start={start}: this build has no CUDA profiler (build with --features cuda)"
    );
}

/// `--e2e-phases`: per-step times of forward + loss, backward and the optimizer, each ended by a
/// device synchronization; their medians are printed when the candidate is dropped.
struct PhaseClock {
    name: &'static str,
    device: burn::tensor::Device,
    samples: Vec<[f64; 3]>,
}

impl PhaseClock {
    const PHASES: [&'static str; 3] = ["forward + loss", "backward", "optimizer"];

    fn new(name: &'static str, device: burn::tensor::Device) -> Self {
        Self {
            name,
            device,
            samples: Vec::new(),
        }
    }

    /// A lap function for one step: `lap(i)` synchronizes and records phase `i` (a no-op
    /// without a clock).
    fn lap_of(clock: &mut Option<PhaseClock>) -> impl FnMut(usize) + '_ {
        if let Some(c) = clock.as_mut() {
            crate::harness::sync(&c.device);
            c.samples.push([0.0; 3]);
        }
        let mut t0 = std::time::Instant::now();
        move |phase| {
            if let Some(c) = clock.as_mut() {
                crate::harness::sync(&c.device);
                let last = c.samples.last_mut().expect("a sample per step");
                last[phase] = t0.elapsed().as_secs_f64() * 1e3;
                t0 = std::time::Instant::now();
            }
        }
    }
}

impl Drop for PhaseClock {
    fn drop(&mut self) {
        if self.samples.is_empty() {
            return;
        }
        let medians: Vec<String> = (0..3)
            .map(|i| {
                let v: Vec<f64> = self.samples.iter().map(|s| s[i]).collect();
                format!("{} {:.1} ms", Self::PHASES[i], crate::harness::median(&v))
            })
            .collect();
        eprintln!(
            "  phases | {}: {} (median of {} steps)",
            self.name,
            medians.join(", "),
            self.samples.len()
        );
    }
}
