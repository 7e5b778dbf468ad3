//! [`TrainOps`]' differentiable kernels (RMSNorm, the SwiGLU gate, RoPE; CUDA, f16/bf16) against
//! [`TensorOps`] in f32 on the same rounded inputs, differentiated by Burn's autodiff: outputs
//! and every gradient, on awkward sizes (one row, primes, a row length that is not a multiple
//! of the 32-unit plane, RoPE on a view of a token-major buffer). Each kernel must have run
//! (counted), forward and backward, and the memory pool is handed NaN blocks first so an
//! unwritten element fails.

use burn::module::Param;
use burn::nn::RmsNorm;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_kernels_core::route::launches;
use burn_kernels_core::{LayerOps, Rope, TensorOps, TrainOps};
use burn_kernels_testing::compare::{assert_rel_l2, rounding_rel_l2, to_f32};
use burn_kernels_testing::{Dist, float_dtypes, random_tensor};

/// A 16-bit result against f32 on the same inputs: relative L2 within a few roundings of the
/// dtype (the output, and the gradient passing through the dtype once more).
fn check(name: &str, actual: &Tensor<1>, expected: &Tensor<1>, dtype: DType) {
    let values = |t: &Tensor<1>| to_f32(t.clone().cast(DType::F32).into_data());
    let name = format!("{name} {dtype:?}");
    assert_rel_l2(
        &name,
        &values(actual),
        &values(expected),
        rounding_rel_l2(dtype, 4),
    );
}

/// Blocks of NaN of `elems` elements, alive together (one per output), for the pool to hand
/// out next.
fn poison(elems: &[usize], dtype: DType, device: &Device) {
    let blocks: Vec<_> = elems
        .iter()
        .map(|&n| Tensor::<1>::full([n], f32::NAN, (device, dtype)))
        .collect();
    let _ = device.sync();
    drop(blocks);
}

fn flat<const D: usize>(t: Tensor<D>) -> Tensor<1> {
    let n = t.shape().num_elements();
    t.reshape([n])
}

/// `(out, grads…)` of `f` on `inputs` (each made a leaf that requires its gradient) with the
/// upstream gradient `g` (f32).
fn run<const D: usize, const N: usize>(
    inputs: [Tensor<D>; N],
    g: &Tensor<D>,
    f: impl Fn([Tensor<D>; N]) -> Tensor<D>,
) -> (Tensor<1>, [Tensor<1>; N]) {
    let inputs = inputs.map(|t| t.require_grad());
    let out = f(inputs.clone());
    let grads = (out.clone().cast(DType::F32) * g.clone()).sum().backward();
    let grads = inputs.map(|t| flat(t.grad(&grads).expect("a gradient for every input")));
    (flat(out), grads)
}

fn rms_norm_case(dtype: DType, [b, s, cols]: [usize; 3], seed: u64, device: &Device) {
    let x = random_tensor([b, s, cols], Dist::STANDARD, seed, dtype, device);
    let gamma = random_tensor([cols], Dist::STANDARD, seed + 1, dtype, device);
    let g = random_tensor([b, s, cols], Dist::STANDARD, seed + 2, DType::F32, device);
    // `(out, dx, dγ)` of `ops` with γ a parameter (tracked) and `x` a leaf.
    let grads_of = |ops: &dyn LayerOps, x: Tensor<3>, gamma: Tensor<1>| {
        let norm = RmsNorm {
            gamma: Param::from_tensor(gamma.require_grad()),
            epsilon: 1e-5,
        };
        let x = x.require_grad();
        let out = ops.rms_norm(&norm, x.clone());
        let grads = (out.clone().cast(DType::F32) * g.clone()).sum().backward();
        let dx = x.grad(&grads).expect("a gradient for x");
        let dgamma = norm.gamma.val().grad(&grads).expect("a gradient for γ");
        (flat(out), flat(dx), dgamma)
    };
    poison(&[b * s * cols, b * s * cols, cols], dtype, device);
    let (before, bwd) = (launches("train_rms_norm"), launches("rms_norm_backward"));
    let train = grads_of(&TrainOps, x.clone(), gamma.clone());
    let reference = grads_of(&TensorOps, x.cast(DType::F32), gamma.cast(DType::F32));
    let name = format!("rms_norm {b}x{s}x{cols}");
    check(&format!("{name} out"), &train.0, &reference.0, dtype);
    check(&format!("{name} dx"), &train.1, &reference.1, dtype);
    check(&format!("{name} dγ"), &train.2, &reference.2, dtype);
    // Counted when the kernels execute: Burn's fusion defers them until a read (the checks).
    assert!(
        launches("train_rms_norm") > before && launches("rms_norm_backward") > bwd,
        "the RMSNorm kernels did not run ({dtype:?} {b}x{s}x{cols})"
    );
}

fn silu_mul_case(dtype: DType, shape: [usize; 3], seed: u64, device: &Device) {
    let make = |s: u64, d: DType| random_tensor(shape, Dist::STANDARD, seed + s, d, device);
    let (gate, up, g) = (make(0, dtype), make(1, dtype), make(2, DType::F32));
    let n: usize = shape.iter().product();
    poison(&[n, n, n], dtype, device);
    let (before, bwd) = (launches("train_silu_mul"), launches("silu_mul_backward"));
    let (out, [dg, du]) = run([gate.clone(), up.clone()], &g, |[a, b]| {
        TrainOps.silu_mul(a, b)
    });
    let f32s = [gate, up].map(|t| t.cast(DType::F32));
    let (r_out, [r_dg, r_du]) = run(f32s, &g, |[a, b]| TensorOps.silu_mul(a, b));
    let name = format!("silu_mul {shape:?}");
    check(&format!("{name} out"), &out, &r_out, dtype);
    check(&format!("{name} d_gate"), &dg, &r_dg, dtype);
    check(&format!("{name} d_up"), &du, &r_du, dtype);
    assert!(
        launches("train_silu_mul") > before && launches("silu_mul_backward") > bwd,
        "the SwiGLU kernels did not run ({dtype:?} {shape:?})"
    );
}

/// RoPE of `[b, h, s, 64]` as a view of a `[b, s, h, 64]` buffer, positions offset per row.
fn rope_case(dtype: DType, [b, h, s]: [usize; 3], seed: u64, device: &Device) {
    let d = 64;
    let rope = Rope::new(d, 4 * s + 8, 10_000.0, None, device);
    let x = random_tensor([b, s, h, d], Dist::STANDARD, seed, dtype, device).swap_dims(1, 2);
    let g = random_tensor([b, h, s, d], Dist::STANDARD, seed + 1, DType::F32, device);
    let pos: Vec<i64> = (0..b)
        .flat_map(|r| (0..s).map(move |t| (3 * r + t) as i64))
        .collect();
    let positions = Tensor::<2, Int>::from_data(TensorData::new(pos, [b, s]), device);
    poison(&[b * h * s * d, b * h * s * d], dtype, device);
    let before = launches("train_rope");
    let (out, [dx]) = run([x.clone()], &g, |[x]| {
        TrainOps.rope(&rope, x, positions.clone())
    });
    let (r_out, [r_dx]) = run([x.cast(DType::F32)], &g, |[x]| {
        TensorOps.rope(&rope, x, positions.clone())
    });
    let name = format!("rope {b}x{h}x{s}");
    check(&format!("{name} out"), &out, &r_out, dtype);
    check(&format!("{name} dx"), &dx, &r_dx, dtype);
    // One launch forward, one backward.
    assert!(
        launches("train_rope") >= before + 2,
        "the RoPE kernel did not run forward and backward ({dtype:?})"
    );
}

/// Every 16-bit dtype of `device` (an autodiff CUDA device).
pub fn train_ops_match_tensor_ops(device: &Device) {
    let dtypes: Vec<DType> = float_dtypes(device)
        .into_iter()
        .filter(|d| matches!(d, DType::F16 | DType::BF16))
        .collect();
    assert!(!dtypes.is_empty(), "no 16-bit dtype on this device");
    for dtype in dtypes {
        rms_norm_case(dtype, [1, 1, 576], 10, device);
        rms_norm_case(dtype, [2, 37, 100], 20, device);
        rms_norm_case(dtype, [3, 13, 576], 30, device);
        silu_mul_case(dtype, [1, 1, 7], 40, device);
        silu_mul_case(dtype, [2, 37, 1536], 50, device);
        rope_case(dtype, [1, 1, 1], 60, device);
        rope_case(dtype, [2, 9, 37], 70, device);
    }
}
