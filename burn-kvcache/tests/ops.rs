//! The four ops: kernels against the tensor-op reference (random seeded inputs, awkward
//! sizes, poisoned outputs) on every enabled runtime; the quantization error bound and the
//! merge invariants on the CPU reference too; typed errors.

use burn::backend::NdArray;
use burn::tensor::{DType, Int, Tensor, TensorCreationOptions, TensorData};
use burn_kernels_testing::{
    Dist, Tolerance, assert_close, compare::to_f32, float_dtypes, poison_memory, random_values,
};
use burn_kvcache::{
    KvBackend, KvCacheError, Packed, QuantLayout, dequantize, merge, quantize, reference, restore,
};

type Cpu = NdArray<f32>;

/// Rows (2 heads × seq 1, 17, 257) and head dims (64 and an odd one).
const ROWS: &[usize] = &[2, 34, 514];
const DIMS: &[usize] = &[64, 33];

fn tensor<B: KvBackend, const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    dtype: DType,
    device: &B::Device,
) -> Tensor<B, D> {
    let data = TensorData::new(values, shape).convert_dtype(dtype);
    Tensor::from_data(
        data,
        TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    )
}

fn cpu<const D: usize>(values: Vec<f32>, shape: [usize; D]) -> Tensor<Cpu, D> {
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
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

fn merge_matches_reference<B: KvBackend>(device: &B::Device) {
    for dtype in float_dtypes::<B>(device) {
        for (c, (&n, &d)) in ROWS
            .iter()
            .flat_map(|n| DIMS.iter().map(move |d| (n, d)))
            .enumerate()
        {
            for &(t, gamma) in &[(0.6, 0.05), (0.3, 0.0), (1.0, 1.0), (0.0, 0.2)] {
                let (a, b) = pair_values(n, d, 100 + c as u64);
                let at = tensor::<B, 2>(a, [n, d], dtype, device);
                let bt = tensor::<B, 2>(b, [n, d], dtype, device);
                // The reference sees the values the kernel sees (rounded to `dtype`).
                let (ar, br) = (to_f32(at.to_data()), to_f32(bt.to_data()));
                let exp = reference::merge(cpu(ar, [n, d]), cpu(br, [n, d]), t, gamma);
                poison_memory::<B>(device, 4 * n * d, dtype);
                poison_memory::<B>(device, 4 * n, DType::F32);
                let got = merge(at, bt, t, gamma).expect("valid");
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
}

fn restore_matches_reference<B: KvBackend>(device: &B::Device) {
    for dtype in float_dtypes::<B>(device) {
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
            let dir_t = tensor::<B, 2>(dir, [n, d], dtype, device);
            let mag_t = tensor::<B, 1>(mag, [n], dtype, device);
            let rows_t = tensor::<B, 2>(rows, [r.max(1), d], dtype, device);
            let slot_t = Tensor::<B, 1, Int>::from_data(
                TensorData::new(slots.clone(), [n]),
                TensorCreationOptions::new(device.clone()).with_dtype(DType::I32),
            );
            let (dc, mc, rc) = (
                cpu(to_f32(dir_t.to_data()), [n, d]),
                cpu(to_f32(mag_t.to_data()), [n]),
                cpu(to_f32(rows_t.to_data()), [r.max(1), d]),
            );
            let slot_c = Tensor::<Cpu, 1, Int>::from_data(
                TensorData::new(slots.iter().map(|&s| s as i64).collect(), [n]),
                &Default::default(),
            );
            let tol = Tolerance::for_dtype(dtype);
            for with_rows in [false, true] {
                let exp = reference::restore(
                    dc.clone(),
                    mc.clone(),
                    with_rows.then(|| (slot_c.clone(), rc.clone())),
                );
                poison_memory::<B>(device, 2 * n * d, dtype);
                let got = restore(
                    dir_t.clone(),
                    mag_t.clone(),
                    with_rows.then(|| (slot_t.clone(), rows_t.clone())),
                )
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

fn words_of<B: KvBackend>(p: &Packed<B>) -> Vec<u32> {
    p.words
        .to_data()
        .convert::<u32>()
        .to_vec::<u32>()
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

fn quantize_matches_reference<B: KvBackend>(device: &B::Device) {
    for dtype in float_dtypes::<B>(device) {
        for (c, &(rows, cols, group)) in QUANT_CASES.iter().enumerate() {
            for bits in [2, 4] {
                let x = random_values(rows * cols, Dist::PEAKY, 300 + c as u64);
                let xt = tensor::<B, 2>(x, [rows, cols], dtype, device);
                let xs = to_f32(xt.to_data());
                let xc = cpu(xs.clone(), [rows, cols]);
                let layout = QuantLayout::new(bits, group, cols).unwrap();
                let exp = reference::quantize(xc, layout);
                poison_memory::<B>(device, 4 * rows * cols, dtype);
                let (got, l2) = quantize(xt, bits, group).expect("valid");
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
                        words: Tensor::<Cpu, 2, Int>::from_data(
                            TensorData::new(wg.clone(), got.words.dims()),
                            &Default::default(),
                        ),
                        scale: cpu(to_f32(got.scale.to_data()), got.scale.dims()),
                        min: cpu(to_f32(got.min.to_data()), got.min.dims()),
                    },
                    layout,
                );
                poison_memory::<B>(device, 4 * rows * cols, dtype);
                let got_x = dequantize(&got, layout);
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
fn quant_error_bound<B: KvBackend>(device: &B::Device) {
    for dtype in float_dtypes::<B>(device) {
        for (c, &(rows, cols, group)) in QUANT_CASES.iter().enumerate() {
            for bits in [2, 4] {
                for dist in [Dist::STANDARD, Dist::PEAKY] {
                    let x = random_values(rows * cols, dist, 400 + c as u64);
                    let xt = tensor::<B, 2>(x, [rows, cols], dtype, device);
                    let xs = to_f32(xt.to_data());
                    let (p, layout) = quantize(xt, bits, group).unwrap();
                    let y = to_f32(dequantize(&p, layout).into_data());
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
fn merge_invariants<B: KvBackend>(device: &B::Device) {
    let (n, d) = (34, 33);
    let a = random_values(n * d, Dist::STANDARD, 500);
    let at = tensor::<B, 2>(a.clone(), [n, d], DType::F32, device);
    let m = merge(at.clone(), at.clone(), 0.6, 0.05).unwrap();
    let dist = to_f32(m.dist.clone().into_data());
    assert!(dist.iter().all(|&x| x <= 1e-6), "identical rows: θ = 0");
    let back = restore(m.dir.clone(), m.mag_b.clone(), None).unwrap();
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
    let bt = tensor::<B, 2>(b.clone(), [n, d], DType::F32, device);
    let at = tensor::<B, 2>(a.clone(), [n, d], DType::F32, device);
    let m = merge(at, bt, 0.6, 0.0).unwrap();
    let dist = to_f32(m.dist.into_data());
    for (i, &x) in dist.iter().enumerate() {
        // Row i of the pair values has noise σ = (i mod 16)·0.1: only σ = 0 rows coincide,
        // to within rounding (CUDA's fused multiply-adds leave a few ulps).
        assert_eq!(x > 1e-6, i % 16 != 0, "row {i}: dist {x}");
    }
    let ra = restore(m.dir, m.mag_a, None).unwrap();
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

macro_rules! on_all {
    ($($f:ident),* $(,)?) => {
        mod cpu {
            $( #[test] fn $f() { super::$f::<super::Cpu>(&Default::default()); } )*
        }
        burn_kernels_testing::testgen! { backend: [$($f),*], autodiff: [] }
    };
}

on_all!(
    merge_matches_reference,
    restore_matches_reference,
    quantize_matches_reference,
    quant_error_bound,
    merge_invariants,
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
