//! Which path runs: the extension on the unfused `CubeBackend` against `Dispatch`, and the
//! reference on an autodiff device.

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_kernels_core::route::require_kernels;
use burn_kernels_testing::{Tolerance, assert_close, compare::to_f32};
use burn_sage::{
    PvPrecision, QkQuant, SageOptions, Unsupported, plan, quantize_stage, sage_attention,
    sage_kernel,
};

use super::attention::pv_tolerance;
use super::common::*;

/// The extension called on the unfused `CubeBackend` directly (outside Burn's `Dispatch` and
/// `Fusion`) gives what the public op gives through them: the tensor-op stages run on the
/// device as the op runs them (ΔS by the extension's fixed GEMM, here called unfused too), then
/// the attention op (with and without the LSE output) and the quantization op run on
/// `CubeBackend` primitives.
#[cfg(feature = "cube")]
pub(super) fn unfused_matches_dispatch(device: &Device) {
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
pub(super) fn autodiff_runs_reference(device: &Device) {
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
