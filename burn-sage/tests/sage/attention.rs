//! The attention kernels against the tensor-op reference given the same quantization, and the
//! shared tensor-op stages on the device against the CPU's.

use burn::backend::Dispatch;
use burn::tensor::{DType, Device, Tensor};
use burn_kernels_core::route::{launches, require_kernels};
use burn_kernels_testing::{
    Tolerance, assert_close, assert_matmul_close, compare::metrics, float_dtypes, is_wgpu,
    poison_memory,
};
use burn_sage::kernels::{KernelChoice, UNIT_MAX_KV};
use burn_sage::{
    PvPrecision, QkQuant, SageKernels, SageOptions, SageOutput, SagePlan, Unsupported, plan, prep,
    reference, sage_attention, sage_kernel,
};

use super::common::*;

/// The relative rounding unit of `P̃` in the PV format: half a unit in the last place of E4M3
/// (3 mantissa bits), f16 or bf16.
pub(super) fn pv_unit(pv: PvPrecision, dtype: DType) -> f64 {
    match (pv, dtype) {
        (PvPrecision::Fp8E4m3, _) => 2f64.powi(-4),
        (PvPrecision::Fp16, DType::BF16) => 2f64.powi(-8),
        (PvPrecision::Fp16, _) => 2f64.powi(-11),
    }
}

/// Element-wise tolerance of the kernel against the reference: one rounding of `P̃` to the PV
/// format (the kernel rounds relative to the running maximum, the reference relative to the
/// final one), plus one rounding of the output into its dtype. The `P̃` rounding moves an
/// output by about the unit times its magnitude; for FP8, whose unit is large, the absolute
/// part scales with the outputs' magnitude `out_max` (max |reference|) instead of being a fixed
/// constant that an all-zero output of small magnitude could pass.
pub(super) fn pv_tolerance(pv: PvPrecision, dtype: DType, out_max: f64) -> Tolerance {
    let unit = pv_unit(pv, dtype);
    let out = Tolerance::for_dtype(dtype);
    let atol = match pv {
        PvPrecision::Fp8E4m3 => unit * out_max,
        PvPrecision::Fp16 => unit,
    };
    Tolerance {
        atol: atol + out.atol,
        rtol: unit + out.rtol,
    }
}

/// Bound on `‖kernel − reference‖₂ / ‖reference‖₂`: the two `P̃` roundings differ by at most
/// the unit relative, independently per key, so the outputs differ by about the unit over √3
/// of their norm; plus the output's rounding. A zero output is at 1, one with half its values
/// wrong at ~0.7.
pub(super) fn pv_rel_l2(pv: PvPrecision, dtype: DType) -> f64 {
    pv_unit(pv, dtype) + Tolerance::for_dtype(dtype).rtol
}

pub(super) fn attention_matches_reference(device: &Device) {
    check_default_kernels(device, CASES);
}

/// Whether `device` runs the register-tile kernel (CUDA).
fn runs_mma(device: &Device) -> bool {
    let opts = SageOptions {
        kernel: Some(KernelChoice::Mma),
        ..Default::default()
    };
    let p = plan(
        &[1, 1, 1, 64],
        &[1, 1, 1, 64],
        &[1, 1, 1, 64],
        [DType::F16; 3],
        &opts,
    )
    .expect("valid");
    sage_kernel(device, &p) == Ok(KernelChoice::Mma)
}

/// `cases` through the kernels the op picks, each kernel on its own: where the register-tile
/// kernel runs (CUDA), it is asked for by name on the head dims it takes (the op times it
/// against the other matrix-unit kernels there, see `tuned_kernel_matches_reference`, which
/// would leave the test to whichever wins) and the rest take the op's pick (the cmma kernel,
/// the only one for head dim 256); elsewhere every case takes the op's pick.
fn check_default_kernels(
    device: &Device,
    cases: &[(usize, usize, usize, usize, usize, usize, bool)],
) {
    if !runs_mma(device) {
        check_cases(device, cases, None);
        return;
    }
    let (mma, rest): (Vec<_>, Vec<_>) = cases.iter().partition(|c| matches!(c.5, 64 | 128));
    check_cases(device, &mma, Some(KernelChoice::Mma));
    check_cases(device, &rest, None);
}

pub(super) fn attention_matches_reference_long(device: &Device) {
    // On wgpu (lavapipe in CI, bound by shader compilation and a CPU oracle) the two
    // 1000-token problems run on CUDA only; the long head-dim and KV-length cases run everywhere.
    let cases = if is_wgpu(device) {
        &LONG_CASES[2..]
    } else {
        LONG_CASES
    };
    check_default_kernels(device, cases);
}

/// The shared-memory-staged cmma kernel, which the op no longer picks where the register-tile
/// kernel runs (head dims 64 and 128 on CUDA), asked for by name; runtimes without it (wgpu:
/// WGSL has no cmma) refuse it in the public API: there the refusal is what is checked (the
/// reference the op then runs on the device is checked by `attention_matches_reference_long`
/// past the portable kernel's length).
pub(super) fn cmma_kernel_matches_reference(device: &Device) {
    if is_wgpu(device) {
        assert!(matches!(
            sage_kernel(device, &cmma_plan()),
            Err(Unsupported::MatrixUnits(_))
        ));
        return;
    }
    check_cases(device, CASES, Some(KernelChoice::Cmma));
}

/// Problems for the kernel tuner: one row, GQA with a causal tail, and keys past one tile.
const TUNED_CASES: &[(usize, usize, usize, usize, usize, usize, bool)] = &[
    (1, 1, 1, 1, 1, 64, false),
    (2, 4, 2, 17, 17, 64, true),
    (1, 2, 2, 67, 131, 128, false),
];

/// The kernel picked by measurement (`KernelChoice::Tuned`, CubeCL's autotune over
/// `tune::candidates`: the matrix-unit kernels on CUDA, the portable kernel alone on wgpu)
/// against the reference on [`TUNED_CASES`]; then, for one shape, the tuner must report the
/// kernel it picked, one of the candidates.
pub(super) fn tuned_kernel_matches_reference(device: &Device) {
    check_cases(device, TUNED_CASES, Some(KernelChoice::Tuned));
    let opts = SageOptions {
        kernel: Some(KernelChoice::Tuned),
        ..Default::default()
    };
    let (q, k, v) = qkv((1, 4, 2, 40, 75, 64), DType::F32, 77, device);
    let p = plan(&q.dims(), &k.dims(), &v.dims(), [DType::F32; 3], &opts).expect("valid");
    assert_eq!(sage_kernel(device, &p), Ok(KernelChoice::Tuned));
    let client = burn_kernels_testing::unfused::cube_device(device).client();
    let candidates = burn_sage::kernels::tune::candidates(&client, &p);
    assert!(!candidates.is_empty(), "the tuner has no kernel to run");
    let out = require_kernels(|| sage_attention(q, k, v, &opts)).expect("valid");
    values(out.out);
    let picked = burn_sage::tuned_kernel(device, &p);
    assert!(
        picked.is_some_and(|k| candidates.contains(&k)),
        "the tuner picked {picked:?}, candidates {candidates:?}"
    );
}

/// Tile boundaries of the Hopper kernel's 128-query, 64-key tiles that [`CASES`] and
/// [`LONG_CASES`] miss: exact tiles, one short of a query tile with fewer keys than queries, and
/// two query tiles plus one row over five key tiles with GQA.
const WGMMA_TILE_CASES: &[(usize, usize, usize, usize, usize, usize, bool)] = &[
    (1, 2, 1, 128, 128, 128, false),
    (1, 2, 1, 127, 63, 64, false),
    (1, 4, 2, 257, 320, 128, true),
];

/// The Hopper kernel's problems: the shared and long cases of head dims 64 and 128 (the ones it
/// takes) below the portable kernel's length, and [`WGMMA_TILE_CASES`].
fn wgmma_cases() -> Vec<(usize, usize, usize, usize, usize, usize, bool)> {
    CASES
        .iter()
        .chain(LONG_CASES)
        .filter(|c| matches!(c.5, 64 | 128) && c.4 < UNIT_MAX_KV)
        .chain(WGMMA_TILE_CASES)
        .copied()
        .collect()
}

/// The Hopper kernel (warpgroup MMA, TMA loads) asked for by name. Where the device has
/// warpgroup MMA and TMA (CUDA on sm_90) it must run and match the reference on
/// [`wgmma_cases`]; elsewhere (wgpu, CUDA before Hopper) the refusal is what is checked.
pub(super) fn wgmma_kernel_matches_reference(device: &Device) {
    let features = burn_kernels_testing::unfused::cube_device(device)
        .client()
        .properties()
        .features
        .clone();
    let hopper =
        !features.matmul.wgmma.is_empty() && features.tma.contains(cubecl::features::Tma::Base);
    let opts = SageOptions {
        kernel: Some(KernelChoice::Wgmma),
        ..Default::default()
    };
    let (q, kv) = ([1, 2, 17, 64], [1, 2, 33, 64]);
    let p = plan(&q, &kv, &kv, [DType::F16; 3], &opts).expect("valid");
    let ran = sage_kernel(device, &p);
    if !hopper {
        assert!(
            matches!(ran, Err(Unsupported::MatrixUnits(_))),
            "no warpgroup MMA here, yet {ran:?}"
        );
        return;
    }
    assert_eq!(
        ran,
        Ok(KernelChoice::Wgmma),
        "a Hopper device refused the kernel"
    );
    check_cases(device, &wgmma_cases(), Some(KernelChoice::Wgmma));
}

/// A small plan that asks for the cmma kernel by name.
pub(super) fn cmma_plan() -> SagePlan {
    let opts = SageOptions {
        kernel: Some(KernelChoice::Cmma),
        ..Default::default()
    };
    let (q, kv) = ([1, 2, 17, 64], [1, 2, 33, 64]);
    plan(&q, &kv, &kv, [DType::F32; 3], &opts).expect("valid")
}

/// The CPU reference of the quantization and attention, after the shared tensor-op stages
/// (smoothing means, ΔS, V's FP8 scaling) computed on `q`'s device exactly as the call under
/// test computed them: the kernel path's ΔS by its fixed GEMM (`kernel`), the device's
/// reference fallback's by Burn's matmul. The kernels must match the reference given the same
/// f32 stages, not stages summed in another order: one ulp in a K channel's mean can move an
/// element across a rounding boundary, which for INT4 (a seventh of the group's range) moves the
/// 1000×1000 causal output by up to 6e-3 (CPU: the reference with f32-summed vs f64-rounded K
/// means, 5 seeds: 0 to 193 outputs past 1e-3, the worst exactly where the kernel on an H200
/// "differed"); TF32 in Burn's matmul moves ΔS, hence the scores, by ~2⁻¹¹ relative. The stages
/// themselves are checked against the CPU's in `shared_stages_match_reference`.
pub(super) fn reference_after_device_stages(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    p: &SagePlan,
    kernel: bool,
) -> SageOutput {
    let stages = if kernel {
        let fixed_gemm = |a: Tensor<4>, b: Tensor<4>| {
            Tensor::from_dispatch(Dispatch::sage_fixed_matmul(
                a.into_dispatch(),
                b.into_dispatch(),
            ))
        };
        prep::prepare_with(q, k, v, p, fixed_gemm)
    } else {
        prep::prepare(q, k, v, p)
    };
    let cpu = |x: Tensor<4>| to_cpu(&x);
    let stages = prep::Prepared {
        q_mean: cpu(stages.q_mean),
        k_mean: cpu(stages.k_mean),
        delta_s: stages.delta_s.map(cpu),
        v: cpu(stages.v),
        post: cpu(stages.post),
    };
    let (out, lse) = reference::sage_attention_prepared(to_cpu(q), to_cpu(k), &stages, p);
    SageOutput {
        out: out.cast(p.dtype),
        lse: p.opts.return_lse.then_some(lse),
    }
}

/// The shared tensor-op stages on the device against the CPU's: the smoothing means and ΔS
/// within f32 reduction tolerances (ΔS a product over the head dim of means over the rows),
/// V's FP8 scaling within f32 rounding.
pub(super) fn shared_stages_match_reference(device: &Device) {
    for (i, &(b, hq, hkv, sq, skv, d, causal)) in
        [CASES[2], CASES[4], LONG_CASES[0]].iter().enumerate()
    {
        let (q, k, v) = qkv((b, hq, hkv, sq, skv, d), DType::F32, 900 + i as u64, device);
        for pv in [PvPrecision::Fp16, PvPrecision::Fp8E4m3] {
            let opts = SageOptions {
                causal,
                pv,
                smooth_q: true,
                ..Default::default()
            };
            let p = plan(&q.dims(), &k.dims(), &v.dims(), [DType::F32; 3], &opts).expect("valid");
            let dev = prep::prepare(&q, &k, &v, &p);
            let cpu = prep::prepare(&to_cpu(&q), &to_cpu(&k), &to_cpu(&v), &p);
            let name = format!("stages [{b},{hq}/{hkv},{sq}x{skv},{d}] {pv:?}");
            let rows = Tolerance::for_reduction(DType::F32, sq.max(skv));
            let check = |what: &str, a: Tensor<4>, e: Tensor<4>, tol: Tolerance| {
                assert_eq!(a.dims(), e.dims(), "{name} {what}");
                assert_close(&format!("{name} {what}"), &values(a), &values(e), tol);
            };
            let (q_mean, k_mean) = (to_cpu(&dev.q_mean), to_cpu(&dev.k_mean));
            check("q_mean", dev.q_mean, cpu.q_mean, rows);
            check("k_mean", dev.k_mean, cpu.k_mean, rows);
            // ΔS = mean(Q block)·(K − mean(K))ᵀ: a product over the head dim, checked from the
            // device's means (checked above) so that their rounding does not count twice.
            let nmq = q_mean.dims()[2];
            let delta_s = q_mean
                .reshape([b, hkv, hq / hkv * nmq, d])
                .matmul((to_cpu(&k) - k_mean).swap_dims(2, 3))
                .reshape([b, hq, nmq, skv]);
            assert_matmul_close(
                &format!("{name} delta_s"),
                &values(dev.delta_s.expect("smoothed")),
                &values(delta_s),
                d,
                device,
            );
            check("v", dev.v, cpu.v, Tolerance::for_dtype(DType::F32));
            check("post", dev.post, cpu.post, Tolerance::for_dtype(DType::F32));
        }
    }
}

/// Checks `sage_attention` against the CPU reference on `cases`, with `kernel` asked for by
/// name where given. Where the device does not run that kernel ([`sage_kernel`] says why: a
/// missing hardware feature, or past the portable kernel's longest KV length), the public API
/// runs its tensor-op reference on the device, which is then what is checked (against the
/// CPU's); everywhere else the kernel is required to run, and its launch is counted.
pub(super) fn check_cases(
    device: &Device,
    cases: &[(usize, usize, usize, usize, usize, usize, bool)],
    kernel: Option<KernelChoice>,
) {
    let mut seed = 100;
    for &(b, hq, hkv, sq, skv, d, causal) in cases {
        for dtype in float_dtypes(device) {
            for (qk, pv, smooth_q) in [
                (QkQuant::Int8PerWarp, PvPrecision::Fp16, false),
                (QkQuant::Int8PerBlock, PvPrecision::Fp8E4m3, true),
                (QkQuant::Int8PerThread, PvPrecision::Fp16, true),
                (QkQuant::Int4PerThread, PvPrecision::Fp8E4m3, false),
                // INT4 with FP16 P·V (no FP8 bound to hide behind).
                (QkQuant::Int4PerThread, PvPrecision::Fp16, false),
            ] {
                seed += 1;
                // On wgpu (lavapipe in CI: each variant compiles its own kernels) 16-bit inputs
                // run the default variant (INT8 per thread, smoothed Q, FP16 P·V); CUDA runs all.
                if dtype != DType::F32
                    && is_wgpu(device)
                    && (qk, pv) != (QkQuant::Int8PerThread, PvPrecision::Fp16)
                {
                    continue;
                }
                let (q, k, v) = qkv((b, hq, hkv, sq, skv, d), dtype, seed, device);
                let opts = SageOptions {
                    causal,
                    qk,
                    pv,
                    smooth_q,
                    return_lse: true,
                    kernel,
                    ..Default::default()
                };
                let p = plan(&q.dims(), &k.dims(), &v.dims(), [dtype; 3], &opts).expect("valid");
                let ran = sage_kernel(device, &p);
                // A kernel asked for that this runtime or shape does not take must fall back to
                // the reference (checked against the CPU reference below), never to another
                // kernel. The only configurations no kernel takes here: the cmma kernel asked
                // for on a runtime without cmma (wgpu), the portable kernel past its longest KV
                // length (where the matrix-unit kernels do not run, as on wgpu).
                match (&ran, kernel) {
                    (Ok(r), Some(k)) => assert_eq!(*r, k, "{k:?} asked for, {r:?} runs"),
                    (Ok(_), None) => {}
                    (Err(Unsupported::MatrixUnits(_)), Some(KernelChoice::Cmma)) => {}
                    (Err(Unsupported::MatrixUnits(_)), Some(KernelChoice::Wgmma)) => {}
                    (Err(Unsupported::UnitKernelLength(n)), None) => assert!(*n > UNIT_MAX_KV),
                    (Err(why), _) => panic!("{kernel:?} asked for: no kernel runs: {why}"),
                }
                poison_memory(device, b * hq * sq * d * 2, dtype);
                let run = || sage_attention(q.clone(), k.clone(), v.clone(), &opts).expect("valid");
                let (actual, counted) = match &ran {
                    Ok(r) => (
                        require_kernels(run),
                        Some((kernel_op(*r), launches(kernel_op(*r)))),
                    ),
                    Err(_) => (run(), None),
                };
                let name = format!(
                    "sage {ran:?} [{b},{hq}/{hkv},{sq}x{skv},{d}] causal={causal} {dtype:?} {qk:?} {pv:?} smooth_q={smooth_q}"
                );
                let expected = reference_after_device_stages(&q, &k, &v, &p, ran.is_ok());
                assert_eq!(actual.out.dtype(), dtype, "{name}");
                let (out, reference) = (values(actual.out), values(expected.out));
                let out_max = reference.iter().fold(0f64, |m, x| m.max(x.abs() as f64));
                assert_close(&name, &out, &reference, pv_tolerance(pv, dtype, out_max));
                let m = metrics(&out, &reference);
                assert!(
                    m.rel_l2 <= pv_rel_l2(pv, dtype),
                    "{name}: relative L2 error {:.3e} above {:.3e} ({m})",
                    m.rel_l2,
                    pv_rel_l2(pv, dtype)
                );
                assert_close(
                    &format!("{name} lse"),
                    &values(actual.lse.expect("asked for")),
                    &values(expected.lse.expect("asked for")),
                    Tolerance::for_reduction(DType::F32, skv),
                );
                // The outputs were read back: the kernel that was picked did run.
                if let Some((op, before)) = counted {
                    assert!(launches(op) > before, "{name}: no {op} launch counted");
                }
            }
        }
    }
}
