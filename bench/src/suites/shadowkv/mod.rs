//! ShadowKV against the full cache: decode throughput of a random-weight Llama-3-8B-shaped
//! model (32 layers, 32 query and 8 KV heads of 128, hidden 4096, FFN 14336, vocabulary
//! 128256), f16, at 32K, 64K and 128K tokens of context, each cache at the largest batch that
//! fits (the paper's measure: ≥ 3× the full cache's tokens/s at 128K is the goal, the
//! paper reports 2.97× on an A100).
//!
//! # Method
//!
//! - **Batch.** Each cache gets the largest batch whose weights, cache and working sets fit
//!   `--max-mem-gb` of device memory (through a model of the memory pool's pages) and, for
//!   ShadowKV's values, `--max-host-mem-gb` of host memory; see `super::kv_decode`. The plan
//!   is printed before anything runs, and each record carries it (`batch`, `batch_bound`,
//!   `est_*`) next to what was measured (`pool_reserved_gb`, `host_rss_gb`).
//! - **Synthetic prompts.** No prompt goes through the model (Burn's attention would take
//!   minutes at 128K): every layer's cache is filled directly. Values are standard normal.
//!   Keys (ShadowKV's) are low-rank like real pre-RoPE keys: `Z·M + noise` with `Z` `[L, 64]`
//!   per layer, one `M` `[64, kv_heads·128]` for all, noise 0.1 (~1% of the energy), then
//!   rotated by the model's RoPE (θ = 500000), which ShadowKV undoes. Every sequence of the
//!   batch gets the layer's same prompt (one tensor expanded over the batch, so that filling
//!   needs one sequence's keys and values at a time); ShadowKV still compresses, offloads and
//!   selects per sequence, and each sequence decodes its own tokens. Since all keys share
//!   `M`'s subspace, the rank-160 basis is computed once (`low_rank` of layer 0's first 16K
//!   keys) and given to the cache (`ShadowKvCache::set_key_basis`) instead of one host
//!   eigen-decomposition per layer and sequence (~1 s each). The full cache gets distinct
//!   random keys and values (its cost does not depend on them). ShadowKV's defaults: rank
//!   160, budget 2048, chunks of 8, 4 local and 48 outlier chunks.
//! - **Timing.** Only decode steps are timed: each feeds one new token per sequence (a
//!   different one per step, so queries and ShadowKV's chunk selection change as in
//!   generation), runs the model with Burn's fused attention and the logits, and is
//!   synchronized. Two warm-up steps, then (ShadowKV only) three steps with its per-phase
//!   profiling on (it synchronizes after each phase: the breakdown of `DecodeTimings`, in the
//!   record's `profile_*` params), then eight timed steps. tokens/s = batch / median step.
//!   Then the same cache decodes with burn-kvcache's decode attention kernel instead of
//!   Burn's attention op (one warm-up, eight timed; the record's `decode_kernel_*` params):
//!   the comparison with a full cache whose attention reads K/V at memory speed. ShadowKV's
//!   cache then decodes once more with the other upload path
//!   (`ShadowKvCache::set_pinned_uploads`: one warm-up, eight timed steps with the decode
//!   kernel, three profiled; the record's `unpinned_*` or `pinned_*` params), so one filled
//!   cache compares both. The cache grows by one token per step (≤ 40 in all).
//!
//! The full cache (`FullKvCache`) concatenates its keys and values for every step and Burn's
//! attention needs the KV heads repeated (4× the keys and values of a layer, materialized):
//! both are costs of this baseline, not of decoding at large, and both shrink its batch.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use burn::tensor::Device;
use burn_kernels_core::{BurnAttention, FullKvCache, KvCache};
use burn_kvcache::{DecodeAttention, ShadowKvConfig};
use burn_llama::LlamaConfig;
use serde_json::json;

use super::SuiteOptions;
use super::kv_decode::{
    F16, Footprint, GB, Plan, RunEnv, SharedModel, SkipAttention, ctx_label, describe, fill_opts,
    fill_query, gb, host_rss, median_mean, model_config, plan, plan_candidate, problem_params,
    random_states, reserved, seq_bytes, sync, timed_steps, warm_up, weight_allocs,
};
use crate::harness::{Extra, PeerRun, Problem, Suite, params};

mod shadow;
use shadow::run_shadow;

/// Rank of the synthetic keys' shared subspace.
const KEY_RANK: usize = 64;
/// Standard deviation of the noise added to the low-rank keys.
const KEY_NOISE: f64 = 0.1;
/// Keys the shared basis is computed from.
const BASIS_ROWS: usize = 16_384;

struct Steps {
    warmup: usize,
    profiled: usize,
    timed: usize,
}

impl Steps {
    fn new(quick: bool) -> Self {
        if quick {
            Steps {
                warmup: 1,
                profiled: 2,
                timed: 3,
            }
        } else {
            Steps {
                warmup: 2,
                profiled: 3,
                timed: 8,
            }
        }
    }

    /// Every step a cache decodes, at most: the timed ones twice (Burn's attention op, then the
    /// decode attention kernel after one warm-up), and for ShadowKV once more with the other
    /// upload path (after one warm-up) and its profiled steps.
    fn total(&self) -> usize {
        self.warmup + 2 * self.profiled + 3 * self.timed + 2
    }
}

/// The suite's ShadowKV settings. `BURN_KERNELS_SHADOWKV_CHUNK` and
/// `BURN_KERNELS_SHADOWKV_CANDIDATES` (two-stage selection) override the full run's chunk length
/// and candidates; the local window and the outliers keep their tokens.
/// `BURN_KERNELS_SHADOWKV_PINNED=0` uploads the values without pinned staging (the comparison
/// run of [`ShadowKvConfig::pinned_uploads`]); `BURN_KERNELS_SHADOWKV_REUSE_MIN` sets
/// [`ShadowKvConfig::reuse_min_percent`] (0: reuse whatever is found, as before 2026-12-07).
fn shadow_config(quick: bool) -> ShadowKvConfig {
    let env = |name: &str| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
    };
    let base = ShadowKvConfig::default();
    if quick {
        // Short prompts still compressed, and fewer chunks selected than held.
        return ShadowKvConfig {
            budget: 128,
            outlier_chunks: 8,
            min_prompt: 0,
            ..base
        };
    }
    let chunk = env("BURN_KERNELS_SHADOWKV_CHUNK")
        .filter(|&c| c > 0)
        .unwrap_or(base.chunk);
    ShadowKvConfig {
        chunk,
        local_chunks: (base.local_chunks * base.chunk).div_ceil(chunk),
        outlier_chunks: (base.outlier_chunks * base.chunk).div_ceil(chunk),
        candidates: env("BURN_KERNELS_SHADOWKV_CANDIDATES").unwrap_or(base.candidates),
        pinned_uploads: env("BURN_KERNELS_SHADOWKV_PINNED").is_none_or(|p| p != 0),
        reuse_min_percent: env("BURN_KERNELS_SHADOWKV_REUSE_MIN")
            .map_or(base.reuse_min_percent, |p| p as u32),
        ..base
    }
}

pub fn suite(opts: SuiteOptions) -> Suite {
    let quick = opts.quick;
    // Longest first: 128K is the goal, and a run cut short by a time limit keeps it.
    let contexts: &[usize] = if quick {
        &[512]
    } else {
        &[131_072, 65_536, 32_768]
    };
    let cap = if quick { 2 } else { 256 };
    let cfg = model_config(quick);
    let sk = shadow_config(quick);
    let steps = Steps::new(quick);
    let max_ctx = contexts.iter().max().copied().unwrap_or(0);
    let positions = max_ctx + steps.total() + 8;
    let model = SharedModel::new(cfg.clone(), positions);
    eprintln!(
        "shadowkv: budgets {:.1} GB device (--max-mem-gb), {:.1} GB host (--max-host-mem-gb)",
        opts.max_mem_bytes / GB,
        opts.max_host_mem_bytes / GB
    );
    let mut problems = Vec::new();
    for &ctx in contexts {
        let grown = ctx + steps.total();
        let full = plan(&opts, cap, |b| full_footprint(&cfg, b, grown, positions));
        let shadow = plan(&opts, cap, |b| {
            shadow_footprint(&cfg, &sk, b, ctx, grown, positions)
        });
        for (name, p) in [("full", &full), ("shadowkv", &shadow)] {
            eprintln!("  ctx={} {name}: {}", ctx_label(ctx), describe(p));
        }
        problems.push(problem(
            &opts,
            &model,
            sk,
            ctx,
            full,
            shadow,
            Steps::new(quick),
        ));
    }
    Suite {
        name: "shadowkv",
        description: "Decode tokens/s, random-weight Llama-3-8B shape, f16, synthetic prompts: \
                      ShadowKV (rank 160, budget 2048, chunk 8; values in host memory) vs the \
                      full cache, each at the largest batch that fits",
        baseline: "full",
        problems,
        measure_memory: false,
        plot: None,
    }
}

/// The full cache: weights, `2·layers` cache tensors; a step concatenates a layer's keys and
/// values (new tensors before the old are freed) and repeats them over the query heads. The
/// fill stores what it draws, so it has no working set of its own.
fn full_footprint(cfg: &LlamaConfig, b: usize, grown: usize, positions: usize) -> Footprint {
    let g = cfg.num_heads / cfg.num_kv_heads;
    let s = seq_bytes(cfg, b, grown);
    let mut held = weight_allocs(cfg, positions);
    held.push((s, 2 * cfg.num_layers));
    Footprint {
        held,
        phases: vec![vec![(s, 2), (s * g as u64, 2)]],
        host: 0,
    }
}

/// ShadowKV's layers after the prefill (see `burn_kvcache::shadowkv`), the fill's working set
/// (one sequence's keys and values, a copy, and the compression's f32 copies of the keys) and
/// a step's (f32 landmark scores, rebuilt keys, the values in use, the concatenated keys and
/// values repeated over the query heads).
fn shadow_footprint(
    cfg: &LlamaConfig,
    sk: &ShadowKvConfig,
    b: usize,
    ctx: usize,
    grown: usize,
    positions: usize,
) -> Footprint {
    let (hkv, d, layers) = (cfg.num_kv_heads, cfg.head_dim, cfg.num_layers);
    let g = (cfg.num_heads / hkv) as u64;
    let chunks = ctx / sk.chunk - sk.local_chunks;
    let chunked = chunks * sk.chunk;
    let landmarks = chunks - sk.outlier_chunks;
    let selected = sk.select_chunks().min(landmarks) * sk.chunk;
    let local = ctx - chunked;
    let outliers = sk.outlier_chunks * sk.chunk;
    let generated = grown - ctx;
    let seq = |n: usize| seq_bytes(cfg, b, n);
    let mut held = weight_allocs(cfg, positions);
    held.extend([
        ((b * chunked * sk.rank) as u64 * F16, layers),
        ((b * hkv * sk.rank * d) as u64 * F16, layers),
        (seq(landmarks), layers),
        (seq(local), 2 * layers),
        (seq(outliers), 2 * layers),
        (seq(selected), layers),
        (seq(generated), 2 * layers),
        ((ctx * d / 2 * 4) as u64, 2),
    ]);
    let one = seq_bytes(cfg, 1, ctx);
    let attended = local + outliers + selected + generated;
    Footprint {
        held,
        phases: vec![
            vec![(one, 3), (2 * one, 5), ((ctx * sk.rank * 4) as u64, 2)],
            vec![
                (2 * seq(landmarks), 1),
                ((b * cfg.num_heads * landmarks * 4) as u64, 3),
                (seq(selected), 3),
                (seq(attended), 2),
                (g * seq(attended), 2),
            ],
        ],
        host: (layers * b * hkv * chunked * d) as u64 * F16 + one + 2_000_000_000,
    }
}

fn problem(
    opts: &SuiteOptions,
    model: &Rc<SharedModel>,
    sk: ShadowKvConfig,
    ctx: usize,
    full: Result<Plan, String>,
    shadow: Result<Plan, String>,
    steps: Steps,
) -> Problem {
    let label = format!("ctx={}", ctx_label(ctx));
    let model = model.clone();
    let probe = opts.probe.clone();
    let steps = Rc::new(steps);
    Problem {
        label: label.clone(),
        params: problem_params(
            opts,
            ctx,
            [
                ("rank", json!(sk.rank)),
                ("budget", json!(sk.budget)),
                ("chunk", json!(sk.chunk)),
                ("outlier_chunks", json!(sk.outlier_chunks)),
                ("local_chunks", json!(sk.local_chunks)),
                ("candidates", json!(sk.candidates)),
                ("pinned_uploads", json!(sk.pinned_uploads)),
                ("max_host_mem_gb", json!(opts.max_host_mem_bytes / GB)),
            ],
        ),
        flops: None,
        bytes: None,
        tokens: None,
        setup: Box::new(move |device| {
            let env = RunEnv {
                model: model.clone(),
                probe: probe.clone(),
                device: device.clone(),
                label: label.clone(),
            };
            let (en, st) = (env.clone(), steps.clone());
            let full = plan_candidate("full", &full, move |p, info| {
                run_full(&en, p, ctx, &st, info)
            });
            let steps = steps.clone();
            let shadow = plan_candidate("shadowkv", &shadow, move |p, info| {
                run_shadow(&env, p, sk, ctx, &steps, info)
            });
            vec![full, shadow]
        }),
    }
}

/// The plan's and the run's common parameters.
fn base_params(
    p: &Plan,
    fill_s: f64,
    cache_bytes: usize,
    pool: Option<u64>,
    times: &[f64],
) -> Extra {
    let (median, mean) = median_mean(times);
    let mut x = Extra::default();
    x.params.extend(params([
        ("batch", json!(p.batch)),
        ("batch_bound", json!(p.bound)),
        ("est_device_gb", json!(p.device as f64 / GB)),
        ("est_device_tensors_gb", json!(p.device_raw as f64 / GB)),
        ("est_host_gb", json!(p.host as f64 / GB)),
        ("fill_s", json!(fill_s)),
        ("cache_bytes_held_gb", json!(cache_bytes as f64 / GB)),
        ("pool_reserved_gb", json!(pool.map(|b| b as f64 / GB))),
        ("host_rss_gb", json!(host_rss().map(|b| b as f64 / GB))),
        ("step_median_ms", json!(median)),
        ("step_mean_ms", json!(mean)),
        ("tokens_per_sec_mean", json!(p.batch as f64 / (mean * 1e-3))),
    ]));
    x
}

/// The same cache decoding with burn-kvcache's decode attention kernel (GQA without
/// repeating K/V, split over the keys) instead of Burn's attention op: one warm-up step, then
/// `steps.timed`; returns the record's params and a note.
fn with_decode_kernel(
    m: &burn_llama::Llama,
    cache: &mut dyn burn_kernels_core::KvCache,
    b: usize,
    step: u64,
    steps: &Steps,
    device: &Device,
) -> (
    std::collections::BTreeMap<String, serde_json::Value>,
    String,
) {
    let attention = DecodeAttention::default();
    let _ = timed_steps(m, cache, b, step, 1, device, &attention);
    let times = timed_steps(m, cache, b, step + 1, steps.timed, device, &attention);
    let (median, _) = median_mean(&times);
    let (min, p90) = (
        crate::harness::quantile(&times, 0.0),
        crate::harness::quantile(&times, 0.9),
    );
    let tps = b as f64 / (median * 1e-3);
    (
        params([
            ("decode_kernel_step_median_ms", json!(median)),
            ("decode_kernel_step_min_ms", json!(min)),
            ("decode_kernel_step_p90_ms", json!(p90)),
            ("decode_kernel_reps", json!(times.len())),
            ("decode_kernel_tokens_per_sec", json!(tps)),
        ]),
        format!(
            "decode-attention kernel: {median:.1} ms (min {min:.1}, p90 {p90:.1}, {} reps), \
             {tps:.1} tok/s",
            times.len()
        ),
    )
}

fn run_full(
    env: &RunEnv,
    p: &Plan,
    ctx: usize,
    steps: &Steps,
    info: &RefCell<Extra>,
) -> Result<PeerRun, String> {
    let m = env.start();
    let (model, probe, device, label) = (&env.model, &env.probe, &env.device, &env.label);
    let cfg = model.config();
    let b = p.batch;
    let t0 = Instant::now();
    let mut cache = FullKvCache::new(cfg.num_layers);
    let (q, opts) = (fill_query(cfg, b, device), fill_opts(cfg));
    for layer in 0..cfg.num_layers {
        let k = random_states(cfg, b, ctx, device);
        let v = random_states(cfg, b, ctx, device);
        cache
            .attend(layer, q.clone(), k, v, &SkipAttention, &opts)
            .map_err(|e| e.to_string())?;
    }
    sync(device);
    let fill_s = t0.elapsed().as_secs_f64();
    let mut step = warm_up(&m, &mut cache, b, steps.warmup + steps.profiled, device);
    let pool = reserved(probe);
    eprintln!(
        "  {label} full: batch {b}, filled {} layers in {fill_s:.1} s; cache {}, pool {} \
         reserved (estimate {})",
        cfg.num_layers,
        gb(Some(cache.bytes_held() as u64)),
        gb(pool),
        gb(Some(p.device))
    );
    let times = timed_steps(&m, &mut cache, b, step, steps.timed, device, &BurnAttention);
    let mut x = base_params(p, fill_s, cache.bytes_held(), reserved(probe), &times);
    step += steps.timed as u64;
    let (kp, kn) = with_decode_kernel(&m, &mut cache, b, step, steps, device);
    eprintln!("  {label} full: {kn}");
    x.params.extend(kp);
    x.note = Some(format!("batch {b} ({}-bound); {kn}", p.bound));
    *info.borrow_mut() = x;
    Ok(times.into())
}

#[cfg(test)]
mod tests {
    use super::super::kv_decode::tests::h100_opts;
    use super::*;

    /// The plans of a full run on an 80 GB H100 with 110 GB of host memory (printed with
    /// `--nocapture`): ShadowKV fits more sequences than the full cache at every context.
    #[test]
    fn h100_plans() {
        let opts = h100_opts();
        let cfg = model_config(false);
        let sk = shadow_config(false);
        let steps = Steps::new(false);
        let positions = 131_072 + steps.total() + 8;
        for ctx in [32_768, 65_536, 131_072] {
            let grown = ctx + steps.total();
            let full = plan(&opts, 256, |b| full_footprint(&cfg, b, grown, positions));
            let shadow = plan(&opts, 256, |b| {
                shadow_footprint(&cfg, &sk, b, ctx, grown, positions)
            });
            println!("ctx={} full: {}", ctx_label(ctx), describe(&full));
            println!("ctx={} shadowkv: {}", ctx_label(ctx), describe(&shadow));
            let (full, shadow) = (full.unwrap(), shadow.unwrap());
            assert!(shadow.batch > full.batch, "{full:?} {shadow:?}");
        }
    }
}
