//! The crate's kernels as a Burn backend extension: `CubeBackend` runs them, Burn's `Dispatch`
//! routes to it, and `Fusion<CubeBackend>` (generated) registers each call as a custom
//! operation of the fused stream. The public ops ([`crate::merge`], [`crate::quantize`], …)
//! validate their arguments and decide (through `burn_kernels_core::route`) when to call them.

// Without a CubeCL runtime the generated `Dispatch` implementation has no backend to pass the
// ordinary arguments to (and the public ops never call it: see `crate::kernel`).
#![cfg_attr(not(feature = "cube"), allow(unused_variables))]

use burn::backend::{
    Backend, ExtensionType, backend_extension,
    tensor::{BoolTensor, FloatTensor, IntTensor},
};

use crate::QuantLayout;

/// Packed quantization codes with their per-group scale and min, as backend primitives
/// (the primitive form of [`crate::Packed`]).
///
/// # Shapes
/// - `words`: `[rows, groups · words_per_group]` u32; `scale`, `min`: `[rows, groups]`, one
///   float dtype (see [`QuantLayout::packed_shapes`])
#[derive(ExtensionType)]
#[extension_type(fusion: cfg(all(feature = "cube", feature = "fusion")))]
pub struct PackedPrimitive<B: Backend> {
    pub words: IntTensor<B>,
    pub scale: FloatTensor<B>,
    pub min: FloatTensor<B>,
}

/// The full-precision keys and values after the quantized positions of a
/// [`KvKernels::kv_quant_attention`] call, if any.
///
/// # Shapes
/// - `k`, `v`: `[b, hkv, t, d]` in the query's dtype, `t ≥ 1`
#[derive(ExtensionType)]
#[extension_type(fusion: cfg(all(feature = "cube", feature = "fusion")))]
pub enum KvTail<B: Backend> {
    Absent,
    Present {
        k: FloatTensor<B>,
        v: FloatTensor<B>,
    },
}

/// The key padding of an attention call, if any.
///
/// # Shapes
/// - `mask`: `[b, skv]` bool, `true` = hidden (any strides: the kernels read Burn's bool
///   storage in place, so a step converts nothing)
#[derive(ExtensionType)]
#[extension_type(fusion: cfg(all(feature = "cube", feature = "fusion")))]
pub enum KeyMask<B: Backend> {
    Absent,
    Present { mask: BoolTensor<B> },
}

/// What [`KvKernels::kv_quant_attention`] needs besides its tensors: the layouts of the packed
/// keys (per channel, `cols` = tokens per key group) and values (per token, `cols` =
/// head dim), the quantized positions, the KV heads, the softmax scale and the causal mask.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuantAttnPlan {
    pub keys: QuantLayout,
    pub values: QuantLayout,
    /// Quantized positions, a multiple of `keys.cols`.
    pub qlen: usize,
    pub kv_heads: usize,
    pub scale: f32,
    /// Bottom-right aligned causal mask.
    pub causal: bool,
}

/// The MiniCache, KIVI and ShadowKV ops, one CubeCL kernel each (forward only).
///
/// Call them through the crate's public functions ([`crate::merge`], [`crate::restore`],
/// [`crate::quantize`], [`crate::dequantize`], [`crate::quant_attention`],
/// [`crate::DecodeAttention`], [`crate::gather_reconstruct_rope`]), which validate the
/// arguments and check the device first; the methods here assume valid input.
#[backend_extension(
    Cube: cfg(feature = "cube"),
    Fusion: cfg(all(feature = "cube", feature = "fusion")),
)]
pub trait KvKernels: Backend {
    /// MiniCache merge of row pairs: `(dir, mag_a, mag_b, dist)`.
    ///
    /// # Shapes
    /// - `a`, `b`: `[n, d]`, one float dtype
    /// - returns `dir [n, d]`, `mag_a`, `mag_b` `[n]` in that dtype, `dist [n]` f32
    #[fusion(meta = |a, _b, _t, _gamma| {
        let (dir, rows) = crate::shapes::merged_shapes(&a.shape);
        let spec = burn::backend::fusion::custom::TensorSpec::new;
        (
            spec(dir, a.dtype),
            spec(rows.clone(), a.dtype),
            spec(rows.clone(), a.dtype),
            spec(rows, burn::tensor::DType::F32),
        )
    })]
    fn minicache_merge(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        t: f32,
        gamma: f32,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    );

    /// MiniCache restore of one layer without retained rows: `mag_i · dir_i`.
    ///
    /// # Shapes
    /// - `dir`: `[n, d]`, `mag`: `[n]`, one float dtype; returns `[n, d]`
    #[fusion(dtype = dir, shape = dir)]
    fn minicache_restore(dir: FloatTensor<Self>, mag: FloatTensor<Self>) -> FloatTensor<Self>;

    /// MiniCache restore of one layer: `mag_i · dir_i`, or retained row `slot_i − 1` where
    /// `slot_i > 0`.
    ///
    /// # Shapes
    /// - `dir`: `[n, d]`, `mag`: `[n]`, `rows`: `[r ≥ 1, d]`, one float dtype; `slot`: `[n]`
    ///   int in `[0, r]`; returns `[n, d]`
    #[fusion(dtype = dir, shape = dir)]
    fn minicache_restore_retained(
        dir: FloatTensor<Self>,
        mag: FloatTensor<Self>,
        slot: IntTensor<Self>,
        rows: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// KIVI quantization of column groups, codes packed into `u32` words.
    ///
    /// # Shapes
    /// - `x`: `[rows, layout.cols]`; returns words, scale and min as
    ///   [`QuantLayout::packed_shapes`] gives, scale and min in `x`'s dtype
    #[fusion(meta = |x, layout| {
        let (words, stats) = layout.packed_shapes(x.shape[0]);
        let spec = burn::backend::fusion::custom::TensorSpec::new;
        PackedPrimitiveMetadata {
            words: spec(words, burn::tensor::DType::U32),
            scale: spec(stats.clone(), x.dtype),
            min: spec(stats, x.dtype),
        }
    })]
    fn kv_quantize(x: FloatTensor<Self>, layout: QuantLayout) -> PackedPrimitive<Self>;

    /// `min + code·scale`.
    ///
    /// # Shapes
    /// - `packed` as [`KvKernels::kv_quantize`] returns it for `layout`; returns `[rows,
    ///   layout.cols]` in the dtype of the scales
    #[fusion(meta = |packed, layout| burn::backend::fusion::custom::TensorSpec::new(
        crate::shapes::dequantized_shape(&packed.scale.shape, layout),
        packed.scale.dtype,
    ))]
    fn kv_dequantize(
        #[extension_type] packed: PackedPrimitive<Self>,
        layout: QuantLayout,
    ) -> FloatTensor<Self>;

    /// Attention read straight from packed KIVI keys (per channel) and values (per token),
    /// then the full-precision tail.
    ///
    /// # Shapes
    /// - `q`: `[b, hq, sq, d]`, `hq` a multiple of `plan.kv_heads`; `keys`, `values` as
    ///   [`crate::QuantAttnView`] documents; returns `q`'s shape and dtype
    #[fusion(dtype = q, shape = q)]
    fn kv_quant_attention(
        q: FloatTensor<Self>,
        #[extension_type] keys: PackedPrimitive<Self>,
        #[extension_type] values: PackedPrimitive<Self>,
        #[extension_type] tail: KvTail<Self>,
        #[extension_type] mask: KeyMask<Self>,
        plan: QuantAttnPlan,
    ) -> FloatTensor<Self>;

    /// Split-K attention of a few queries over full-precision keys and values, GQA without
    /// copies (the quantized read's kernel with every position in its tail).
    ///
    /// # Shapes
    /// - `q`: `[b, hq, sq, d]`; `k`, `v`: `[b, hkv, skv, d]`, `hq` a multiple of `hkv`, one
    ///   float dtype, `sq ≤ skv` when causal; returns `q`'s shape and dtype
    #[fusion(dtype = q, shape = q)]
    fn kv_decode_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        #[extension_type] mask: KeyMask<Self>,
        scale: f32,
        causal: bool,
    ) -> FloatTensor<Self>;

    /// ShadowKV's fused gather, low-rank rebuild and RoPE of the selected chunks' keys.
    ///
    /// # Shapes
    /// - `a`: `[batch, rows, rank]`, `wt`: `[batch, heads, rank, d]` (`a`'s dtype, `d` even),
    ///   `chunks`: `[batch, heads, k]` int, `cos`, `sin`: `[positions, d/2]` f32
    /// - returns `[batch, heads, k · chunk, d]` in `a`'s dtype
    #[fusion(dtype = a, shape = crate::shapes::gather_rope_shape(wt, chunks, chunk))]
    fn shadowkv_gather_reconstruct_rope(
        a: FloatTensor<Self>,
        wt: FloatTensor<Self>,
        chunks: IntTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        chunk: usize,
    ) -> FloatTensor<Self>;

    /// ShadowKV's landmark scoring: per (sequence, KV head) row, the maximum over the group's
    /// query heads of the sum over their positions of `softmax(q·lᵀ·scale)` over the row's
    /// first `n` landmarks (the rest masked).
    ///
    /// # Shapes
    /// - `q`: `[b, hq, sq, dd]` f32; `landmarks`: `[b, h, t, dd]`; `sizes`: `[b·h, 2]` int, `n`
    ///   first
    /// - returns `[b·h, t]` f32
    #[fusion(dtype = q, shape = crate::shapes::landmark_scores_shape(landmarks))]
    fn shadowkv_landmark_scores(
        q: FloatTensor<Self>,
        landmarks: FloatTensor<Self>,
        sizes: IntTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self>;

    /// ShadowKV's selection: per row, the positions of the `k` largest of its first `n`
    /// scores, ascending (ties to the lowest positions), then the first of them repeated.
    ///
    /// # Shapes
    /// - `scores`: `[rows, cols]` f32; `sizes`: `[rows, 2]` int, `(n, k)` per row
    /// - returns `[rows, kk]` in `sizes`' int dtype
    #[fusion(dtype = sizes, shape = crate::shapes::top_k_shape(scores, kk))]
    fn shadowkv_top_k(
        scores: FloatTensor<Self>,
        sizes: IntTensor<Self>,
        kk: usize,
    ) -> IntTensor<Self>;
}

#[cfg(feature = "cube")]
mod cube_backend {
    use super::{KeyMask, KvKernels, KvTail, PackedPrimitive, QuantAttnPlan};
    use crate::QuantLayout;
    use crate::kernels;
    use crate::kernels::quant_attention::{QuantAttnArgs, QuantAttnInputs};
    use burn::backend::tensor::{FloatTensor, IntTensor};
    use burn_cubecl::CubeBackend;
    use burn_kernels_core::route::count_launch;

    fn mask_of(mask: KeyMask<CubeBackend>) -> Option<burn_cubecl::tensor::CubeTensor> {
        match mask {
            KeyMask::Absent => None,
            KeyMask::Present { mask } => Some(mask),
        }
    }

    impl KvKernels for CubeBackend {
        fn minicache_merge(
            a: FloatTensor<Self>,
            b: FloatTensor<Self>,
            t: f32,
            gamma: f32,
        ) -> (
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
            FloatTensor<Self>,
        ) {
            count_launch("minicache_merge");
            kernels::merge::merge(a, b, t, gamma)
        }

        fn minicache_restore(dir: FloatTensor<Self>, mag: FloatTensor<Self>) -> FloatTensor<Self> {
            count_launch("minicache_restore");
            kernels::restore::restore(dir, mag, None)
        }

        fn minicache_restore_retained(
            dir: FloatTensor<Self>,
            mag: FloatTensor<Self>,
            slot: IntTensor<Self>,
            rows: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            count_launch("minicache_restore");
            kernels::restore::restore(dir, mag, Some((slot, rows)))
        }

        fn kv_quantize(x: FloatTensor<Self>, layout: QuantLayout) -> PackedPrimitive<Self> {
            count_launch("kv_quantize");
            let (words, scale, min) = kernels::quantize::quantize(x, layout);
            PackedPrimitive { words, scale, min }
        }

        fn kv_dequantize(packed: PackedPrimitive<Self>, layout: QuantLayout) -> FloatTensor<Self> {
            count_launch("kv_dequantize");
            kernels::dequantize::dequantize(packed.words, packed.scale, packed.min, layout)
        }

        fn kv_quant_attention(
            q: FloatTensor<Self>,
            keys: PackedPrimitive<Self>,
            values: PackedPrimitive<Self>,
            tail: KvTail<Self>,
            mask: KeyMask<Self>,
            plan: QuantAttnPlan,
        ) -> FloatTensor<Self> {
            count_launch("kv_quant_attention");
            let [_, hq, sq, _] = q.meta.shape().dims::<4>();
            let tail = match tail {
                KvTail::Absent => None,
                KvTail::Present { k, v } => Some((k, v)),
            };
            let t = tail.as_ref().map_or(0, |(k, _)| k.meta.shape()[2]);
            let (kl, vl) = (plan.keys, plan.values);
            let args = QuantAttnArgs {
                rows: 0,
                hkv: plan.kv_heads,
                group: hq / plan.kv_heads,
                sq,
                qlen: plan.qlen,
                tail: t,
                kblocks: plan.qlen / kl.cols,
                kgroup: kl.cols,
                kwords: kl.words_per_group(),
                vgroups: vl.groups(),
                vgroup: vl.group_len(),
                vwords: vl.words_per_group(),
                bits: kl.bits,
                split: 0,
                splits: 0,
                scale: plan.scale,
            };
            let parts = |p: PackedPrimitive<Self>| (p.words, p.scale, p.min);
            let inputs = QuantAttnInputs {
                q,
                k: Some(parts(keys)),
                v: Some(parts(values)),
                tail,
                mask: mask_of(mask),
            };
            kernels::quant_attention::quant_attention(inputs, args, plan.causal)
        }

        fn kv_decode_attention(
            q: FloatTensor<Self>,
            k: FloatTensor<Self>,
            v: FloatTensor<Self>,
            mask: KeyMask<Self>,
            scale: f32,
            causal: bool,
        ) -> FloatTensor<Self> {
            count_launch("kv_decode_attention");
            let [_, hq, sq, d] = q.meta.shape().dims::<4>();
            let [_, hkv, skv, _] = k.meta.shape().dims::<4>();
            // One plane per split where planes have one known size; else one unit per split.
            let rows = (hq / hkv.max(1)) * sq;
            if let Some(lanes) = kernels::decode_attention::supported(&q.client, d, rows) {
                return kernels::decode_attention::decode_attention(
                    q,
                    k,
                    v,
                    mask_of(mask),
                    scale,
                    causal,
                    kernels::decode_attention::DecodeLayout::new(lanes),
                );
            }
            // The quantized read with no quantized part: every position is in the tail.
            let args = QuantAttnArgs {
                rows: 0,
                hkv,
                group: hq / hkv,
                sq,
                qlen: 0,
                tail: skv,
                kblocks: 0,
                kgroup: 1,
                kwords: 1,
                vgroups: 1,
                vgroup: 1,
                vwords: 1,
                bits: 4,
                split: 0,
                splits: 0,
                scale,
            };
            let inputs = QuantAttnInputs {
                q,
                k: None,
                v: None,
                tail: Some((k, v)),
                mask: mask_of(mask),
            };
            kernels::quant_attention::quant_attention(inputs, args, causal)
        }

        fn shadowkv_gather_reconstruct_rope(
            a: FloatTensor<Self>,
            wt: FloatTensor<Self>,
            chunks: IntTensor<Self>,
            cos: FloatTensor<Self>,
            sin: FloatTensor<Self>,
            chunk: usize,
        ) -> FloatTensor<Self> {
            count_launch("shadowkv_gather_reconstruct_rope");
            kernels::gather_rope::gather_reconstruct_rope(a, wt, chunks, cos, sin, chunk)
        }

        fn shadowkv_landmark_scores(
            q: FloatTensor<Self>,
            landmarks: FloatTensor<Self>,
            sizes: IntTensor<Self>,
            scale: f32,
        ) -> FloatTensor<Self> {
            count_launch("shadowkv_landmark_scores");
            kernels::landmark_scores::landmark_scores(q, landmarks, sizes, scale)
        }

        fn shadowkv_top_k(
            scores: FloatTensor<Self>,
            sizes: IntTensor<Self>,
            kk: usize,
        ) -> IntTensor<Self> {
            count_launch("shadowkv_top_k");
            kernels::top_k::top_k(scores, sizes, kk)
        }
    }
}
