//! MiniCache's merge and restore against the tensor-op reference, and the merge invariants.

use burn::tensor::{DType, Device, Int, Tensor, TensorCreationOptions, TensorData};
use burn_kernels_testing::{
    Dist, Tolerance, assert_close, compare::to_f32, float_dtypes, poison_memory, random_values,
};
use burn_kvcache::{merge, reference, restore};

use crate::{assert_launched, launch_counts, on_kernels};

use super::common::*;

pub(super) fn merge_matches_reference(device: &Device) {
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

pub(super) fn restore_matches_reference(device: &Device) {
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

/// Identical rows merge to their own direction (θ = 0) and restore exactly; γ = 0 retains
/// every row whose directions differ.
pub(super) fn merge_invariants(device: &Device) {
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
