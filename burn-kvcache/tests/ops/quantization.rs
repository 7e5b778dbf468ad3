//! KIVI quantization against the tensor-op reference (words, scales, minimums, padding bits),
//! and its error bound.

use burn::tensor::{DType, Device, Int, Tensor, TensorCreationOptions, TensorData};
use burn_kernels_testing::{
    Dist, Tolerance, assert_close, compare::to_f32, float_dtypes, poison_memory, random_values,
};
use burn_kvcache::{Packed, QuantLayout, dequantize, quantize, reference};

use crate::{assert_launched, launch_counts, on_kernels};

use super::common::*;

pub(super) fn unpack(words: &[u32], layout: QuantLayout, rows: usize) -> Vec<u32> {
    let (g, ng, wpg, pw) = (
        layout.group_len(),
        layout.groups(),
        layout.words_per_group(),
        layout.codes_per_word(),
    );
    let mut out = Vec::with_capacity(rows * layout.cols);
    for r in 0..rows {
        for c in 0..layout.cols {
            let (gi, i) = (c / g, c % g);
            let w = words[(r * ng + gi) * wpg + i / pw];
            out.push((w >> ((i % pw) as u32 * layout.bits)) & layout.levels());
        }
    }
    out
}

pub(super) fn words_of(p: &Packed) -> Vec<u32> {
    p.words
        .to_data()
        .convert::<u32>()
        .try_to_vec::<u32>()
        .expect("u32 words")
}

pub(super) const QUANT_CASES: &[(usize, usize, usize)] = &[
    // (rows, cols, group)
    (1, 64, 32),
    (17, 64, 32),
    (257, 33, 32),
    (17, 33, 7),
    (34, 32, 32),
    (3, 5, 64),
];

pub(super) fn quantize_matches_reference(device: &Device) {
    let ops = ["kv_quantize", "kv_dequantize"];
    let before = launch_counts(ops);
    for dtype in float_dtypes(device) {
        for (c, &(rows, cols, group)) in QUANT_CASES.iter().enumerate() {
            for bits in [2, 4] {
                let x = random_values(rows * cols, Dist::PEAKY, 300 + c as u64);
                let xt = tensor::<2>(x, [rows, cols], dtype, device);
                let xs = to_f32(xt.to_data());
                let xc = cpu(xs.clone(), [rows, cols]);
                let layout = QuantLayout::new(bits, group, cols).unwrap();
                let exp = reference::quantize(xc, layout);
                poison_memory(device, 4 * rows * cols, dtype);
                let (got, l2) = on_kernels(device, || quantize(xt, bits, group)).expect("valid");
                assert_eq!(l2, layout);
                let name = format!("quantize {rows}x{cols} g={group} {bits}b {dtype:?}");
                let tol = Tolerance::for_dtype(dtype);
                let scale = to_f32(exp.scale.to_data());
                assert_close(
                    &format!("{name} scale"),
                    &to_f32(got.scale.to_data()),
                    &scale,
                    tol,
                );
                assert_close(
                    &format!("{name} min"),
                    &to_f32(got.min.to_data()),
                    &to_f32(exp.min.to_data()),
                    tol,
                );
                // Codes agree with the reference's except where the stored scales differ by
                // rounding (a division's last bit on some runtimes, then the dtype's rounding)
                // or (x − min)/scale lands within rounding of a .5 tie. Each differing code must
                // then be exactly what the kernel's own stored scale and min give.
                let (cg, ce) = (
                    unpack(&words_of(&got), layout, rows),
                    unpack(&words_of(&exp), layout, rows),
                );
                let g_min = to_f32(got.min.to_data());
                let g_scale = to_f32(got.scale.to_data());
                let ng = layout.groups();
                let mut n_off = 0;
                for (i, (a, b)) in cg.iter().zip(&ce).enumerate() {
                    if a == b {
                        continue;
                    }
                    n_off += 1;
                    let (r, c) = (i / cols, i % cols);
                    let gi = r * ng + c / layout.group_len();
                    let ratio = (f64::from(xs[i]) - f64::from(g_min[gi])) / f64::from(g_scale[gi]);
                    let levels = f64::from(layout.levels());
                    let tie = (ratio - ratio.floor() - 0.5).abs() <= 1e-5 * ratio.abs().max(1.0);
                    let own = |v: f64| v.clamp(0.0, levels) as u32;
                    assert!(
                        a.abs_diff(*b) == 1
                            && (*a == own(ratio.round())
                                || (tie && (*a == own(ratio.floor()) || *a == own(ratio.ceil())))),
                        "{name}: code {i} is {a} (reference {b}), its own scale and min give {ratio}"
                    );
                }
                assert!(
                    n_off <= rows * cols / 20 + 1,
                    "{name}: {n_off} codes differ from the reference's"
                );
                // Padding bits of the last word of a group are zero on both sides.
                let (wg, we) = (words_of(&got), words_of(&exp));
                let pad_g = unpack_padding(&wg, layout);
                assert_eq!(pad_g, unpack_padding(&we, layout), "{name}: padding");
                assert!(
                    pad_g.iter().all(|&p| p == 0),
                    "{name}: padding bits are zero"
                );

                // Dequantization of the kernel's words: kernel and reference agree.
                let exp_x = reference::dequantize(
                    &Packed {
                        words: Tensor::<2, Int>::from_data(
                            TensorData::new(wg.clone(), got.words.dims()),
                            TensorCreationOptions::new(Device::flex()).with_dtype(DType::U32),
                        ),
                        scale: cpu(to_f32(got.scale.to_data()), got.scale.dims()),
                        min: cpu(to_f32(got.min.to_data()), got.min.dims()),
                    },
                    layout,
                );
                poison_memory(device, 4 * rows * cols, dtype);
                let got_x = on_kernels(device, || dequantize(&got, layout));
                assert_eq!(got_x.dims(), [rows, cols]);
                assert_close(
                    &format!("{name} dequantize"),
                    &to_f32(got_x.into_data()),
                    &to_f32(exp_x.into_data()),
                    Tolerance::for_reduction(dtype, 2),
                );
            }
        }
    }
    assert_launched(device, ops, before);
}

/// The unused high bits of every group's last word.
pub(super) fn unpack_padding(words: &[u32], layout: QuantLayout) -> Vec<u32> {
    let (g, wpg, pw) = (
        layout.group_len(),
        layout.words_per_group(),
        layout.codes_per_word(),
    );
    let used = (g - (wpg - 1) * pw) as u32 * layout.bits;
    words
        .chunks(wpg)
        .map(|w| if used >= 32 { 0 } else { w[wpg - 1] >> used })
        .collect()
}

/// `|x − dequantize(quantize(x))| ≤ scale/2` per element (plus rounding of the stored values).
pub(super) fn quant_error_bound(device: &Device) {
    for dtype in float_dtypes(device) {
        for (c, &(rows, cols, group)) in QUANT_CASES.iter().enumerate() {
            for bits in [2, 4] {
                for dist in [Dist::STANDARD, Dist::PEAKY] {
                    let x = random_values(rows * cols, dist, 400 + c as u64);
                    let xt = tensor::<2>(x, [rows, cols], dtype, device);
                    let xs = to_f32(xt.to_data());
                    let (p, layout) = on_kernels(device, || quantize(xt, bits, group)).unwrap();
                    let y = to_f32(on_kernels(device, || dequantize(&p, layout)).into_data());
                    let scale = to_f32(p.scale.to_data());
                    let g = layout.group_len();
                    let eps = Tolerance::for_dtype(dtype);
                    for r in 0..rows {
                        for col in 0..cols {
                            let i = r * cols + col;
                            let s = scale[r * layout.groups() + col / g] as f64;
                            let err = (xs[i] as f64 - y[i] as f64).abs();
                            let bound =
                                s / 2.0 + eps.atol + 4.0 * eps.rtol * (xs[i].abs() as f64 + s);
                            assert!(
                                err <= bound,
                                "{bits}b {rows}x{cols} g={group} {dtype:?}: |x − x̂| = {err} > \
                                 scale/2 = {} at ({r}, {col})",
                                s / 2.0
                            );
                        }
                    }
                }
            }
        }
    }
}
