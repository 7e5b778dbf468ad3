//! The ops in plain tensor operations: the oracle the kernels are tested against, and the
//! implementation on backends without kernels (`NdArray`). Math in f32, outputs in the input
//! dtype (distances in f32).

use burn::tensor::{DType, Int, IntDType, Tensor, TensorData};

use burn_kernels_core::{AttentionImpl, AttnOptions, ReferenceAttention};

use crate::store::{Axis, seq_from_rows};
use crate::{Merged, Packed, QuantAttnView, QuantLayout};

/// Below this a norm counts as zero (the direction of a zero vector is the zero vector).
pub const NORM_EPS: f32 = 1e-12;
/// Below this `sin θ` the SLERP weights fall back to linear interpolation (the two directions
/// are parallel or antiparallel, where SLERP's formula divides by ~0).
pub const SIN_EPS: f32 = 1e-6;

/// MiniCache merge of row pairs. See [`crate::merge`].
///
/// # Shapes
/// - `a`, `b`: `[n, d]`; returns `dir [n, d]`, `mag_a`, `mag_b` `[n]` (input dtype), `dist [n]`
///   (f32)
pub fn merge(a: Tensor<2>, b: Tensor<2>, t: f32, gamma: f32) -> Merged {
    let dtype = a.dtype();
    let a = a.cast(DType::F32);
    let b = b.cast(DType::F32);
    let na = a.clone().powi_scalar(2).sum_dim(1).sqrt();
    let nb = b.clone().powi_scalar(2).sum_dim(1).sqrt();
    let u = a / na.clone().clamp_min(NORM_EPS);
    let w = b / nb.clone().clamp_min(NORM_EPS);
    let diff = (u.clone() - w.clone()).powi_scalar(2).sum_dim(1).sqrt();
    let sum = (u.clone() + w.clone()).powi_scalar(2).sum_dim(1).sqrt();
    // 2·atan2(|u − w|, |u + w|) is accurate near 0 and π, unlike acos(u·w).
    let theta = diff.atan2(sum) * 2.0;
    let dist = theta.clone() * std::f32::consts::FRAC_1_PI;
    let sin = theta.clone().sin();
    let small = sin.clone().lower_elem(SIN_EPS);
    let ca = (theta.clone() * (1.0 - t))
        .sin()
        .div(sin.clone().clamp_min(SIN_EPS))
        .mask_fill(small.clone(), 1.0 - t);
    let cb = (theta * t)
        .sin()
        .div(sin.clamp_min(SIN_EPS))
        .mask_fill(small, t);
    let m = u.clone() * ca + w * cb;
    let nm = m.clone().powi_scalar(2).sum_dim(1).sqrt();
    let m = m / nm.clamp_min(NORM_EPS);
    let [n, d] = u.dims();
    let retain = dist.clone().greater_elem(gamma).expand([n, d]);
    let dir = m.mask_where(retain, u);
    Merged {
        dir: dir.cast(dtype),
        mag_a: na.reshape([n]).cast(dtype),
        mag_b: nb.reshape([n]).cast(dtype),
        dist: dist.reshape([n]),
    }
}

/// MiniCache restore of one layer. See [`crate::restore`].
///
/// # Shapes
/// - `dir`: `[n, d]`, `mag`: `[n]`, `slot`: `[n]`, `retained`: `[r, d]`; returns `[n, d]`
pub fn restore(
    dir: Tensor<2>,
    mag: Tensor<1>,
    retained: Option<(Tensor<1, Int>, Tensor<2>)>,
) -> Tensor<2> {
    let dtype = dir.dtype();
    let [n, d] = dir.dims();
    let out = dir.cast(DType::F32) * mag.cast(DType::F32).reshape([n, 1]);
    let out = match retained {
        Some((slot, rows)) if rows.dims()[0] > 0 => {
            let keep = slot.clone().greater_elem(0).reshape([n, 1]).expand([n, d]);
            let idx = (slot - 1).clamp_min(0);
            out.mask_where(keep, rows.cast(DType::F32).select(0, idx))
        }
        _ => out,
    };
    out.cast(dtype)
}

/// Asymmetric min/scale quantization of groups of columns, codes packed into `u32` words. See
/// [`crate::quantize`].
///
/// # Shapes
/// - `x`: `[rows, cols]`; returns words `[rows, groups·words_per_group]` (u32), scale and min
///   `[rows, groups]` (input dtype)
pub fn quantize(x: Tensor<2>, layout: QuantLayout) -> Packed {
    let dtype = x.dtype();
    let device = x.device();
    let [rows, cols] = x.dims();
    let (g, ng, wpg, pw) = (
        layout.group_len(),
        layout.groups(),
        layout.words_per_group(),
        layout.codes_per_word(),
    );
    let x = x.cast(DType::F32);
    let padded = ng * g;
    // The ragged last group is padded with copies of its last column, which leave its min and
    // max unchanged; their codes are zeroed before packing, as the kernel leaves them.
    let x = if padded > cols {
        let last = x.clone().slice([0..rows, cols - 1..cols]);
        Tensor::cat(vec![x, last.expand([rows, padded - cols])], 1)
    } else {
        x
    };
    let xg = x.reshape([rows, ng, g]);
    let mn = xg.clone().min_dim(2);
    let mx = xg.clone().max_dim(2);
    let levels = layout.levels() as f32;
    // The stored (dtype-rounded) scale and min are what dequantization uses, so the codes are
    // computed from them.
    let scale = ((mx - mn.clone()) / levels).cast(dtype).cast(DType::F32);
    let mn = mn.cast(dtype).cast(DType::F32);
    let zero = scale.clone().lower_equal_elem(0.0);
    let inv = scale
        .clone()
        .clamp_min(f32::MIN_POSITIVE)
        .recip()
        .mask_fill(zero, 0.0);
    let codes = ((xg - mn.clone()) * inv)
        .round()
        .clamp(0.0, levels)
        .int()
        .cast(IntDType::I64);
    let valid: Vec<i64> = (0..padded).map(|c| i64::from(c < cols)).collect();
    let valid = Tensor::<1, Int>::from_data(TensorData::new(valid, [padded]), &device)
        .cast(IntDType::I64)
        .reshape([1, ng, g]);
    let codes = codes * valid;
    let slots = wpg * pw;
    let codes = if slots > g {
        let zeros = Tensor::<3, Int>::zeros([rows, ng, slots - g], &device).cast(IntDType::I64);
        Tensor::cat(vec![codes, zeros], 2)
    } else {
        codes
    };
    let shifts: Vec<i64> = (0..pw).map(|j| 1i64 << (j as u32 * layout.bits)).collect();
    let shifts = Tensor::<1, Int>::from_data(TensorData::new(shifts, [pw]), &device)
        .cast(IntDType::I64)
        .reshape([1, 1, 1, pw]);
    let words = (codes.reshape([rows, ng, wpg, pw]) * shifts)
        .sum_dim(3)
        .reshape([rows, ng * wpg])
        .cast(IntDType::U32);
    Packed {
        words,
        scale: scale.reshape([rows, ng]).cast(dtype),
        min: mn.reshape([rows, ng]).cast(dtype),
    }
}

/// Unpacks and dequantizes, `min + code·scale`. See [`crate::dequantize`].
///
/// # Shapes
/// - as returned by [`quantize`]; returns `[rows, layout.cols]` in the dtype of `scale`
pub fn dequantize(packed: &Packed, layout: QuantLayout) -> Tensor<2> {
    let dtype = packed.scale.dtype();
    let device = packed.scale.device();
    let [rows, _] = packed.scale.dims();
    let (g, ng, wpg, pw) = (
        layout.group_len(),
        layout.groups(),
        layout.words_per_group(),
        layout.codes_per_word(),
    );
    let shifts: Vec<i64> = (0..pw).map(|j| (j as u32 * layout.bits) as i64).collect();
    let shifts = Tensor::<1, Int>::from_data(TensorData::new(shifts, [pw]), &device)
        .cast(IntDType::I64)
        .reshape([1, 1, 1, pw])
        .expand([rows, ng, wpg, pw]);
    let words = packed
        .words
        .clone()
        .cast(IntDType::I64)
        .reshape([rows, ng, wpg, 1])
        .expand([rows, ng, wpg, pw]);
    let codes = words
        .bitwise_right_shift(shifts)
        .bitwise_and_scalar(layout.levels() as i64)
        .reshape([rows, ng, wpg * pw])
        .slice([0..rows, 0..ng, 0..g])
        .float()
        .cast(DType::F32);
    let scale = packed.scale.clone().cast(DType::F32).reshape([rows, ng, 1]);
    let mn = packed.min.clone().cast(DType::F32).reshape([rows, ng, 1]);
    let out = (codes * scale + mn).reshape([rows, ng * g]);
    out.slice([0..rows, 0..layout.cols]).cast(dtype)
}

/// ShadowKV's key rebuild: rows `c·chunk + t` of `a` for the chunks of each `(batch, head)`,
/// times that head's right factor, rotated by RoPE at their positions. See
/// [`crate::gather_reconstruct_rope`].
///
/// # Shapes
/// - `a`: `[batch, rows, rank]`, `wt`: `[batch, heads, rank, d]`, `chunks`: `[batch, heads,
///   k]`, `cos`, `sin`: `[positions, d/2]` (f32)
/// - returns `[batch, heads, k · chunk, d]` in `a`'s dtype (zeros where a position is out of
///   range)
pub fn gather_reconstruct_rope(
    a: Tensor<3>,
    wt: Tensor<4>,
    chunks: Tensor<3, Int>,
    cos: Tensor<2>,
    sin: Tensor<2>,
    chunk: usize,
) -> Tensor<4> {
    let dtype = a.dtype();
    let device = a.device();
    let [b, rows, rank] = a.dims();
    let [_, h, _, d] = wt.dims();
    let k = chunks.dims()[2];
    let n = k * chunk;
    let half = d / 2;
    let p = cos.dims()[0];
    if b * h * n == 0 || rows == 0 || p == 0 {
        return Tensor::<4>::zeros([b, h, n, d], &device).cast(dtype);
    }
    let offsets: Vec<i64> = (0..chunk as i64).collect();
    let offsets = Tensor::<1, Int>::from_data(TensorData::new(offsets, [chunk]), &device)
        .cast(IntDType::I64)
        .reshape([1, 1, 1, chunk]);
    let pos = (chunks.cast(IntDType::I64).reshape([b, h, k, 1]) * chunk as i64 + offsets)
        .reshape([b, h, n]);
    let limit = rows.min(p) as i64;
    let valid = pos.clone().lower_elem(limit);
    let pos = pos.clamp(0, limit - 1);
    let base: Vec<i64> = (0..b as i64).map(|i| i * rows as i64).collect();
    let base = Tensor::<1, Int>::from_data(TensorData::new(base, [b]), &device)
        .cast(IntDType::I64)
        .reshape([b, 1, 1]);
    let rows_idx = (pos.clone() + base).reshape([b * h * n]);
    let gathered = a
        .cast(DType::F32)
        .reshape([b * rows, rank])
        .select(0, rows_idx)
        .reshape([b, h, n, rank]);
    let x = gathered.matmul(wt.cast(DType::F32));
    let flat = pos.reshape([b * h * n]);
    let cos = cos.select(0, flat.clone()).reshape([b, h, n, half]);
    let sin = sin.select(0, flat).reshape([b, h, n, half]);
    let x1 = x.clone().slice([0..b, 0..h, 0..n, 0..half]);
    let x2 = x.slice([0..b, 0..h, 0..n, half..d]);
    let out = Tensor::cat(
        vec![
            x1.clone() * cos.clone() - x2.clone() * sin.clone(),
            x2 * cos + x1 * sin,
        ],
        3,
    );
    let keep = valid.reshape([b, h, n, 1]).expand([b, h, n, d]);
    out.mask_fill(keep.bool_not(), 0.0).cast(dtype)
}

/// Attention over a quantized layer and its tail: dequantize, concatenate, and
/// [`ReferenceAttention`]. See [`crate::quant_attention`].
///
/// # Shapes
/// - as [`crate::quant_attention`] documents
pub fn quant_attention(q: Tensor<4>, view: &QuantAttnView, opts: &AttnOptions) -> Tensor<4> {
    let [b, _, _, d] = q.dims();
    let n = view.qlen;
    let quantized = match (&view.keys, &view.values) {
        (Some((kp, kl)), Some((vp, vl))) => {
            let h = view.kv_heads(b);
            let k = seq_from_rows(dequantize(kp, *kl), Axis::PerChannel, [b, h, n, d]);
            let v = seq_from_rows(dequantize(vp, *vl), Axis::PerToken, [b, h, n, d]);
            Some((k, v))
        }
        _ => None,
    };
    let (k, v) = match (quantized, view.tail.clone()) {
        (Some((k, v)), Some((tk, tv))) => {
            (Tensor::cat(vec![k, tk], 2), Tensor::cat(vec![v, tv], 2))
        }
        (Some(kv), None) | (None, Some(kv)) => kv,
        (None, None) => unreachable!("validated: a view holds positions"),
    };
    ReferenceAttention.attend(0, q, k, v, opts)
}

/// ShadowKV's landmark scoring as tensor ops (see [`crate::landmark_scores`]): the row's
/// landmarks past its count masked with −10³⁰ before the softmax.
///
/// # Shapes
/// - `q`: `[b, hq, sq, dd]` f32; `landmarks`: `[b, h, t, dd]`; `sizes`: `[b·h, 2]` int
/// - returns `[b·h, t]` f32
pub fn landmark_scores(
    q: Tensor<4>,
    landmarks: Tensor<4>,
    sizes: Tensor<2, Int>,
    scale: f32,
) -> Tensor<2> {
    let [b, hq, sq, dd] = q.dims();
    let [_, h, t, _] = landmarks.dims();
    let g = hq / h;
    let device = q.device();
    let n = sizes
        .slice([0..b * h, 0..1])
        .cast(IntDType::I64)
        .reshape([b, h, 1, 1]);
    let pos = Tensor::<1, Int>::arange(0..t as i64, &device)
        .cast(IntDType::I64)
        .reshape([1, 1, 1, t]);
    let hidden = pos.greater_equal(n).expand([b, h, g * sq, t]);
    let scores = q
        .reshape([b, h, g * sq, dd])
        .matmul(landmarks.cast(DType::F32).swap_dims(2, 3))
        * scale;
    burn::tensor::activation::softmax(scores.mask_fill(hidden, -1.0e30), 3)
        .reshape([b, h, g, sq, t])
        .sum_dim(3)
        .max_dim(2)
        .reshape([b * h, t])
}

/// ShadowKV's selection as tensor ops (see [`crate::top_k_rows`]): each row sorted descending
/// with the positions past its `n` hidden, the first `k` of those positions sorted ascending,
/// the remaining of the `kk` slots the first of them (zeros where `k = 0`).
///
/// # Shapes
/// - `scores`: `[rows, cols]` f32; `sizes`: `[rows, 2]` int, `(n, k)` per row; `kk ≤ cols`
/// - returns `[rows, kk]` in `sizes`' int dtype
pub fn top_k_rows(scores: Tensor<2>, sizes: Tensor<2, Int>, kk: usize) -> Tensor<2, Int> {
    let [rows, cols] = scores.dims();
    let device = scores.device();
    let int = IntDType::from(sizes.dtype());
    let sizes = sizes.cast(IntDType::I64);
    let n = sizes.clone().slice([0..rows, 0..1]).clamp(0, cols as i64);
    let k = sizes
        .slice([0..rows, 1..2])
        .min_pair(n.clone())
        .clamp(0, kk as i64);
    let positions = |len: usize| {
        Tensor::<1, Int>::arange(0..len as i64, &device)
            .cast(IntDType::I64)
            .reshape([1, len])
            .expand([rows, len])
    };
    let hidden = positions(cols).greater_equal(n.expand([rows, cols]));
    let (_, order) = scores
        .mask_fill(hidden, f32::NEG_INFINITY)
        .sort_descending_with_indices(1);
    let dropped = positions(kk).greater_equal(k.expand([rows, kk]));
    let sorted = order
        .cast(IntDType::I64)
        .slice([0..rows, 0..kk])
        .mask_fill(dropped, cols as i64)
        .sort(1);
    let first = sorted.clone().slice([0..rows, 0..1]);
    let first = first.clone().mask_fill(first.equal_elem(cols as i64), 0);
    let pad = sorted.clone().equal_elem(cols as i64);
    sorted.mask_where(pad, first.expand([rows, kk])).cast(int)
}
