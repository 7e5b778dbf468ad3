//! Llama prefill and decode throughput with random weights of real shapes, against a PyTorch
//! (Hugging Face transformers) model of the same shape on the same GPU in the same run.
//!
//! prefill: one forward over the prompt plus the last position's logits; tokens = prompt length.
//! decode: one new token per sequence after a cached context; the cache is truncated back to
//! the context after each step so every repetition does the same work.

use std::path::PathBuf;
use std::process::Command;

use burn::tensor::{DType, Int, Tensor, TensorData, backend::Backend};
use burn_kernels_core::{BurnAttention, FullKvCache, KvCache};
use burn_llama::{Llama, LlamaConfig};
use serde_json::json;

use super::SuiteOptions;
use crate::harness::{Candidate, Problem, Suite, params};

pub fn suite<B: Backend>(opts: SuiteOptions) -> Suite<B> {
    let shapes: &[&str] = if opts.quick {
        &["smollm2-135m"]
    } else {
        &["smollm2-135m", "llama-3.2-1b", "llama-3-8b"]
    };
    let len = if opts.quick { 128 } else { 512 };
    let mut problems = Vec::new();
    for (i, &shape) in shapes.iter().enumerate() {
        for phase in ["prefill", "decode"] {
            problems.push(problem::<B>(
                shape,
                i as f64,
                phase,
                len,
                opts.peers_dir.clone(),
            ));
        }
    }
    Suite {
        name: "llama",
        description: "Llama forward, random weights, f16, batch 1: prefill of the prompt and decode \
                      steps after it; Burn (burn-fused attention) vs PyTorch/transformers",
        baseline: "pytorch",
        problems,
        plot: None,
    }
}

fn problem<B: Backend>(
    shape: &'static str,
    order: f64,
    phase: &'static str,
    len: usize,
    peers: PathBuf,
) -> Problem<B> {
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
            let model = Llama::<B>::random(&cfg, device, DType::F16);
            let ids: Vec<i64> = (0..len as i64)
                .map(|i| (i * 7919) % cfg.vocab_size as i64)
                .collect();
            let prompt = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, len]), device);
            let step = Tensor::<B, 2, Int>::from_data(TensorData::new(vec![42i64], [1, 1]), device);
            let layers = cfg.num_layers;
            let burn = match phase {
                "prefill" => Candidate::timed_here("burn", move || {
                    let mut cache = FullKvCache::new(layers);
                    let h = model.forward(prompt.clone(), &[], &mut cache, &BurnAttention);
                    let [b, s, d] = h.dims();
                    let _ = model.logits(h.slice([0..b, s - 1..s, 0..d]));
                }),
                _ => {
                    let mut cache = FullKvCache::new(layers);
                    let _ = model.forward(prompt, &[], &mut cache, &BurnAttention);
                    Candidate::timed_here("burn", move || {
                        let h = model.forward(step.clone(), &[], &mut cache, &BurnAttention);
                        let _ = model.logits(h);
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
) -> Result<Vec<f64>, String> {
    let script = peers.join("llama_torch.py");
    if !script.exists() {
        return Err(format!("peer script {} not found", script.display()));
    }
    let out = Command::new("python3")
        .arg(&script)
        .args([
            "--shape",
            shape,
            "--phase",
            phase,
            "--len",
            &len.to_string(),
        ])
        .output()
        .map_err(|e| format!("python3: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| {
            format!(
                "peer printed no result: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    if let Some(e) = v.get("error") {
        return Err(format!("peer: {e}"));
    }
    v["times_ms"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
        .ok_or_else(|| "peer gave no times".to_string())
}
