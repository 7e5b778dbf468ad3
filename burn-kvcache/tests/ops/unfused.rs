//! The extension ops called on the unfused `CubeBackend` directly against the public ops
//! through Burn's `Dispatch`, one helper per op.

use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorCreationOptions, TensorData};
use burn_cubecl::CubeBackend;
use burn_kernels_core::AttnOptions;
use burn_kernels_core::route::require_kernels;
use burn_kernels_testing::unfused::{boolean, float, int, read_float, read_int};
use burn_kernels_testing::{Dist, compare::to_f32, random_values};
use burn_kvcache::{
    KeyMask, KvKernels, KvTail, Packed, PackedPrimitive, QuantAttnPlan, QuantAttnView, QuantLayout,
    dequantize, merge, quant_attention, quantize, restore,
};

use super::common::*;
use crate::{assert_launched, launch_counts};

/// The extension ops called on the unfused `CubeBackend` directly give what the public ops
/// give through Burn's `Dispatch` (on `Fusion<CubeBackend>`, where Burn fuses): the same kernels
/// on the same values, bit for bit. Covers a tuple output (merge), the retained restore (an int
/// input), a struct output and input (quantize, dequantize) and the quantized read with its
/// enum inputs (a tail and a key padding mask).
pub(super) fn unfused_matches_dispatch(device: &Device) {
    let ops = [
        "minicache_merge",
        "minicache_restore",
        "kv_quantize",
        "kv_dequantize",
        "kv_quant_attention",
    ];
    let before = launch_counts(ops);

    merge_and_restore_match(device);
    quantize_and_dequantize_match(device);
    quant_attention_matches(device);
    assert_launched(device, ops, before);
}

fn f32s(data: TensorData) -> Vec<f32> {
    to_f32(data)
}

fn u32s(data: TensorData) -> Vec<u32> {
    data.convert::<u32>().try_to_vec::<u32>().expect("u32")
}

/// `p` as the unfused backend's packed primitive.
fn prim(p: &Packed, device: &Device) -> PackedPrimitive<CubeBackend> {
    PackedPrimitive::<CubeBackend> {
        words: int(&p.words, device),
        scale: float(&p.scale, device),
        min: float(&p.min, device),
    }
}

/// Merge (four outputs) and the retained restore (an int input).
fn merge_and_restore_match(device: &Device) {
    let (n, d) = (34, 33);
    let (a, b) = pair_values(n, d, 600);
    let at = tensor::<2>(a, [n, d], DType::F32, device);
    let bt = tensor::<2>(b, [n, d], DType::F32, device);
    let (dir, mag_a, mag_b, dist) =
        CubeBackend::minicache_merge(float(&at, device), float(&bt, device), 0.6, 0.05);
    let fused = require_kernels(|| merge(at, bt.clone(), 0.6, 0.05)).expect("valid");
    assert_eq!(
        f32s(read_float(dir)),
        f32s(fused.dir.to_data()),
        "merge dir"
    );
    assert_eq!(
        f32s(read_float(mag_a)),
        f32s(fused.mag_a.to_data()),
        "merge mag_a"
    );
    assert_eq!(
        f32s(read_float(mag_b)),
        f32s(fused.mag_b.to_data()),
        "merge mag_b"
    );
    assert_eq!(
        f32s(read_float(dist)),
        f32s(fused.dist.to_data()),
        "merge dist"
    );
    let slots: Vec<i32> = (0..n as i32)
        .map(|i| if i % 3 == 0 { i / 3 + 1 } else { 0 })
        .collect();
    let slot = Tensor::<1, Int>::from_data(
        TensorData::new(slots, [n]),
        TensorCreationOptions::new(device.clone()).with_dtype(DType::I32),
    );
    let direct = CubeBackend::minicache_restore_retained(
        float(&fused.dir, device),
        float(&fused.mag_b, device),
        int(&slot, device),
        float(&bt, device),
    );
    let via = require_kernels(|| restore(fused.dir, fused.mag_b, Some((slot, bt)))).expect("valid");
    assert_eq!(f32s(read_float(direct)), f32s(via.into_data()), "restore");
}

/// Quantize (a struct output) and dequantize (a struct input).
fn quantize_and_dequantize_match(device: &Device) {
    let (rows, cols, group) = (17, 33, 7);
    let x = tensor::<2>(
        random_values(rows * cols, Dist::PEAKY, 601),
        [rows, cols],
        DType::F32,
        device,
    );
    let layout = QuantLayout::new(4, group, cols).unwrap();
    let direct = CubeBackend::kv_quantize(float(&x, device), layout);
    let (via, _) = require_kernels(|| quantize(x, 4, group)).expect("valid");
    let words = read_int(direct.words);
    assert_eq!(words.dtype(), DType::U32);
    assert_eq!(u32s(words), u32s(via.words.to_data()), "quantize words");
    let (scale, min) = (read_float(direct.scale), read_float(direct.min));
    assert_eq!(
        f32s(scale.clone()),
        f32s(via.scale.to_data()),
        "quantize scale"
    );
    assert_eq!(f32s(min.clone()), f32s(via.min.to_data()), "quantize min");
    let direct = CubeBackend::kv_dequantize(prim(&via, device), layout);
    let fused = require_kernels(|| dequantize(&via, layout));
    assert_eq!(
        f32s(read_float(direct)),
        f32s(fused.into_data()),
        "dequantize"
    );
}

/// The quantized read with its enum inputs (a tail and a key padding mask).
fn quant_attention_matches(device: &Device) {
    // The quantized read: 32 quantized positions (keys per channel, values per token), a tail
    // of 5, the first two keys of the sequence hidden.
    let (hq, hkv, sq, qlen, t, d) = (4, 2, 2, 32, 5, 16);
    let rnd = |shape: [usize; 4], seed| {
        tensor::<4>(
            random_values(shape.iter().product(), Dist::STANDARD, seed),
            shape,
            DType::F32,
            device,
        )
    };
    let (q, k, v) = (
        rnd([1, hq, sq, d], 602),
        rnd([1, hkv, qlen, d], 603),
        rnd([1, hkv, qlen, d], 604),
    );
    let (tk, tv) = (rnd([1, hkv, t, d], 605), rnd([1, hkv, t, d], 606));
    let krows = k
        .reshape([1, hkv, 1, qlen, d])
        .swap_dims(3, 4)
        .reshape([hkv * d, qlen]);
    let (kp, kl) = quantize(krows, 4, qlen).expect("valid");
    let (vp, vl) = quantize(v.reshape([hkv * qlen, d]), 4, qlen).expect("valid");
    let hidden: Vec<bool> = (0..qlen + t).map(|j| j < 2).collect();
    let padding = Tensor::<2, Bool>::from_data(TensorData::new(hidden, [1, qlen + t]), device);
    let opts = AttnOptions {
        causal: true,
        scale: 0.25,
        key_padding: Some(padding.clone()),
    };
    let plan = QuantAttnPlan {
        keys: kl,
        values: vl,
        qlen,
        kv_heads: hkv,
        scale: opts.scale,
        causal: true,
    };
    let direct = CubeBackend::kv_quant_attention(
        float(&q, device),
        prim(&kp, device),
        prim(&vp, device),
        KvTail::Present {
            k: float(&tk, device),
            v: float(&tv, device),
        },
        KeyMask::Present {
            mask: boolean(&padding, device),
        },
        plan,
    );
    let view = QuantAttnView {
        keys: Some((kp, kl)),
        values: Some((vp, vl)),
        qlen,
        tail: Some((tk, tv)),
    };
    let fused = require_kernels(|| quant_attention(q, &view, &opts)).expect("valid");
    assert_eq!(
        f32s(read_float(direct)),
        f32s(fused.into_data()),
        "quant_attention"
    );
}
