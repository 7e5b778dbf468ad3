//! Test shapes, inputs like a model's, and helpers the checks share.

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_kernels_core::route::{cube_device, require_kernels};
use burn_kernels_testing::{Dist, compare::to_f32, random_tensor, random_values};
use burn_sage::QkQuant;
use burn_sage::kernels::{KernelChoice, UNIT_MAX_KV};

pub(super) const QUANTS: [QkQuant; 4] = [
    QkQuant::Int8PerBlock,
    QkQuant::Int8PerWarp,
    QkQuant::Int8PerThread,
    QkQuant::Int4PerThread,
];

/// `(batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal)`: 1s, primes, tails of every
/// block size, GQA, q_len ≠ kv_len (decode-like), each head dim.
pub(super) const CASES: &[(usize, usize, usize, usize, usize, usize, bool)] = &[
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
pub(super) const LONG_CASES: &[(usize, usize, usize, usize, usize, usize, bool)] = &[
    (1, 4, 2, 1000, 1000, 64, true),
    (1, 2, 2, 1000, 1000, 128, false),
    (1, 2, 1, 17, 600, 256, true),
    (1, 2, 1, 2, UNIT_MAX_KV, 64, true),
    (1, 2, 1, 1, UNIT_MAX_KV + 1000, 64, false),
];

/// Q, K, V like a model's: K carries a large per-channel offset shared by all tokens (what K
/// smoothing removes), Q and V are plain normals.
pub(super) fn qkv(
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
pub(super) fn to_cpu(x: &Tensor<4>) -> Tensor<4> {
    Tensor::from_data(x.to_data().convert::<f32>(), &Device::flex())
}

/// Runs `f` with kernels required where `device` runs kernels (a CubeCL device): the calls
/// in it must not take the reference there. On the CPU they take the reference anyway.
pub(super) fn kernels_where_possible<T>(device: &Device, f: impl FnOnce() -> T) -> T {
    if cube_device(device).is_some() {
        require_kernels(f)
    } else {
        f()
    }
}

/// The launch counter of `kernel`'s attention op (see the `CubeBackend` implementation).
pub(super) fn kernel_op(kernel: KernelChoice) -> &'static str {
    match kernel {
        KernelChoice::Unit => "sage_attention_unit",
        KernelChoice::Cmma => "sage_attention_cmma",
        KernelChoice::Mma => "sage_attention_mma",
        KernelChoice::Wgmma => "sage_attention_wgmma",
        KernelChoice::Tuned => "sage_attention_tuned",
    }
}

pub(super) fn values<const D: usize>(x: Tensor<D>) -> Vec<f32> {
    to_f32(x.cast(DType::F32).into_data())
}
