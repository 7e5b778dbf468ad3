//! End to end, part 1: one fine-tuning step (forward, loss, backward, AdamW update) of a
//! random-weight SmolLM2-135M-shaped model (f32), with Cut Cross-Entropy and with Burn's plain
//! loss: step time and peak memory at growing batch sizes. The plain loss holds the logits
//! (`batch · seq · 49152` values) and their gradient, CCE does not, so the gap grows with the
//! batch. Generation with the inference features is part 2, [`super::generate`]
//! (`e2e-generate`, which `--suite e2e` runs too).
//!
//! FLOPs: ~6 · parameters · tokens for the model (the 28M-parameter embedding counted once, as
//! the tied classifier) plus 6 · tokens · vocab · hidden for the classifier GEMMs.

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_kernels_core::ReferenceAttention;
use burn_llama::train::{LossKind, next_token_loss};
use burn_llama::{Llama, LlamaConfig};
use serde_json::json;

use super::SuiteOptions;
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
        .map(|&b| problem(cfg.clone(), b, seq))
        .collect();
    Suite {
        name: "e2e",
        description: "fine-tuning step (forward, loss, backward, AdamW) of a random-weight \
                      SmolLM2-135M shape in f32, reference attention: Cut Cross-Entropy vs \
                      Burn's plain loss; peak MB = bytes one step allocates exact-size",
        baseline: "plain loss",
        problems,
        measure_memory: true,
        plot: None,
    }
}

fn problem(cfg: LlamaConfig, batch: usize, seq: usize) -> Problem {
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
            let device = device.clone().autodiff();
            [("cce", LossKind::cce()), ("plain loss", LossKind::Plain)]
                .into_iter()
                .map(|(name, kind)| {
                    device.seed(0);
                    let model = Llama::random(&cfg, &device, DType::F32);
                    let ids: Vec<i64> = (0..batch * (seq + 1))
                        .map(|i| ((i * 7919) % cfg.vocab_size) as i64)
                        .collect();
                    let tokens = Tensor::<2, Int>::from_data(
                        TensorData::new(ids, [batch, seq + 1]),
                        &device,
                    );
                    let mut state = Some((model, AdamWConfig::new().init()));
                    Candidate::timed_here(name, move || {
                        let (model, mut optim) = state.take().expect("state is put back");
                        let loss = next_token_loss(
                            &model,
                            tokens.clone(),
                            &ReferenceAttention,
                            kind,
                            -100,
                        )
                        .expect("valid tokens");
                        let grads = GradientsParams::from_grads(loss.backward(), &model);
                        let model = optim.step(1e-5, model, grads);
                        state = Some((model, optim));
                    })
                })
                .collect()
        }),
    }
}
