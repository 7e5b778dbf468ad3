//! The projection kernels (GEMV, three GEMVs of one input, GEMV with the SwiGLU gate) against
//! f64 products of the stored values, on awkward sizes.

use burn::tensor::{DType, Device, Tensor};
use burn_kernels_core::route::{launches, require_kernels};
use burn_kernels_core::{FusedOps, LayerOps};
use burn_kernels_testing::{
    Dist, Tolerance, assert_close, assert_product_close, compare::to_f32, float_dtypes,
    poison_memory, random_tensor,
};

/// `x · w` of host copies in f64: `x` `[rows, k]`, `w` `[k, n]`.
fn host_product(x: &[f32], w: &[f32], rows: usize, k: usize, n: usize) -> Vec<f64> {
    (0..rows)
        .flat_map(|r| {
            (0..n).map(move |c| {
                (0..k)
                    .map(|j| x[r * k + j] as f64 * w[j * n + c] as f64)
                    .sum()
            })
        })
        .collect()
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

fn weight(k: usize, n: usize, seed: u64, dtype: DType, device: &Device) -> Tensor<2> {
    random_tensor::<2>([k, n], Dist::STANDARD, seed, dtype, device)
}

/// Rows one (one cube of rows), two, three (a partial cube of four), five (two cubes) and
/// seventeen (past `GEMV_MAX_ROWS`: Burn's matmul, not a fallback); inner sizes that leave
/// tails in the unrolled splits (97, 131, 1), several chunks (1031) and the long-K unroll
/// (2053, past 2048: eight rows of `W` in flight per unit); columns read one at a
/// time (45), in pairs (6) and in 16-byte vectors (200, 576), with partial cubes of columns.
/// Outputs land in NaN-poisoned memory.
pub fn fused_projections_match_host_products(device: &Device) {
    let ops = ["gemv", "gemv3", "gemv_swiglu"];
    let before = ops.map(launches);
    for dtype in float_dtypes(device) {
        let cases = [
            [1, 1, 97, 45],
            [1, 5, 97, 45],
            [17, 1, 97, 45],
            [1, 1, 1031, 200],
            [3, 1, 131, 576],
            [1, 2, 1, 6],
            [1, 1, 2053, 16],
        ];
        for (i, [b, s, k, n]) in cases.into_iter().enumerate() {
            let seed = 70 + 2 * i as u64;
            let x = random_tensor::<3>([b, s, k], Dist::STANDARD, seed, dtype, device);
            let w = weight(k, n, seed + 1, dtype, device);
            let (hx, hw) = (to_f32(x.to_data()), to_f32(w.to_data()));
            let want = f32s(&host_product(&hx, &hw, b * s, k, n));
            poison_memory(device, b * s * n, dtype);
            let got = require_kernels(|| FusedOps.linear(x, w));
            assert_eq!(got.dims(), [b, s, n]);
            let name = format!("linear {dtype:?} {b}x{s}x{k} · {k}x{n}");
            assert_product_close(&name, &to_f32(got.into_data()), &want, dtype, k, device);
        }

        // Q, K and V widths whose boundaries fall inside a cube of columns (25 and 5
        // vectors of 8), and widths that only allow single columns.
        for (i, [b, s, k, na, nb, nc]) in [[1, 1, 131, 200, 40, 64], [3, 1, 97, 45, 6, 10]]
            .into_iter()
            .enumerate()
        {
            let seed = 90 + 4 * i as u64;
            let x = random_tensor::<3>([b, s, k], Dist::STANDARD, seed, dtype, device);
            let ws = [na, nb, nc]
                .into_iter()
                .enumerate()
                .map(|(j, n)| weight(k, n, seed + 1 + j as u64, dtype, device))
                .collect::<Vec<_>>();
            let hx = to_f32(x.to_data());
            poison_memory(device, b * s * (na + nb + nc), dtype);
            let (qa, qb, qc) = require_kernels(|| {
                FusedOps.linear3(x, ws[0].clone(), ws[1].clone(), ws[2].clone())
            });
            for (got, (w, n)) in [qa, qb, qc].into_iter().zip(ws.iter().zip([na, nb, nc])) {
                assert_eq!(got.dims(), [b, s, n]);
                let want = f32s(&host_product(&hx, &to_f32(w.to_data()), b * s, k, n));
                let name = format!("linear3 {dtype:?} {b}x{s}x{k} · {k}x{n}");
                assert_product_close(&name, &to_f32(got.into_data()), &want, dtype, k, device);
            }
        }

        // silu(x·g)·(x·u): the products in f64, the gate in f64, the result rounded once.
        for (i, [b, s, k, n]) in [
            [1, 1, 97, 45],
            [3, 1, 131, 200],
            [2, 2, 576, 72],
            [1, 1, 2053, 24],
        ]
        .into_iter()
        .enumerate()
        {
            let seed = 110 + 3 * i as u64;
            let x = random_tensor::<3>([b, s, k], Dist::STANDARD, seed, dtype, device);
            let (g, u) = (
                weight(k, n, seed + 1, dtype, device),
                weight(k, n, seed + 2, dtype, device),
            );
            let hx = to_f32(x.to_data());
            let hg = host_product(&hx, &to_f32(g.to_data()), b * s, k, n);
            let hu = host_product(&hx, &to_f32(u.to_data()), b * s, k, n);
            let want: Vec<f32> = hg
                .iter()
                .zip(&hu)
                .map(|(&g, &u)| (g / (1.0 + (-g).exp()) * u) as f32)
                .collect();
            poison_memory(device, b * s * n, dtype);
            let got = require_kernels(|| FusedOps.swiglu(x, g, u));
            assert_eq!(got.dims(), [b, s, n]);
            // Two products of magnitude ~√k multiply: scale the product tolerance by the
            // largest |x·u| (the gate's factor is at most |x·g|, about the same).
            let scale = hu.iter().fold(1.0f64, |m, v| m.max(v.abs()));
            let base = Tolerance::for_reduction(dtype, k);
            let tol = Tolerance {
                atol: base.atol * scale,
                rtol: base.rtol * 2.0,
            };
            let name = format!("swiglu {dtype:?} {b}x{s}x{k} · {k}x{n}");
            assert_close(&name, &to_f32(got.into_data()), &want, tol);
        }
    }
    for (op, before) in ops.iter().zip(before) {
        assert!(launches(op) > before, "{op}: no kernel launch counted");
    }
}
