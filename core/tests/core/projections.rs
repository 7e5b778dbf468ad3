//! The projection kernels (GEMV, three GEMVs of one input, GEMV with the SwiGLU gate) against
//! f64 products of the stored values, on awkward sizes; the same launches with the residual
//! add and RMSNorm in front against the add-and-norm kernel followed by the projection.

use burn::module::Param;
use burn::nn::RmsNorm;
use burn::tensor::{DType, Device, Tensor};
use burn_kernels_core::route::{launches, require_kernels};
use burn_kernels_core::{FusedOps, LayerOps};
use burn_kernels_testing::{
    Dist, Tolerance, assert_close, assert_product_close, compare::to_f32, float_dtypes,
    poison_memory, random_tensor,
};

/// `x · w` of host copies in f64: `x` `[rows, k]`, `w` `[k, n]`.
pub fn host_product(x: &[f32], w: &[f32], rows: usize, k: usize, n: usize) -> Vec<f64> {
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

pub fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

fn weight(k: usize, n: usize, seed: u64, dtype: DType, device: &Device) -> Tensor<2> {
    random_tensor::<2>([k, n], Dist::STANDARD, seed, dtype, device)
}

/// `w` (`[k, n]`) as a view whose rows lie `2n` apart (a slice of `[w, w]`): the kernels must
/// read such rows in place, as they read Burn's pitched layouts, with the same values.
pub fn strided(w: Tensor<2>) -> Tensor<2> {
    let [k, n] = w.dims();
    Tensor::cat(vec![w.clone(), w], 1).slice([0..k, 0..n])
}

/// Rows one (one cube of rows), two, three (a partial cube of four), five (two cubes) and
/// seventeen (past `GEMV_MAX_ROWS`: Burn's matmul, not a fallback); inner sizes that leave
/// tails in the unrolled splits (97, 131, 1), several chunks (1031) and the long-K unroll
/// (2053, past 2048: eight rows of `W` in flight per unit); columns read one at a
/// time (45), in pairs (6) and in 16-byte vectors (200, 576), with partial cubes of columns.
/// Outputs land in NaN-poisoned memory.
pub fn fused_projections_match_host_products(device: &Device) {
    let ops = ["gemv", "gemv_t", "gemv3", "gemv_swiglu"];
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
            // Every other case reads a row-strided view of the same weight.
            let w = if i % 2 == 1 { strided(w) } else { w };
            let got = require_kernels(|| FusedOps.linear(x, w));
            assert_eq!(got.dims(), [b, s, n]);
            let name = format!("linear {dtype:?} {b}x{s}x{k} · {k}x{n}");
            assert_product_close(&name, &to_f32(got.into_data()), &want, dtype, k, device);
        }

        // x · eᵀ (a tied LM head): one row, three, eight (two cubes of rows), seventeen and
        // thirty-two (past GEMV_MAX_ROWS, still the kernel); inner sizes in 16-byte vectors
        // (576), pairs (130) and singles (97); output counts that leave a partial plane and
        // cube (45, 1000, 33). Every other case reads a row-strided view of `e`.
        for (i, [rows, k, n]) in [
            [1, 576, 1000],
            [3, 97, 45],
            [8, 576, 200],
            [17, 130, 33],
            [32, 576, 100],
        ]
        .into_iter()
        .enumerate()
        {
            let seed = 150 + 2 * i as u64;
            let x = random_tensor::<3>([1, rows, k], Dist::STANDARD, seed, dtype, device);
            let e = weight(n, k, seed + 1, dtype, device);
            let (hx, he) = (to_f32(x.to_data()), to_f32(e.to_data()));
            // e is [n, k]: its transpose [k, n] is what host_product multiplies by.
            let ht: Vec<f32> = (0..k)
                .flat_map(|j| (0..n).map(move |c| (j, c)))
                .map(|(j, c)| he[c * k + j])
                .collect();
            let want = f32s(&host_product(&hx, &ht, rows, k, n));
            let e = if i % 2 == 1 { strided(e) } else { e };
            poison_memory(device, rows * n, dtype);
            let got = require_kernels(|| FusedOps.linear_t(x, e));
            assert_eq!(got.dims(), [1, rows, n]);
            let name = format!("linear_t {dtype:?} {rows}x{k} · ({n}x{k})ᵀ");
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
            let base = Tolerance::for_reduction(dtype, k).atol_scaled(scale);
            let tol = Tolerance {
                rtol: base.rtol * 2.0,
                ..base
            };
            let name = format!("swiglu {dtype:?} {b}x{s}x{k} · {k}x{n}");
            assert_close(&name, &to_f32(got.into_data()), &want, tol);
        }
    }
    for (op, before) in ops.iter().zip(before) {
        assert!(launches(op) > before, "{op}: no kernel launch counted");
    }
}

/// Half a unit in the last place of `dtype`, relative.
fn unit(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        _ => 2f64.powi(-24),
    }
}

fn max_abs(v: &[f32]) -> f64 {
    v.iter().fold(0f64, |m, x| m.max(x.abs() as f64))
}

/// `add_norm_linear3` and `add_norm_swiglu` (one launch: `x + y`, its RMSNorm, the products)
/// against the two-launch composition they replace (`add_rms_norm`, then `linear3` or
/// `swiglu`, each checked on its own above and in the layer-ops test). Both round the sum and
/// the normed input to the dtype, so they differ only where the two reductions of `Σ sum²`
/// (f32, other orders) move a normed value across a rounding boundary: the tolerance adds one
/// such flip (half a unit of the dtype times the largest normed value and weight) to the
/// product's. The sum must equal the tensor-op `x + y`. Rows 1, 3 (a partial cube of rows),
/// 5 (two cubes) and 17 (past `GEMV_MAX_ROWS`: the composition, not a fallback); inner sizes
/// with tails (97, 131) and the long-K unroll (2053). Outputs land in NaN-poisoned memory. The
/// one-launch kernels read row-strided views of the weights ([`strided`]).
pub fn norm_projections_match_composition(device: &Device) {
    let ops = ["norm_gemv3", "norm_gemv_swiglu"];
    let before = ops.map(launches);
    for dtype in float_dtypes(device) {
        for (i, [rows, k, na, nb]) in [
            [1, 97, 45, 6],
            [3, 131, 200, 40],
            [5, 576, 64, 16],
            [17, 97, 24, 8],
            [1, 2053, 16, 8],
        ]
        .into_iter()
        .enumerate()
        {
            let seed = 130 + 8 * i as u64;
            let x = random_tensor::<3>([1, rows, k], Dist::STANDARD, seed, dtype, device);
            let y = random_tensor::<3>([1, rows, k], Dist::STANDARD, seed + 1, dtype, device);
            let gamma = random_tensor::<1>([k], Dist::STANDARD, seed + 2, dtype, device);
            let norm = RmsNorm {
                gamma: Param::from_tensor(gamma),
                epsilon: 1e-5,
            };
            let ws = [na, nb, nb, na]
                .into_iter()
                .enumerate()
                .map(|(j, n)| weight(k, n, seed + 3 + j as u64, dtype, device))
                .collect::<Vec<_>>();
            let w3 = || [ws[0].clone(), ws[1].clone(), ws[2].clone()];
            // The launches under test read row-strided views of the weights (the references
            // read the contiguous ones).
            let w3_strided = || w3().map(strided);
            let name = format!("{dtype:?} {rows}x{k}");

            let (_, h) = FusedOps.add_rms_norm(&norm, x.clone(), y.clone());
            let flips = unit(dtype) * max_abs(&to_f32(h.to_data()));
            let tol = |w: &Tensor<2>, scale: f64| {
                let base = Tolerance::for_reduction(dtype, k);
                Tolerance {
                    atol: (base.atol + flips * max_abs(&to_f32(w.to_data()))) * scale,
                    rtol: base.rtol * if scale > 1.0 { 2.0 } else { 1.0 },
                }
            };
            let check_sum = |what: &str, sum: Tensor<3>| {
                assert_close(
                    &format!("{what} sum {name}"),
                    &to_f32(sum.into_data()),
                    &to_f32((x.clone() + y.clone()).into_data()),
                    Tolerance::for_dtype(dtype),
                );
            };

            poison_memory(device, rows * (k + na + 2 * nb), dtype);
            let (sum, got) = require_kernels(|| {
                FusedOps.add_norm_linear3(&norm, x.clone(), y.clone(), w3_strided())
            });
            check_sum("add_norm_linear3", sum);
            let [wa, wb, wc] = w3();
            let (ea, eb, ec) = FusedOps.linear3(h.clone(), wa, wb, wc);
            for ((got, want), w) in got.into_iter().zip([ea, eb, ec]).zip(w3()) {
                assert_eq!(got.dims(), want.dims(), "{name}");
                assert_close(
                    &format!("add_norm_linear3 {name} · {:?}", w.dims()),
                    &to_f32(got.into_data()),
                    &to_f32(want.into_data()),
                    tol(&w, 1.0),
                );
            }

            poison_memory(device, rows * (k + na), dtype);
            let (sum, got) = require_kernels(|| {
                let (gate, up) = (strided(ws[3].clone()), strided(ws[0].clone()));
                FusedOps.add_norm_swiglu(&norm, x.clone(), y.clone(), gate, up)
            });
            check_sum("add_norm_swiglu", sum);
            let want = FusedOps.swiglu(h.clone(), ws[3].clone(), ws[0].clone());
            // Two products multiply (see the SwiGLU case above): scale by the largest |h·u|.
            let hu = FusedOps.linear(h, ws[0].clone());
            let scale = max_abs(&to_f32(hu.into_data())).max(1.0);
            assert_eq!(got.dims(), want.dims(), "{name}");
            assert_close(
                &format!("add_norm_swiglu {name}"),
                &to_f32(got.into_data()),
                &to_f32(want.into_data()),
                tol(&ws[3], scale),
            );
        }
    }
    for (op, before) in ops.iter().zip(before) {
        assert!(launches(op) > before, "{op}: no kernel launch counted");
    }
}
