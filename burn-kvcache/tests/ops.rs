//! The four ops: kernels against the tensor-op reference (random seeded inputs, awkward
//! sizes, poisoned outputs) on every enabled runtime; the quantization error bound and the
//! merge invariants on the CPU reference too; typed errors.

use burn::tensor::{DType, Device, Int, Tensor, TensorCreationOptions, TensorData};
use burn_kernels_testing::{
    Dist, Tolerance, assert_close, compare::to_f32, float_dtypes, poison_memory, random_values,
};
use burn_kvcache::{
    KvCacheError, Packed, QuantLayout, dequantize, merge, quantize, reference, restore,
};

use crate::{assert_launched, launch_counts, on_kernels};

/// Rows (2 heads × seq 1, 17, 257) and head dims (64 and an odd one).
const ROWS: &[usize] = &[2, 34, 514];
const DIMS: &[usize] = &[64, 33];

fn tensor<const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    dtype: DType,
    device: &Device,
) -> Tensor<D> {
    let data = TensorData::new(values, shape).convert_dtype(dtype);
    Tensor::from_data(
        data,
        TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    )
}

fn cpu<const D: usize>(values: Vec<f32>, shape: [usize; D]) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values, shape), &Device::flex())
}

/// Row pairs whose angles spread over [0, ~0.5π]: `b = a + σᵢ·noise`, `σᵢ` from 0 to 1.5.
fn pair_values(n: usize, d: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let a = random_values(n * d, Dist::STANDARD, seed);
    let noise = random_values(n * d, Dist::STANDARD, seed + 1);
    let b = a
        .iter()
        .zip(&noise)
        .enumerate()
        .map(|(i, (x, e))| x + e * ((i / d) % 16) as f32 * 0.1)
        .collect();
    (a, b)
}

fn rows_of(v: &[f32], d: usize, skip: &[bool]) -> Vec<f32> {
    v.chunks(d)
        .zip(skip)
        .filter(|(_, s)| !**s)
        .flat_map(|(r, _)| r.iter().copied())
        .collect()
}

fn merge_matches_reference(device: &Device) {
    let before = launch_counts(["minicache_merge"]);
    for dtype in float_dtypes(device) {
        for (c, (&n, &d)) in ROWS
            .iter()
            .flat_map(|n| DIMS.iter().map(move |d| (n, d)))
            .enumerate()
        {
            for &(t, gamma) in &[(0.6, 0.05), (0.3, 0.0), (1.0, 1.0), (0.0, 0.2)] {
                let (a, b) = pair_values(n, d, 100 + c as u64);
                let at = tensor::<2>(a, [n, d], dtype, device);
                let bt = tensor::<2>(b, [n, d], dtype, device);
                // The reference sees the values the kernel sees (rounded to `dtype`).
                let (ar, br) = (to_f32(at.to_data()), to_f32(bt.to_data()));
                let exp = reference::merge(cpu(ar, [n, d]), cpu(br, [n, d]), t, gamma);
                poison_memory(device, 4 * n * d, dtype);
                poison_memory(device, 4 * n, DType::F32);
                let got = on_kernels(device, || merge(at, bt, t, gamma)).expect("valid");
                let name = format!("merge n={n} d={d} t={t} γ={gamma} {dtype:?}");
                let tol = Tolerance::for_reduction(dtype, d);
                let dist_e = to_f32(exp.dist.into_data());
                let dist_g = to_f32(got.dist.into_data());
                assert_close(&format!("{name} dist"), &dist_g, &dist_e, tol);
                assert_close(
                    &format!("{name} mag_a"),
                    &to_f32(got.mag_a.into_data()),
                    &to_f32(exp.mag_a.into_data()),
                    tol,
                );
                assert_close(
                    &format!("{name} mag_b"),
                    &to_f32(got.mag_b.into_data()),
                    &to_f32(exp.mag_b.into_data()),
                    tol,
                );
                // Rows within rounding of the threshold may be retained on one side only (with
                // γ = 0, the rows whose two layers coincide: distance 0 or a few ulps).
                let skip: Vec<bool> = dist_e
                    .iter()
                    .zip(&dist_g)
                    .map(|(e, g)| (*e > gamma) != (*g > gamma))
                    .collect();
                for (i, _) in skip.iter().enumerate().filter(|(_, s)| **s) {
                    assert!(
                        f64::from((dist_e[i] - gamma).abs())
                            <= tol.atol + tol.rtol * f64::from(gamma),
                        "{name}: row {i} retained on one side only, dist {} vs {} (γ {gamma})",
                        dist_g[i],
                        dist_e[i]
                    );
                }
                let dir_g = to_f32(got.dir.into_data());
                let dir_e = to_f32(exp.dir.into_data());
                assert!(
                    dir_g.iter().all(|x| x.is_finite()),
                    "{name}: dir fully written"
                );
                assert_close(
                    &format!("{name} dir"),
                    &rows_of(&dir_g, d, &skip),
                    &rows_of(&dir_e, d, &skip),
                    Tolerance {
                        atol: 1e-4 + tol.atol,
                        rtol: tol.rtol,
                    },
                );
            }
        }
    }
    assert_launched(device, ["minicache_merge"], before);
}

fn restore_matches_reference(device: &Device) {
    let before = launch_counts(["minicache_restore"]);
    for dtype in float_dtypes(device) {
        for (c, (&n, &d)) in ROWS
            .iter()
            .flat_map(|n| DIMS.iter().map(move |d| (n, d)))
            .enumerate()
        {
            let seed = 200 + c as u64;
            let dir = random_values(n * d, Dist::STANDARD, seed);
            let mag = random_values(n, Dist::Uniform { lo: 0.0, hi: 5.0 }, seed + 1);
            // About a third of the rows retained, in order.
            let mut slots = vec![0i32; n];
            let mut r = 0;
            for (i, s) in slots.iter_mut().enumerate() {
                if (i * 7 + c) % 3 == 0 {
                    r += 1;
                    *s = r;
                }
            }
            let rows = random_values(r.max(1) as usize * d, Dist::STANDARD, seed + 2);
            let r = r as usize;
            let dir_t = tensor::<2>(dir, [n, d], dtype, device);
            let mag_t = tensor::<1>(mag, [n], dtype, device);
            let rows_t = tensor::<2>(rows, [r.max(1), d], dtype, device);
            let slot_t = Tensor::<1, Int>::from_data(
                TensorData::new(slots.clone(), [n]),
                TensorCreationOptions::new(device.clone()).with_dtype(DType::I32),
            );
            let (dc, mc, rc) = (
                cpu(to_f32(dir_t.to_data()), [n, d]),
                cpu(to_f32(mag_t.to_data()), [n]),
                cpu(to_f32(rows_t.to_data()), [r.max(1), d]),
            );
            let slot_c = Tensor::<1, Int>::from_data(
                TensorData::new(slots.iter().map(|&s| s as i64).collect(), [n]),
                &Device::flex(),
            );
            let tol = Tolerance::for_dtype(dtype);
            for with_rows in [false, true] {
                let exp = reference::restore(
                    dc.clone(),
                    mc.clone(),
                    with_rows.then(|| (slot_c.clone(), rc.clone())),
                );
                poison_memory(device, 2 * n * d, dtype);
                let got = on_kernels(device, || {
                    restore(
                        dir_t.clone(),
                        mag_t.clone(),
                        with_rows.then(|| (slot_t.clone(), rows_t.clone())),
                    )
                })
                .expect("valid");
                assert_eq!(got.dtype(), dtype);
                assert_close(
                    &format!("restore n={n} d={d} retained={with_rows} {dtype:?}"),
                    &to_f32(got.into_data()),
                    &to_f32(exp.into_data()),
                    tol,
                );
            }
        }
    }
    assert_launched(device, ["minicache_restore"], before);
}

fn unpack(words: &[u32], layout: QuantLayout, rows: usize) -> Vec<u32> {
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

fn words_of(p: &Packed) -> Vec<u32> {
    p.words
        .to_data()
        .convert::<u32>()
        .try_to_vec::<u32>()
        .expect("u32 words")
}

const QUANT_CASES: &[(usize, usize, usize)] = &[
    // (rows, cols, group)
    (1, 64, 32),
    (17, 64, 32),
    (257, 33, 32),
    (17, 33, 7),
    (34, 32, 32),
    (3, 5, 64),
];

fn quantize_matches_reference(device: &Device) {
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
fn unpack_padding(words: &[u32], layout: QuantLayout) -> Vec<u32> {
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
fn quant_error_bound(device: &Device) {
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

/// Identical rows merge to their own direction (θ = 0) and restore exactly; γ = 0 retains
/// every row whose directions differ.
fn merge_invariants(device: &Device) {
    let (n, d) = (34, 33);
    let a = random_values(n * d, Dist::STANDARD, 500);
    let at = tensor::<2>(a.clone(), [n, d], DType::F32, device);
    let m = on_kernels(device, || merge(at.clone(), at.clone(), 0.6, 0.05)).unwrap();
    let dist = to_f32(m.dist.clone().into_data());
    assert!(dist.iter().all(|&x| x <= 1e-6), "identical rows: θ = 0");
    let back = on_kernels(device, || restore(m.dir.clone(), m.mag_b.clone(), None)).unwrap();
    assert_close(
        "identical rows restore",
        &to_f32(back.into_data()),
        &a,
        Tolerance {
            atol: 1e-5,
            rtol: 1e-5,
        },
    );

    let (a, b) = pair_values(n, d, 501);
    let bt = tensor::<2>(b.clone(), [n, d], DType::F32, device);
    let at = tensor::<2>(a.clone(), [n, d], DType::F32, device);
    let m = on_kernels(device, || merge(at, bt, 0.6, 0.0)).unwrap();
    let dist = to_f32(m.dist.into_data());
    for (i, &x) in dist.iter().enumerate() {
        // Row i of the pair values has noise σ = (i mod 16)·0.1: only σ = 0 rows coincide,
        // to within rounding (CUDA's fused multiply-adds leave a few ulps).
        assert_eq!(x > 1e-6, i % 16 != 0, "row {i}: dist {x}");
    }
    let ra = on_kernels(device, || restore(m.dir, m.mag_a, None)).unwrap();
    assert_close(
        "γ = 0: layer a restores exactly",
        &to_f32(ra.into_data()),
        &a,
        Tolerance {
            atol: 1e-5,
            rtol: 1e-5,
        },
    );
}

/// The extension ops called on the unfused `CubeBackend` directly give what the public ops
/// give through Burn's `Dispatch` (on `Fusion<CubeBackend>`, where Burn fuses): the same kernels
/// on the same values, bit for bit. Covers a tuple output (merge), the retained restore (an int
/// input), a struct output and input (quantize, dequantize) and the quantized read with its
/// enum inputs (a tail and a key padding mask).
#[cfg(feature = "cube")]
fn unfused_matches_dispatch(device: &Device) {
    use burn::tensor::{Bool, IntDType};
    use burn_cubecl::CubeBackend;
    use burn_kernels_core::AttnOptions;
    use burn_kernels_core::route::require_kernels;
    use burn_kernels_testing::unfused::{float, int, read_float, read_int};
    use burn_kvcache::{
        KeyMask, KvKernels, KvTail, PackedPrimitive, QuantAttnPlan, QuantAttnView, quant_attention,
    };

    let f32s = |data: TensorData| to_f32(data);
    let u32s = |data: TensorData| data.convert::<u32>().try_to_vec::<u32>().expect("u32");
    let ops = [
        "minicache_merge",
        "minicache_restore",
        "kv_quantize",
        "kv_dequantize",
        "kv_quant_attention",
    ];
    let before = launch_counts(ops);

    // Merge (four outputs) and the retained restore.
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

    // Quantize (a struct output) and dequantize (a struct input).
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
    let prim = |p: &Packed| PackedPrimitive::<CubeBackend> {
        words: int(&p.words, device),
        scale: float(&p.scale, device),
        min: float(&p.min, device),
    };
    let direct = CubeBackend::kv_dequantize(prim(&via), layout);
    let fused = require_kernels(|| dequantize(&via, layout));
    assert_eq!(
        f32s(read_float(direct)),
        f32s(fused.into_data()),
        "dequantize"
    );

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
    let mask = padding.int().cast(IntDType::I32);
    let direct = CubeBackend::kv_quant_attention(
        float(&q, device),
        prim(&kp),
        prim(&vp),
        KvTail::Present {
            k: float(&tk, device),
            v: float(&tv, device),
        },
        KeyMask::Present {
            mask: int(&mask, device),
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
    assert_launched(device, ops, before);
}

macro_rules! on_all {
    ($($f:ident),* $(,)?; kernels only: [$($g:ident),* $(,)?] $(,)?) => {
        mod cpu {
            $( #[test] fn $f() { super::$f(&::burn::tensor::Device::flex()); } )*
        }
        burn_kernels_testing::testgen! { backend: [$($f,)* $($g,)*], autodiff: [] }
    };
}

on_all!(
    merge_matches_reference,
    restore_matches_reference,
    quantize_matches_reference,
    quant_error_bound,
    merge_invariants;
    kernels only: [unfused_matches_dispatch],
);

#[test]
fn typed_errors() {
    let x = cpu(vec![0.0; 6], [2, 3]);
    let y = cpu(vec![0.0; 4], [2, 2]);
    let err = |t: f32, g: f32| merge(x.clone(), x.clone(), t, g).unwrap_err();
    assert_eq!(err(1.5, 0.05), KvCacheError::InvalidInterpolation(1.5));
    assert_eq!(err(-0.1, 0.05), KvCacheError::InvalidInterpolation(-0.1));
    assert_eq!(err(0.6, -0.01), KvCacheError::InvalidGamma(-0.01));
    assert!(matches!(err(0.6, f32::NAN), KvCacheError::InvalidGamma(_)));
    assert!(matches!(
        merge(x.clone(), y.clone(), 0.5, 0.0),
        Err(KvCacheError::ShapeMismatch { .. })
    ));
    assert!(matches!(
        restore(x.clone(), cpu(vec![1.0; 3], [3]), None),
        Err(KvCacheError::ShapeMismatch { .. })
    ));
    assert_eq!(
        quantize(x.clone(), 3, 32).unwrap_err(),
        KvCacheError::InvalidBits(3)
    );
    assert_eq!(
        quantize(x.clone(), 8, 32).unwrap_err(),
        KvCacheError::InvalidBits(8)
    );
    assert_eq!(quantize(x, 4, 0).unwrap_err(), KvCacheError::ZeroGroupSize);
}
