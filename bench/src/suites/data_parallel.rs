//! End to end, part 3 (`e2e-dp`): data-parallel fine-tuning over the GPUs of `--devices`
//! (`burn_llama::finetune::train_data_parallel`: one replica per GPU on its thread, gradients
//! averaged by Burn's all-reduce, NCCL between CUDA GPUs) against the same step on one GPU, in
//! the same run. A step is the fine-tuning example's: a random-weight SmolLM2-135M shape, bf16
//! mixed precision, CCE in 256 MiB blocks (as `finetune` runs it), the recomputing attention
//! backward, AdamW. Rows: one GPU at the per-GPU batch (the baseline), N GPUs at the same
//! global batch (strong scaling), N GPUs at N times the batch (weak scaling: the issue's "same
//! per-GPU batch" figure). Tokens/s of the global batch, so the speed-up column is the scaling.
//!
//! Each candidate trains `warm-up + reps + 1` steps over a synthetic corpus and reports the
//! time between consecutive steps after the warm-up (the last step's interval holds the final
//! validation and is left out). Every step reads its loss back (a synchronization of each
//! replica), so the intervals add up to the run's time.
//!
//! With `--peers-dir` (and without layer checkpointing), `peers/train_ddp_torch.py` adds
//! PyTorch's step on one GPU and DistributedDataParallel over the same GPUs at N times the
//! batch, so the peer's own scaling is in the same table.
//!
//! Without CUDA (`--quick` on wgpu) the replicas share the suite's one device, which checks the
//! plumbing, not the scaling; where the device has no bf16 the steps run in f32.

use std::time::Instant;

use burn::tensor::{DType, Device};
use burn_kernels_core::AttentionImpl;
use burn_llama::LlamaConfig;
use burn_llama::finetune::{Corpus, TrainAttention, TrainConfig, train_data_parallel};
use burn_llama::model::Llama;
use burn_llama::precision::Precision;
use burn_llama::train::LossKind;
use serde_json::json;

use super::SuiteOptions;
use crate::harness::{Candidate, PeerRun, Problem, Suite, params};

/// Steps before the timed ones (the first compiles and autotunes; NCCL sets up its
/// communicator at the first all-reduce).
const WARMUP_STEPS: usize = 3;

pub fn suite(opts: SuiteOptions) -> Suite {
    let (cfg, seq, batch, reps) = if opts.quick {
        (super::tiny_llama(2, 4096), 32, 2, 3)
    } else {
        (LlamaConfig::smollm2_135m(), 2048, 8, 6)
    };
    let seq = opts.seq.unwrap_or(seq);
    let batches = match opts.batches.is_empty() {
        true => vec![batch],
        false => opts.batches.clone(),
    };
    let indices = match opts.devices.len() {
        0 | 1 => vec![0, 1],
        _ => opts.devices.clone(),
    };
    // `--e2e-checkpointing layers`: every replica's step with layer checkpointing (`ops`, Burn's
    // device-wide strategy, runs on one device only).
    let layers = opts.e2e_checkpointing == Some(super::E2eCheckpointing::Layers);
    // The PyTorch DDP peer has no layer checkpointing: it runs where the Burn rows do not use it.
    let peers = (!opts.quick && !layers).then(|| opts.peers_dir.join("train_ddp_torch.py"));
    let problems = batches
        .into_iter()
        .map(|b| {
            let peer = peers.clone();
            problem(cfg.clone(), b, seq, indices.clone(), reps, layers, peer)
        })
        .collect();
    Suite {
        name: "e2e-dp",
        description: "data-parallel fine-tuning step (bf16, CCE in 256 MiB blocks, \
                      recomputing attention backward, AdamW) of a random-weight SmolLM2-135M \
                      shape over N GPUs (Burn's all-reduce, NCCL) vs one GPU, and PyTorch's \
                      DistributedDataParallel step (transformers, bf16 autocast, SDPA, its own \
                      loss) on one and N GPUs; tokens/s of the global batch",
        baseline: "1 GPU",
        problems,
        measure_memory: false,
        plot: None,
    }
}

/// The replicas' devices (training devices, with autodiff): the CUDA GPUs `indices` on CUDA,
/// else `device` once per index.
fn replica_devices(device: &Device, indices: &[usize]) -> Result<Vec<Device>, String> {
    if burn_kernels_core::route::is_cuda(device) {
        #[cfg(feature = "cuda")]
        return burn_llama::data_parallel::cuda_devices(indices).map_err(|e| e.to_string());
    }
    Ok(indices.iter().map(|_| device.clone().autodiff()).collect())
}

/// The rows of one per-GPU batch: Burn on one GPU (the baseline), on N GPUs at the same global
/// batch and at N times it, and with `peer` (`peers/train_ddp_torch.py`) PyTorch's
/// DistributedDataParallel step on one GPU and on N GPUs at N times the batch.
fn problem(
    cfg: LlamaConfig,
    batch: usize,
    seq: usize,
    indices: Vec<usize>,
    reps: usize,
    layers: bool,
    peer: Option<std::path::PathBuf>,
) -> Problem {
    let n = indices.len();
    Problem {
        label: format!("dp step per-GPU batch {batch} x {seq}, {n} GPUs {indices:?}"),
        params: params([
            ("batch_per_gpu", json!(batch)),
            ("seq", json!(seq)),
            ("layer_checkpointing", json!(layers)),
            ("gpus", json!(n)),
            ("devices", json!(indices)),
        ]),
        flops: None,
        bytes: None,
        tokens: Some((batch * seq) as f64),
        setup: Box::new(move |device| {
            let one = vec![device.clone().autodiff()];
            let many = match replica_devices(device, &indices) {
                Ok(d) => d,
                Err(why) => return vec![Candidate::skipped("N GPUs", why)],
            };
            let corpus = synthetic_corpus(cfg.vocab_size, 64 * (seq + 1));
            let mut rows = vec![("1 GPU", one, batch)];
            if batch.is_multiple_of(n) {
                rows.push(("N GPUs, same global batch", many.clone(), batch));
            }
            rows.push(("N GPUs, N x batch", many, n * batch));
            let burn = rows.into_iter().map(|(name, devices, global)| {
                let (cfg, corpus) = (cfg.clone(), corpus.clone());
                let tokens = (global * seq) as f64;
                Candidate::timed_elsewhere(name, move || {
                    step_times(&cfg, &corpus, &devices, global, seq, reps, layers)
                })
                .with_tokens(tokens)
            });
            let gpus: Vec<String> = indices.iter().map(|i| i.to_string()).collect();
            let torch = peer.iter().flat_map(|script| {
                [
                    ("pytorch 1 GPU", gpus[0].clone(), batch),
                    ("pytorch ddp N GPUs, N x batch", gpus.join(","), n * batch),
                ]
                .into_iter()
                .map(|(name, list, global)| {
                    let script = script.clone();
                    let (b, s, r) = (batch.to_string(), seq.to_string(), reps.to_string());
                    Candidate::timed_elsewhere(name, move || {
                        let args = ["--batch", &b, "--seq", &s, "--devices", &list, "--reps", &r];
                        super::run_python_peer(&script, &args)
                    })
                    .with_tokens((global * seq) as f64)
                })
                .collect::<Vec<_>>()
            });
            burn.chain(torch).collect()
        }),
    }
}

/// Token ids spread over the vocabulary (a deterministic stream; the timing does not depend on
/// the text).
fn synthetic_corpus(vocab: usize, len: usize) -> Corpus {
    let tokens = (0..len as u64)
        .map(|i| (i.wrapping_mul(2_654_435_761) % vocab as u64) as u32)
        .collect();
    Corpus::split(tokens, 0.05)
}

/// Trains `WARMUP_STEPS + reps + 1` steps on `devices` and returns the times of the `reps`
/// steps after the warm-up.
fn step_times(
    cfg: &LlamaConfig,
    corpus: &Corpus,
    devices: &[Device],
    batch: usize,
    seq: usize,
    reps: usize,
    layers: bool,
) -> Result<PeerRun, String> {
    let device = devices[0].clone();
    device.seed(0);
    let model = Llama::random(cfg, &device, DType::F32);
    let train_cfg = TrainConfig {
        steps: WARMUP_STEPS + reps + 1,
        batch,
        seq,
        val_every: 0,
        val_windows: 1,
        precision: match device.supports_dtype(DType::BF16) {
            true => Precision::Bf16,
            false => Precision::F32,
        },
        layer_checkpointing: layers,
        ..TrainConfig::default()
    };
    let attention: Box<dyn AttentionImpl> = TrainAttention::Recompute.build();
    let mut stamps = Vec::new();
    train_data_parallel(
        model,
        devices,
        corpus,
        &train_cfg,
        LossKind::cce_for_training(),
        None,
        attention.as_ref(),
        attention.as_ref(),
        None,
        |_| {
            stamps.push(Instant::now());
            true
        },
    )
    .map_err(|e| e.to_string())?;
    let intervals: Vec<f64> = stamps
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
        .collect();
    // Every interval, warm-up included, for the log: a stalled step shows where it falls.
    let shown: Vec<String> = intervals.iter().map(|t| format!("{t:.1}")).collect();
    eprintln!(
        "    {} GPU(s), batch {batch}: step intervals ms [{}] (timed: {}..{})",
        devices.len(),
        shown.join(", "),
        WARMUP_STEPS - 1,
        WARMUP_STEPS - 1 + reps
    );
    let times_ms: Vec<f64> = intervals
        .into_iter()
        .skip(WARMUP_STEPS - 1)
        .take(reps)
        .collect();
    Ok(PeerRun::from(times_ms))
}
