//! Accuracy against exact attention (the paper's metrics) and large magnitudes.

use burn::tensor::{DType, Device};
use burn_kernels_testing::float_dtypes;
use burn_sage::{Accuracy, PvPrecision, QkQuant, SageOptions, reference, sage_attention};

use super::common::*;

/// The paper's accuracy metrics against exact f32 attention, and the bars:
/// INT8 + FP16 cos sim ≥ 0.9995, INT8 + FP8 ≥ 0.999. Returns the table rows.
pub(super) fn accuracy_table(
    device: &Device,
    shapes: &[(usize, usize, usize, usize, usize, usize, bool)],
) {
    println!("| shape | causal | Q,K | PV | cos sim | rel L1 | RMSE |");
    println!("|---|---|---|---|---|---|---|");
    for (i, &(b, hq, hkv, sq, skv, d, causal)) in shapes.iter().enumerate() {
        let (q, k, v) = qkv((b, hq, hkv, sq, skv, d), DType::F32, 500 + i as u64, device);
        let scale = 1.0 / (d as f32).sqrt();
        // The exact output comes from the CPU: the oracle should not share the device under test.
        let (exact, _) =
            reference::exact_attention(to_cpu(&q), to_cpu(&k), to_cpu(&v), causal, scale);
        let exact = values(exact);
        for qk in QUANTS {
            for pv in [PvPrecision::Fp16, PvPrecision::Fp8E4m3] {
                let opts = SageOptions {
                    causal,
                    qk,
                    pv,
                    ..Default::default()
                };
                let out = kernels_where_possible(device, || {
                    sage_attention(q.clone(), k.clone(), v.clone(), &opts).expect("valid")
                });
                let acc = Accuracy::of(&values(out.out), &exact);
                println!(
                    "| [{b},{hq}/{hkv},{sq}x{skv},{d}] | {causal} | {} | {pv:?} | {:.5} | {:.4} | {:.4} |",
                    qk.name(),
                    acc.cos_sim,
                    acc.rel_l1,
                    acc.rmse
                );
                // The issue sets no bar for INT4 (reported per layer). Its 7 levels a side give
                // cos sim 0.977-0.990 and rel L1 0.14-0.21 on these inputs (H100, 2026-11-22,
                // and the CPU): the bars sit just outside, where a few wrong rows already fail.
                let (bar, l1_bar) = match (qk, pv) {
                    (QkQuant::Int4PerThread, _) => (0.97, 0.25),
                    (_, PvPrecision::Fp16) => (0.9995, 0.03),
                    (_, PvPrecision::Fp8E4m3) => (0.999, 0.05),
                };
                assert!(acc.cos_sim >= bar, "{qk:?} {pv:?}: {acc} below {bar}");
                assert!(
                    acc.rel_l1 <= l1_bar,
                    "{qk:?} {pv:?}: {acc} above rel L1 {l1_bar}"
                );
            }
        }
    }
}

pub(super) fn accuracy_vs_exact(device: &Device) {
    accuracy_table(device, &LONG_CASES[..2]);
    accuracy_table(
        device,
        &[(1, 4, 2, 257, 257, 64, true), (1, 2, 1, 17, 200, 256, true)],
    );
}

/// Inputs scaled by 10³ (f32) or 10² (f16/bf16): scores in the 10⁶ range still give finite,
/// bounded outputs (the online softmax subtracts its running maximum).
pub(super) fn large_magnitudes_stay_finite(device: &Device) {
    for dtype in float_dtypes(device) {
        let mag = if dtype == DType::F32 { 1000.0 } else { 100.0 };
        let (q, k, v) = qkv((1, 2, 1, 33, 65, 64), dtype, 900, device);
        let vmax = values(v.clone()).iter().fold(0f32, |m, x| m.max(x.abs()));
        for pv in [PvPrecision::Fp16, PvPrecision::Fp8E4m3] {
            let opts = SageOptions {
                causal: true,
                pv,
                return_lse: true,
                ..Default::default()
            };
            let (qm, km) = (q.clone() * mag, k.clone() * mag);
            let out = kernels_where_possible(device, || {
                sage_attention(qm, km, v.clone(), &opts).expect("valid")
            });
            // An output is a convex combination of V rows up to the rounding of P̃: f16 P̃
            // is within 2⁻¹¹ of P, E4M3 P̃ within 2⁻⁴ (3 mantissa bits), relative.
            let bound = match pv {
                PvPrecision::Fp16 => vmax * 1.01,
                PvPrecision::Fp8E4m3 => vmax * (1.0 + 2f32.powi(-4)) * 1.01,
            };
            for x in values(out.out) {
                assert!(
                    x.is_finite() && x.abs() <= bound,
                    "{dtype:?} {pv:?}: {x} (max |v| {vmax})"
                );
            }
            for x in values(out.lse.expect("asked for")) {
                assert!(x.is_finite(), "{dtype:?} {pv:?} lse: {x}");
            }
        }
    }
}
