//! MiniCache, KIVI-style 4-bit quantization and both against the full cache: the device memory
//! a cache holds and decode tokens/s of a random-weight Llama-3-8B-shaped model (f16), each
//! cache at the largest batch that fits, at 8K and 32K tokens of context. KIVI-4 runs twice:
//! `quant4` attends straight from the codes (`burn_kvcache::quant_attention`, the default),
//! `quant4-dequant` dequantizes each layer for Burn's attention (the path before it).
//!
//! # Method
//!
//! - **Batch.** Each cache gets the largest batch whose weights, cache and working sets fit
//!   `--max-mem-gb` (through a model of the memory pool's pages; see `super::kv_decode`).
//!   Every cache here rebuilds a layer's full f16 keys and values at each step (dequantized,
//!   restored), so the working set of a step is at least that of the full cache (more for
//!   the compressed caches: the rebuilt sequence and its copies); only what is held shrinks.
//! - **Synthetic prompts.** No prompt goes through the model: each layer's cache is filled
//!   through `KvCache::attend` with an attention that computes nothing, in two calls (all but
//!   the last 32 positions, then those), as a prefill in two pieces would. States are standard
//!   normal f16. MiniCache merges a layer with the one below it from layer 16 on; for its
//!   premise (adjacent layers aligned, as the paper measures on Llama-3) the deeper layer of
//!   each pair is the shallower one's states plus 5% noise (an angle of ~0.016π, under the
//!   retention threshold γ = 0.05), except for 5% of the positions, drawn independently,
//!   which MiniCache keeps unmerged. Every cache gets the same kind of data.
//! - **Timing.** Only decode steps are timed: each feeds one new token per sequence (a
//!   different one per step), runs the model with Burn's fused attention and the logits, and
//!   is synchronized. Two warm-up steps, then 32 timed steps, which include MiniCache's merges
//!   of its pending window (every 16 steps) and the quantization of the full-precision window
//!   (every 32 steps): tokens/s = batch / median step; the mean step (merges and
//!   quantizations included) is in `step_mean_ms` and `tokens_per_sec_mean`.
//! - **Memory.** `cache_bytes_held_gb` is `KvCache::bytes_held` after the timed steps (every
//!   tensor the cache holds at its element size); `compression_vs_full` divides a full cache
//!   of the same positions by it; `pool_reserved_gb` is what the device memory pool had
//!   reserved at the end (weights, cache and the pages of the working sets).

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use burn::tensor::{Device, Distribution, Tensor};
use burn_kernels_core::{BurnAttention, FullKvCache, KvCache};
use burn_kvcache::{MiniCacheConfig, MiniCacheKv, QuantConfig, QuantKv};
use burn_llama::LlamaConfig;
use serde_json::json;

use super::SuiteOptions;
use super::kv_decode::{
    F16, Footprint, GB, Plan, RunEnv, SharedModel, SkipAttention, ctx_label, describe, fill_opts,
    fill_query, gb, median_mean, model_config, plan, plan_candidate, problem_params, random_states,
    reserved, seq_bytes, sync, timed_steps, warm_up, weight_allocs,
};
use crate::harness::{Extra, PeerRun, Problem, Suite, params};

/// Positions of the second fill call (the quantized caches' full-precision window).
const TAIL: usize = 32;
/// Relative noise between the two layers of a merged pair.
const PAIR_NOISE: f64 = 0.05;
/// Share of positions whose deeper-layer state is independent (kept unmerged).
const UNALIGNED: f64 = 0.05;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Full,
    MiniCache,
    /// KIVI-4 with the attention read from the codes (`quant_attention`, the default).
    Quant4,
    /// KIVI-4 dequantizing each layer for Burn's attention (`fused_attention: false`).
    Quant4Dequant,
    MiniCacheQuant4,
}

impl Kind {
    const ALL: [Kind; 5] = [
        Kind::Full,
        Kind::MiniCache,
        Kind::Quant4,
        Kind::Quant4Dequant,
        Kind::MiniCacheQuant4,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::Full => "full",
            Kind::MiniCache => "minicache",
            Kind::Quant4 => "quant4",
            Kind::Quant4Dequant => "quant4-dequant",
            Kind::MiniCacheQuant4 => "minicache+quant4",
        }
    }

    fn quant(self) -> Option<QuantConfig> {
        match self {
            Kind::Quant4 | Kind::MiniCacheQuant4 => Some(QuantConfig::bits(4)),
            Kind::Quant4Dequant => Some(QuantConfig {
                fused_attention: false,
                ..QuantConfig::bits(4)
            }),
            Kind::Full | Kind::MiniCache => None,
        }
    }

    fn merges(self) -> bool {
        matches!(self, Kind::MiniCache | Kind::MiniCacheQuant4)
    }
}

struct Steps {
    warmup: usize,
    timed: usize,
}

pub fn suite(opts: SuiteOptions) -> Suite {
    let quick = opts.quick;
    let contexts: &[usize] = if quick { &[512] } else { &[8192, 32_768] };
    let cap = if quick { 2 } else { 512 };
    let steps = if quick {
        Steps {
            warmup: 1,
            timed: 16,
        }
    } else {
        Steps {
            warmup: 2,
            timed: 32,
        }
    };
    let cfg = model_config(quick);
    let max_ctx = contexts.iter().max().copied().unwrap_or(0);
    let grow = steps.warmup + steps.timed;
    let positions = max_ctx + grow + 8;
    let model = SharedModel::new(cfg.clone(), positions);
    let steps = Rc::new(steps);
    eprintln!(
        "minicache: device budget {:.1} GB (--max-mem-gb)",
        opts.max_mem_bytes / GB
    );
    let mut problems = Vec::new();
    for &ctx in contexts {
        let plans: Vec<(Kind, Result<Plan, String>)> = Kind::ALL
            .iter()
            .map(|&k| {
                let p = plan(&opts, cap, |b| {
                    footprint(&cfg, k, b, ctx, ctx + grow, positions)
                });
                eprintln!("  ctx={} {}: {}", ctx_label(ctx), k.name(), describe(&p));
                (k, p)
            })
            .collect();
        problems.push(problem(&opts, &model, ctx, plans, steps.clone()));
    }
    Suite {
        name: "minicache",
        description: "Decode tokens/s and KV bytes held, random-weight Llama-3-8B shape, f16, \
                      synthetic prompts: MiniCache (from layer 16, t 0.6, γ 0.05), KIVI 4-bit \
                      (read from the codes, and dequantized for Burn's attention), both, vs \
                      the full cache, each at the largest batch that fits",
        baseline: "full",
        problems,
        measure_memory: false,
        plot: None,
    }
}

/// Bytes of `rows` token vectors of `d` channels quantized to `q.bits` bits in groups of
/// `q.group_size`, with an f16 scale and minimum per group (keys per channel and values per
/// token come to the same).
fn quant_bytes(q: QuantConfig, rows: usize, d: usize) -> [(u64, usize); 2] {
    let words = (rows * d * q.bits as usize / 8) as u64;
    let scales = (rows * d.div_ceil(q.group_size)) as u64 * F16;
    [(words, 1), (scales, 2)]
}

/// What one cache holds and its working sets, by the storage rules of `burn_kvcache` (see
/// its crate docs): full layers as f16 or quantized sequences, merged pairs as one direction
/// (f16 or quantized), two f16 magnitudes, an i32 slot map and the unmerged rows.
fn footprint(
    cfg: &LlamaConfig,
    kind: Kind,
    b: usize,
    ctx: usize,
    grown: usize,
    positions: usize,
) -> Footprint {
    let (hkv, d, layers) = (cfg.num_kv_heads, cfg.head_dim, cfg.num_layers);
    let g = (cfg.num_heads / hkv) as u64;
    let s = seq_bytes(cfg, b, grown);
    let rows = b * hkv * grown;
    let pairs = if kind.merges() {
        let start = MiniCacheConfig::default().start_for(layers);
        (layers - start) / 2
    } else {
        0
    };
    let full_layers = layers - 2 * pairs;
    let mut held = weight_allocs(cfg, positions);
    let mut cache = Vec::new();
    match kind.quant() {
        None => cache.push((s, 2 * full_layers)),
        Some(q) => {
            for (size, n) in quant_bytes(q, rows, d) {
                cache.push((size, n * 2 * full_layers));
            }
            cache.push((
                seq_bytes(cfg, b, q.residual + q.group_size),
                2 * full_layers,
            ));
        }
    }
    if pairs > 0 {
        let kept = (UNALIGNED * 1.2 * rows as f64) as usize;
        let per_kv = 2 * pairs;
        match kind.quant() {
            None => cache.extend([(s, per_kv), ((kept * d) as u64 * F16, per_kv)]),
            Some(q) => {
                for (size, n) in quant_bytes(q, rows, d)
                    .into_iter()
                    .chain(quant_bytes(q, kept, d))
                {
                    cache.push((size, n * per_kv));
                }
                cache.push((seq_bytes(cfg, b, q.residual + q.group_size), per_kv));
            }
        }
        cache.extend([
            (rows as u64 * F16, 2 * per_kv),
            (rows as u64 * 4, per_kv),
            (seq_bytes(cfg, b, 16), 2 * per_kv),
        ]);
    }
    held.extend(cache);
    // A step's rebuilt keys and values: the full cache's concatenations; a quantized or
    // merged layer's dequantized / restored sequence, its reordered copy (keys) and the
    // concatenations with the window and the new token, some of them alive at once; then
    // both repeated over the query heads for Burn's attention. The fused quantized read
    // rebuilds nothing: its working set is the f32 partial results of its key splits.
    let step = match kind {
        Kind::Quant4 => {
            let splits = burn_kvcache::shapes::quant_attention_splits(grown) as u64;
            let rows = (b * cfg.num_heads) as u64;
            vec![(rows * splits * d as u64 * 4, 1), (rows * splits * 4, 2)]
        }
        Kind::Full => vec![(s, 2), (s * g, 2)],
        _ => vec![(s, 5), (s * g, 2)],
    };
    let fill = seq_bytes(cfg, b, ctx);
    Footprint {
        held,
        phases: vec![step, vec![(fill, 8), ((b * hkv * ctx * 4) as u64, 1)]],
        host: 2_000_000_000,
    }
}

/// Bytes the cache tensors of a footprint hold (weights left out), for the log.
fn cache_estimate(cfg: &LlamaConfig, f: &Footprint, positions: usize) -> u64 {
    let weights: u64 = weight_allocs(cfg, positions)
        .iter()
        .map(|&(s, n)| s * n as u64)
        .sum();
    f.held.iter().map(|&(s, n)| s * n as u64).sum::<u64>() - weights
}

fn problem(
    opts: &SuiteOptions,
    model: &Rc<SharedModel>,
    ctx: usize,
    plans: Vec<(Kind, Result<Plan, String>)>,
    steps: Rc<Steps>,
) -> Problem {
    let label = format!("ctx={}", ctx_label(ctx));
    let model = model.clone();
    let probe = opts.probe.clone();
    let mc = MiniCacheConfig::default();
    let q = QuantConfig::bits(4);
    Problem {
        label: label.clone(),
        params: problem_params(
            opts,
            ctx,
            [
                ("minicache_t", json!(mc.t)),
                ("minicache_gamma", json!(mc.gamma)),
                ("minicache_window", json!(mc.window)),
                ("quant_group", json!(q.group_size)),
                ("quant_residual", json!(q.residual)),
                ("synthetic_unaligned_share", json!(UNALIGNED)),
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
            plans
                .iter()
                .map(|(kind, p)| {
                    let (env, steps, kind) = (env.clone(), steps.clone(), *kind);
                    plan_candidate(kind.name(), p, move |p, info| {
                        run(&env, kind, p, ctx, &steps, info)
                    })
                })
                .collect()
        }),
    }
}

/// The deeper layer of a merged pair: `states` plus 5% noise, except at 5% of the positions,
/// independent.
fn aligned(states: &Tensor<4>) -> Tensor<4> {
    let device = states.device();
    let dtype = states.dtype();
    let [b, h, n, d] = states.dims();
    let noise = Tensor::<4>::random(
        [b, h, n, d],
        Distribution::Normal(0.0, PAIR_NOISE),
        (&device, dtype),
    );
    let other = Tensor::<4>::random(
        [b, h, n, d],
        Distribution::Normal(0.0, 1.0),
        (&device, dtype),
    );
    let unaligned = Tensor::<4>::random([b, h, n, 1], Distribution::Uniform(0.0, 1.0), &device)
        .lower_elem(UNALIGNED)
        .expand([b, h, n, d]);
    (states.clone() + noise).mask_where(unaligned, other)
}

/// Fills every layer of `cache` with `n` positions through `attend` (nothing attended).
fn fill_part(cache: &mut dyn KvCache, cfg: &LlamaConfig, b: usize, n: usize, device: &Device) {
    let start = MiniCacheConfig::default().start_for(cfg.num_layers);
    let (q, opts) = (fill_query(cfg, b, device), fill_opts(cfg));
    let mut below: Option<(Tensor<4>, Tensor<4>)> = None;
    for layer in 0..cfg.num_layers {
        let second = layer > start && (layer - start) % 2 == 1;
        let (k, v) = match (second, below.take()) {
            (true, Some((k, v))) => (aligned(&k), aligned(&v)),
            _ => (
                random_states(cfg, b, n, device),
                random_states(cfg, b, n, device),
            ),
        };
        if layer >= start && !second {
            below = Some((k.clone(), v.clone()));
        }
        cache
            .attend(layer, q.clone(), k, v, &SkipAttention, &opts)
            .expect("the fill attends");
    }
}

fn run(
    env: &RunEnv,
    kind: Kind,
    p: &Plan,
    ctx: usize,
    steps: &Steps,
    info: &RefCell<Extra>,
) -> Result<PeerRun, String> {
    let m = env.start();
    let (model, probe, device, label) = (&env.model, &env.probe, &env.device, &env.label);
    let cfg = model.config();
    let layers = cfg.num_layers;
    let b = p.batch;
    let err = |e: burn_kvcache::KvCacheError| e.to_string();
    let mc = MiniCacheConfig::default();
    let mut cache = match kind {
        Kind::Full => Held::Other(Box::new(FullKvCache::new(layers))),
        Kind::Quant4 | Kind::Quant4Dequant => Held::Other(Box::new(
            QuantKv::new(layers, kind.quant().expect("quantized")).map_err(err)?,
        )),
        Kind::MiniCache => Held::Mini(MiniCacheKv::new(layers, mc).map_err(err)?),
        Kind::MiniCacheQuant4 => {
            Held::Mini(MiniCacheKv::with_quant(layers, mc, QuantConfig::bits(4)).map_err(err)?)
        }
    };
    let t0 = Instant::now();
    fill_part(cache.get(), cfg, b, ctx - TAIL, device);
    fill_part(cache.get(), cfg, b, TAIL, device);
    sync(device);
    let fill_s = t0.elapsed().as_secs_f64();
    let filled = cache.get().bytes_held();
    let step = warm_up(&m, cache.get(), b, steps.warmup, device);
    let positions = m.rope.max_positions();
    let est = cache_estimate(
        cfg,
        &footprint(cfg, kind, b, ctx, ctx, positions),
        positions,
    );
    eprintln!(
        "  {label} {}: batch {b}, filled in {fill_s:.1} s; cache {} (estimate {}), pool {} \
         reserved (estimate {})",
        kind.name(),
        gb(Some(filled as u64)),
        gb(Some(est)),
        gb(reserved(probe)),
        gb(Some(p.device))
    );
    let times = timed_steps(
        &m,
        cache.get(),
        b,
        step,
        steps.timed,
        device,
        &BurnAttention,
    );
    let held = cache.get().bytes_held();
    let full = 2 * layers as u64 * seq_bytes(cfg, b, cache.get().seq_len());
    let (median, mean) = median_mean(&times);
    let mut x = Extra::default();
    x.params.extend(params([
        ("batch", json!(b)),
        ("batch_bound", json!(p.bound)),
        ("est_device_gb", json!(p.device as f64 / GB)),
        ("est_device_tensors_gb", json!(p.device_raw as f64 / GB)),
        ("fill_s", json!(fill_s)),
        ("cache_bytes_held_gb", json!(held as f64 / GB)),
        (
            "cache_bytes_per_seq_mb",
            json!(held as f64 / b as f64 / 1e6),
        ),
        ("compression_vs_full", json!(full as f64 / held as f64)),
        (
            "pool_reserved_gb",
            json!(reserved(probe).map(|r| r as f64 / GB)),
        ),
        ("step_median_ms", json!(median)),
        ("step_mean_ms", json!(mean)),
        ("tokens_per_sec_mean", json!(b as f64 / (mean * 1e-3))),
    ]));
    let mut note = format!(
        "batch {b} ({}-bound), {:.0} MB/seq held ({:.2}× compression), mean {:.1} tok/s",
        p.bound,
        held as f64 / b as f64 / 1e6,
        full as f64 / held as f64,
        b as f64 / (mean * 1e-3)
    );
    if let Held::Mini(c) = &cache {
        let s = c.stats();
        x.params.extend(params([
            ("retained_fraction", json!(s.retained_fraction())),
            ("mean_angle_over_pi", json!(s.mean_dist())),
        ]));
        note.push_str(&format!(
            ", {:.1}% kept unmerged",
            100.0 * s.retained_fraction()
        ));
    }
    x.note = Some(note);
    *info.borrow_mut() = x;
    Ok(times.into())
}

/// The cache under test; MiniCache's own type is kept for its merge counts.
enum Held {
    Mini(MiniCacheKv),
    Other(Box<dyn KvCache>),
}

impl Held {
    fn get(&mut self) -> &mut dyn KvCache {
        match self {
            Held::Mini(c) => c,
            Held::Other(c) => c.as_mut(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::kv_decode::tests::h100_opts;
    use super::*;

    /// The plans of a full run on an 80 GB H100 (printed with `--nocapture`): every
    /// compressed cache fits at least the full cache's batch.
    #[test]
    fn h100_plans() {
        let opts = h100_opts();
        let cfg = model_config(false);
        let positions = 32_768 + 42;
        for ctx in [8192, 32_768] {
            let batch = |k: Kind| {
                let p = plan(&opts, 512, |b| {
                    footprint(&cfg, k, b, ctx, ctx + 34, positions)
                });
                println!("ctx={} {}: {}", ctx_label(ctx), k.name(), describe(&p));
                p.unwrap().batch
            };
            let full = batch(Kind::Full);
            for k in [
                Kind::MiniCache,
                Kind::Quant4,
                Kind::Quant4Dequant,
                Kind::MiniCacheQuant4,
            ] {
                assert!(batch(k) >= full);
            }
        }
    }
}
