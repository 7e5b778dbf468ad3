//! What a Burn model author writes to use burn-kernels on the Burn they already have: tensors on
//! a `Device` of Burn's fused CubeCL backend (Burn's defaults), one call per op. Each op must
//! run its CubeCL kernel there (`require_kernels` turns a fallback to the tensor-op reference
//! into a panic) and agree with the plain Burn computation.
//!
//! `cargo run --manifest-path examples/downstream/Cargo.toml` (wgpu; `--no-default-features
//! --features cuda` for CUDA). Exits non-zero on any mismatch.

use burn::nn::RmsNormConfig;
use burn::tensor::{DType, Device, Distribution, Int, Tensor};
use burn_cce::{CceOptions, Reduction, linear_cross_entropy, reference};
use burn_kernels_core::route::{launches, require_kernels};
use burn_kernels_core::{FusedOps, LayerOps, TensorOps};

fn device() -> Device {
    #[cfg(feature = "cuda")]
    return Device::cuda(0);
    #[cfg(not(feature = "cuda"))]
    Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)
}

/// Largest absolute difference, and the largest magnitude of `want`.
fn max_diff<const D: usize>(got: Tensor<D>, want: Tensor<D>) -> (f32, f32) {
    let g = got
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32");
    let w = want
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32");
    assert_eq!(g.len(), w.len(), "output sizes");
    let diff = g
        .iter()
        .zip(&w)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    (diff, w.iter().map(|x| x.abs()).fold(0.0, f32::max))
}

fn check(what: &str, (diff, scale): (f32, f32), rel: f32) {
    println!("{what}: max |diff| {diff:.3e} (scale {scale:.3e})");
    assert!(
        diff.is_finite() && diff <= rel * scale.max(1e-6),
        "{what}: {diff} > {rel} × {scale}"
    );
}

/// Cut cross-entropy forward and backward on an autodiff device, against Burn's plain loss.
fn cce(device: &Device) {
    let device = device.clone().autodiff();
    let (n, d, v) = (37, 64, 1009);
    device.seed(7);
    let e = Tensor::<2>::random([n, d], Distribution::Normal(0.0, 1.0), &device).require_grad();
    let c = Tensor::<2>::random([v, d], Distribution::Normal(0.0, 0.2), &device).require_grad();
    let targets = Tensor::<1, Int>::random([n], Distribution::Uniform(0.0, v as f64), &device);

    let before = launches("linear_ce_forward") + launches("linear_ce_backward");
    let loss = require_kernels(|| {
        linear_cross_entropy(
            e.clone(),
            c.clone(),
            targets.clone(),
            None,
            &CceOptions::default(),
        )
    })
    .expect("valid input")
    .loss;
    let grads = require_kernels(|| loss.backward());
    let plain = reference::plain_linear_cross_entropy(
        e.clone(),
        c.clone(),
        None,
        targets,
        -100,
        None,
        Reduction::Mean,
    );
    let plain_grads = plain.backward();
    check("CCE loss", max_diff(loss, plain), 1e-4);
    check(
        "CCE dE",
        max_diff(e.grad(&grads).unwrap(), e.grad(&plain_grads).unwrap()),
        1e-3,
    );
    check(
        "CCE dC",
        max_diff(c.grad(&grads).unwrap(), c.grad(&plain_grads).unwrap()),
        1e-3,
    );
    let ran = launches("linear_ce_forward") + launches("linear_ce_backward") - before;
    assert!(ran >= 2, "CCE forward and backward kernels ran {ran} times");
}

/// The fused layer ops (RMSNorm, SwiGLU gate) against Burn's modules and tensor ops.
fn layer_ops(device: &Device) {
    let x = Tensor::<3>::random([2, 5, 96], Distribution::Normal(0.0, 1.0), device);
    let up = Tensor::<3>::random([2, 5, 96], Distribution::Normal(0.0, 1.0), device);
    let norm = RmsNormConfig::new(96).init(device);
    let before = launches("rms_norm") + launches("silu_mul");
    let (normed, gated) = require_kernels(|| {
        (
            FusedOps.rms_norm(&norm, x.clone()),
            FusedOps.silu_mul(x.clone(), up.clone()),
        )
    });
    check(
        "RMSNorm",
        max_diff(normed, TensorOps.rms_norm(&norm, x.clone())),
        1e-5,
    );
    check("SiLU·up", max_diff(gated, TensorOps.silu_mul(x, up)), 1e-5);
    // Burn's fusion defers a custom op until its output is read: count after the reads.
    assert_eq!(
        launches("rms_norm") + launches("silu_mul") - before,
        2,
        "layer-op kernels"
    );
}

/// KIVI 4-bit quantization of a KV block and back: the kernels against the reference.
fn kv_quant(device: &Device) {
    let x = Tensor::<2>::random([19, 64], Distribution::Normal(0.0, 1.0), device);
    let before = launches("kv_quantize") + launches("kv_dequantize");
    let back = require_kernels(|| {
        let (packed, layout) = burn_kvcache::quantize(x.clone(), 4, 32).expect("valid layout");
        burn_kvcache::dequantize(&packed, layout)
    });
    let cpu = Device::flex();
    let x_cpu = Tensor::<2>::from_data(x.to_data(), &cpu);
    let (packed, layout) = burn_kvcache::quantize(x_cpu, 4, 32).expect("valid layout");
    let want = burn_kvcache::dequantize(&packed, layout);
    let got = Tensor::<2>::from_data(back.into_data(), &cpu);
    assert_eq!(
        launches("kv_quantize") + launches("kv_dequantize") - before,
        2,
        "KV kernels"
    );
    check(
        "KIVI-4 round trip vs CPU reference",
        max_diff(got, want),
        1e-5,
    );
}

fn main() {
    let device = device();
    println!("device: {device:?}");
    assert_eq!(Tensor::<1>::zeros([1], &device).dtype(), DType::F32);
    layer_ops(&device);
    kv_quant(&device);
    cce(&device);
    println!("downstream: every op ran its kernel and matched plain Burn");
}
