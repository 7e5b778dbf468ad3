//! SageAttention against Burn's fused attention, f16, B=4 H=32, and the peers on the same GPU:
//! PyTorch `scaled_dot_product_attention` and the `sageattention` package.
//!
//! TOPS follow the paper: `4·B·H·N²·D` operations, halved when causal. Fewest bytes: read Q, K, V
//! and write O once (f16).

use burn::tensor::{DType, Distribution, Tensor};
use burn_kernels_core::attention::{AttentionImpl, AttnOptions, BurnAttention};
use burn_kernels_testing::metrics;
use burn_sage::kernels::KernelChoice;
use burn_sage::{PvPrecision, QkQuant, SageOptions, sage_attention};
use serde_json::json;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::rc::Rc;

use super::attention::{BATCH, HEADS, attention_plot, attention_problem, label};
use super::{SuiteOptions, peer_run, python_json};
use crate::harness::{Candidate, Extra, PeerRun, Problem, Suite, keep, params};

/// Lowest cosine similarity to Burn's output a timed variant may have: below what INT4 QK (the
/// least accurate variant) should reach, far above an unwritten or half-written output's.
const MIN_COSINE: f64 = 0.95;

/// Whether `sage_attention(q, k, v, opts)` runs `kernel` on their device; why not otherwise.
fn runs_kernel(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    opts: &SageOptions,
    kernel: KernelChoice,
) -> Result<(), String> {
    let p = burn_sage::plan(
        &q.dims(),
        &k.dims(),
        &v.dims(),
        [q.dtype(), k.dtype(), v.dtype()],
        opts,
    )
    .map_err(|e| e.to_string())?;
    match burn_sage::sage_kernel(&q.device(), &p) {
        Ok(ran) if ran == kernel => Ok(()),
        Ok(ran) => Err(format!("{kernel:?} asked for, {ran:?} would run")),
        Err(why) => Err(format!("{kernel:?} does not run here: {why}")),
    }
}

/// The first sequence's first two heads of an attention output, on the host.
fn head_sample(out: &Tensor<4>) -> Result<Vec<f32>, String> {
    let [_, h, n, d] = out.dims();
    out.clone()
        .slice([0..1, 0..h.min(2), 0..n, 0..d])
        .cast(DType::F32)
        .try_into_data()
        .map_err(|e| e.to_string())?
        .try_into_vec::<f32>()
        .map_err(|e| format!("{e:?}"))
}

/// Longest sequence the tensor-op reference runs at (see its candidate).
const REFERENCE_MAX_N: usize = 2048;

/// `(name, QK quantization, Q smoothing, PV precision, kernel)`; `None` is the kernel the op
/// picks (on CUDA the fastest of the matrix-unit kernels, timed at each shape's first run: the
/// row's note names it); the `-cmma` row keeps the shared-memory-staged kernel measured beside
/// it, the `-wgmma` rows the Hopper kernel.
type Variant = (
    &'static str,
    QkQuant,
    bool,
    PvPrecision,
    Option<KernelChoice>,
);

const VARIANTS: [Variant; 7] = [
    (
        "sage-int8-fp16",
        QkQuant::Int8PerWarp,
        false,
        PvPrecision::Fp16,
        None,
    ),
    // Per-thread INT8 with Q smoothing: the CLI's `sage`, the configuration that meets the
    // accuracy bar on every SmolLM2 layer.
    (
        "sage-int8thread-smoothq-fp16",
        QkQuant::Int8PerThread,
        true,
        PvPrecision::Fp16,
        None,
    ),
    (
        "sage-int8-fp8",
        QkQuant::Int8PerWarp,
        false,
        PvPrecision::Fp8E4m3,
        None,
    ),
    (
        "sage-int4-fp8",
        QkQuant::Int4PerThread,
        false,
        PvPrecision::Fp8E4m3,
        None,
    ),
    (
        "sage-int8-fp16-cmma",
        QkQuant::Int8PerWarp,
        false,
        PvPrecision::Fp16,
        Some(KernelChoice::Cmma),
    ),
    // The Hopper kernel (warpgroup MMA, TMA), asked for by name until it is measured faster.
    (
        "sage-int8-fp16-wgmma",
        QkQuant::Int8PerWarp,
        false,
        PvPrecision::Fp16,
        Some(KernelChoice::Wgmma),
    ),
    (
        "sage-int8thread-smoothq-fp16-wgmma",
        QkQuant::Int8PerThread,
        true,
        PvPrecision::Fp16,
        Some(KernelChoice::Wgmma),
    ),
];

pub fn suite(opts: SuiteOptions) -> Suite {
    let seq_lens: &[usize] = if opts.quick {
        &[1024, 2048]
    } else {
        &[1024, 2048, 4096, 8192, 16384, 32768]
    };
    let mut configs = Vec::new();
    for &head_dim in &[64usize, 128] {
        for &causal in &[false, true] {
            for &n in seq_lens {
                if opts.selects(&label(n, head_dim, causal)) {
                    configs.push((n, head_dim, causal));
                }
            }
        }
    }
    let peers = Rc::new(PeerBatch::new(
        opts.peers_dir.join("sage_torch.py"),
        &configs,
    ));
    let problems = configs
        .into_iter()
        .map(|(n, d, causal)| problem(n, d, causal, &opts, peers.clone()))
        .collect();
    Suite {
        name: "sage",
        description: "SageAttention (CubeCL) vs Burn fused attention, f16, B=4 H=32",
        baseline: "burn-fused",
        problems,
        measure_memory: false,
        plot: Some(attention_plot()),
    }
}

/// The PyTorch peers of every problem, timed by one Python process (torch imported and the
/// Triton kernels compiled once) the first time a problem asks for one, on the same GPU in the
/// same run; the process runs between two problems, so nothing of Burn's runs beside it.
struct PeerBatch {
    script: PathBuf,
    keys: Vec<String>,
    results: RefCell<Option<Result<BTreeMap<String, serde_json::Value>, String>>>,
}

const PEERS: [(&str, &str); 2] = [
    ("sdpa", "pytorch-sdpa"),
    ("sageattention", "sageattention-1.0.6"),
];

fn peer_key(peer: &str, n: usize, d: usize, causal: bool) -> String {
    format!("{peer}:{n}:{d}:{}", u8::from(causal))
}

impl PeerBatch {
    fn new(script: PathBuf, configs: &[(usize, usize, bool)]) -> Self {
        let keys = configs
            .iter()
            .flat_map(|&(n, d, c)| PEERS.iter().map(move |(p, _)| peer_key(p, n, d, c)))
            .collect();
        Self {
            script,
            keys,
            results: RefCell::new(None),
        }
    }

    fn get(&self, key: &str) -> Result<PeerRun, String> {
        let mut results = self.results.borrow_mut();
        let all = results.get_or_insert_with(|| {
            let batch = self.keys.join(",");
            let v = python_json(&self.script, &["--batch", &batch])?;
            if let Some(e) = v.get("error") {
                return Err(format!("peer: {e}"));
            }
            v["results"]
                .as_object()
                .map(|m| m.clone().into_iter().collect())
                .ok_or_else(|| "peer gave no results".to_string())
        });
        match all {
            Ok(map) => peer_run(map.get(key).ok_or_else(|| format!("peer skipped {key}"))?),
            Err(e) => Err(e.clone()),
        }
    }
}

fn problem(n: usize, d: usize, causal: bool, opts: &SuiteOptions, peers: Rc<PeerBatch>) -> Problem {
    // The reference materializes several f32 B·H·N² score matrices.
    let reference_bytes = 4.0 * (BATCH * HEADS * n * n) as f64 * 4.0;
    let max_mem = opts.max_mem_bytes;
    attention_problem(
        n,
        d,
        causal,
        Box::new(move |device| {
            let shape = [BATCH, HEADS, n, d];
            // Drawn on the device: host generation of 3 × 537M values at N = 32K, D = 128
            // took longer than timing them.
            device.seed(1);
            let normal = || {
                Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(DType::F16)
            };
            let (q, k, v) = (normal(), normal(), normal());
            let mut out = Vec::new();
            let (q2, k2, v2) = (q.clone(), k.clone(), v.clone());
            let attn_opts = AttnOptions {
                causal,
                scale: 1.0 / (d as f32).sqrt(),
                key_padding: None,
            };
            // Every timed output is checked once against Burn's: a launch that failed (and left
            // its output unwritten) would otherwise time as the fastest row.
            let want =
                head_sample(&BurnAttention.attend(0, q.clone(), k.clone(), v.clone(), &attn_opts));
            out.push(Candidate::timed_here("burn-fused", move || {
                keep(BurnAttention.attend(0, q2.clone(), k2.clone(), v2.clone(), &attn_opts));
            }));
            for (name, qk, smooth_q, pv, kernel) in VARIANTS {
                let (q, k, v) = (q.clone(), k.clone(), v.clone());
                let o = SageOptions {
                    causal,
                    qk,
                    smooth_q,
                    pv,
                    kernel,
                    ..Default::default()
                };
                // A kernel asked for by name that this device does not run would time the
                // reference the op falls back to: skip the row instead, saying why.
                if let Some(wanted) = kernel
                    && let Err(why) = runs_kernel(&q, &k, &v, &o, wanted)
                {
                    out.push(Candidate::skipped(name, why));
                    continue;
                }
                let device = q.device();
                let p = burn_sage::plan(&q.dims(), &k.dims(), &v.dims(), [DType::F16; 3], &o);
                let run = move || sage_attention(q.clone(), k.clone(), v.clone(), &o);
                let checked = match (&want, run()) {
                    (Ok(want), Ok(got)) => {
                        head_sample(&got.out).map(|got| metrics(&got, want).cos_sim)
                    }
                    (Err(e), _) => Err(format!("Burn's output unreadable: {e}")),
                    (_, Err(e)) => Err(e.to_string()),
                };
                // Where the op picks its kernel by measurement, the first run above timed the
                // candidates: say which one the row times.
                let tuned = p
                    .ok()
                    .filter(|_| kernel.is_none())
                    .and_then(|p| burn_sage::tuned_kernel(&device, &p))
                    .map(|k| format!("; tuned: {k}"))
                    .unwrap_or_default();
                out.push(match checked {
                    Ok(cos) if cos >= MIN_COSINE => Candidate::timed_here(name, move || {
                        keep(run());
                    })
                    .with_extra(move || Extra {
                        params: params([("cosine_vs_burn", json!(cos))]),
                        note: Some(format!("cos sim vs Burn {cos:.5}{tuned}")),
                    }),
                    Ok(cos) => Candidate::skipped(name, format!("wrong output: cos sim {cos:.4}")),
                    Err(e) => Candidate::skipped(name, format!("output unreadable: {e}")),
                });
            }
            for (peer, name) in PEERS {
                let peers = peers.clone();
                out.push(Candidate::timed_elsewhere(name, move || {
                    peers.get(&peer_key(peer, n, d, causal))
                }));
            }
            if reference_bytes > max_mem {
                out.push(Candidate::skipped(
                    "sage-reference",
                    format!("needs ~{:.0} GB of score matrices", reference_bytes / 1e9),
                ));
            } else if n > REFERENCE_MAX_N {
                // Its tensor-op matmuls autotune at every new shape (20–75 s on an H100),
                // which the whole suite cannot afford inside one 10-minute device call.
                out.push(Candidate::skipped(
                    "sage-reference",
                    format!("run up to N = {REFERENCE_MAX_N} only (autotuning time)"),
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
                    keep(burn_sage::reference::sage_attention(
                        q.clone(),
                        k.clone(),
                        v.clone(),
                        &plan,
                    ));
                }));
            }
            out
        }),
    )
}
