//! The quantization kernel against the reference.

use burn::tensor::{DType, Device};
use burn_kernels_core::route::{launches, require_kernels};
use burn_kernels_testing::{Dist, Tolerance, assert_close, poison_memory, random_tensor};
use burn_sage::{quantize_stage, reference};

use super::common::*;

/// The quantization kernel writes the same integers and scales as the reference. A value
/// exactly halfway between two integers may round differently after a one-ulp difference
/// in the division, so at most one element in 10⁴ may differ, by one.
pub(super) fn quantize_matches_reference(device: &Device) {
    let before = launches("sage_quantize");
    for (i, &(b, h, s, d)) in [
        (1, 1, 1, 64),
        (2, 3, 17, 64),
        (1, 2, 131, 128),
        (1, 1, 70, 256),
        (1, 4, 1000, 64),
        // Per-thread layouts: 2 · 65 600 / 2 groups, one cube each, more than one grid row of
        // 65 535 cubes holds.
        (2, 1, 65_600, 64),
    ]
    .iter()
    .enumerate()
    {
        for qk in QUANTS {
            for layout in [qk.q_layout(), qk.k_layout()] {
                let x = random_tensor::<4>(
                    [b, h, s, d],
                    Dist::PEAKY,
                    10 + i as u64,
                    DType::F32,
                    device,
                );
                let mean_block = 16;
                let nm = s.div_ceil(mean_block);
                let mean = random_tensor::<4>(
                    [b, h, nm, d],
                    Dist::STANDARD,
                    20 + i as u64,
                    DType::F32,
                    device,
                );
                let (r_ints, r_scales) =
                    reference::quantize(to_cpu(&x), to_cpu(&mean), mean_block, layout, qk.qmax());
                poison_memory(device, b * h * s * d * 2, DType::F32);
                let (ints, scales) =
                    require_kernels(|| quantize_stage(x, mean, mean_block, layout, qk.qmax()));
                let name = format!("quantize {:?} {layout:?} [{b},{h},{s},{d}]", qk);
                assert_eq!(scales.dims(), [b, h, layout.groups(s)], "{name}");
                assert_close(
                    &format!("{name} scales"),
                    &values(scales),
                    &values(r_scales),
                    Tolerance::for_dtype(DType::F32),
                );
                let (a, e) = (values(ints), values(r_ints));
                let mut off = 0;
                for (x, y) in a.iter().zip(&e) {
                    assert!(x.is_finite() && x.abs() <= qk.qmax(), "{name}: {x}");
                    if x != y {
                        assert!((x - y).abs() <= 1.0, "{name}: {x} vs {y}");
                        off += 1;
                    }
                }
                assert!(
                    off * 10_000 <= a.len(),
                    "{name}: {off} of {} differ",
                    a.len()
                );
            }
        }
    }
    // The outputs were read back: the kernel ran (through `Dispatch` and, where Burn fuses,
    // `Fusion`), and its `CubeBackend` implementation counted the launches.
    assert!(
        launches("sage_quantize") > before,
        "no quantize launch counted"
    );
}
