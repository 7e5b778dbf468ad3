//! The caches against the full cache through `KvCache::attend`: γ = 0 and identical adjacent
//! layers are lossless, quantized caches stay close, truncation, and exact byte accounting.

use burn::tensor::{DType, Device, Tensor};
use burn_kernels_core::{AttnOptions, FullKvCache, KvCache, ReferenceAttention};
use burn_kernels_testing::{
    Dist, Tolerance, assert_close_unless_tf32, compare::metrics, compare::to_f32, random_tensor,
};
use burn_kvcache::{KvCacheError, MiniCacheConfig, MiniCacheKv, QuantConfig, QuantKv};

use crate::{assert_launched, launch_counts, on_kernels};

const LAYERS: usize = 7;
const HEADS: usize = 2;
const Q_HEADS: usize = 4;

/// Feeds `a` and a new full cache the same per-layer Q/K/V for each chunk of `steps` (`dup`
/// makes layer `2i+1`'s K/V a copy of layer `2i`'s) and truncates to `cut` before the chunk at
/// index `cut_at`; returns every attention output of both, flattened, and the full cache.
fn drive(
    a: &mut dyn KvCache,
    steps: &[usize],
    d: usize,
    dup: bool,
    cut: Option<(usize, usize)>,
    seed: u64,
    device: &Device,
) -> (Vec<f32>, Vec<f32>, FullKvCache) {
    let mut full = FullKvCache::new(LAYERS);
    let b = &mut full;
    let opts = AttnOptions {
        causal: true,
        scale: (d as f32).sqrt().recip(),
        key_padding: None,
    };
    let (mut oa, mut ob) = (Vec::new(), Vec::new());
    for (i, &s) in steps.iter().enumerate() {
        if let Some((at, len)) = cut
            && at == i
        {
            on_kernels(device, || a.truncate(len));
            b.truncate(len);
            assert_eq!(a.seq_len(), len);
            assert_eq!(b.seq_len(), len);
        }
        let mut prev: Option<(Tensor<4>, Tensor<4>)> = None;
        for layer in 0..LAYERS {
            let sd = seed + (i * LAYERS + layer) as u64 * 3;
            let q = random_tensor::<4>([1, Q_HEADS, s, d], Dist::STANDARD, sd, DType::F32, device);
            let (k, v) = match (&prev, dup && layer % 2 == 1) {
                (Some(kv), true) => kv.clone(),
                _ => (
                    random_tensor::<4>([1, HEADS, s, d], Dist::PEAKY, sd + 1, DType::F32, device),
                    random_tensor::<4>(
                        [1, HEADS, s, d],
                        Dist::STANDARD,
                        sd + 2,
                        DType::F32,
                        device,
                    ),
                ),
            };
            prev = Some((k.clone(), v.clone()));
            let att = ReferenceAttention;
            // The compressed cache `a` runs its kernels on a CubeCL device.
            let ya = on_kernels(device, || {
                a.attend(layer, q.clone(), k.clone(), v.clone(), &att, &opts)
                    .expect("the cache attends")
            });
            let yb = b
                .attend(layer, q, k, v, &att, &opts)
                .expect("the cache attends");
            oa.extend(to_f32(ya.into_data()));
            ob.extend(to_f32(yb.into_data()));
        }
        assert_eq!(a.seq_len(), b.seq_len());
    }
    (oa, ob, full)
}

const STEPS: &[usize] = &[19, 1, 1, 1, 1, 5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3];
const TIGHT: Tolerance = Tolerance {
    atol: 1e-4,
    rtol: 1e-4,
};

fn full_bytes(layers: usize, seq: usize, d: usize) -> usize {
    layers * 2 * HEADS * seq * d * 4
}

/// γ = 0 retains every token whose layers differ, so attention equals the full cache's, from
/// the start layer 0 or the middle, before and after truncation into merged positions.
fn gamma_zero_matches_full(device: &Device) {
    let ops = ["minicache_merge", "minicache_restore"];
    let before = launch_counts(ops);
    for d in [64, 33] {
        for start in [Some(0), None] {
            let cfg = MiniCacheConfig {
                start_layer: start,
                gamma: 0.0,
                window: 4,
                ..Default::default()
            };
            let mut mc = MiniCacheKv::new(LAYERS, cfg).unwrap();
            let (y, e, _) = drive(&mut mc, STEPS, d, false, Some((10, 17)), 10, device);
            // Where products run in TF32 (CUDA), the restored keys' last-bit differences are
            // amplified by its 10-bit mantissa.
            assert_close_unless_tf32(&format!("γ=0 d={d} start={start:?}"), &y, &e, TIGHT, device);
            let s = mc.stats();
            assert!(s.merged > 0 && s.retained == s.merged, "{s:?}");
        }
    }
    assert_launched(device, ops, before);
}

/// Identical adjacent layers merge with nothing retained and restore exactly, at a fraction
/// of the bytes.
fn identical_layers_lossless(device: &Device) {
    let d = 64;
    let cfg = MiniCacheConfig {
        start_layer: Some(0),
        window: 4,
        ..Default::default()
    };
    let mut mc = MiniCacheKv::new(LAYERS, cfg).unwrap();
    let (y, e, full) = drive(&mut mc, STEPS, d, true, Some((7, 21)), 20, device);
    assert_close_unless_tf32("identical layers", &y, &e, TIGHT, device);
    let s = mc.stats();
    assert!(s.merged > 0 && s.retained == 0, "{s:?}");
    let seq = mc.seq_len();
    assert!(mc.bytes_held() < full.bytes_held());
    assert_eq!(full.bytes_held(), full_bytes(LAYERS, seq, d));
}

/// Quantized caches stay close to the full cache (4 bits closer than 2), through truncation.
fn quantized_close_to_full(device: &Device) {
    // The quantized read (QuantKv), and the dequantization the merged pairs' restore needs.
    let ops = [
        "kv_quantize",
        "kv_quant_attention",
        "kv_dequantize",
        "minicache_merge",
    ];
    let before = launch_counts(ops);
    let d = 64;
    let steps: Vec<usize> = [70].into_iter().chain([1; 24]).collect();
    let mut prev_err = 0.0;
    for bits in [4, 2] {
        let q = QuantConfig {
            bits,
            group_size: 32,
            residual: 16,
            ..QuantConfig::default()
        };
        let mut qkv = QuantKv::new(LAYERS, q).unwrap();
        let (y, e, full) = drive(&mut qkv, &steps, d, false, Some((25, 60)), 30, device);
        let m = metrics(&y, &e);
        let min_cos = if bits == 4 { 0.99 } else { 0.95 };
        assert!(m.cos_sim > min_cos, "quant{bits}: {m:?}");
        assert!(m.rel_l1 > prev_err, "2 bits are worse than 4: {m:?}");
        prev_err = m.rel_l1;
        assert!(qkv.bytes_held() < full.bytes_held());

        let mut mcq = MiniCacheKv::with_quant(LAYERS, MiniCacheConfig::default(), q).unwrap();
        let (y, e, _) = drive(&mut mcq, &steps, d, true, Some((25, 60)), 40, device);
        let m = metrics(&y, &e);
        assert!(m.cos_sim > min_cos, "minicache+quant{bits}: {m:?}");
        assert!(mcq.bytes_held() < qkv.bytes_held());
    }
    assert_launched(device, ops, before);
}

on_all!(
    gamma_zero_matches_full,
    identical_layers_lossless,
    quantized_close_to_full,
);

/// Every tensor counted at its size: for one layer, 100 tokens, 4 bits, group 32, residual 32,
/// 64 tokens are quantized and 36 stay in f32.
#[test]
fn quant_bytes_are_exact() {
    let device = Device::flex();
    let (h, d, s) = (HEADS, 64, 100);
    let mut c = QuantKv::new(1, QuantConfig::default()).unwrap();
    let mut full = FullKvCache::new(1);
    drive_one(&mut c, &mut full, s, d, &device);
    let words_k = h * 2 * d * 4; // blocks × channels × 4 words (32 codes / 8 per word)
    let stats_k = h * 2 * d * 2; // scale + min per block and channel
    let words_v = h * 64 * 2 * 4; // tokens × groups × 4 words
    let stats_v = h * 64 * 2 * 2;
    let residual = 2 * h * 36 * d;
    assert_eq!(
        c.bytes_held(),
        4 * (words_k + stats_k + words_v + stats_v + residual)
    );
}

/// MiniCache bytes with identical layers (nothing retained): one pair, window 16, chunks of
/// 20 (merged), 12 (pending) and 8 (pending reaches 20: merged), next to one unmerged layer.
#[test]
fn minicache_bytes_are_exact() {
    let device = Device::flex();
    let (h, d) = (HEADS, 64);
    let cfg = MiniCacheConfig {
        start_layer: Some(0),
        ..Default::default()
    };
    let mut c = MiniCacheKv::new(3, cfg).unwrap();
    assert_eq!(c.num_pairs(), 1);
    let opts = AttnOptions {
        causal: true,
        scale: 0.125,
        key_padding: None,
    };
    for s in [20, 12, 8] {
        let k = random_tensor::<4>([1, h, s, d], Dist::STANDARD, s as u64, DType::F32, &device);
        let v = random_tensor::<4>(
            [1, h, s, d],
            Dist::STANDARD,
            7 + s as u64,
            DType::F32,
            &device,
        );
        let q = random_tensor::<4>([1, h, s, d], Dist::STANDARD, 9, DType::F32, &device);
        for layer in 0..3 {
            c.attend(
                layer,
                q.clone(),
                k.clone(),
                v.clone(),
                &ReferenceAttention,
                &opts,
            )
            .expect("the cache attends");
        }
    }
    assert_eq!(c.seq_len(), 40);
    assert_eq!(c.stats().retained, 0);
    assert_eq!(c.stats().merged, 2 * h * 40);
    let per_seq = h * 40 * d + 2 * h * 40 + h * 40; // dir, mags, slots
    let unmerged = 2 * h * 40 * d;
    assert_eq!(c.bytes_held(), 4 * (2 * per_seq + unmerged));
}

fn drive_one(a: &mut dyn KvCache, b: &mut dyn KvCache, s: usize, d: usize, device: &Device) {
    let opts = AttnOptions {
        causal: true,
        scale: 0.125,
        key_padding: None,
    };
    let k = random_tensor::<4>([1, HEADS, s, d], Dist::STANDARD, 1, DType::F32, device);
    let v = random_tensor::<4>([1, HEADS, s, d], Dist::STANDARD, 2, DType::F32, device);
    let q = random_tensor::<4>([1, HEADS, s, d], Dist::STANDARD, 3, DType::F32, device);
    a.attend(
        0,
        q.clone(),
        k.clone(),
        v.clone(),
        &ReferenceAttention,
        &opts,
    )
    .expect("the cache attends");
    b.attend(0, q, k, v, &ReferenceAttention, &opts)
        .expect("the cache attends");
}

#[test]
fn cache_config_errors() {
    let mc = |cfg: MiniCacheConfig, layers: usize| MiniCacheKv::new(layers, cfg).unwrap_err();
    let base = MiniCacheConfig::default();
    assert_eq!(
        mc(
            MiniCacheConfig {
                start_layer: Some(30),
                ..base
            },
            30
        ),
        KvCacheError::StartLayerOutOfRange {
            start_layer: 30,
            num_layers: 30
        }
    );
    assert_eq!(
        mc(MiniCacheConfig { t: 1.01, ..base }, 30),
        KvCacheError::InvalidInterpolation(1.01)
    );
    assert_eq!(
        mc(
            MiniCacheConfig {
                gamma: -1.0,
                ..base
            },
            30
        ),
        KvCacheError::InvalidGamma(-1.0)
    );
    assert_eq!(
        mc(MiniCacheConfig { window: 0, ..base }, 30),
        KvCacheError::ZeroMergeWindow
    );
    assert_eq!(mc(base, 0), KvCacheError::NoLayers);
    let q = |bits: u32, group_size: usize| QuantConfig {
        bits,
        group_size,
        residual: 32,
        ..QuantConfig::default()
    };
    assert_eq!(
        QuantKv::new(4, q(3, 32)).unwrap_err(),
        KvCacheError::InvalidBits(3)
    );
    assert_eq!(
        QuantKv::new(4, q(4, 0)).unwrap_err(),
        KvCacheError::ZeroGroupSize
    );
    assert_eq!(
        QuantKv::new(0, q(4, 32)).unwrap_err(),
        KvCacheError::NoLayers
    );
    assert_eq!(
        MiniCacheKv::with_quant(30, base, q(8, 32)).unwrap_err(),
        KvCacheError::InvalidBits(8)
    );
}
