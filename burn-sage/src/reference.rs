//! Plain tensor-op references: exact attention in f32, the group quantization, and Sage
//! attention with exactly the kernels' quantization and rounding (but a plain, not online,
//! softmax: `P̃` is rounded relative to the row's final maximum rather than the running one).

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_kernels_core::attention::repeat_kv;

use crate::prep::{
    MIN_SCALE, Prepared, expand_blocks, matmul_chunked, max_dim_chunked, prepare, sum_dim_chunked,
};
use crate::{Grid, GroupLayout, SagePlan};

/// `[1, 1, sq, skv]` bottom-right causal mask, `true` = hidden.
fn causal_mask(sq: usize, skv: usize, device: &Device) -> Tensor<4, burn::tensor::Bool> {
    let offset = skv - sq;
    let data: Vec<bool> = (0..sq)
        .flat_map(|i| (0..skv).map(move |j| j > i + offset))
        .collect();
    Tensor::<2, burn::tensor::Bool>::from_data(TensorData::new(data, [sq, skv]), device)
        .reshape([1, 1, sq, skv])
}

/// Exact attention in f32 (bottom-right causal), GQA by repetition. Returns `(out, lse)`,
/// `out` in f32. Long key axes are reduced in chunks (see [`crate::prep::AXIS_CHUNK`]).
pub fn exact_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    causal: bool,
    scale: f32,
) -> (Tensor<4>, Tensor<3>) {
    let [b, hq, sq, _] = q.dims();
    let [_, hkv, skv, _] = k.dims();
    let k = repeat_kv(k.cast(DType::F32), hq / hkv);
    let v = repeat_kv(v.cast(DType::F32), hq / hkv);
    let mut s = q.cast(DType::F32).matmul(k.swap_dims(2, 3)) * scale;
    if causal {
        let mask = causal_mask(sq, skv, &s.device()).expand([b, hq, sq, skv]);
        s = s.mask_fill(mask, -1.0e30);
    }
    let m = max_dim_chunked(s.clone(), 3);
    let p = (s - m.clone()).exp();
    let l = sum_dim_chunked(p.clone(), 3);
    let out = matmul_chunked(p, v) / l.clone();
    let lse = (m + l.log()).reshape([b, hq, sq]);
    (out, lse)
}

/// `x` rounded to `grid` (ties away from zero, saturating), as tensor ops.
pub fn round_to_grid<const D: usize>(x: Tensor<D>, grid: Grid) -> Tensor<D> {
    let a = x.clone().abs();
    let e = (a.clone().clamp_min(f32::MIN_POSITIVE).log() / std::f32::consts::LN_2)
        .floor()
        .clamp_min(grid.min_exp as f32);
    let two = Tensor::<D>::full(e.shape(), 2.0, &e.device()).cast(DType::F32);
    let step = two.powf(e - grid.mantissa as f32);
    ((a / step.clone() + 0.5).floor() * step).clamp_max(grid.max) * x.sign()
}

/// `sign(x)·floor(|x| + 0.5)`.
pub fn round_away<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    (x.clone().abs() + 0.5).floor() * x.sign()
}

/// Quantizes `x − mean` per group: integers (stored as f32) and one scale per group.
///
/// # Shapes
/// - `x`: `[b, h, s, d]`; `mean`: `[b, h, nm, d]` f32, block `m` of `mean_block` rows uses
///   row `m`
/// - returns `(ints [b, h, s, d] f32, scales [b, h, layout.groups(s)] f32)`
pub fn quantize(
    x: Tensor<4>,
    mean: Tensor<4>,
    mean_block: usize,
    layout: GroupLayout,
    qmax: f32,
) -> (Tensor<4>, Tensor<3>) {
    let [b, h, s, d] = x.dims();
    let centered = x.cast(DType::F32) - expand_blocks(mean, mean_block, s);
    let nb = s.div_ceil(layout.block);
    let padded = nb * layout.block;
    let xp = if padded > s {
        let zeros = Tensor::<4>::zeros([b, h, padded - s, d], &centered.device());
        Tensor::cat(vec![centered, zeros.cast(DType::F32)], 2)
    } else {
        centered
    };
    let g = layout.interleave;
    let shape6 = [b, h, nb, layout.block / g, g, d];
    let amax = xp
        .clone()
        .reshape(shape6)
        .abs()
        .max_dim(5)
        .max_dim(3)
        .reshape([b, h, nb * g]);
    let scales = (amax / qmax).clamp_min(MIN_SCALE);
    let per_row = row_scales(scales.clone(), layout, padded);
    let ints = round_away(xp / per_row.unsqueeze_dim::<4>(3)).clamp(-qmax, qmax);
    (ints.slice([0..b, 0..h, 0..s, 0..d]), scales)
}

/// Group scales `[b, h, groups]` spread to one per row: `[b, h, rows]`.
pub fn row_scales(scales: Tensor<3>, layout: GroupLayout, rows: usize) -> Tensor<3> {
    let [b, h, ng] = scales.dims();
    let g = layout.interleave;
    let nb = ng / g;
    scales
        .reshape([b, h, nb, 1, g])
        .expand([b, h, nb, layout.block / g, g])
        .reshape([b, h, nb * layout.block])
        .slice([0..b, 0..h, 0..rows])
}

/// Sage attention with the kernels' quantization and rounding. Returns `(out in the input
/// dtype, lse f32 when asked for)`.
pub fn sage_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    plan: &SagePlan,
) -> (Tensor<4>, Option<Tensor<3>>) {
    let prep = prepare(&q, &k, &v, plan);
    let (out, lse) = sage_attention_prepared(q, k, &prep, plan);
    (out.cast(plan.dtype), plan.opts.return_lse.then_some(lse))
}

/// The reference after the shared stages. Returns `(out f32, lse)`.
pub fn sage_attention_prepared(
    q: Tensor<4>,
    k: Tensor<4>,
    prep: &Prepared,
    plan: &SagePlan,
) -> (Tensor<4>, Tensor<3>) {
    let (b, hq, sq, skv) = (plan.batch, plan.q_heads, plan.q_len, plan.kv_len);
    let group = plan.group();
    let qk = plan.opts.qk;
    let (qi, qs) = quantize(
        q,
        prep.q_mean.clone(),
        plan.q_mean_block(),
        qk.q_layout(),
        qk.qmax(),
    );
    let (ki, ks) = quantize(
        k,
        prep.k_mean.clone(),
        plan.kv_len,
        qk.k_layout(),
        qk.qmax(),
    );
    let q_rows = row_scales(qs, qk.q_layout(), sq).unsqueeze_dim::<4>(3);
    let k_rows = repeat_kv(
        row_scales(ks, qk.k_layout(), skv).unsqueeze_dim::<4>(2),
        group,
    );
    let mut s = qi.matmul(repeat_kv(ki, group).swap_dims(2, 3)) * q_rows * k_rows;
    if let Some(ds) = &prep.delta_s {
        s = s + expand_blocks(ds.clone(), plan.q_mean_block(), sq);
    }
    let mut s = s * plan.scale;
    if plan.opts.causal {
        let mask = causal_mask(sq, skv, &s.device()).expand([b, hq, sq, skv]);
        s = s.mask_fill(mask, -1.0e30);
    }
    let m = max_dim_chunked(s.clone(), 3);
    let p = (s - m.clone()).exp();
    let l = sum_dim_chunked(p.clone(), 3);
    let grid = plan.pv_grid();
    let pq = round_to_grid(p * plan.p_scale(), grid);
    let vq = repeat_kv(round_to_grid(prep.v.clone().cast(DType::F32), grid), group);
    let post = repeat_kv(prep.post.clone(), group);
    let out = matmul_chunked(pq, vq) / l.clone() * post;
    let lse = (m + l.log()).reshape([b, hq, sq]);
    (out, lse)
}
