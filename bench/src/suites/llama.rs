//! Llama prefill and decode throughput with random weights of real shapes, against a PyTorch
//! (Hugging Face transformers) model of the same shape on the same GPU in the same run; and
//! SmolLM2-135M's decode step on its real weights (Burn only, beside the random-weight peers).
//!
//! prefill: one forward over the prompt plus the last position's logits; tokens = prompt length.
//! decode: one new token per sequence after a cached context; the cache is truncated back to
//! the context after each step so every repetition does the same work. Burn runs it three
//! ways: tensor ops with Burn's attention op (`burn`), the decode kernels (fused layer ops,
//! split-K decode attention: `burn-kernels`), and the decode kernels in a captured step replayed
//! as a CUDA graph (`burn-graph`, a static cache rewound after each step); PyTorch eagerly
//! (`pytorch`), with its step captured in a CUDA graph over transformers' static cache
//! (`pytorch-graph`), and through `torch.compile(mode="reduce-overhead")` (`pytorch-compile`).

use std::path::PathBuf;

use std::sync::Arc;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_kernels_core::{AttentionImpl, BurnAttention, FullKvCache, FusedLayers, KvCache};
use burn_kvcache::DecodeAttention;
use burn_llama::graph::CapturedDecoder;
use burn_llama::{Llama, LlamaConfig};
use serde_json::json;

use super::{SuiteOptions, run_python_peer};
use crate::harness::{Candidate, PeerRun, Problem, Suite, keep, params};

pub fn suite(opts: SuiteOptions) -> Suite {
    let shapes: &[&str] = if opts.quick {
        &["smollm2-135m"]
    } else {
        &["smollm2-135m", "llama-3.2-1b", "llama-3-8b"]
    };
    let len = if opts.quick { 128 } else { 512 };
    // Decode throughput against the batch on the small model (a step reads the weights once
    // for every row), after every batch-1 problem: a large batch's prefill is the one most
    // likely to fail on the device, and a failed launch can poison the runtime for the rest.
    let batches: &[usize] = if opts.quick { &[] } else { &[8, 32, 128] };
    let peers = || opts.peers_dir.clone();
    let mut problems = Vec::new();
    for (i, &shape) in shapes.iter().enumerate() {
        for phase in ["prefill", "decode"] {
            problems.push(problem(shape, i as f64, phase, len, 1, peers()));
        }
        if i == 0 {
            problems.push(real_weights_problem(len, peers()));
        }
    }
    // The same batch-1 step in bf16 and f32 (Burn only: the peer runs f16), so that the
    // dtypes compare in one run.
    for dtype in [DType::BF16, DType::F32] {
        problems.push(problem_in(dtype, shapes[0], 0.0, "decode", len, 1, peers()));
    }
    for &batch in batches {
        problems.push(problem(shapes[0], 0.0, "decode", len, batch, peers()));
    }
    Suite {
        name: "llama",
        description: "Llama forward, random weights, f16: prefill of the prompt (batch 1) and \
                      decode steps after it (batch 1; 8, 32 and 128 on SmolLM2-135M; batch 1 \
                      also in bf16 and f32, and on SmolLM2's real weights, Burn only); Burn (tensor ops + Burn's attention; the decode kernels, \
                      eager and CUDA-graph replayed) vs PyTorch/transformers (eager, CUDA graph, \
                      torch.compile reduce-overhead)",
        baseline: "pytorch",
        problems,
        measure_memory: false,
        plot: None,
    }
}

fn problem(
    shape: &'static str,
    order: f64,
    phase: &'static str,
    len: usize,
    batch: usize,
    peers: PathBuf,
) -> Problem {
    problem_in(DType::F16, shape, order, phase, len, batch, peers)
}

/// A problem with weights and activations in `dtype`; the PyTorch peers run only in f16.
fn problem_in(
    dtype: DType,
    shape: &'static str,
    order: f64,
    phase: &'static str,
    len: usize,
    batch: usize,
    peers: PathBuf,
) -> Problem {
    let cfg = LlamaConfig::preset(shape).expect("known preset");
    let tokens = if phase == "prefill" { len } else { batch };
    let name = match dtype {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => "f32",
    };
    let suffix = if dtype == DType::F16 {
        String::new()
    } else {
        format!(", {name}")
    };
    let label = match batch {
        1 => format!("{shape} {phase} (context {len}{suffix})"),
        _ => format!("{shape} {phase} (batch {batch}, context {len}{suffix})"),
    };
    Problem {
        label,
        params: params([
            ("shape", json!(shape)),
            ("shape_index", json!(order)),
            ("phase", json!(phase)),
            ("context", json!(len)),
            ("batch", json!(batch)),
            ("dtype", json!(name)),
        ]),
        flops: None,
        bytes: (phase == "decode").then(|| decode_bytes(&cfg, batch, len, dtype.size())),
        tokens: Some(tokens as f64),
        setup: Box::new(move |device| {
            let model = Llama::random(&cfg, device, dtype);
            let prompt = synthetic_prompt(batch, len, cfg.vocab_size, device);
            let layers = cfg.num_layers;
            let mut candidates = match phase {
                "prefill" => vec![Candidate::timed_here("burn", move || {
                    let mut cache = FullKvCache::new(layers);
                    let h = model.forward(prompt.clone(), &[], &mut cache, &BurnAttention);
                    let [b, s, d] = h.dims();
                    keep(model.logits(h.slice([0..b, s - 1..s, 0..d])));
                })],
                _ => decode_candidates(model, prompt, len),
            };
            for (name, mode) in [
                ("pytorch", None),
                ("pytorch-graph", Some("--cuda-graph")),
                ("pytorch-compile", Some("--compile")),
            ] {
                if (phase == "prefill" && mode.is_some()) || dtype != DType::F16 {
                    continue;
                }
                let peers = peers.clone();
                candidates.push(Candidate::timed_elsewhere(name, move || {
                    torch_peer(&peers, shape, phase, len, batch, mode)
                }));
            }
            candidates
        }),
    }
}

/// SmolLM2-135M's batch-1 decode step on its real weights (the GGUF that `cargo xtask
/// fetch-model` caches, or `$BURN_KERNELS_MODEL`), dequantized to f16; Burn only. The problem
/// before it times the PyTorch peers on random weights of the same shape in the same run: a
/// step's work does not depend on the weights' values, and the peer cannot read the GGUF.
fn real_weights_problem(len: usize, peers: PathBuf) -> Problem {
    let mut problem = problem_in(DType::F16, "smollm2-135m", 0.0, "decode", len, 1, peers);
    problem.label = format!("smollm2-135m decode (context {len}, real weights)");
    problem.params.insert("weights".into(), json!("real"));
    problem.setup = Box::new(move |device| {
        let skipped = |why: String| vec![Candidate::skipped("burn-graph", why)];
        let Some(ckpt) = super::specdec::checkpoint() else {
            return skipped(
                "no SmolLM2 checkpoint (`cargo xtask fetch-model` or $BURN_KERNELS_MODEL)".into(),
            );
        };
        match Llama::from_checkpoint(ckpt, device, DType::F16) {
            Ok(model) => {
                let prompt = synthetic_prompt(1, len, model.config.vocab_size, device);
                decode_candidates(model, prompt, len)
            }
            Err(e) => skipped(e.to_string()),
        }
    });
    problem
}

/// `batch` rows of `len` token ids spread over the vocabulary (the same for every run).
fn synthetic_prompt(batch: usize, len: usize, vocab: usize, device: &Device) -> Tensor<2, Int> {
    let ids: Vec<i64> = (0..(batch * len) as i64)
        .map(|i| (i * 7919) % vocab as i64)
        .collect();
    Tensor::<2, Int>::from_data(TensorData::new(ids, [batch, len]), device)
}

/// The fewest bytes a decode step of `batch` rows after `len` cached tokens reads from device
/// memory: every weight once (the LM head's `vocab × hidden` included, tied or not; the
/// embedding's gathered rows left out) and the cache's keys and values, in `elem`-byte
/// elements. The GB/s column divided by the GPU's HBM bandwidth is the fraction reached.
fn decode_bytes(cfg: &LlamaConfig, batch: usize, len: usize, elem: usize) -> f64 {
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let attn = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + cfg.num_heads * hd * h;
    let layer = attn + 3 * h * cfg.intermediate_size + 2 * h;
    let weights = cfg.num_layers * layer + h + cfg.vocab_size * h;
    let cache = cfg.num_layers * batch * (len + 1) * 2 * cfg.num_kv_heads * hd;
    ((weights + cache) * elem) as f64
}

/// The decode step after a `len`-token prompt: tensor ops with Burn's attention, the decode
/// kernels eagerly, and the decode kernels replayed from a capture. The model (and the
/// kernels' attention) are leaked: the captured decoder borrows them for the rest of the
/// process, which the candidates' `'static` closures cannot otherwise express.
fn decode_candidates(model: Llama, prompt: Tensor<2, Int>, len: usize) -> Vec<Candidate<'static>> {
    let model: &'static Llama = Box::leak(Box::new(model));
    let kernels: &'static dyn AttentionImpl = Box::leak(Box::new(FusedLayers::new(Arc::new(
        DecodeAttention::default(),
    ))));
    let device = prompt.device();
    let [batch, _] = prompt.dims();
    let step =
        Tensor::<2, Int>::from_data(TensorData::new(vec![42i64; batch], [batch, 1]), &device);
    let layers = model.config.num_layers;
    let eager = |name: &'static str, attention: &'static dyn AttentionImpl| {
        let mut cache = FullKvCache::new(layers);
        let _ = model.forward(prompt.clone(), &[], &mut cache, attention);
        let step = step.clone();
        Candidate::timed_here(name, move || {
            let h = model.forward(step.clone(), &[], &mut cache, attention);
            keep(model.logits(h));
            cache.truncate(len);
        })
    };
    let ids: Vec<u32> = prompt
        .clone()
        .into_data()
        .iter::<i64>()
        .map(|t| t as u32)
        .collect();
    let rows: Vec<Vec<u32>> = ids.chunks(len).map(<[u32]>::to_vec).collect();
    let graph = match CapturedDecoder::prefill(model, kernels, &rows, 1) {
        Ok((mut decoder, _)) => Candidate::timed_here("burn-graph", move || {
            keep(
                decoder
                    .step(&vec![42; batch])
                    .expect("the captured step runs"),
            );
            decoder.rewind();
        }),
        Err(e) => Candidate::skipped("burn-graph", e.to_string()),
    };
    vec![
        eager("burn", &BurnAttention),
        eager("burn-kernels", kernels),
        graph,
    ]
}

/// Runs the PyTorch peer script (`mode`: `--cuda-graph` or `--compile` for the step over a
/// static cache) and returns its times.
fn torch_peer(
    peers: &std::path::Path,
    shape: &str,
    phase: &str,
    len: usize,
    batch: usize,
    mode: Option<&str>,
) -> Result<PeerRun, String> {
    let (len, batch) = (len.to_string(), batch.to_string());
    let mut args = vec![
        "--shape", shape, "--phase", phase, "--len", &len, "--batch", &batch,
    ];
    args.extend(mode);
    run_python_peer(&peers.join("llama_torch.py"), &args)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M has 134.5 M parameters with its tied embedding counted once; its cache
    /// at 512 tokens holds 30 layers × 2 × 3 heads × 64 × 513 elements per row.
    #[test]
    fn decode_bytes_count_weights_and_cache() {
        let cfg = LlamaConfig::preset("smollm2-135m").unwrap();
        let weights = decode_bytes(&cfg, 0, 0, 2);
        assert!((268.0e6..270.0e6).contains(&weights), "{weights}");
        let cache = decode_bytes(&cfg, 8, 512, 2) - weights;
        assert_eq!(cache, (8 * 30 * 2 * 3 * 64 * 513 * 2) as f64);
    }
}
