//! SageAttention against Burn's fused attention, f16, B=4 H=32, and the peers on the same GPU:
//! PyTorch `scaled_dot_product_attention` and the `sageattention` package.
//!
//! TOPS follow the paper: `4·B·H·N²·D` operations, halved when causal. Fewest bytes: read Q, K, V
//! and write O once (f16).

use burn::tensor::{DType, backend::Backend};
use burn_kernels_core::attention::{AttentionImpl, AttnOptions, BurnAttention};
use burn_kernels_testing::{Dist, random_tensor};
use burn_sage::{PvPrecision, QkQuant, SageBackend, SageOptions, sage_attention};
use serde_json::json;

use super::{SuiteOptions, run_python_peer};
use crate::harness::{Candidate, PlotSpec, Problem, Suite, params};

const BATCH: usize = 4;
const HEADS: usize = 32;

const VARIANTS: [(&str, QkQuant, PvPrecision); 3] = [
    ("sage-int8-fp16", QkQuant::Int8PerWarp, PvPrecision::Fp16),
    ("sage-int8-fp8", QkQuant::Int8PerWarp, PvPrecision::Fp8E4m3),
    (
        "sage-int4-fp8",
        QkQuant::Int4PerThread,
        PvPrecision::Fp8E4m3,
    ),
];

pub fn suite<B: Backend + SageBackend>(opts: SuiteOptions) -> Suite<B> {
    let seq_lens: &[usize] = if opts.quick {
        &[1024, 2048]
    } else {
        &[1024, 2048, 4096, 8192, 16384, 32768]
    };
    let mut problems = Vec::new();
    for &head_dim in &[64usize, 128] {
        for &causal in &[false, true] {
            for &n in seq_lens {
                problems.push(problem::<B>(n, head_dim, causal, &opts));
            }
        }
    }
    Suite {
        name: "sage",
        description: "SageAttention (CubeCL) vs Burn fused attention, f16, B=4 H=32",
        baseline: "burn-fused",
        problems,
        measure_memory: false,
        plot: Some(PlotSpec {
            x: "seq_len".into(),
            series: vec!["head_dim".into(), "causal".into()],
            y: "tflops".into(),
        }),
    }
}

fn problem<B: Backend + SageBackend>(
    n: usize,
    d: usize,
    causal: bool,
    opts: &SuiteOptions,
) -> Problem<B> {
    let elem = 2.0;
    let qkv = (BATCH * HEADS * n * d) as f64;
    let flops = 4.0 * qkv * n as f64 / if causal { 2.0 } else { 1.0 };
    // The reference materializes several f32 B·H·N² score matrices.
    let reference_bytes = 4.0 * (BATCH * HEADS * n * n) as f64 * 4.0;
    let max_mem = opts.max_mem_bytes;
    let peers = opts.peers_dir.clone();
    Problem {
        label: format!("N={n} D={d}{}", if causal { " causal" } else { "" }),
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
        setup: Box::new(move |device| {
            let shape = [BATCH, HEADS, n, d];
            let q = random_tensor::<B, 4>(shape, Dist::STANDARD, 1, DType::F16, device);
            let k = random_tensor::<B, 4>(shape, Dist::STANDARD, 2, DType::F16, device);
            let v = random_tensor::<B, 4>(shape, Dist::STANDARD, 3, DType::F16, device);
            let mut out = Vec::new();
            let (q2, k2, v2) = (q.clone(), k.clone(), v.clone());
            let attn_opts = AttnOptions::<B> {
                causal,
                scale: 1.0 / (d as f32).sqrt(),
                key_padding: None,
            };
            out.push(Candidate::timed_here("burn-fused", move || {
                let _ = BurnAttention.attend(0, q2.clone(), k2.clone(), v2.clone(), &attn_opts);
            }));
            for (name, qk, pv) in VARIANTS {
                let (q, k, v) = (q.clone(), k.clone(), v.clone());
                let o = SageOptions {
                    causal,
                    qk,
                    pv,
                    ..Default::default()
                };
                out.push(Candidate::timed_here(name, move || {
                    let _ = sage_attention(q.clone(), k.clone(), v.clone(), &o);
                }));
            }
            let n_s = n.to_string();
            let d_s = d.to_string();
            for (peer, name) in [
                ("sdpa", "pytorch-sdpa"),
                ("sageattention", "sageattention-1.0.6"),
            ] {
                let (peers, n_s, d_s) = (peers.clone(), n_s.clone(), d_s.clone());
                out.push(Candidate::timed_elsewhere(name, move || {
                    let mut args = vec!["--impl", peer, "--n", &n_s, "--d", &d_s];
                    if causal {
                        args.push("--causal");
                    }
                    run_python_peer(&peers.join("sage_torch.py"), &args)
                }));
            }
            if reference_bytes > max_mem {
                out.push(Candidate::skipped(
                    "sage-reference",
                    format!("needs ~{:.0} GB of score matrices", reference_bytes / 1e9),
                ));
            } else {
                let o = SageOptions {
                    causal,
                    ..Default::default()
                };
                out.push(Candidate::timed_here("sage-reference", move || {
                    let plan =
                        burn_sage::plan(&q.dims(), &k.dims(), &v.dims(), [DType::F16; 3], &o)
                            .expect("valid");
                    let _ = burn_sage::reference::sage_attention(
                        q.clone(),
                        k.clone(),
                        v.clone(),
                        &plan,
                    );
                }));
            }
            out
        }),
    }
}
