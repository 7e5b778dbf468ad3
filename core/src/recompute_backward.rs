//! The recomputing attention's backward for f16/bf16 operands: the composed backward of Burn's
//! `attention_backward_default`, with every product on core's fixed GEMM ([`GemmTo`]) instead of
//! Burn's autotuned matmul, the scores and their gradient kept in f32.
//!
//! Why: cubek 0.4.0-pre.1's fused attention backward (what Burn's `attention` differentiates
//! with) ran at 3.5 ms a layer for SmolLM2's attention at batch 8 × 1024 in bf16 on an H200
//! (`ncu`, 2026-11-29: 104 ms of a 219 ms step's GPU time; PyTorch's cuDNN backward 3.2 ms for
//! all 30 layers), and Burn's composed backward runs its products on Burn's autotuned matmul,
//! which fails at some of these shapes on Hopper ([`crate::gemm`]). Here five batched GEMMs
//! (`QKᵀ`, `Pᵀ·dO`, `dO·Vᵀ`, `dS·K`, `dSᵀ·Q`) and element-wise work, whose `seq²` tensors live
//! while one layer's gradient is computed (the scores and their gradient in f32).
//!
//! Not faster than cubek's fused backward (H200, 2026-11-29: 4.5 ms a layer against 3.5 at
//! SmolLM2's batch 8 × 1024): `Pᵀ·dO` and `dSᵀ·Q` (1024 × 64 outputs per head over k = 3072)
//! run on cubek's portable kernel at ~8 TFLOP/s, the TMA kernel refusing that shape. Computing
//! on the transposed scores instead (`Sᵀ = K·Qᵀ`, every left operand row-major) was slower
//! still (5.5 ms): the refusal follows the shape, not the layout.
//!
//! Grouped-query attention is read in place: the query heads that share a key head are adjacent,
//! so `[batch, q_heads, seq_q, d]` is `[batch · kv_heads, groups · seq_q, d]` rows against
//! `[batch · kv_heads, seq_k, d]` keys, and the key and value gradients sum over the group by the
//! products themselves.

use burn::backend::ops::AttentionModuleOptions;
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Backend, TensorMetadata, get_or_init_device_settings};
use burn::tensor::{DType, FloatDType, Shape};

use crate::gemm::GemmTo;

/// The gradients against the query, key and value.
pub(crate) struct HalfGradients<B: Backend> {
    pub query: FloatTensor<B>,
    pub key: FloatTensor<B>,
    pub value: FloatTensor<B>,
}

/// The gradients of `attention(q, k, v)` (no mask or bias; `options.is_causal` honoured with its
/// alignment, no softcap) from its output `out`, the per-query log-sum-exp `lse` of the scaled
/// scores (`[batch, q_heads, seq_q]`, f32) and the output's gradient `dout`.
///
/// # Shapes
/// - `q`, `out`, `dout`: `[batch, q_heads, seq_q, d]` (`out`, `dout` with `d_v`)
/// - `k`: `[batch, kv_heads, seq_k, d]`, `v`: `[batch, kv_heads, seq_k, d_v]`
/// - returns gradients of `q`, `k`, `v`'s shapes, in their dtype
#[cfg_attr(not(feature = "cube"), allow(dead_code))]
pub(crate) fn half_backward<B: GemmTo>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    dout: FloatTensor<B>,
    options: AttentionModuleOptions,
) -> HalfGradients<B> {
    backward_with::<B>([q, k, v, out, lse, dout], options, B::gemm_to)
}

/// [`half_backward`] with the products by `gemm(a, b, out_dtype)` (batched `a · b`).
fn backward_with<B: Backend>(
    [q, k, v, out, lse, dout]: [FloatTensor<B>; 6],
    options: AttentionModuleOptions,
    gemm: impl Fn(FloatTensor<B>, FloatTensor<B>, DType) -> FloatTensor<B>,
) -> HalfGradients<B> {
    let [batch, q_heads, seq_q, d] = q.shape().dims::<4>();
    let [_, kv_heads, seq_k, d_v] = v.shape().dims::<4>();
    let dtype = q.dtype();
    let (heads, rows) = (batch * kv_heads, (q_heads / kv_heads) * seq_q);
    let scale = options.scale.unwrap_or(1.0 / (d as f64).sqrt());
    let grouped =
        |t: FloatTensor<B>, cols: usize| B::float_reshape(t, Shape::new([heads, rows, cols]));
    let per_head =
        |t: FloatTensor<B>, cols: usize| B::float_reshape(t, Shape::new([heads, seq_k, cols]));
    let f32 = |t: FloatTensor<B>| B::float_cast(t, FloatDType::F32);

    let (q, dout) = (grouped(q, d), grouped(dout, d_v));
    let (k, v) = (per_head(k, d), per_head(v, d_v));
    let lse = B::float_reshape(lse, Shape::new([heads, rows, 1]));
    // P = exp(scale · QKᵀ − lse), zero where the causal mask hides a key.
    let scores = gemm(q.clone(), B::float_transpose(k.clone()), DType::F32);
    let mut p = B::float_exp(B::float_sub(B::float_mul_scalar(scores, scale.into()), lse));
    if options.is_causal {
        let offset = options.causal_alignment.offset(seq_q, seq_k);
        let mask = causal_mask::<B>(&p, seq_q, offset);
        p = B::float_mask_fill(p, mask, 0.0.into());
    }
    // dS = P ⊙ (dO·Vᵀ − rowsum(dO ⊙ O)) · scale
    let delta = B::float_sum_dim(B::float_mul(f32(dout.clone()), f32(grouped(out, d_v))), 2);
    let value = gemm(
        B::float_transpose(B::float_cast(p.clone(), dtype.into())),
        dout.clone(),
        dtype,
    );
    let dp = gemm(dout, B::float_transpose(v), DType::F32);
    let ds = B::float_cast(
        B::float_mul_scalar(B::float_mul(p, B::float_sub(dp, delta)), scale.into()),
        dtype.into(),
    );
    let query = gemm(ds.clone(), k, dtype);
    let key = gemm(B::float_transpose(ds), q, dtype);
    HalfGradients {
        query: B::float_reshape(query, Shape::new([batch, q_heads, seq_q, d])),
        key: B::float_reshape(key, Shape::new([batch, kv_heads, seq_k, d])),
        value: B::float_reshape(value, Shape::new([batch, kv_heads, seq_k, d_v])),
    }
}

/// `true` where grouped row `r` (query `r mod seq_q`) may not see key `c`: `c > r mod seq_q +
/// offset`, expanded to `p`'s `[heads, rows, seq_k]`.
fn causal_mask<B: Backend>(p: &FloatTensor<B>, seq_q: usize, offset: i64) -> BoolTensor<B> {
    let [heads, rows, seq_k] = p.shape().dims::<3>();
    let device = p.device();
    let settings = get_or_init_device_settings::<B>(&device);
    let query = B::int_remainder_scalar(
        B::int_arange(0..rows as i64, &device, settings.int_dtype),
        (seq_q as i64).into(),
    );
    let query = B::int_reshape(
        B::int_add_scalar(query, offset.into()),
        Shape::new([rows, 1]),
    );
    let key = B::int_reshape(
        B::int_arange(0..seq_k as i64, &device, settings.int_dtype),
        Shape::new([1, seq_k]),
    );
    let mask = B::int_lower(query, key, settings.bool_dtype);
    let mask = B::bool_reshape(mask, Shape::new([1, rows, seq_k]));
    B::bool_expand(mask, Shape::new([heads, rows, seq_k]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Dispatch;
    use burn::backend::ops::FloatTensorOps;
    use burn::backend::ops::attention::{
        attention_backward_default, attention_with_logsumexp_default,
    };
    use burn::tensor::ops::CausalAlignment;
    use burn::tensor::{Device, Tensor};
    use burn_kernels_testing::compare::to_f32;
    use burn_kernels_testing::{Dist, Tolerance, assert_close, random_tensor};

    /// This backward's math (its masks, grouped heads, transposes and reshapes) against
    /// Burn's composed backward, both on the CPU in f32 with Burn's matmul as the products, so
    /// the two differ only by f32 rounding: one query and key; grouped heads with primes; fewer
    /// queries than keys with either causal alignment; no mask.
    #[test]
    fn half_backward_math_matches_burns_composed_backward() {
        let device = Device::flex();
        let cases = [
            (1, 1, 1, 1, 1, 8, true, CausalAlignment::BottomRight),
            (2, 6, 2, 13, 13, 16, true, CausalAlignment::BottomRight),
            (1, 3, 1, 5, 17, 8, true, CausalAlignment::BottomRight),
            (1, 3, 1, 5, 17, 8, true, CausalAlignment::TopLeft),
            (2, 4, 4, 11, 7, 16, false, CausalAlignment::BottomRight),
        ];
        for (i, &(b, hq, hkv, sq, skv, d, causal, alignment)) in cases.iter().enumerate() {
            let seed = 40 + 10 * i as u64;
            let make = |shape: [usize; 4], s: u64| {
                random_tensor(shape, Dist::STANDARD, seed + s, DType::F32, &device).into_dispatch()
            };
            let (q, k, v) = (
                make([b, hq, sq, d], 0),
                make([b, hkv, skv, d], 1),
                make([b, hkv, skv, d], 2),
            );
            let dout = make([b, hq, sq, d], 3);
            let options = AttentionModuleOptions {
                scale: None,
                softcap: None,
                is_causal: causal,
                causal_alignment: alignment,
            };
            let (out, lse) = attention_with_logsumexp_default::<Dispatch>(
                q.clone(),
                k.clone(),
                v.clone(),
                options,
            );
            let want = attention_backward_default::<Dispatch>(
                q.clone(),
                k.clone(),
                v.clone(),
                out.clone(),
                lse.clone(),
                dout.clone(),
                options,
            );
            let matmul = |a, b, _out| Dispatch::float_matmul(a, b);
            let got = backward_with::<Dispatch>([q, k, v, out, lse, dout], options, matmul);
            let values = |t| to_f32(Tensor::<4>::from_dispatch(t).into_data());
            for (what, g, w, len) in [
                ("dQ", got.query, want.query_grad, skv * d),
                ("dK", got.key, want.key_grad, sq * d * hq / hkv),
                ("dV", got.value, want.value_grad, sq * hq / hkv),
            ] {
                let name = format!("{what} b{b} hq{hq} hkv{hkv} sq{sq} skv{skv} {alignment:?}");
                let (g, w) = (values(g), values(w));
                // With one key the scores' gradient is zero, so dQ and dK are.
                let zero = skv == 1 && what != "dV";
                assert!(
                    zero || w.iter().any(|x| *x != 0.0),
                    "{name}: the reference is all zero"
                );
                assert_close(&name, &g, &w, Tolerance::for_reduction(DType::F32, len));
            }
        }
    }
}
