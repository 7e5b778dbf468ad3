//! ShadowKV's side of the suite: the cache filled layer by layer with synthetic low-rank keys,
//! warm-up, the per-phase profile, timed steps and the decode-kernel steps.

use std::cell::RefCell;
use std::time::Instant;

use burn::tensor::{DType, Device, Distribution, Int, Tensor, TensorData};
use burn_kernels_core::{BurnAttention, KvCache};
use burn_kvcache::shadowkv::low_rank;
use burn_kvcache::{RopeParams, ShadowKvCache, ShadowKvConfig};
use serde_json::json;

use super::super::kv_decode::{
    GB, Plan, RunEnv, SharedModel, gb, host_rss, median_mean, random_states, reserved, sync,
    timed_steps, warm_up,
};
use super::{BASIS_ROWS, KEY_NOISE, KEY_RANK, Steps, base_params, with_decode_kernel};
use crate::harness::{Extra, PeerRun, params};

pub(super) fn run_shadow(
    env: &RunEnv,
    p: &Plan,
    sk: ShadowKvConfig,
    ctx: usize,
    steps: &Steps,
    info: &RefCell<Extra>,
) -> Result<PeerRun, String> {
    let m = env.start();
    let (model, probe, device, label) = (&env.model, &env.probe, &env.device, &env.label);
    let b = p.batch;
    let t0 = Instant::now();
    let mut cache = fill(model, sk, ctx, b, device, label)?;
    sync(device);
    let fill_s = t0.elapsed().as_secs_f64();
    let bytes = cache.bytes_split();
    let mut step = warm_up(&m, &mut cache, b, steps.warmup, device);
    let pool = reserved(probe);
    eprintln!(
        "  {label} shadowkv: batch {b}, filled in {fill_s:.1} s; cache {} device + {} host, \
         pool {} reserved (estimate {}), host RSS {} (estimate {})",
        gb(Some(bytes.device as u64)),
        gb(Some(bytes.host as u64)),
        gb(pool),
        gb(Some(p.device)),
        gb(host_rss()),
        gb(Some(p.host))
    );

    // The per-phase breakdown.
    let profile = profiled(&m, &mut cache, b, step, steps.profiled, device);
    step += steps.profiled as u64;
    cache.reset_timings();
    eprintln!("  {label} shadowkv: {}", profile.line());

    let times = timed_steps(&m, &mut cache, b, step, steps.timed, device, &BurnAttention);
    let timed = cache.timings();
    step += steps.timed as u64;
    let (kp, kn) = with_decode_kernel(&m, &mut cache, b, step, steps, device);
    eprintln!("  {label} shadowkv: {kn}");
    step += steps.timed as u64 + 1;
    // The other upload path on the same filled cache (ShadowKvConfig::pinned_uploads), with the
    // decode kernel and then profiled: what the pinned staging changes, in one run.
    let pinned = cache.config().pinned_uploads;
    cache.set_pinned_uploads(!pinned);
    let (op, on) = with_decode_kernel(&m, &mut cache, b, step, steps, device);
    step += steps.timed as u64 + 1;
    let other = profiled(&m, &mut cache, b, step, steps.profiled, device);
    cache.set_pinned_uploads(pinned);
    let other_name = if pinned { "unpinned" } else { "pinned" };
    eprintln!(
        "  {label} shadowkv, {other_name} uploads: {on}; {}",
        other.line()
    );
    let mut x = base_params(p, fill_s, cache.bytes_held(), reserved(probe), &times);
    x.params.extend(kp);
    x.params.extend(profile.params());
    x.params.extend(
        op.into_iter()
            .map(|(k, v)| (format!("{other_name}_{k}"), v)),
    );
    x.params.extend(
        other
            .params()
            .into_iter()
            .map(|(k, v)| (format!("{other_name}_{k}"), v)),
    );
    x.params.extend(params([
        ("cache_device_gb", json!(bytes.device as f64 / GB)),
        ("cache_host_gb", json!(bytes.host as f64 / GB)),
        ("chunks_reused_fraction", json!(reused(timed))),
        ("chunks_overlap_fraction", json!(timed.overlap())),
        (
            "chunks_fetched_per_step",
            json!(timed.chunks_fetched as f64 / steps.timed.max(1) as f64),
        ),
    ]));
    let pf = &profile;
    x.note = Some(format!(
        "batch {b} ({}-bound); profiled step {:.0} ms: scoring {:.0}, transfer {:.0}, \
         reconstruct {:.0}, attention {:.0}, rest {:.0}; {:.0}% chunks reused ({:.0}% overlap); {kn}; \
         {other_name} uploads: {on}, transfer {:.0} ms",
        p.bound,
        pf.step,
        pf.scoring,
        pf.transfer,
        pf.reconstruct,
        pf.attention,
        pf.rest,
        100.0 * reused(timed),
        100.0 * timed.overlap(),
        other.transfer
    ));
    *info.borrow_mut() = x;
    Ok(times.into())
}

/// `n` decode steps from `step` with Burn's attention and the cache's per-phase profiling on
/// (it synchronizes after each phase, so these steps are kept apart from the timed ones).
fn profiled(
    m: &burn_llama::Llama,
    cache: &mut ShadowKvCache,
    b: usize,
    step: u64,
    n: usize,
    device: &Device,
) -> Profile {
    cache.reset_timings();
    cache.set_profiling(true);
    let times = timed_steps(m, cache, b, step, n, device, &BurnAttention);
    let profile = Profile::new(cache, &times, n);
    cache.set_profiling(false);
    profile
}

/// A ShadowKV cache holding `ctx` synthetic tokens per layer for a batch of `b` (see the
/// module docs of the suite: low-rank keys plus noise, RoPE'd; one basis for all layers).
fn fill(
    model: &SharedModel,
    sk: ShadowKvConfig,
    ctx: usize,
    b: usize,
    device: &Device,
    label: &str,
) -> Result<ShadowKvCache, String> {
    let m = model.get(device);
    let cfg = model.config();
    let (hkv, d) = (cfg.num_kv_heads, cfg.head_dim);
    let t0 = Instant::now();
    let rope = RopeParams {
        theta: cfg.rope_theta,
        scaling: cfg.rope_scaling,
    };
    let mut cache =
        ShadowKvCache::new(cfg.num_layers, hkv, d, sk, rope).map_err(|e| e.to_string())?;
    // Uploaded as f32 (`from_data` stores the device's default float type) and cast on the
    // device, to the f16 of the noise and the model.
    let base = Tensor::<2>::from_data(
        TensorData::new(low_rank_keys(ctx, hkv * d), [ctx, hkv * d]),
        device,
    )
    .cast(DType::F16);
    let positions: Vec<i64> = (0..ctx as i64).collect();
    let positions = Tensor::<2, Int>::from_data(TensorData::new(positions, [1, ctx]), device);
    for layer in 0..cfg.num_layers {
        let noise = Tensor::<2>::random(
            [ctx, hkv * d],
            Distribution::Normal(0.0, KEY_NOISE),
            (device, DType::F16),
        );
        let pre = base.clone() + noise;
        if layer == 0 {
            let rows = ctx.min(BASIS_ROWS);
            let basis = low_rank(pre.clone().slice([0..rows, 0..hkv * d]), sk.rank)
                .map_err(|e| e.to_string())?;
            cache
                .set_key_basis(Some(basis.wt))
                .map_err(|e| e.to_string())?;
        }
        let k = pre.reshape([1, ctx, hkv, d]).swap_dims(1, 2);
        // One prompt expanded over the batch: a view, so the fill holds one sequence's keys
        // and values whatever the batch (a [batch, …] tensor past 2.7 GB would take a 21 GB
        // page of the pool).
        let k = m.rope.apply(k, positions.clone()).expand([b, hkv, ctx, d]);
        let v = random_states(cfg, 1, ctx, device).expand([b, hkv, ctx, d]);
        let sparse = cache
            .compress_prompt(layer, k, v, None)
            .map_err(|e| e.to_string())?;
        if !sparse {
            return Err(format!("layer {layer} was not compressed"));
        }
        if (layer + 1) % 8 == 0 {
            eprintln!(
                "  {label} shadowkv: {} of {} layers filled ({:.1} s)",
                layer + 1,
                cfg.num_layers,
                t0.elapsed().as_secs_f64()
            );
        }
    }
    Ok(cache)
}

/// The fraction of selected chunks a step found already on the device.
fn reused(t: burn_kvcache::DecodeTimings) -> f64 {
    t.chunks_reused as f64 / (t.chunks_reused + t.chunks_fetched).max(1) as f64
}

/// The profiled steps' phases, ms per step.
struct Profile {
    step: f64,
    scoring: f64,
    scoring_issue: f64,
    transfer: f64,
    transfer_host: f64,
    transfer_upload: f64,
    transfer_assemble: f64,
    reconstruct: f64,
    attention: f64,
    attention_issue: f64,
    /// The step less the cache's phases: the rest of the model.
    rest: f64,
    reused: f64,
}

impl Profile {
    /// From the cache's timings after `n` profiled steps that took `times` (ms).
    fn new(cache: &ShadowKvCache, times: &[f64], n: usize) -> Self {
        let t = cache.timings();
        let n = n.max(1) as f64;
        let ms = |x: std::time::Duration| x.as_secs_f64() * 1e3 / n;
        let (_, step) = median_mean(times);
        let (scoring, transfer, reconstruct, attention) = (
            ms(t.scoring),
            ms(t.transfer),
            ms(t.reconstruct),
            ms(t.attention),
        );
        Profile {
            step,
            scoring,
            scoring_issue: ms(t.scoring_issue),
            transfer,
            transfer_host: ms(t.transfer_host),
            transfer_upload: ms(t.transfer_upload),
            transfer_assemble: ms(t.transfer_assemble),
            reconstruct,
            attention,
            attention_issue: ms(t.attention_issue),
            rest: step - scoring - transfer - reconstruct - attention,
            reused: reused(t),
        }
    }

    fn line(&self) -> String {
        format!(
            "profiled step {:.1} ms = scoring {:.1} (issue {:.1}) + transfer {:.1} (host staging \
             {:.1}, upload {:.1}, device assembly {:.1}) + reconstruct {:.1} + attention {:.1} \
             (issue {:.1}) + rest of the model {:.1} ms; {:.0}% of the chunks reused",
            self.step,
            self.scoring,
            self.scoring_issue,
            self.transfer,
            self.transfer_host,
            self.transfer_upload,
            self.transfer_assemble,
            self.reconstruct,
            self.attention,
            self.attention_issue,
            self.rest,
            100.0 * self.reused
        )
    }

    fn params(&self) -> std::collections::BTreeMap<String, serde_json::Value> {
        params([
            ("profile_step_ms", json!(self.step)),
            ("profile_scoring_ms", json!(self.scoring)),
            ("profile_scoring_issue_ms", json!(self.scoring_issue)),
            ("profile_transfer_ms", json!(self.transfer)),
            ("profile_transfer_host_ms", json!(self.transfer_host)),
            ("profile_transfer_upload_ms", json!(self.transfer_upload)),
            (
                "profile_transfer_assemble_ms",
                json!(self.transfer_assemble),
            ),
            ("profile_reconstruct_ms", json!(self.reconstruct)),
            ("profile_attention_ms", json!(self.attention)),
            ("profile_attention_issue_ms", json!(self.attention_issue)),
            ("profile_rest_ms", json!(self.rest)),
        ])
    }
}

/// Rank-[`KEY_RANK`] pre-RoPE keys `z · mix`, `[ctx, width]` row-major, `z` ~ N(0, 1) and `mix`
/// ~ N(0, 1/KEY_RANK), computed on the host and shared by every layer (each adds its own noise).
/// On the device this is a `[ctx, 64] · [64, width]` f16 matmul, which Burn 0.23.0-pre.1's
/// autotuned matmul fails at 128K on Hopper (a TMA launch error that spreads to the work after
/// it; `gemm` suite, H200, 2026-11-27).
fn low_rank_keys(ctx: usize, width: usize) -> Vec<f32> {
    use burn_kernels_testing::{Dist, random_values};
    let z = random_values(ctx * KEY_RANK, Dist::STANDARD, 11);
    let scale = (KEY_RANK as f32).sqrt().recip();
    let mix: Vec<f32> = random_values(KEY_RANK * width, Dist::STANDARD, 12)
        .into_iter()
        .map(|x| x * scale)
        .collect();
    let mut keys = vec![0f32; ctx * width];
    for (row, zr) in keys.chunks_exact_mut(width).zip(z.chunks_exact(KEY_RANK)) {
        for (&zi, mr) in zr.iter().zip(mix.chunks_exact(width)) {
            for (k, &m) in row.iter_mut().zip(mr) {
                *k += zi * m;
            }
        }
    }
    keys
}
