//! The KV caches (full and static) against one-shot attention over the same keys and values.

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use burn_kernels_core::route::launches;
use burn_kernels_core::{
    AttentionImpl, AttnOptions, FullKvCache, KvCache, ReferenceAttention, StaticKvCache,
};
use burn_kernels_testing::{Dist, assert_matmul_close, compare::to_f32, random_values};

use crate::host;

pub fn full_cache_decode_equals_one_shot(device: &Device) {
    let (b, hq, hkv, d, s) = (1, 4, 2, 8, 10);
    let q = random_values(b * hq * s * d, Dist::STANDARD, 1);
    let k = random_values(b * hkv * s * d, Dist::STANDARD, 2);
    let v = random_values(b * hkv * s * d, Dist::STANDARD, 3);
    let opts = AttnOptions {
        causal: true,
        scale: 0.35,
        key_padding: None,
    };
    let qt = host::<4>(&q, [b, hq, s, d], device);
    let kt = host::<4>(&k, [b, hkv, s, d], device);
    let vt = host::<4>(&v, [b, hkv, s, d], device);
    let one_shot = ReferenceAttention.attend(0, qt.clone(), kt.clone(), vt.clone(), &opts);
    let mut cache = FullKvCache::new(2);
    let mut parts = Vec::new();
    // A prefill of 6, then single steps; layer 1 sees the same to check layers stay separate.
    for (lo, hi) in [(0, 6), (6, 7), (7, 8), (8, 9), (9, 10)] {
        let cut = |t: &Tensor<4>| t.clone().slice([0..b, 0..t.dims()[1], lo..hi, 0..d]);
        let o = cache
            .attend(0, cut(&qt), cut(&kt), cut(&vt), &ReferenceAttention, &opts)
            .expect("the cache attends");
        cache
            .attend(1, cut(&qt), cut(&kt), cut(&vt), &ReferenceAttention, &opts)
            .expect("the cache attends");
        parts.push(o);
    }
    assert_eq!(cache.seq_len(), s);
    assert_eq!(cache.bytes_held(), 2 * 2 * b * hkv * s * d * 4);
    let steps = Tensor::cat(parts, 2);
    assert_matmul_close(
        "cache decode",
        &to_f32(steps.into_data()),
        &to_f32(one_shot.into_data()),
        s * d,
        device,
    );
    cache.truncate(7);
    assert_eq!(cache.seq_len(), 7);
}

/// The static cache gives the one-shot attention too, two ways: appended at its length like the
/// full cache (prefill of 6, then steps of 1 and 3) and written at device-held positions with
/// the whole capacity attended and the unwritten positions masked (the captured decode step),
/// here with two rows, the second left-padded by 2. Capacity 11 of 10 used (a spare, masked
/// slot), 2 layers; a write past the capacity is a typed error.
pub fn static_cache_equals_one_shot(device: &Device) {
    let (b, hq, hkv, d, s, cap) = (2, 4, 2, 8, 10, 11);
    let q = host::<4>(
        &random_values(b * hq * s * d, Dist::STANDARD, 11),
        [b, hq, s, d],
        device,
    );
    let k = host::<4>(
        &random_values(b * hkv * s * d, Dist::STANDARD, 12),
        [b, hkv, s, d],
        device,
    );
    let v = host::<4>(
        &random_values(b * hkv * s * d, Dist::STANDARD, 13),
        [b, hkv, s, d],
        device,
    );
    let pad = [0usize, 2];
    let pad_mask = |len: usize| -> Tensor<2, Bool> {
        let m: Vec<bool> = pad
            .iter()
            .flat_map(|&p| (0..len).map(move |j| j < p))
            .collect();
        Tensor::from_data(TensorData::new(m, [b, len]), device)
    };
    let opts = |len: usize| AttnOptions {
        causal: true,
        scale: 0.35,
        key_padding: Some(pad_mask(len)),
    };
    let one_shot = ReferenceAttention.attend(0, q.clone(), k.clone(), v.clone(), &opts(s));
    let cut =
        |t: &Tensor<4>, lo: usize, hi: usize| t.clone().slice([0..b, 0..t.dims()[1], lo..hi, 0..d]);
    // Row by row, from the first position that sees a key (a padded query's output is
    // unspecified).
    let expect = |lo: usize, hi: usize, got: Tensor<4>, what: &str| {
        for (r, &p) in pad.iter().enumerate() {
            let from = lo.max(p);
            if from >= hi {
                continue;
            }
            let row = |t: Tensor<4>, a: usize, z: usize| t.slice([r..r + 1, 0..hq, a..z, 0..d]);
            assert_matmul_close(
                &format!("{what}, row {r}"),
                &to_f32(row(got.clone(), from - lo, hi - lo).into_data()),
                &to_f32(row(one_shot.clone(), from, hi).into_data()),
                s * d,
                device,
            );
        }
    };

    let mut cache = StaticKvCache::new(2, cap);
    for (lo, hi) in [(0, 6), (6, 7), (7, 10)] {
        for layer in [1, 0] {
            let o = cache
                .attend(
                    layer,
                    cut(&q, lo, hi),
                    cut(&k, lo, hi),
                    cut(&v, lo, hi),
                    &ReferenceAttention,
                    &opts(hi),
                )
                .expect("the cache attends");
            expect(
                lo,
                hi,
                o,
                &format!("static cache append {lo}..{hi}, layer {layer}"),
            );
        }
    }
    assert_eq!(cache.seq_len(), s);
    assert_eq!(cache.bytes_held(), 2 * 2 * b * hkv * cap * d * 4);
    let err = cache
        .attend(
            0,
            cut(&q, 0, 2),
            cut(&k, 0, 2),
            cut(&v, 0, 2),
            &ReferenceAttention,
            &opts(s + 2),
        )
        .expect_err("11 slots cannot take 12 positions");
    assert!(err.to_string().contains("capacity 11"), "{err}");

    // Indexed writes: a prefill of 6 through the append path, then one position per step.
    let mut cache = StaticKvCache::new(1, cap);
    cache
        .attend(
            0,
            cut(&q, 0, 6),
            cut(&k, 0, 6),
            cut(&v, 0, 6),
            &ReferenceAttention,
            &opts(6),
        )
        .expect("prefill");
    let positions = Tensor::<1, Int>::arange(0..cap as i64, device).reshape([1, cap]);
    let stores = launches("store_kv");
    for t in 6..s {
        let len = Tensor::<1, Int>::from_data(TensorData::new(vec![t as i64], [1]), device);
        let mask = StaticKvCache::unwritten_mask(positions.clone(), len.clone(), pad_mask(cap));
        let step_opts = AttnOptions {
            key_padding: Some(mask),
            ..opts(cap)
        };
        let o = cache
            .at(len)
            .attend(
                0,
                cut(&q, t, t + 1),
                cut(&k, t, t + 1),
                cut(&v, t, t + 1),
                &ReferenceAttention,
                &step_opts,
            )
            .expect("the indexed step attends");
        expect(t, t + 1, o, &format!("static cache indexed step {t}"));
    }
    // On a CubeCL device each step's keys and values went in with one kernel.
    if *device != Device::flex() {
        assert_eq!(
            launches("store_kv") - stores,
            (s - 6) as u64,
            "store_kv launches"
        );
    }
}
