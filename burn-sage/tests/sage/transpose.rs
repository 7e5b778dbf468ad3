//! The `Vᵀ` copy the matrix-unit kernels read (`kernels::v_transposed_map`) against the host's
//! transpose.

use burn::tensor::{DType, Device};
use burn_kernels_testing::{Dist, float_dtypes, random_tensor};
use burn_sage::kernels::v_transposed_map;

/// `[b, h, skv, d]` to `[b·h, d, skv_pad]` with zero keys past `skv`, bit-exact in each float dtype the device has:
/// the tiled kernel (padded length a multiple of 32, head dims 64 and 128), a tail tile, one
/// key, and the plain kernel (padded length 70, head dim 24) it falls back to.
pub(super) fn v_transposed_matches_host(device: &Device) {
    for (i, &(b, h, skv, skv_pad, d)) in [
        (1, 1, 1, 32, 64),
        (2, 3, 97, 128, 128),
        (1, 2, 64, 64, 64),
        (1, 1, 61, 70, 24),
    ]
    .iter()
    .enumerate()
    {
        for dtype in float_dtypes(device) {
            let v =
                random_tensor::<4>([b, h, skv, d], Dist::STANDARD, 40 + i as u64, dtype, device);
            let want: Vec<f32> = v
                .to_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .expect("f32");
            let poisoned = b * h * d * skv_pad;
            burn_kernels_testing::poison_memory(device, poisoned * 4, DType::F32);
            let out = v_transposed_map(
                burn_kernels_testing::unfused::float(&v, device),
                dtype,
                skv_pad,
            );
            let got: Vec<f32> = burn_kernels_testing::unfused::read_float(out)
                .convert::<f32>()
                .try_to_vec::<f32>()
                .expect("f32");
            assert_eq!(got.len(), b * h * d * skv_pad, "case {i}");
            for bh in 0..b * h {
                for c in 0..d {
                    for k in 0..skv_pad {
                        let g = got[(bh * d + c) * skv_pad + k];
                        let w = if k < skv {
                            want[(bh * skv + k) * d + c]
                        } else {
                            0.0
                        };
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "case {i} {dtype:?}: head {bh}, channel {c}, key {k}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }
}
