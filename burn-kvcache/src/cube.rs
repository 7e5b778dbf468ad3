//! `CubeBackend` runs the CubeCL kernels.

use burn::tensor::{Int, IntDType, Tensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_kernels_core::{AttnOptions, cube_float as float};

use crate::{KvBackend, Merged, Packed, QuantAttnView, QuantLayout, kernels};

type Cb<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// The key padding as the kernels read it: `[batch, skv]` i32, non-zero = hidden.
fn mask_i32<R, F, I, BT>(
    opts: &AttnOptions<Cb<R, F, I, BT>>,
) -> Option<burn_cubecl::tensor::CubeTensor<R>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    opts.key_padding
        .clone()
        .map(|m| m.int().cast(IntDType::I32).into_primitive())
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> KvBackend
    for CubeBackend<R, F, I, BT>
{
    fn minicache_merge(a: Tensor<Self, 2>, b: Tensor<Self, 2>, t: f32, gamma: f32) -> Merged<Self> {
        let (dir, mag_a, mag_b, dist) = kernels::merge::merge(
            a.into_primitive().tensor(),
            b.into_primitive().tensor(),
            t,
            gamma,
        );
        Merged {
            dir: float(dir),
            mag_a: float(mag_a),
            mag_b: float(mag_b),
            dist: float(dist),
        }
    }

    fn minicache_restore(
        dir: Tensor<Self, 2>,
        mag: Tensor<Self, 1>,
        retained: Option<(Tensor<Self, 1, Int>, Tensor<Self, 2>)>,
    ) -> Tensor<Self, 2> {
        float(kernels::restore::restore(
            dir.into_primitive().tensor(),
            mag.into_primitive().tensor(),
            retained.map(|(slot, rows)| (slot.into_primitive(), rows.into_primitive().tensor())),
        ))
    }

    fn kv_quantize(x: Tensor<Self, 2>, layout: QuantLayout) -> Packed<Self> {
        let (words, scale, min) = kernels::quantize::quantize(x.into_primitive().tensor(), layout);
        Packed {
            words: Tensor::from_primitive(words),
            scale: float(scale),
            min: float(min),
        }
    }

    fn kv_dequantize(packed: &Packed<Self>, layout: QuantLayout) -> Tensor<Self, 2> {
        float(kernels::dequantize::dequantize(
            packed.words.clone().into_primitive(),
            packed.scale.clone().into_primitive().tensor(),
            packed.min.clone().into_primitive().tensor(),
            layout,
        ))
    }

    fn kv_has_quant_attention() -> bool {
        true
    }

    fn kv_quant_attention(
        q: Tensor<Self, 4>,
        view: &QuantAttnView<Self>,
        opts: &AttnOptions<Self>,
    ) -> Tensor<Self, 4> {
        let (Some((kp, kl)), Some((vp, vl))) = (&view.keys, &view.values) else {
            // Only full-precision positions: nothing to dequantize.
            return crate::reference::quant_attention(q, view, opts);
        };
        let [b, hq, sq, _] = q.dims();
        let hkv = view.kv_heads(b);
        let tail = view.tail.as_ref().map_or(0, |(tk, _)| tk.dims()[2]);
        let args = kernels::quant_attention::QuantAttnArgs {
            rows: 0,
            hkv,
            group: hq / hkv,
            sq,
            qlen: view.qlen,
            tail,
            kblocks: view.qlen / kl.cols,
            kgroup: kl.cols,
            kwords: kl.words_per_group(),
            vgroups: vl.groups(),
            vgroup: vl.group_len(),
            vwords: vl.words_per_group(),
            bits: kl.bits,
            split: 0,
            splits: 0,
            scale: opts.scale,
        };
        let parts = |p: &Packed<Self>| {
            (
                p.words.clone().into_primitive(),
                p.scale.clone().into_primitive().tensor(),
                p.min.clone().into_primitive().tensor(),
            )
        };
        let inputs = kernels::quant_attention::QuantAttnInputs {
            q: q.into_primitive().tensor(),
            k: Some(parts(kp)),
            v: Some(parts(vp)),
            tail: view
                .tail
                .clone()
                .map(|(k, v)| (k.into_primitive().tensor(), v.into_primitive().tensor())),
            mask: mask_i32(opts),
        };
        float(kernels::quant_attention::quant_attention(
            inputs,
            args,
            opts.causal,
        ))
    }

    fn kv_decode_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        opts: &AttnOptions<Self>,
    ) -> Tensor<Self, 4> {
        let [_, hq, sq, _] = q.dims();
        let [_, hkv, skv, _] = k.dims();
        // The quantized read with no quantized part: every position is in the tail.
        let args = kernels::quant_attention::QuantAttnArgs {
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
            scale: opts.scale,
        };
        let inputs = kernels::quant_attention::QuantAttnInputs {
            q: q.into_primitive().tensor(),
            k: None,
            v: None,
            tail: Some((k.into_primitive().tensor(), v.into_primitive().tensor())),
            mask: mask_i32(opts),
        };
        float(kernels::quant_attention::quant_attention(
            inputs,
            args,
            opts.causal,
        ))
    }

    fn shadowkv_gather_reconstruct_rope(
        a: Tensor<Self, 3>,
        wt: Tensor<Self, 4>,
        chunks: Tensor<Self, 3, Int>,
        cos: Tensor<Self, 2>,
        sin: Tensor<Self, 2>,
        chunk: usize,
    ) -> Tensor<Self, 4> {
        float(kernels::gather_rope::gather_reconstruct_rope(
            a.into_primitive().tensor(),
            wt.into_primitive().tensor(),
            chunks.into_primitive(),
            cos.into_primitive().tensor(),
            sin.into_primitive().tensor(),
            chunk,
        ))
    }
}
