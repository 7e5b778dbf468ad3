//! Decoding through ShadowKV against the full cache: budget ≥ context, batches, retrieval of a
//! planted chunk, short prompts, a given key basis.

use burn::tensor::{DType, Device, Tensor};
use burn_kernels_core::{AttnOptions, FullKvCache, KvCache, ReferenceAttention};
use burn_kernels_testing::{
    Dist, Tolerance, assert_close, assert_matmul_close, compare::to_f32, random_tensor,
    random_values,
};
use burn_kvcache::shadowkv::{low_rank, rope_tables, unrope};
use burn_kvcache::{ChunkScoring, KvCacheError, RopeParams, ShadowKvCache, ShadowKvConfig};

use crate::on_kernels;

use super::common::*;

/// Budget ≥ context at full rank: every chunk is selected and rebuilt exactly (up to
/// rounding), so decoding equals the full cache; GQA, two head dims, a prime prompt length,
/// batch 2 with different lengths (left padding), and truncation back into the prompt.
pub(super) fn budget_covers_context_matches_full(device: &Device) {
    let steps = [1, 1, 3, 1, 2];
    for (b, hq, h, d, pads) in [
        (1, 4, 2, 32, vec![0]),
        (2, 6, 3, 34, vec![0, 9]),
        (2, 2, 2, 16, vec![5, 0]),
    ] {
        let prompt = 61;
        let dims = (b, hq, h, d);
        let mut sk =
            ShadowKvCache::new(LAYERS, h, d, cfg(h * d, 64), RopeParams::default()).unwrap();
        let mut full = FullKvCache::new(LAYERS);
        let (y, e) = drive_both(device, &mut sk, &mut full, |c| {
            drive(c, dims, prompt, &pads, &steps, None, 70, device)
        });
        assert!((0..LAYERS).all(|l| sk.is_sparse(l)));
        let name = format!("budget ≥ context b={b} hq={hq} h={h} d={d}");
        assert_eq!(y.prefill, e.prefill, "{name}: the prefill is exact");
        // The rebuilt keys pass through two f32 products over h·d terms (K·W, A·Wᵀ), in TF32
        // on CUDA.
        assert_matmul_close(&name, &y.decode, &e.decode, 2 * h * d, device);
        let t = sk.timings();
        assert_eq!(t.layer_steps, LAYERS * steps.len());
        assert!(t.chunks_reused > 0, "{t:?}");
        // The transfer's parts are timed inside it, as the scoring's and attention's issue.
        assert!(
            t.transfer_host + t.transfer_upload + t.transfer_assemble <= t.transfer,
            "{t:?}"
        );
        assert!(t.scoring_issue <= t.scoring && t.attention_issue <= t.attention);
        // The closing report counts what the timings count.
        let stats = sk.stats().expect("decoded");
        let counts = format!(
            "{} of {} selected chunks",
            t.chunks_reused,
            t.chunks_reused + t.chunks_fetched
        );
        assert!(stats.contains(&counts), "{stats} ({counts})");
        // With reuse off every step fetches every chunk, and decodes the same values bit for
        // bit: only where the rows come from differs.
        let never = ShadowKvConfig {
            reuse_min_percent: 101,
            ..cfg(h * d, 64)
        };
        let mut off = ShadowKvCache::new(LAYERS, h, d, never, RopeParams::default()).unwrap();
        let z = on_kernels(device, || {
            drive(&mut off, dims, prompt, &pads, &steps, None, 70, device)
        });
        assert_eq!(z.decode, y.decode, "{name}: reuse off");
        let u = off.timings();
        assert!(
            u.chunks_fetched > t.chunks_fetched,
            "{name}: {u:?} against {t:?}"
        );
        // The overlap of adjacent steps' selections is counted whether or not it is reused:
        // the same selections, so the same counts; no more than the reused slots (which also
        // count padding), and some. With reuse off every selected slot is fetched.
        assert_eq!(
            (u.chunks_selected, u.chunks_overlapping),
            (t.chunks_selected, t.chunks_overlapping),
            "{name}"
        );
        assert!(
            0 < t.chunks_overlapping
                && t.chunks_overlapping <= t.chunks_reused
                && t.chunks_overlapping <= t.chunks_selected,
            "{name}: {t:?}"
        );
        assert_eq!(u.chunks_fetched, u.chunks_selected, "{name}: {u:?}");

        // Truncating into the prompt rebuilds it (full rank: exactly) as a full cache.
        let mut sk =
            ShadowKvCache::new(LAYERS, h, d, cfg(h * d, 64), RopeParams::default()).unwrap();
        let mut full = FullKvCache::new(LAYERS);
        let (y, e) = drive_both(device, &mut sk, &mut full, |c| {
            drive(c, dims, prompt, &pads, &steps, Some((3, 50)), 90, device)
        });
        assert!(!sk.is_sparse(0));
        assert_matmul_close(
            &format!("{name} truncated"),
            &y.decode,
            &e.decode,
            2 * h * d,
            device,
        );
    }
}

/// Each sequence of a batch selects on its own: batch 2 of different lengths (left padded)
/// gives each sequence what it gets alone, at a small budget and low rank; with chunk
/// selection and with two-stage selection (the shorter sequence has fewer candidates than the
/// batch's slots: padded and masked).
pub(super) fn batch_matches_single(device: &Device) {
    for candidates in [1, 3] {
        batch_matches_single_with(
            device,
            ShadowKvConfig {
                candidates,
                ..cfg(24, 16)
            },
        );
    }
}

fn batch_matches_single_with(device: &Device, c: ShadowKvConfig) {
    let (hq, h, d) = (4, 2, 32);
    let steps = [1, 2, 1];
    let lens = [67, 53];
    let prompt = 67;
    let mut batch = ShadowKvCache::new(LAYERS, h, d, c, RopeParams::default()).unwrap();
    let pads: Vec<usize> = lens.iter().map(|l| prompt - l).collect();
    // Each sequence's inputs are the batch's rows: drive the batch with per-row seeds by
    // running both sequences alone with the batch's data taken apart.
    let both = on_kernels(device, || {
        drive_rows(&mut batch, (hq, h, d), &lens, prompt, &steps, device)
    });
    for (r, &len) in lens.iter().enumerate() {
        let mut one = ShadowKvCache::new(LAYERS, h, d, c, RopeParams::default()).unwrap();
        let alone = on_kernels(device, || {
            drive_rows(&mut one, (hq, h, d), &[len], len, &steps, device)
        });
        let got: Vec<f32> = both
            .iter()
            .flat_map(|call| call[r].iter().copied())
            .collect();
        let want: Vec<f32> = alone
            .iter()
            .flat_map(|call| call[0].iter().copied())
            .collect();
        assert_matmul_close(
            &format!(
                "batch row {r} (pad {}, {} candidates)",
                pads[r], c.candidates
            ),
            &got,
            &want,
            2 * h * d,
            device,
        );
    }
}

/// Small normal values (std 0.1) of seed `seed`.
fn small(n: usize, seed: u64) -> Vec<f32> {
    random_values(
        n,
        Dist::Normal {
            mean: 0.0,
            std: 0.1,
        },
        seed,
    )
}

/// One layer of `c` prefilled with pre-RoPE keys `k` and values `v` (`[h, prompt, d]`), then one
/// decode step whose query (every query head) is the prompt's key at `at` as rotated: the
/// step's output `[1, 2h, 1, d]` (f32, flat).
fn decode_after_prompt(
    device: &Device,
    c: ShadowKvConfig,
    (h, d, prompt): (usize, usize, usize),
    k: Vec<f32>,
    v: Vec<f32>,
    at: usize,
) -> Vec<f32> {
    let mut sk = ShadowKvCache::new(1, h, d, c, RopeParams::default()).unwrap();
    // The model's keys arrive rotated.
    let (cos, sin) = rope_tables(d, prompt + 1, RopeParams::default(), device);
    let kt = tensor::<3>(k, [h, prompt, d], DType::F32, device);
    let kt = rotate(kt, &cos, &sin, prompt);
    let vt = tensor::<3>(v, [h, prompt, d], DType::F32, device);
    let opts = AttnOptions {
        causal: true,
        scale: (d as f32).sqrt().recip(),
        key_padding: None,
    };
    let q0 = tensor::<4>(
        small(2 * h * prompt * d, 4),
        [1, 2 * h, prompt, d],
        DType::F32,
        device,
    );
    let q = kt
        .clone()
        .slice([0..1, at..at + 1, 0..d])
        .reshape([1, 1, 1, d])
        .repeat_dim(1, 2 * h);
    on_kernels(device, || {
        sk.attend(
            0,
            q0,
            kt.unsqueeze_dim(0),
            vt.unsqueeze_dim(0),
            &ReferenceAttention,
            &opts,
        )
        .expect("the cache attends")
    });
    assert!(sk.is_sparse(0));
    let knew = tensor::<4>(small(h * d, 5), [1, h, 1, d], DType::F32, device);
    let vnew = tensor::<4>(small(h * d, 6), [1, h, 1, d], DType::F32, device);
    to_f32(
        on_kernels(device, || {
            sk.attend(0, q, knew, vnew, &ReferenceAttention, &opts)
                .expect("the cache attends")
        })
        .into_data(),
    )
}

fn mean_of(y: &[f32]) -> f32 {
    y.iter().sum::<f32>() / y.len() as f32
}

/// A chunk whose keys point along the query is found among many at a budget of a few
/// chunks, at a rank well below full: the output is its value.
pub(super) fn retrieves_planted_chunk(device: &Device) {
    let (h, d, prompt) = (2, 32, 401);
    let c = ShadowKvConfig {
        rank: 16,
        chunk: 8,
        budget: 32,
        local_chunks: 2,
        outlier_chunks: 2,
        min_prompt: 0,
        scoring: Default::default(),
        candidates: 1,
        pinned_uploads: true,
        reuse_min_percent: ShadowKvConfig::default().reuse_min_percent,
    };
    let dir = random_values(d, Dist::STANDARD, 3);
    let planted = 17; // chunk id: positions 136..144
    let mut k = small(h * prompt * d, 1);
    let mut v = small(h * prompt * d, 2);
    for hh in 0..h {
        for p in planted * 8..planted * 8 + 8 {
            for j in 0..d {
                k[(hh * prompt + p) * d + j] = 4.0 * dir[j];
                v[(hh * prompt + p) * d + j] = 1.0;
            }
        }
    }
    for scoring in [ChunkScoring::Mean, ChunkScoring::Bounds] {
        let c = ShadowKvConfig { scoring, ..c };
        let y = decode_after_prompt(device, c, (h, d, prompt), k.clone(), v.clone(), planted * 8);
        let mean = mean_of(&y);
        assert!(
            mean > 0.9,
            "{scoring:?}: planted chunk retrieved: mean output {mean}"
        );
    }
}

/// Full rank (two KV heads of `d`), chunks of 8, a budget of 4 chunks (2 of them the local
/// window), no outliers, mean landmarks, `candidates` as given.
fn lone_key_config(d: usize, candidates: usize) -> ShadowKvConfig {
    ShadowKvConfig {
        rank: 2 * d,
        chunk: 8,
        budget: 32,
        local_chunks: 2,
        outlier_chunks: 0,
        min_prompt: 0,
        scoring: ChunkScoring::Mean,
        candidates,
        pinned_uploads: true,
        reuse_min_percent: ShadowKvConfig::default().reuse_min_percent,
    }
}

/// Keys and values `[h, prompt, d]` (small noise) where chunk `chunk` (of 8) holds one key
/// (`lone`) along a random direction with value 1, and seven keys pointing away from it with
/// value 0.
fn lone_key_prompt(
    (h, d, prompt): (usize, usize, usize),
    chunk: usize,
    lone: usize,
) -> (Vec<f32>, Vec<f32>) {
    let dir = random_values(d, Dist::STANDARD, 3);
    let mut k = small(h * prompt * d, 1);
    let mut v = small(h * prompt * d, 2);
    for hh in 0..h {
        for p in chunk * 8..chunk * 8 + 8 {
            let (kw, vw) = if p == lone { (4.0, 1.0) } else { (-1.0, 0.0) };
            for j in 0..d {
                k[(hh * prompt + p) * d + j] = kw * dir[j];
                v[(hh * prompt + p) * d + j] = vw;
            }
        }
    }
    (k, v)
}

/// One key along the query in a chunk whose other keys point away from it: the chunk's mean
/// scores low, so [`ChunkScoring::Mean`] misses it at a budget of a few chunks, while the
/// bounds ([`ChunkScoring::Bounds`]) find it and the output is that key's value. No outliers,
/// which would keep such a chunk exact.
pub(super) fn bounds_find_a_lone_key(device: &Device) {
    let (h, d, prompt) = (2, 32, 401);
    let c = lone_key_config(d, 1);
    let (chunk, lone) = (23, 23 * 8 + 5);
    let (k, v) = lone_key_prompt((h, d, prompt), chunk, lone);
    let run = |scoring| {
        let c = ShadowKvConfig { scoring, ..c };
        mean_of(&decode_after_prompt(
            device,
            c,
            (h, d, prompt),
            k.clone(),
            v.clone(),
            lone,
        ))
    };
    let (mean, bounds) = (run(ChunkScoring::Mean), run(ChunkScoring::Bounds));
    assert!(
        bounds > 0.9,
        "bounds: the lone key's value, mean output {bounds}"
    );
    assert!(
        mean.abs() < 0.3,
        "mean landmarks: the chunk is not selected, mean output {mean}"
    );
}

/// Two-stage selection with a budget that covers the context keeps every token: decoding
/// equals the full cache (GQA, a prime prompt length, batch 2 of different lengths).
pub(super) fn two_stage_covering_budget_matches_full(device: &Device) {
    let steps = [1, 2, 1];
    let (b, hq, h, d, pads) = (2, 6, 3, 34, vec![0, 9]);
    let c = ShadowKvConfig {
        candidates: 3,
        ..cfg(h * d, 64)
    };
    let mut sk = ShadowKvCache::new(LAYERS, h, d, c, RopeParams::default()).unwrap();
    let mut full = FullKvCache::new(LAYERS);
    let (y, e) = drive_both(device, &mut sk, &mut full, |c| {
        drive(c, (b, hq, h, d), 61, &pads, &steps, None, 70, device)
    });
    assert!((0..LAYERS).all(|l| sk.is_sparse(l)));
    assert_matmul_close(
        "two-stage, budget ≥ context",
        &y.decode,
        &e.decode,
        2 * h * d,
        device,
    );
    assert!(sk.timings().chunks_fetched > 0);
}

/// Two-stage selection finds the lone key of [`bounds_find_a_lone_key`] with the mean
/// landmarks: its chunk is among the candidates, and the token's own rebuilt key wins.
pub(super) fn two_stage_finds_a_lone_key(device: &Device) {
    let (h, d, prompt) = (2, 32, 401);
    let (chunk, lone) = (23, 23 * 8 + 5);
    let (k, v) = lone_key_prompt((h, d, prompt), chunk, lone);
    let c = lone_key_config(d, 16);
    let y = mean_of(&decode_after_prompt(device, c, (h, d, prompt), k, v, lone));
    assert!(y > 0.9, "two-stage: the lone key's value, mean output {y}");
}

/// A prompt below the threshold keeps the full cache, exactly.
pub(super) fn short_prompt_is_full(device: &Device) {
    let (h, d) = (2, 16);
    let c = ShadowKvConfig {
        min_prompt: 100,
        ..cfg(8, 16)
    };
    let mut sk = ShadowKvCache::new(LAYERS, h, d, c, RopeParams::default()).unwrap();
    let mut full = FullKvCache::new(LAYERS);
    let (y, e) = drive_both(device, &mut sk, &mut full, |c| {
        drive(c, (1, 4, h, d), 99, &[0], &[1, 2], None, 5, device)
    });
    assert!(!sk.is_sparse(0));
    assert_eq!(y.decode, e.decode);
    assert_eq!(sk.bytes_held(), full.bytes_held());
}

/// A key basis given with `set_key_basis` replaces the per-sequence eigen-decomposition: the
/// basis a prompt's own `low_rank` finds gives the same decode as no basis (batch 2, both
/// sequences projected on the first one's basis; the second's own basis differs, so only the
/// first sequence is compared), and a basis of the wrong shape is refused.
pub(super) fn key_basis_replaces_own_basis(device: &Device) {
    let (b, hq, h, d, len, rank) = (2, 4, 2, 16, 61, 12);
    let k = random_tensor::<4>([b, h, len, d], Dist::STANDARD, 31, DType::F32, device);
    let v = random_tensor::<4>([b, h, len, d], Dist::STANDARD, 32, DType::F32, device);
    let (cos, sin) = rope_tables(d, len, RopeParams::default(), device);
    let first = k
        .clone()
        .slice([0..1, 0..h, 0..len, 0..d])
        .reshape([h, len, d]);
    let pre = unrope(first, &cos, &sin)
        .swap_dims(0, 1)
        .reshape([len, h * d]);
    let basis = low_rank(pre, rank).unwrap().wt;
    let c = cfg(rank, 16);
    let step = |sk: &mut ShadowKvCache| {
        assert!(sk.compress_prompt(0, k.clone(), v.clone(), None).unwrap());
        let opts = AttnOptions {
            causal: true,
            scale: (d as f32).sqrt().recip(),
            key_padding: None,
        };
        let q = random_tensor::<4>([b, hq, 1, d], Dist::STANDARD, 33, DType::F32, device);
        let kn = random_tensor::<4>([b, h, 1, d], Dist::STANDARD, 34, DType::F32, device);
        let vn = random_tensor::<4>([b, h, 1, d], Dist::STANDARD, 35, DType::F32, device);
        let y = sk
            .attend(0, q, kn, vn, &ReferenceAttention, &opts)
            .expect("the cache attends");
        to_f32(y.slice([0..1, 0..hq, 0..1, 0..d]).into_data())
    };
    let mut own = ShadowKvCache::new(1, h, d, c, RopeParams::default()).unwrap();
    let mut given = ShadowKvCache::new(1, h, d, c, RopeParams::default()).unwrap();
    given.set_key_basis(Some(basis)).unwrap();
    let (y, e) = on_kernels(device, || (step(&mut given), step(&mut own)));
    assert_close(
        "given basis",
        &y,
        &e,
        Tolerance::for_reduction(DType::F32, h * d),
    );
    assert_eq!(given.bytes_split(), own.bytes_split());

    let wrong = Tensor::<2>::zeros([rank + 1, h * d], device);
    assert_eq!(
        given.set_key_basis(Some(wrong)).unwrap_err(),
        KvCacheError::ShapeMismatch {
            left: vec![rank, h * d],
            right: vec![rank + 1, h * d],
        }
    );
}
