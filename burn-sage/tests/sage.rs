//! Sage attention: the kernels against the tensor-op reference (same quantization) on every
//! enabled runtime, accuracy against exact attention (the paper's metrics), special values,
//! and typed errors.

// Without a CubeCL runtime feature only the CPU tests run; the kernel tests are unused.
#![cfg_attr(not(feature = "cube"), allow(dead_code, unused_imports))]

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_kernels_core::route::{cube_device, launches, require_kernels};
use burn_kernels_testing::{
    Dist, Tolerance, assert_close, assert_matmul_close, compare::metrics, compare::to_f32,
    float_dtypes, is_cuda, is_wgpu, poison_memory, random_tensor, random_values, testgen,
};
use burn_sage::kernels::{KernelChoice, UNIT_MAX_KV};
use burn_sage::{
    Accuracy, GroupLayout, PvPrecision, QkQuant, SageError, SageOptions, SageOutput, SagePlan,
    Unsupported, plan, prep, quantize_stage, reference, sage_attention, sage_kernel,
};

const QUANTS: [QkQuant; 4] = [
    QkQuant::Int8PerBlock,
    QkQuant::Int8PerWarp,
    QkQuant::Int8PerThread,
    QkQuant::Int4PerThread,
];

/// `(batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal)`: 1s, primes, tails of every
/// block size, GQA, q_len ≠ kv_len (decode-like), each head dim.
const CASES: &[(usize, usize, usize, usize, usize, usize, bool)] = &[
    (1, 1, 1, 1, 1, 64, false),
    (1, 2, 1, 1, 37, 64, true),
    (2, 4, 2, 17, 17, 64, true),
    (1, 3, 1, 17, 70, 128, true),
    (1, 2, 2, 67, 131, 128, false),
    (2, 2, 1, 129, 129, 128, true),
    (1, 2, 1, 33, 65, 256, false),
];

/// Longer problems: the 1000, a head dim of 256 past the few hundred keys where the
/// portable kernel used to stop short on lavapipe (its per-channel loops used up lavapipe's
/// budget of 65 535 loop iterations per invocation), decode steps at the portable kernel's
/// longest KV length and past it (the reference).
const LONG_CASES: &[(usize, usize, usize, usize, usize, usize, bool)] = &[
    (1, 4, 2, 1000, 1000, 64, true),
    (1, 2, 2, 1000, 1000, 128, false),
    (1, 2, 1, 17, 600, 256, true),
    (1, 2, 1, 2, UNIT_MAX_KV, 64, true),
    (1, 2, 1, 1, UNIT_MAX_KV + 1000, 64, false),
];

/// Q, K, V like a model's: K carries a large per-channel offset shared by all tokens (what K
/// smoothing removes), Q and V are plain normals.
fn qkv(
    shape: (usize, usize, usize, usize, usize, usize),
    dtype: DType,
    seed: u64,
    device: &Device,
) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    let (b, hq, hkv, sq, skv, d) = shape;
    let q = random_tensor::<4>([b, hq, sq, d], Dist::STANDARD, seed, dtype, device);
    let bias = random_values(
        hkv * d,
        Dist::Normal {
            mean: 0.0,
            std: 4.0,
        },
        seed + 1,
    );
    let k: Vec<f32> = random_values(b * hkv * skv * d, Dist::STANDARD, seed + 2)
        .into_iter()
        .enumerate()
        .map(|(i, x)| {
            let h = (i / (skv * d)) % hkv;
            x + bias[h * d + i % d]
        })
        .collect();
    let k = Tensor::<4>::from_data(
        TensorData::new(k, [b, hkv, skv, d]).convert_dtype(dtype),
        burn::tensor::TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    );
    let v = random_tensor::<4>([b, hkv, skv, d], Dist::STANDARD, seed + 3, dtype, device);
    (q, k, v)
}

/// `x`'s values as f32 on the CPU (`Flex`), where the reference runs as the oracle.
fn to_cpu(x: &Tensor<4>) -> Tensor<4> {
    Tensor::from_data(x.to_data().convert::<f32>(), &Device::flex())
}

/// Runs `f` with kernels required where `device` runs kernels (a CubeCL device): the calls
/// in it must not take the reference there. On the CPU they take the reference anyway.
fn kernels_where_possible<T>(device: &Device, f: impl FnOnce() -> T) -> T {
    if cube_device(device).is_some() {
        require_kernels(f)
    } else {
        f()
    }
}

/// The launch counter of `kernel`'s attention op (see the `CubeBackend` implementation).
fn kernel_op(kernel: KernelChoice) -> &'static str {
    match kernel {
        KernelChoice::Unit => "sage_attention_unit",
        KernelChoice::Cmma => "sage_attention_cmma",
        KernelChoice::Mma => "sage_attention_mma",
    }
}

fn values<const D: usize>(x: Tensor<D>) -> Vec<f32> {
    to_f32(x.cast(DType::F32).into_data())
}

/// The quantization kernel writes the same integers and scales as the reference. A value
/// exactly halfway between two integers may round differently after a one-ulp difference
/// in the division, so at most one element in 10⁴ may differ, by one.
fn quantize_matches_reference(device: &Device) {
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

/// The relative rounding unit of `P̃` in the PV format: half a unit in the last place of E4M3
/// (3 mantissa bits), f16 or bf16.
fn pv_unit(pv: PvPrecision, dtype: DType) -> f64 {
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
fn pv_tolerance(pv: PvPrecision, dtype: DType, out_max: f64) -> Tolerance {
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
fn pv_rel_l2(pv: PvPrecision, dtype: DType) -> f64 {
    pv_unit(pv, dtype) + Tolerance::for_dtype(dtype).rtol
}

fn attention_matches_reference(device: &Device) {
    check_cases(device, CASES, None);
}

fn attention_matches_reference_long(device: &Device) {
    // On wgpu (lavapipe in CI, bound by shader compilation and a CPU oracle) the two
    // 1000-token problems run on CUDA only; the long head-dim and KV-length cases run everywhere.
    let cases = if is_wgpu(device) {
        &LONG_CASES[2..]
    } else {
        LONG_CASES
    };
    check_cases(device, cases, None);
}

/// The shared-memory-staged cmma kernel, which the op no longer picks where the register-tile
/// kernel runs (head dims 64 and 128 on CUDA), asked for by name; runtimes without it (wgpu:
/// WGSL has no cmma) refuse it in the public API: there the refusal is what is checked (the
/// reference the op then runs on the device is checked by `attention_matches_reference_long`
/// past the portable kernel's length).
fn cmma_kernel_matches_reference(device: &Device) {
    if is_wgpu(device) {
        assert!(matches!(
            sage_kernel(device, &cmma_plan()),
            Err(Unsupported::MatrixUnits(_))
        ));
        return;
    }
    check_cases(device, CASES, Some(KernelChoice::Cmma));
}

/// A small plan that asks for the cmma kernel by name.
fn cmma_plan() -> SagePlan {
    let opts = SageOptions {
        kernel: Some(KernelChoice::Cmma),
        ..Default::default()
    };
    let (q, kv) = ([1, 2, 17, 64], [1, 2, 33, 64]);
    plan(&q, &kv, &kv, [DType::F32; 3], &opts).expect("valid")
}

/// The CPU reference of the quantization and attention, after the shared tensor-op stages
/// (smoothing means, ΔS, V's FP8 scaling) computed on `q`'s device, as the kernel path does:
/// the kernels must match the reference given the same f32 means, not means summed in another
/// order. One ulp in a K channel's mean can move an element across a rounding boundary, which
/// for INT4 (a seventh of the group's range) moves the 1000×1000 causal output by up to 6e-3
/// (CPU: the reference with f32-summed vs f64-rounded K means, 5 seeds: 0 to 193 outputs past
/// 1e-3, the worst exactly where the kernel on an H200 "differed"). The stages themselves are
/// checked against the CPU's in `shared_stages_match_reference`.
fn reference_after_device_stages(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    p: &SagePlan,
) -> SageOutput {
    let stages = prep::prepare(q, k, v, p);
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
fn shared_stages_match_reference(device: &Device) {
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
fn check_cases(
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
                let expected = reference_after_device_stages(&q, &k, &v, &p);
                assert_eq!(actual.out.dtype(), dtype, "{name}");
                // The smoothing stages (Q's block means, ΔS = mean(Q)·Kᵀ) run on the device in
                // another summation order than the CPU reference (and in TF32 where Burn's f32
                // matmul uses it; TF32 exists on CUDA only). Either can move a smoothed Q entry across an INT8 rounding
                // boundary, one quantization level, which shifts that row's scores. Seen on an
                // H200 with exact f32 matmuls (2026-11-27): LSE 1.7e-4 from the reference at 4.5,
                // one output of 256000 off by 5.8e-4. The widening (2⁻¹⁰ absolute, TF32's
                // relative) is the bound these tests had on CUDA before; a wrong or unwritten
                // output is off by O(1).
                let device_smoothing = smooth_q && is_cuda(device);
                let widen = |t: Tolerance| {
                    if device_smoothing {
                        Tolerance {
                            atol: t.atol + 2f64.powi(-10),
                            rtol: t.rtol + Tolerance::tf32().rtol,
                        }
                    } else {
                        t
                    }
                };
                let (out, reference) = (values(actual.out), values(expected.out));
                let out_max = reference.iter().fold(0f64, |m, x| m.max(x.abs() as f64));
                assert_close(
                    &name,
                    &out,
                    &reference,
                    widen(pv_tolerance(pv, dtype, out_max)),
                );
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
                    widen(Tolerance::for_reduction(DType::F32, skv)),
                );
                // The outputs were read back: the kernel that was picked did run.
                if let Some((op, before)) = counted {
                    assert!(launches(op) > before, "{name}: no {op} launch counted");
                }
            }
        }
    }
}

/// The paper's accuracy metrics against exact f32 attention, and the bars:
/// INT8 + FP16 cos sim ≥ 0.9995, INT8 + FP8 ≥ 0.999. Returns the table rows.
fn accuracy_table(device: &Device, shapes: &[(usize, usize, usize, usize, usize, usize, bool)]) {
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

fn accuracy_vs_exact(device: &Device) {
    accuracy_table(device, &LONG_CASES[..2]);
    accuracy_table(
        device,
        &[(1, 4, 2, 257, 257, 64, true), (1, 2, 1, 17, 200, 256, true)],
    );
}

/// Inputs scaled by 10³ (f32) or 10² (f16/bf16): scores in the 10⁶ range still give finite,
/// bounded outputs (the online softmax subtracts its running maximum).
fn large_magnitudes_stay_finite(device: &Device) {
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

/// The extension called on the unfused `CubeBackend` directly (outside Burn's `Dispatch` and
/// `Fusion`) gives what the public op gives through them: the tensor-op stages run on the
/// device as the op runs them (ΔS by the extension's fixed GEMM, here called unfused too), then
/// the attention op (with and without the LSE output) and the quantization op run on
/// `CubeBackend` primitives.
#[cfg(feature = "cube")]
fn unfused_matches_dispatch(device: &Device) {
    use burn_cubecl::CubeBackend;
    use burn_kernels_testing::unfused::{float, read_float};
    use burn_sage::SageKernels;

    let (b, hq, hkv, sq, skv, d) = (2, 4, 2, 17, 33, 64);
    let from = |data: TensorData| Tensor::<4>::from_data(data, device);
    for (qk, pv, smooth_q, return_lse) in [
        (QkQuant::Int8PerThread, PvPrecision::Fp16, true, true),
        (QkQuant::Int8PerBlock, PvPrecision::Fp8E4m3, false, false),
    ] {
        let (q, k, v) = qkv((b, hq, hkv, sq, skv, d), DType::F32, 700, device);
        let opts = SageOptions {
            causal: true,
            qk,
            pv,
            smooth_q,
            return_lse,
            ..Default::default()
        };
        let p = plan(&q.dims(), &k.dims(), &v.dims(), [DType::F32; 3], &opts).expect("valid");
        let kernel = sage_kernel(device, &p).expect("a kernel takes this configuration");
        let fused = require_kernels(|| sage_attention(q.clone(), k.clone(), v.clone(), &opts))
            .expect("valid");

        let fixed_matmul = |a: Tensor<4>, b: Tensor<4>| {
            from(read_float(CubeBackend::sage_fixed_matmul(
                float(&a, device),
                float(&b, device),
            )))
        };
        let prep = burn_sage::prep::prepare_with(&q, &k, &v, &p, fixed_matmul);
        let delta_s = prep
            .delta_s
            .clone()
            .unwrap_or_else(|| Tensor::<4>::zeros([1, 1, 1, 1], device).cast(DType::F32));
        let args = [
            &q,
            &k,
            &prep.q_mean,
            &prep.k_mean,
            &delta_s,
            &prep.v,
            &prep.post,
        ]
        .map(|t| float(t, device));
        let [uq, uk, uqm, ukm, uds, uv, upost] = args;
        let name = format!("unfused {kernel:?} {qk:?} {pv:?} smooth_q={smooth_q}");
        let (out, lse) = if return_lse {
            let (out, lse) = CubeBackend::sage_attention_lse(
                uq,
                uk,
                uqm,
                ukm,
                uds,
                uv,
                upost,
                p.clone(),
                kernel,
            );
            (out, Some(lse))
        } else {
            let out =
                CubeBackend::sage_attention(uq, uk, uqm, ukm, uds, uv, upost, p.clone(), kernel);
            (out, None)
        };
        let out = read_float(out);
        assert_eq!(out.shape().dims::<4>(), [b, hq, sq, d], "{name}");
        assert_close(
            &name,
            &to_f32(out),
            &values(fused.out),
            Tolerance::for_dtype(DType::F32),
        );
        assert_eq!(lse.is_some(), fused.lse.is_some(), "{name}");
        if let (Some(lse), Some(fused_lse)) = (lse, fused.lse) {
            let lse = read_float(lse);
            assert_eq!(lse.shape().dims::<3>(), [b, hq, sq], "{name} lse");
            assert_close(
                &format!("{name} lse"),
                &to_f32(lse),
                &values(fused_lse),
                Tolerance::for_dtype(DType::F32),
            );
        }

        // The quantization op, unfused against the public op.
        let layout = qk.k_layout();
        let (ints, scales) = require_kernels(|| {
            quantize_stage(k.clone(), prep.k_mean.clone(), skv, layout, qk.qmax())
        });
        let (u_ints, u_scales) = CubeBackend::sage_quantize(
            float(&k, device),
            float(&prep.k_mean, device),
            skv,
            layout,
            qk.qmax(),
        );
        let (u_ints, u_scales) = (read_float(u_ints), read_float(u_scales));
        assert_eq!(u_scales.shape().dims::<3>(), [b, hkv, layout.groups(skv)]);
        assert_close(
            &format!("{name} quantize ints"),
            &to_f32(u_ints),
            &values(ints),
            Tolerance::for_dtype(DType::F32),
        );
        assert_close(
            &format!("{name} quantize scales"),
            &to_f32(u_scales),
            &values(scales),
            Tolerance::for_dtype(DType::F32),
        );
    }
}

/// On an autodiff device the kernels (which have no backward) are refused with a reason, and
/// the reference runs there.
fn autodiff_runs_reference(device: &Device) {
    let (q, k, v) = qkv((1, 2, 1, 17, 33, 64), DType::F32, 800, device);
    let opts = SageOptions {
        causal: true,
        return_lse: true,
        ..Default::default()
    };
    let p = plan(&q.dims(), &k.dims(), &v.dims(), [DType::F32; 3], &opts).expect("valid");
    assert_eq!(sage_kernel(device, &p), Err(Unsupported::Autodiff));
    let expected = sage_attention(to_cpu(&q), to_cpu(&k), to_cpu(&v), &opts).expect("valid");
    let actual = sage_attention(q, k, v, &opts).expect("valid");
    assert_close(
        "autodiff",
        &values(actual.out),
        &values(expected.out),
        pv_tolerance(opts.pv, DType::F32, 0.0),
    );
    assert_close(
        "autodiff lse",
        &values(actual.lse.expect("asked for")),
        &values(expected.lse.expect("asked for")),
        Tolerance::for_reduction(DType::F32, 33),
    );
}

testgen! {
    backend: [
        quantize_matches_reference,
        shared_stages_match_reference,
        attention_matches_reference,
        attention_matches_reference_long,
        cmma_kernel_matches_reference,
        accuracy_vs_exact,
        large_magnitudes_stay_finite,
        unfused_matches_dispatch,
    ],
    autodiff: [autodiff_runs_reference],
}

#[test]
fn cpu_reference_accuracy() {
    accuracy_table(&Device::flex(), &[(1, 2, 1, 257, 257, 64, true)]);
}

#[test]
fn cpu_large_magnitudes() {
    large_magnitudes_stay_finite(&Device::flex());
}

/// The CPU runs no kernel; the public API says so.
#[test]
fn cpu_runs_no_kernel() {
    let s = [1, 2, 5, 64];
    let p = plan(&s, &s, &s, [DType::F32; 3], &SageOptions::default()).expect("valid");
    assert_eq!(
        sage_kernel(&Device::flex(), &p),
        Err(Unsupported::NoKernels)
    );
}

#[test]
fn bad_input_gives_typed_errors() {
    let dev = Device::flex();
    let t = |s: [usize; 4]| Tensor::<4>::ones(s, &dev);
    let ok = SageOptions::default();
    let err = |q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, o: &SageOptions| {
        sage_attention(q, k, v, o).expect_err("must be rejected")
    };
    let r3 = Tensor::<3>::ones([2, 3, 64], &dev);
    assert_eq!(
        sage_attention(r3.clone(), r3.clone(), r3, &ok).expect_err("rank 3"),
        SageError::Rank { name: "q", rank: 3 }
    );
    assert!(matches!(
        err(t([1, 2, 5, 64]), t([1, 2, 5, 32]), t([1, 2, 5, 32]), &ok),
        SageError::HeadDimMismatch { .. }
    ));
    assert!(matches!(
        err(t([1, 3, 5, 64]), t([1, 2, 5, 64]), t([1, 2, 5, 64]), &ok),
        SageError::KvHeadsNotDividing {
            q_heads: 3,
            kv_heads: 2
        }
    ));
    assert!(matches!(
        err(t([1, 2, 5, 64]), t([2, 2, 5, 64]), t([2, 2, 5, 64]), &ok),
        SageError::BatchMismatch { .. }
    ));
    assert!(matches!(
        err(t([1, 2, 5, 64]), t([1, 2, 5, 64]), t([1, 2, 6, 64]), &ok),
        SageError::KvShapeMismatch { .. }
    ));
    let causal = SageOptions { causal: true, ..ok };
    assert!(matches!(
        err(
            t([1, 2, 9, 64]),
            t([1, 2, 5, 64]),
            t([1, 2, 5, 64]),
            &causal
        ),
        SageError::CausalQueryLongerThanKeys {
            q_len: 9,
            kv_len: 5
        }
    ));
    let bad_scale = SageOptions {
        scale: Some(f32::NAN),
        ..ok
    };
    assert!(matches!(
        err(
            t([1, 2, 5, 64]),
            t([1, 2, 5, 64]),
            t([1, 2, 5, 64]),
            &bad_scale
        ),
        SageError::InvalidScale(_)
    ));
    assert!(matches!(
        err(t([1, 2, 0, 64]), t([1, 2, 5, 64]), t([1, 2, 5, 64]), &ok),
        SageError::Empty { .. }
    ));
    let s = [1, 2, 5, 64];
    assert!(matches!(
        plan(&s, &s, &s, [DType::F32, DType::F16, DType::F32], &ok),
        Err(SageError::DtypeMismatch { .. })
    ));
    assert!(matches!(
        plan(&s, &s, &s, [DType::I32, DType::I32, DType::I32], &ok),
        Err(SageError::DtypeMismatch { .. })
    ));
}

#[test]
fn group_layouts_cover_every_row_once() {
    for qk in QUANTS {
        for layout in [qk.q_layout(), qk.k_layout()] {
            let GroupLayout { block, interleave } = layout;
            assert_eq!(block % interleave, 0);
            for rows in [1, 15, 16, 17, 64, 129] {
                let mut sizes = vec![0; layout.groups(rows)];
                for r in 0..rows {
                    sizes[layout.group_of(r)] += 1;
                }
                assert!(
                    sizes.iter().all(|&n| n <= block / interleave),
                    "{layout:?} {rows}"
                );
                assert_eq!(sizes.iter().sum::<usize>(), rows);
            }
        }
    }
}
