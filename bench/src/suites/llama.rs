//! Llama prefill and decode throughput with random weights of real shapes, against a PyTorch
//! (Hugging Face transformers) model of the same shape on the same GPU in the same run.
//!
//! prefill: one forward over the prompt plus the last position's logits; tokens = prompt length.
//! decode: one new token per sequence after a cached context; the cache is truncated back to
//! the context after each step so every repetition does the same work.

use std::path::PathBuf;

use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_kernels_core::{BurnAttention, FullKvCache, KvCache};
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
    let mut problems = Vec::new();
    for (i, &shape) in shapes.iter().enumerate() {
        for phase in ["prefill", "decode"] {
            problems.push(problem(shape, i as f64, phase, len, opts.peers_dir.clone()));
        }
    }
    Suite {
        name: "llama",
        description: "Llama forward, random weights, f16, batch 1: prefill of the prompt and decode \
                      steps after it; Burn (burn-fused attention) vs PyTorch/transformers",
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
    peers: PathBuf,
) -> Problem {
    let cfg = LlamaConfig::preset(shape).expect("known preset");
    let tokens = if phase == "prefill" { len } else { 1 };
    Problem {
        label: format!("{shape} {phase} (context {len})"),
        params: params([
            ("shape", json!(shape)),
            ("shape_index", json!(order)),
            ("phase", json!(phase)),
            ("context", json!(len)),
            ("batch", json!(1)),
            ("dtype", json!("f16")),
        ]),
        flops: None,
        bytes: None,
        tokens: Some(tokens as f64),
        setup: Box::new(move |device| {
            let model = Llama::random(&cfg, device, DType::F16);
            let ids: Vec<i64> = (0..len as i64)
                .map(|i| (i * 7919) % cfg.vocab_size as i64)
                .collect();
            let prompt = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, len]), device);
            let step = Tensor::<2, Int>::from_data(TensorData::new(vec![42i64], [1, 1]), device);
            let layers = cfg.num_layers;
            let burn = match phase {
                "prefill" => Candidate::timed_here("burn", move || {
                    let mut cache = FullKvCache::new(layers);
                    let h = model.forward(prompt.clone(), &[], &mut cache, &BurnAttention);
                    let [b, s, d] = h.dims();
                    keep(model.logits(h.slice([0..b, s - 1..s, 0..d])));
                }),
                _ => {
                    let mut cache = FullKvCache::new(layers);
                    let _ = model.forward(prompt, &[], &mut cache, &BurnAttention);
                    Candidate::timed_here("burn", move || {
                        let h = model.forward(step.clone(), &[], &mut cache, &BurnAttention);
                        keep(model.logits(h));
                        cache.truncate(len);
                    })
                }
            };
            let peers = peers.clone();
            let peer = Candidate::timed_elsewhere("pytorch", move || {
                torch_peer(&peers, shape, phase, len)
            });
            vec![burn, peer]
        }),
    }
}

/// Runs the PyTorch peer script and returns its times.
fn torch_peer(
    peers: &std::path::Path,
    shape: &str,
    phase: &str,
    len: usize,
) -> Result<PeerRun, String> {
    let len = len.to_string();
    run_python_peer(
        &peers.join("llama_torch.py"),
        &["--shape", shape, "--phase", phase, "--len", &len],
    )
}
