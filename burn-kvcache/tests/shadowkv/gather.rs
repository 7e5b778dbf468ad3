//! The gather-reconstruct-rope kernel against the tensor-op reference and a scalar oracle.

use burn::tensor::{DType, Device, Int, Tensor, TensorCreationOptions, TensorData};
use burn_kernels_testing::{
    Dist, Tolerance, assert_close, compare::to_f32, float_dtypes, poison_memory, random_values,
};
use burn_kvcache::shadowkv::rope_tables;
use burn_kvcache::{RopeParams, gather_reconstruct_rope, reference};

use crate::{assert_launched, launch_counts, on_kernels};

use super::common::*;

/// The rebuild as scalar loops in f64: the oracle of the reference.
#[allow(clippy::too_many_arguments)]
pub(super) fn oracle(
    a: &[f32],
    wt: &[f32],
    ids: &[i32],
    cos: &[f32],
    sin: &[f32],
    [b, rows, rank]: [usize; 3],
    [h, d]: [usize; 2],
    k: usize,
    chunk: usize,
    positions: usize,
) -> Vec<f32> {
    let half = d / 2;
    let n = k * chunk;
    let mut out = vec![0f32; b * h * n * d];
    for bi in 0..b {
        for hh in 0..h {
            for tok in 0..n {
                let pos = ids[(bi * h + hh) * k + tok / chunk] as usize * chunk + tok % chunk;
                if pos >= rows || pos >= positions {
                    continue;
                }
                let x: Vec<f64> = (0..d)
                    .map(|j| {
                        (0..rank)
                            .map(|r| {
                                a[(bi * rows + pos) * rank + r] as f64
                                    * wt[((bi * h + hh) * rank + r) * d + j] as f64
                            })
                            .sum()
                    })
                    .collect();
                let o = ((bi * h + hh) * n + tok) * d;
                for j in 0..half {
                    let (c, s) = (cos[pos * half + j] as f64, sin[pos * half + j] as f64);
                    out[o + j] = (x[j] * c - x[j + half] * s) as f32;
                    out[o + j + half] = (x[j + half] * c + x[j] * s) as f32;
                }
            }
        }
    }
    out
}

/// `(batch, rows, rank, heads, d, k, chunk, positions)`: prime and odd sizes, a chunk id past
/// the rows (zero output), tables shorter than the rows; the tiled kernel's tiles (64 tokens at
/// ShadowKV's rank 160, 56 at rank 200) with tails, two blocks of 32 pairs with a tail of one,
/// and a rank whose rows do not fit its shared memory (the plain kernel).
pub(super) const GATHER_CASES: &[[usize; 8]] = &[
    [1, 37, 13, 3, 64, 5, 7, 37],
    [2, 41, 160, 2, 34, 3, 8, 41],
    [3, 23, 5, 1, 2, 4, 3, 20],
    [2, 64, 31, 4, 128, 6, 8, 64],
    [2, 300, 160, 2, 128, 11, 8, 300],
    [1, 90, 200, 3, 66, 9, 7, 85],
    [1, 20, 1601, 1, 16, 2, 4, 20],
];

pub(super) fn gather_rope_matches_reference(device: &Device) {
    let before = launch_counts(["shadowkv_gather_reconstruct_rope"]);
    for dtype in float_dtypes(device) {
        for (c, &[b, rows, rank, h, d, k, chunk, positions]) in GATHER_CASES.iter().enumerate() {
            let seed = 500 + 10 * c as u64;
            let a = random_values(b * rows * rank, Dist::STANDARD, seed);
            let wt = random_values(b * h * rank * d, Dist::STANDARD, seed + 1);
            let max_chunk = rows.div_ceil(chunk) as i32;
            let ids: Vec<i32> = random_values(b * h * k, Dist::Uniform { lo: 0.0, hi: 1.0 }, seed)
                .iter()
                .map(|u| ((u * max_chunk as f32) as i32).min(max_chunk - 1))
                .enumerate()
                // One id past every row: its positions come out as zeros.
                .map(|(i, id)| if i == 1 { max_chunk + 2 } else { id })
                .collect();
            let rope = RopeParams {
                theta: 10_000.0,
                scaling: None,
            };
            let (cos, sin) = rope_tables(d, positions, rope, device);
            let at = tensor::<3>(a, [b, rows, rank], dtype, device);
            let wtt = tensor::<4>(wt, [b, h, rank, d], dtype, device);
            let idt = Tensor::<3, Int>::from_data(
                TensorData::new(ids.clone(), [b, h, k]),
                TensorCreationOptions::new(device.clone()).with_dtype(DType::I32),
            );
            // The oracle and reference see the values the kernel sees (rounded to `dtype`).
            let (ar, wr) = (to_f32(at.to_data()), to_f32(wtt.to_data()));
            let (cr, sr) = (to_f32(cos.to_data()), to_f32(sin.to_data()));
            let want = oracle(
                &ar,
                &wr,
                &ids,
                &cr,
                &sr,
                [b, rows, rank],
                [h, d],
                k,
                chunk,
                positions,
            );
            let name = format!("gather_rope case {c} {dtype:?}");
            let tol = Tolerance::for_reduction(dtype, rank);
            let ids_cpu = Tensor::<3, Int>::from_data(
                TensorData::new(ids.iter().map(|&x| x as i64).collect::<Vec<_>>(), [b, h, k]),
                &Device::flex(),
            );
            let r = reference::gather_reconstruct_rope(
                cpu(ar, [b, rows, rank]),
                cpu(wr, [b, h, rank, d]),
                ids_cpu,
                cpu(cr, [positions, d / 2]),
                cpu(sr, [positions, d / 2]),
                chunk,
            );
            assert_close(
                &format!("{name} reference vs oracle"),
                &to_f32(r.into_data()),
                &want,
                Tolerance::for_reduction(DType::F32, rank),
            );
            poison_memory(device, 2 * b * h * k * chunk * d, dtype);
            let got = on_kernels(device, || {
                gather_reconstruct_rope(at, wtt, idt, cos, sin, chunk)
            })
            .expect("valid");
            assert_eq!(got.dims(), [b, h, k * chunk, d]);
            assert_close(&name, &to_f32(got.into_data()), &want, tol);
        }
    }
    assert_launched(device, ["shadowkv_gather_reconstruct_rope"], before);
}
