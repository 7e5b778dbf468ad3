//! ShadowKV's selection (`top_k_rows`): the kernel and the tensor-op reference against a host
//! oracle, with distinct scores (every implementation must agree exactly) and with ties (the
//! kernel gives them to the lowest positions; the reference must select equal values).

use burn::tensor::{DType, Device, Int, Tensor, TensorCreationOptions, TensorData};
use burn_kernels_core::route::is_wgpu;
use burn_kernels_testing::{Dist, poison_memory, random_values};
use burn_kvcache::{KvCacheError, top_k_rows};

use crate::{assert_launched, cpu, launch_counts, on_kernels, tensor};

/// The selection as the host computes it: per row, the `min(k, n, kk)` highest of the first
/// `n` scores (ties to the lowest position), ascending, then the first repeated to `kk`
/// (zeros when nothing is selected).
fn oracle(scores: &[f32], cols: usize, sizes: &[[usize; 2]], kk: usize) -> Vec<i64> {
    let mut out = Vec::with_capacity(sizes.len() * kk);
    for (r, &[n, k]) in sizes.iter().enumerate() {
        let row = &scores[r * cols..r * cols + n.min(cols)];
        let k = k.min(row.len()).min(kk);
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let mut ids: Vec<i64> = order[..k].iter().map(|&i| i as i64).collect();
        ids.sort_unstable();
        let first = ids.first().copied().unwrap_or(0);
        ids.resize(kk, first);
        out.extend(ids);
    }
    out
}

/// `(rows, cols, kk)` and each row's `(n, k)` (cycled): a single score, prime widths, rows
/// longer than one element per unit (4099 > 16 · 256), `k` above `n` and above `kk` (capped),
/// `k = 0`, `k = n`.
const CASES: &[(usize, usize, usize, &[[usize; 2]])] = &[
    (1, 1, 1, &[[1, 1]]),
    (5, 37, 11, &[[37, 11], [1, 1], [13, 20], [36, 36], [20, 0]]),
    (3, 4099, 300, &[[4099, 300], [4000, 299], [257, 257]]),
    (
        7,
        257,
        64,
        &[[257, 64], [256, 63], [64, 64], [100, 1], [2, 2]],
    ),
];

fn sizes_of(rows: usize, pattern: &[[usize; 2]]) -> Vec<[usize; 2]> {
    pattern.iter().copied().cycle().take(rows).collect()
}

fn int_tensor(sizes: &[[usize; 2]], dtype: DType, device: &Device) -> Tensor<2, Int> {
    let flat: Vec<i64> = sizes.iter().flatten().map(|&x| x as i64).collect();
    Tensor::from_data(
        TensorData::new(flat, [sizes.len(), 2]),
        TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    )
}

fn select(
    device: &Device,
    scores: Vec<f32>,
    [rows, cols, kk]: [usize; 3],
    sizes: &[[usize; 2]],
    int: DType,
) -> Vec<i64> {
    poison_memory(device, rows * kk * 2, DType::F32);
    let scores = tensor(scores, [rows, cols], DType::F32, device);
    let sizes = int_tensor(sizes, int, device);
    let got = on_kernels(device, || top_k_rows(scores, sizes, kk)).expect("valid");
    assert_eq!(got.dims(), [rows, kk]);
    assert_eq!(got.dtype(), int);
    got.into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .unwrap()
}

/// Distinct random scores (of both signs): every implementation selects exactly the oracle's
/// positions, in its order, padding included.
pub(super) fn top_k_matches_oracle(device: &Device) {
    let before = launch_counts(["shadowkv_top_k"]);
    for (c, &(rows, cols, kk, pattern)) in CASES.iter().enumerate() {
        let sizes = sizes_of(rows, pattern);
        let scores = random_values(rows * cols, Dist::STANDARD, 900 + c as u64);
        let want = oracle(&scores, cols, &sizes, kk);
        // WebGPU has no 64-bit integers.
        let ints = if is_wgpu(device) {
            &[DType::I32][..]
        } else {
            &[DType::I32, DType::I64]
        };
        for &int in ints {
            let got = select(device, scores.clone(), [rows, cols, kk], &sizes, int);
            assert_eq!(got, want, "case {c} ({rows}×{cols}, kk {kk}) {int:?}");
        }
    }
    assert_launched(device, ["shadowkv_top_k"], before);
}

/// Scores on four levels (many ties at the threshold) and softmax-like zeros: the kernel gives
/// ties to the lowest positions (the oracle exactly); the reference's sort may order ties
/// otherwise, so it must select the same values, ascending, distinct and in range.
pub(super) fn top_k_with_ties(device: &Device) {
    let on_cube = burn_kernels_core::route::cube_device(device).is_some();
    for (c, &(rows, cols, kk, pattern)) in CASES.iter().enumerate() {
        let sizes = sizes_of(rows, pattern);
        let scores: Vec<f32> = random_values(rows * cols, Dist::Uniform { lo: 0.0, hi: 1.0 }, 7)
            .iter()
            .map(|u| ((u * 4.0).floor() / 4.0).max(0.25) - 0.25)
            .collect();
        let want = oracle(&scores, cols, &sizes, kk);
        let got = select(device, scores.clone(), [rows, cols, kk], &sizes, DType::I32);
        if on_cube {
            assert_eq!(got, want, "ties case {c}");
            continue;
        }
        for (r, &[n, k]) in sizes.iter().enumerate() {
            let k = k.min(n).min(kk);
            let (g, w) = (&got[r * kk..(r + 1) * kk], &want[r * kk..(r + 1) * kk]);
            let value = |ids: &[i64]| -> Vec<f32> {
                let mut v: Vec<f32> = ids.iter().map(|&i| scores[r * cols + i as usize]).collect();
                v.sort_by(f32::total_cmp);
                v
            };
            assert_eq!(value(&g[..k]), value(&w[..k]), "ties case {c} row {r}");
            assert!(
                g[..k].windows(2).all(|p| p[0] < p[1]),
                "ascending, distinct"
            );
            assert!(g[..k].iter().all(|&i| (i as usize) < n), "in range");
            assert!(
                g[k..].iter().all(|&i| i == g[0]),
                "padding repeats the first"
            );
        }
    }
}

/// Typed errors instead of panics.
#[test]
fn top_k_errors() {
    let device = Device::flex();
    let scores = || cpu(random_values(12, Dist::STANDARD, 1), [3, 4]);
    let sizes = |rows: usize| int_tensor(&vec![[4, 2]; rows], DType::I64, &device);
    assert!(matches!(
        top_k_rows(scores(), sizes(2), 2).unwrap_err(),
        KvCacheError::ShapeMismatch { .. }
    ));
    assert!(matches!(
        top_k_rows(scores(), sizes(3), 5).unwrap_err(),
        KvCacheError::ShapeMismatch { .. }
    ));
    assert_eq!(
        top_k_rows(scores().cast(DType::F16), sizes(3), 2).unwrap_err(),
        KvCacheError::NotF32("top-k scores")
    );
    assert!(top_k_rows(scores(), sizes(3), 4).is_ok());
}
