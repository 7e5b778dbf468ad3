//! The softmax's polynomial `2^y` (`kernels::fast_exp`) against the host's `exp2`.

use burn::tensor::{Device, Tensor, TensorData};
use burn_kernels_testing::{Dist, random_values};
use burn_sage::kernels::fast_exp::{EXP2_POLY_MIN, EXP2_POLY_REL_ERR, exp2_poly_map};

/// Seeded uniform arguments over the clamp, the softmax's range and a little above it, plus
/// the edges (the clamp, integers and half-integers where the rounding flips, a masked score),
/// 1031 in all: a tail past the kernel's 256-unit cubes.
pub(super) fn exp2_poly_matches_exp2(device: &Device) {
    let mut ys = random_values(
        1020,
        Dist::Uniform {
            lo: -140.0,
            hi: 20.0,
        },
        91,
    );
    ys.extend([
        0.0, -0.5, 0.5, -1.5, -1.0, 1.0, -124.5, -125.0, -126.0, -1.0e30, 126.9,
    ]);
    let n = ys.len();
    let x = Tensor::<1>::from_data(TensorData::new(ys.clone(), [n]), device);
    let out = exp2_poly_map(burn_kernels_testing::unfused::float(&x, device));
    let got = burn_kernels_testing::unfused::read_float(out)
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32");
    let floor = (EXP2_POLY_MIN as f64).exp2();
    for (i, (&y, &g)) in ys.iter().zip(&got).enumerate() {
        let want = (y.max(EXP2_POLY_MIN) as f64).exp2();
        let rel = ((g as f64) / want - 1.0).abs();
        assert!(
            rel <= EXP2_POLY_REL_ERR as f64,
            "exp2_poly({y}) = {g} at {i}, want {want} (relative error {rel:.2e})"
        );
        if y < EXP2_POLY_MIN {
            assert!((g as f64) < 1.01 * floor, "{y} is not clamped: {g}");
        }
    }
}
