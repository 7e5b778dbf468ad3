//! ShadowKV's landmark scoring (`landmark_scores`): the kernel against the tensor-op reference
//! on the CPU, fed the values the kernel sees.

use burn::tensor::{DType, Device, Int, Tensor, TensorCreationOptions, TensorData};
use burn_kernels_testing::{
    Dist, Tolerance, assert_close, compare::to_f32, float_dtypes, poison_memory, random_values,
};
use burn_kvcache::{KvCacheError, landmark_scores, reference};

use crate::{assert_launched, cpu, launch_counts, on_kernels, tensor};

/// `(b, hq, h, sq, t, dd)` and each row's landmark count (cycled): one landmark, two cubes of
/// 256 with a tail, a row with no landmarks (the reference's uniform softmax), several query
/// positions a head, a head dim of 256 (the bound scoring's `[max | min]`), and one of 40 (a
/// tail of the 16-column staging) with 10 query rows a KV head. Groups of more than 16 query
/// rows take the reference with a log line, which the kernel tests refuse.
type Shape6 = (usize, usize, usize, usize, usize, usize);

const CASES: &[(Shape6, &[usize])] = &[
    ((1, 4, 1, 1, 1, 8), &[1]),
    ((2, 8, 2, 1, 300, 128), &[300, 257, 1, 0]),
    ((1, 6, 3, 3, 600, 64), &[513, 600, 77]),
    ((2, 4, 2, 2, 33, 256), &[33, 5]),
    ((1, 2, 1, 5, 259, 40), &[259]),
];

pub(super) fn landmark_scores_match_reference(device: &Device) {
    let before = launch_counts(["shadowkv_landmark_scores"]);
    for dtype in float_dtypes(device) {
        for (c, &((b, hq, h, sq, t, dd), counts)) in CASES.iter().enumerate() {
            let seed = 700 + 10 * c as u64;
            let qv = random_values(b * hq * sq * dd, Dist::STANDARD, seed);
            let lv = random_values(b * h * t * dd, Dist::STANDARD, seed + 1);
            let n: Vec<i32> = (0..b * h)
                .flat_map(|r| [counts[r % counts.len()] as i32, 1])
                .collect();
            let scale = 1.0 / (dd as f32).sqrt();
            let q = Tensor::<4>::from_data(TensorData::new(qv.clone(), [b, hq, sq, dd]), device);
            let l = tensor::<4>(lv, [b, h, t, dd], dtype, device);
            let sizes = |dev: &Device| {
                Tensor::<2, Int>::from_data(
                    TensorData::new(n.clone(), [b * h, 2]),
                    TensorCreationOptions::new(dev.clone()).with_dtype(DType::I32),
                )
            };
            let want = reference::landmark_scores(
                cpu(qv, [b, hq, sq, dd]),
                cpu(to_f32(l.to_data()), [b, h, t, dd]),
                sizes(&Device::flex()),
                scale,
            );
            poison_memory(device, 4 * b * h * t * (hq / h * sq + 1), DType::F32);
            let got =
                on_kernels(device, || landmark_scores(q, l, sizes(device), scale)).expect("valid");
            assert_eq!(got.dims(), [b * h, t]);
            let name = format!("landmark scores case {c} {dtype:?}");
            // The logits sum `dd` products, the softmax `t` exponentials.
            let tol = Tolerance::for_reduction(DType::F32, dd + t);
            assert_close(
                &name,
                &to_f32(got.into_data()),
                &to_f32(want.into_data()),
                tol,
            );
        }
    }
    assert_launched(device, ["shadowkv_landmark_scores"], before);
    let q = Tensor::<4>::zeros([1, 4, 1, 8], device);
    let l = Tensor::<4>::zeros([1, 3, 5, 8], device);
    let sizes = Tensor::<2, Int>::zeros([3, 2], device);
    assert!(matches!(
        landmark_scores(q, l, sizes, 1.0),
        Err(KvCacheError::ShapeMismatch { .. })
    ));
}
