//! Dequantization of hand-built blocks.

use burn_llama::loader::LoadError;
use burn_llama::loader::gguf::{GGmlType, dequantize, unpermute_qk};
use half::{bf16, f16};

pub(super) fn h(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

pub(super) fn dequant_q8_0() {
    // d = 0.5, q = 8 i - 128 (covers -128 and 120), then a second block with d = -2.
    let mut raw = h(0.5).to_vec();
    raw.extend((0..32).map(|i| (8 * i - 128) as i8 as u8));
    raw.extend(h(-2.0));
    raw.extend((0..32).map(|i| (i as i8 - 16) as u8));
    let got = dequantize("t", GGmlType::Q8_0, &raw, 64).unwrap();
    let mut want: Vec<f32> = (0..32).map(|i| (8 * i - 128) as f32 * 0.5).collect();
    want.extend((0..32).map(|i| (i - 16) as f32 * -2.0));
    assert_eq!(got, want);
}

pub(super) fn dequant_q4_0() {
    // Byte j holds element j in its low nibble and element j + 16 in its high nibble.
    let mut raw = h(0.25).to_vec();
    raw.extend((0..16u8).map(|j| ((15 - j) << 4) | j));
    let got = dequantize("t", GGmlType::Q4_0, &raw, 32).unwrap();
    let mut want: Vec<f32> = (0..16).map(|j| (j - 8) as f32 * 0.25).collect();
    want.extend((0..16).map(|j| (15 - j - 8) as f32 * 0.25));
    assert_eq!(got, want);
}

pub(super) fn dequant_q4_1() {
    // x = q d + m with d = 0.5, m = -1.
    let mut raw = h(0.5).to_vec();
    raw.extend(h(-1.0));
    raw.extend((0..16u8).map(|j| (((j * 7) % 16) << 4) | j));
    let got = dequantize("t", GGmlType::Q4_1, &raw, 32).unwrap();
    let mut want: Vec<f32> = (0..16).map(|j| j as f32 * 0.5 - 1.0).collect();
    want.extend((0..16).map(|j| ((j * 7) % 16) as f32 * 0.5 - 1.0));
    assert_eq!(got, want);
}

pub(super) fn dequant_q5_0_and_q5_1() {
    // The fifth bit of element i is bit i of qh; qh = 0xAAAA5555 sets it for even i < 16 and
    // odd i >= 16. Low nibbles as in Q4_0.
    let qh = 0xAAAA_5555u32.to_le_bytes();
    let qs: Vec<u8> = (0..16u8).map(|j| ((15 - j) << 4) | j).collect();
    let q = |i: usize| -> i32 {
        let low = if i < 16 {
            i as i32
        } else {
            15 - (i as i32 - 16)
        };
        let high = (0xAAAA_5555u32 >> i) & 1;
        low | ((high as i32) << 4)
    };
    let mut raw = h(0.5).to_vec();
    raw.extend(qh);
    raw.extend(&qs);
    let got = dequantize("t", GGmlType::Q5_0, &raw, 32).unwrap();
    let want: Vec<f32> = (0..32).map(|i| (q(i) - 16) as f32 * 0.5).collect();
    assert_eq!(got, want);

    let mut raw = h(0.25).to_vec();
    raw.extend(h(3.0));
    raw.extend(qh);
    raw.extend(&qs);
    let got = dequantize("t", GGmlType::Q5_1, &raw, 32).unwrap();
    let want: Vec<f32> = (0..32).map(|i| q(i) as f32 * 0.25 + 3.0).collect();
    assert_eq!(got, want);
}

pub(super) fn dequant_float_types() {
    let vals = [0.0f32, 1.5, -2.25, 65504.0, 1.0e-3];
    let f32_raw: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(dequantize("t", GGmlType::F32, &f32_raw, 5).unwrap(), vals);

    let f16_raw: Vec<u8> = vals.iter().flat_map(|&v| h(v)).collect();
    let want: Vec<f32> = vals.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
    assert_eq!(dequantize("t", GGmlType::F16, &f16_raw, 5).unwrap(), want);

    let bf_raw: Vec<u8> = vals
        .iter()
        .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
        .collect();
    let want: Vec<f32> = vals.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    assert_eq!(dequantize("t", GGmlType::BF16, &bf_raw, 5).unwrap(), want);
}

pub(super) fn dequant_rejects_unsupported_and_short_data() {
    let err = dequantize("blk.0.ffn_up.weight", GGmlType::Q4K, &[0; 144], 256).unwrap_err();
    assert!(
        matches!(&err, LoadError::UnsupportedQuant { tensor, quant }
            if tensor == "blk.0.ffn_up.weight" && quant == "Q4K"),
        "{err}"
    );
    let err = dequantize("t", GGmlType::Q4_1, &[0; 19], 32).unwrap_err();
    assert!(matches!(err, LoadError::ShapeMismatch { .. }), "{err}");
}

pub(super) fn unpermute_small() {
    // One head of 4 rows: HF rows r0 r1 r2 r3 are stored by llama.cpp as r0 r2 r1 r3.
    let gguf = [0.0, 2.0, 1.0, 3.0, 10.0, 12.0, 11.0, 13.0];
    assert_eq!(
        unpermute_qk(&gguf, 2, 8, 1),
        [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]
    );
}
