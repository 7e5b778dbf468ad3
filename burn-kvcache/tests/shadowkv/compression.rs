//! The compressed parts on their own: low-rank keys' error against rank, values' host round
//! trip.

use burn::tensor::{DType, Device};
use burn_kernels_testing::{
    Dist, TF32_REL_L2, compare::to_f32, f32_matmul_is_tf32, float_dtypes, random_values,
};
use burn_kvcache::shadowkv::{HostValues, low_rank};

use super::common::*;

/// The low-rank error falls with the rank, equals the truncated-SVD optimum
/// `sqrt(Σ_{i≥r} λ_i / Σ λ)` and is ~0 at full rank.
pub(super) fn low_rank_error_vs_rank(device: &Device) {
    let (s, n) = (211, 96);
    // Columns with decaying scales: a spread-out spectrum like real keys'.
    let x: Vec<f32> = random_values(s * n, Dist::STANDARD, 11)
        .iter()
        .enumerate()
        .map(|(i, v)| v * (-((i % n) as f32) / 12.0).exp())
        .collect();
    let xt = tensor::<2>(x.clone(), [s, n], DType::F32, device);
    let norm: f64 = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
    let mut prev = f64::INFINITY;
    // The Gram matrix and the reconstruction are f32 products: exact-f32 rounding leaves
    // ~1e-5 of the norm; TF32 (CUDA) leaves up to its relative-L2 bound.
    let (gap, lossless) = if f32_matmul_is_tf32(device) {
        (TF32_REL_L2, TF32_REL_L2)
    } else {
        (1e-4, 1e-5)
    };
    println!("rank | rel. Frobenius error | SVD optimum");
    for rank in [1, 4, 8, 16, 32, 64, 96] {
        let lr = low_rank(xt.clone(), rank).unwrap();
        let rec = to_f32(lr.a.clone().matmul(lr.wt.clone()).into_data());
        let err: f64 = rec
            .iter()
            .zip(&x)
            .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
            .sum::<f64>()
            .sqrt()
            / norm;
        let total: f64 = lr.eigenvalues.iter().map(|l| l.max(0.0)).sum();
        let tail: f64 = lr.eigenvalues[rank..].iter().map(|l| l.max(0.0)).sum();
        let optimum = (tail / total).sqrt();
        println!("{rank:4} | {err:.3e} | {optimum:.3e}");
        assert!(err < prev, "error falls with rank: {err} at {rank}");
        assert!(
            (err - optimum).abs() <= gap + 1e-3 * optimum,
            "rank {rank}: {err} vs optimum {optimum}"
        );
        assert!((lr.energy() - (1.0 - optimum * optimum)).abs() < 1e-9);
        prev = err;
    }
    assert!(prev < lossless, "full rank is lossless: {prev}");
}

/// Values round-trip bit-exactly through host memory in every dtype.
pub(super) fn values_round_trip(device: &Device) {
    for dtype in float_dtypes(device) {
        let (h, chunks, chunk, d) = (3, 7, 5, 33);
        let v = tensor::<3>(
            random_values(h * (chunks * chunk + 3) * d, Dist::PEAKY, 21),
            [h, chunks * chunk + 3, d],
            dtype,
            device,
        );
        let host = HostValues::from_tensor(v.clone(), chunk, chunks);
        assert_eq!(host.bytes(), h * chunks * chunk * d * dtype.size());
        let sel: Vec<Vec<usize>> = (0..h).map(|hh| vec![6, hh, 0, 6]).collect();
        let got = host.gather(&sel, device);
        assert_eq!(got.dtype(), dtype);
        for (hh, ids) in sel.iter().enumerate() {
            for (slot, &c) in ids.iter().enumerate() {
                let want = v
                    .clone()
                    .slice([hh..hh + 1, c * chunk..(c + 1) * chunk, 0..d])
                    .into_data();
                let have = got
                    .clone()
                    .slice([hh..hh + 1, slot * chunk..(slot + 1) * chunk, 0..d])
                    .into_data();
                assert_eq!(
                    have.as_bytes(),
                    want.as_bytes(),
                    "{dtype:?} head {hh} chunk {c}"
                );
            }
        }
    }
}
