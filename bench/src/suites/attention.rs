//! Burn's own attention: the fused (flash) path against the unfused fallback. This is the
//! baseline SageAttention is measured against.
//!
//! FLOPs follow the FlashAttention/SageAttention convention: `4·B·H·N²·D`, halved when causal.
//! Fewest bytes: read Q, K, V and write O once, `4·B·H·N·D` f16 values.

use burn::tensor::DType;
use burn::tensor::module::{attention, attention_fallback};
use burn::tensor::ops::{AttentionModuleOptions, CausalAlignment};
use burn_kernels_testing::{Dist, random_tensor};
use serde_json::json;

use super::SuiteOptions;
use crate::harness::{Candidate, PlotSpec, Problem, Setup, Suite, keep, params};

/// Batch and heads of this suite's problems and of the SageAttention suite's.
pub(super) const BATCH: usize = 4;
pub(super) const HEADS: usize = 32;

pub fn suite(opts: SuiteOptions) -> Suite {
    let seq_lens: &[usize] = if opts.quick {
        &[1024, 2048]
    } else {
        &[1024, 2048, 4096, 8192, 16384]
    };
    let mut problems = Vec::new();
    for &head_dim in &[64usize, 128] {
        for &causal in &[false, true] {
            for &n in seq_lens {
                problems.push(problem(n, head_dim, causal, opts.max_mem_bytes));
            }
        }
    }
    Suite {
        name: "attention-baseline",
        description: "Burn attention, f16, B=4 H=32: fused flash kernel vs unfused fallback",
        baseline: "burn-fused",
        problems,
        measure_memory: false,
        plot: Some(attention_plot()),
    }
}

/// An f16 attention problem over `[BATCH, HEADS, n, d]` (shared with the SageAttention suite):
/// its label, parameters, FLOPs and fewest bytes, with the candidates `setup` makes.
pub(super) fn attention_problem(n: usize, d: usize, causal: bool, setup: Setup) -> Problem {
    let elem = 2.0; // f16
    let qkv = (BATCH * HEADS * n * d) as f64;
    let flops = 4.0 * qkv * n as f64 / if causal { 2.0 } else { 1.0 };
    Problem {
        label: label(n, d, causal),
        params: params([
            ("batch", json!(BATCH)),
            ("heads", json!(HEADS)),
            ("seq_len", json!(n)),
            ("head_dim", json!(d)),
            ("causal", json!(causal)),
            ("dtype", json!("f16")),
        ]),
        flops: Some(flops),
        bytes: Some(4.0 * qkv * elem),
        tokens: None,
        setup,
    }
}

/// TFLOPs against the sequence length, a line per head dim and causality: the plot of the
/// [`attention_problem`] suites.
pub(super) fn attention_plot() -> PlotSpec {
    PlotSpec {
        x: "seq_len".into(),
        series: vec!["head_dim".into(), "causal".into()],
        y: "tflops".into(),
        ..PlotSpec::default()
    }
}

/// The label of [`attention_problem`].
pub(super) fn label(n: usize, d: usize, causal: bool) -> String {
    format!("N={n} D={d}{}", if causal { " causal" } else { "" })
}

fn problem(n: usize, d: usize, causal: bool, max_mem: f64) -> Problem {
    let elem = 2.0; // f16
    let qkv = (BATCH * HEADS * n * d) as f64;
    // The fallback materializes the B·H·N² score matrix several times over (scores, masked,
    // exp, softmax); four live copies is what its sequence of ops needs at its peak.
    let fallback_bytes = 4.0 * (BATCH * HEADS * n * n) as f64 * elem + 4.0 * qkv * elem;
    attention_problem(
        n,
        d,
        causal,
        Box::new(move |device| {
            let shape = [BATCH, HEADS, n, d];
            let q = random_tensor::<4>(shape, Dist::STANDARD, 1, DType::F16, device);
            let k = random_tensor::<4>(shape, Dist::STANDARD, 2, DType::F16, device);
            let v = random_tensor::<4>(shape, Dist::STANDARD, 3, DType::F16, device);
            let options = AttentionModuleOptions {
                scale: None,
                softcap: None,
                is_causal: causal,
                causal_alignment: CausalAlignment::BottomRight,
            };
            let (q2, k2, v2) = (q.clone(), k.clone(), v.clone());
            let fused = Candidate::timed_here("burn-fused", move || {
                keep(attention(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    None,
                    None,
                    options,
                ));
            });
            let fallback = if fallback_bytes > max_mem {
                Candidate::skipped(
                    "burn-fallback",
                    format!(
                        "needs ~{:.0} GB for the score matrices (limit {:.0} GB)",
                        fallback_bytes / 1e9,
                        max_mem / 1e9
                    ),
                )
            } else {
                Candidate::timed_here("burn-fallback", move || {
                    keep(attention_fallback(
                        q2.clone(),
                        k2.clone(),
                        v2.clone(),
                        None,
                        None,
                        options,
                    ));
                })
            };
            vec![fused, fallback]
        }),
    )
}
