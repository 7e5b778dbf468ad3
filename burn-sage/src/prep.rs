//! The stages both paths share, as tensor ops: smoothing means, the `ΔS` correction and the
//! V scaling. They are cheap (one pass over Q, K, V, and one GEMV-like matmul per Q block);
//! the quantization and the attention itself are the kernels.

use burn::tensor::{DType, Tensor, TensorData};

use crate::{PvPrecision, SagePlan};

/// Smallest scale a group may get (an all-zero group quantizes to zeros).
pub const MIN_SCALE: f32 = f32::MIN_POSITIVE;

/// Longest axis the tensor-op stages reduce, or contract in a matmul, in one op: longer axes
/// (the keys of a long context) are cut into chunks of this many and the partial results
/// combined. Some of Burn's reduction and matmul kernels give one unit a whole axis, and
/// lavapipe cuts every loop of an invocation short after
/// [`LOOP_BUDGET`](crate::kernels::LOOP_BUDGET) iterations: a sum over 65 535 keys there came
/// out 5 short.
pub const AXIS_CHUNK: usize = 4096;

/// `x` summed over `dim` (kept, size 1), at most [`AXIS_CHUNK`] elements per reduction.
pub fn sum_dim_chunked<const D: usize>(x: Tensor<D>, dim: usize) -> Tensor<D> {
    if x.dims()[dim] <= AXIS_CHUNK {
        return x.sum_dim(dim);
    }
    let parts: Vec<_> = x
        .split(AXIS_CHUNK, dim)
        .into_iter()
        .map(|c| c.sum_dim(dim))
        .collect();
    sum_dim_chunked(Tensor::cat(parts, dim), dim)
}

/// `x`'s maximum over `dim` (kept, size 1), at most [`AXIS_CHUNK`] elements per reduction.
pub fn max_dim_chunked<const D: usize>(x: Tensor<D>, dim: usize) -> Tensor<D> {
    if x.dims()[dim] <= AXIS_CHUNK {
        return x.max_dim(dim);
    }
    let parts: Vec<_> = x
        .split(AXIS_CHUNK, dim)
        .into_iter()
        .map(|c| c.max_dim(dim))
        .collect();
    max_dim_chunked(Tensor::cat(parts, dim), dim)
}

/// `a · b` for `a` `[b, h, m, k]` and `b` `[b, h, k, n]`, summing products over chunks of at
/// most [`AXIS_CHUNK`] of `k`.
pub fn matmul_chunked(a: Tensor<4>, b: Tensor<4>) -> Tensor<4> {
    let k = a.dims()[3];
    if k <= AXIS_CHUNK {
        return a.matmul(b);
    }
    (0..k)
        .step_by(AXIS_CHUNK)
        .map(|start| {
            let len = AXIS_CHUNK.min(k - start);
            a.clone()
                .narrow(3, start, len)
                .matmul(b.clone().narrow(2, start, len))
        })
        .reduce(|acc, x| acc + x)
        .expect("k > AXIS_CHUNK")
}

/// What the quantization and the attention consume besides Q, K, V.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// `[batch, q_heads, q_mean_blocks, head_dim]` f32: subtracted from Q before quantizing
    /// (zeros when Q is not smoothed).
    pub q_mean: Tensor<4>,
    /// `[batch, kv_heads, 1, head_dim]` f32 (zeros when K is not smoothed).
    pub k_mean: Tensor<4>,
    /// `[batch, q_heads, q_mean_blocks, kv_len]` f32, `mean(Q_block)·(K − k_mean)ᵀ`, unscaled.
    pub delta_s: Option<Tensor<4>>,
    /// V as the PV product reads it: `V` (FP16 PV) or `V / v_scale` in f32 (FP8 PV).
    pub v: Tensor<4>,
    /// `[batch, kv_heads, 1, head_dim]` f32 epilogue factor per channel: `v_scale / 448` (FP8)
    /// or 1.
    pub post: Tensor<4>,
}

/// Per-block means of `x` over its rows: `[b, h, ceil(s / block), d]`, f32.
pub fn block_means(x: Tensor<4>, block: usize) -> Tensor<4> {
    let [b, h, s, d] = x.dims();
    let x = x.cast(DType::F32);
    let nb = s.div_ceil(block);
    let padded = nb * block;
    let x = if padded > s {
        let zeros = Tensor::<4>::zeros([b, h, padded - s, d], &x.device()).cast(DType::F32);
        Tensor::cat(vec![x, zeros], 2)
    } else {
        x
    };
    let sums = x
        .reshape([b, h, nb, block, d])
        .sum_dim(3)
        .reshape([b, h, nb, d]);
    let counts: Vec<f32> = (0..nb).map(|i| (s - i * block).min(block) as f32).collect();
    let counts = Tensor::<1>::from_data(TensorData::new(counts, [nb]), &sums.device())
        .cast(DType::F32)
        .reshape([1, 1, nb, 1]);
    sums / counts
}

/// Repeats each of the `nb` block rows `block` times and keeps the first `rows`:
/// `[b, h, nb, c] → [b, h, rows, c]`.
pub fn expand_blocks(x: Tensor<4>, block: usize, rows: usize) -> Tensor<4> {
    let [b, h, nb, c] = x.dims();
    x.reshape([b, h, nb, 1, c])
        .expand([b, h, nb, block, c])
        .reshape([b, h, nb * block, c])
        .slice([0..b, 0..h, 0..rows, 0..c])
}

/// The shared stages for `plan`, with Burn's matmul for ΔS.
pub fn prepare(q: &Tensor<4>, k: &Tensor<4>, v: &Tensor<4>, plan: &SagePlan) -> Prepared {
    prepare_with(q, k, v, plan, Tensor::matmul)
}

/// [`prepare`] with `matmul` computing ΔS (`[b, h, m, d] · [b, h, d, n]`, f32). The kernel
/// path passes a GEMM that is not autotuned: autotuning this product (1/256 of the attention's
/// operations at the default 128-row Q blocks) cost 20–45 s per new sequence length on an H100,
/// more than a whole benchmark problem; with the fixed GEMM the smoothed variant's time moved
/// by under 2% at N = 8K and 16K (D = 128, H100, 2026-11-25).
pub fn prepare_with(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    plan: &SagePlan,
    matmul: impl Fn(Tensor<4>, Tensor<4>) -> Tensor<4>,
) -> Prepared {
    let (b, hq, hkv, d) = (plan.batch, plan.q_heads, plan.kv_heads, plan.head_dim);
    let device = q.device();
    let zeros = |shape: [usize; 4]| Tensor::<4>::zeros(shape, &device).cast(DType::F32);
    let k_mean = if plan.opts.smooth_k {
        sum_dim_chunked(k.clone().cast(DType::F32), 2) / plan.kv_len as f32
    } else {
        zeros([b, hkv, 1, d])
    };
    let (q_mean, delta_s) = if plan.opts.smooth_q {
        let mb = plan.q_mean_block();
        let q_mean = block_means(q.clone(), mb);
        let nmq = q_mean.dims()[2];
        let group = plan.group();
        let k_smooth = k.clone().cast(DType::F32) - k_mean.clone();
        let ds = matmul(
            q_mean.clone().reshape([b, hkv, group * nmq, d]),
            k_smooth.swap_dims(2, 3),
        )
        .reshape([b, hq, nmq, plan.kv_len]);
        (q_mean, Some(ds))
    } else {
        (zeros([b, hq, 1, d]), None)
    };
    let (v, post) = match plan.opts.pv {
        PvPrecision::Fp8E4m3 => {
            let v32 = v.clone().cast(DType::F32);
            let v_scale = (max_dim_chunked(v32.clone().abs(), 2) / 448.0).clamp_min(MIN_SCALE);
            let post = v_scale.clone() / plan.p_scale();
            (v32 / v_scale, post)
        }
        PvPrecision::Fp16 => (v.clone(), zeros([b, hkv, 1, d]) + 1.0),
    };
    Prepared {
        q_mean,
        k_mean,
        delta_s,
        v,
        post,
    }
}
