//! Attention over the caches' layouts: the split-K decode attention over full-precision keys and
//! values, and attention straight from KIVI-packed keys and values.

use burn::backend::Dispatch;
use burn::tensor::{Device, Tensor};
use burn_kernels_core::{AttentionImpl, AttnOptions, BurnAttention};

use crate::{
    KeyMask, KvCacheError, KvKernels, KvTail, Packed, QuantAttnPlan, QuantLayout, kernel, reference,
};

/// One layer's KIVI-quantized keys and values as [`QuantKv`](crate::QuantKv) holds them, and the
/// full-precision positions after them, for [`quant_attention`].
///
/// # Shapes
/// With `n = qlen` quantized positions, `g = keys.1.cols` tokens per key group:
/// - `keys`: per-channel rows, [`Packed`] of `[b·hkv·(n/g)·d, …]`, layout `cols = g`: row
///   `((b·hkv + h)·(n/g) + block)·d + c` holds channel `c` of the block's `g` tokens
/// - `values`: per-token rows, [`Packed`] of `[b·hkv·n, …]`, layout `cols = d`
/// - `tail`: keys and values `[b, hkv, t, d]` after the quantized positions, in the dtype of
///   the query
#[derive(Debug, Clone)]
pub struct QuantAttnView {
    pub keys: Option<(Packed, QuantLayout)>,
    pub values: Option<(Packed, QuantLayout)>,
    /// Quantized positions, a multiple of the key group.
    pub qlen: usize,
    pub tail: Option<(Tensor<4>, Tensor<4>)>,
}

impl QuantAttnView {
    /// KV heads of the view for a batch of `batch` (0 when it holds no position).
    pub fn kv_heads(&self, batch: usize) -> usize {
        match (&self.tail, &self.values) {
            (Some((tk, _)), _) => tk.dims()[1],
            (None, Some((p, _))) if batch * self.qlen > 0 => {
                p.scale.dims()[0] / (batch * self.qlen)
            }
            _ => 0,
        }
    }
}

/// Whether [`quant_attention`] runs its kernel on `device` (a CubeCL device of a runtime this
/// build enables, without autodiff). [`QuantKv`](crate::QuantKv) then attends straight from its packed keys and
/// values at each step (see [`QuantConfig::fused_attention`](crate::QuantConfig::fused_attention)); elsewhere it dequantizes them
/// for the model's attention.
pub fn kv_has_quant_attention(device: &Device) -> bool {
    cfg!(feature = "cube")
        && burn_kernels_core::route::cube_device(device).is_some()
        && !device.is_autodiff()
}

/// The key padding as the kernels read it: `[batch, skv]` bool, `true` = hidden, as stored.
fn key_mask(opts: &AttnOptions) -> KeyMask<Dispatch> {
    match &opts.key_padding {
        Some(m) => KeyMask::Present {
            mask: m.clone().into_dispatch(),
        },
        None => KeyMask::Absent,
    }
}

/// Split-K "flash decoding" over full-precision keys and values for calls with at most
/// `max_queries` query rows (decode steps, speculative verification): the quantized read's
/// kernel ([`quant_attention`]) with every position in its full-precision tail. Two launches
/// per call instead of the dozen of a tensor-op attention, and each KV head is read once for
/// its whole query group (no repeated K/V). Longer calls (prefill), and devices without the
/// kernel, use Burn's attention op.
#[derive(Debug, Clone, Copy)]
pub struct DecodeAttention {
    pub max_queries: usize,
}

impl Default for DecodeAttention {
    fn default() -> Self {
        Self { max_queries: 16 }
    }
}

impl AttentionImpl for DecodeAttention {
    fn name(&self) -> String {
        "decode".into()
    }

    fn attend(
        &self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        opts: &AttnOptions,
    ) -> Tensor<4> {
        let [_, _, sq, _] = q.dims();
        let skv = k.dims()[2];
        if sq > self.max_queries || (opts.causal && sq > skv) {
            // Not a fallback: Burn's attention is the right kernel for long query blocks.
            return BurnAttention.attend(layer, q, k, v, opts);
        }
        decode_attention(q, k, v, opts, |q, k, v| {
            BurnAttention.attend(layer, q, k, v, opts)
        })
    }
}

/// The decode attention's kernel over full-precision `k`, `v` where it runs, else `fallback`.
///
/// # Shapes
/// As [`burn_kernels_core::AttentionImpl::attend`], `sq ≤ skv` when causal.
fn decode_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    opts: &AttnOptions,
    fallback: impl FnOnce(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>,
) -> Tensor<4> {
    let [b, hq, _, d] = q.dims();
    let [_, hkv, skv, _] = k.dims();
    let unsupported = if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
        Some(format!(
            "q, k, v are {:?}, {:?}, {:?}",
            q.dtype(),
            k.dtype(),
            v.dtype()
        ))
    } else if k.dims() != v.dims() || k.dims()[0] != b || k.dims()[3] != d {
        Some(format!(
            "k {:?} and v {:?} for q {:?}",
            k.dims(),
            v.dims(),
            q.dims()
        ))
    } else if hkv == 0 || hq % hkv != 0 {
        Some(format!("{hq} query heads over {hkv} KV heads"))
    } else {
        opts.key_padding
            .as_ref()
            .filter(|m| m.dims() != [b, skv])
            .map(|m| format!("key padding {:?} for {b} x {skv} keys", m.dims()))
    };
    if !kernel("kv_decode_attention", &q.device(), unsupported) {
        return fallback(q, k, v);
    }
    Tensor::from_dispatch(Dispatch::kv_decode_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        key_mask(opts),
        opts.scale,
        opts.causal,
    ))
}

/// Attention over a quantized layer (see [`QuantAttnView`]) and its tail, keys and values
/// dequantized as they are read: the same result as dequantizing the layer, concatenating the
/// tail and calling [`burn_kernels_core::ReferenceAttention`] (which is what devices without
/// the kernel run), but without the f16 copies. A view without quantized positions runs the
/// [`DecodeAttention`] kernel over its tail. Masks as [`AttnOptions`] documents (causal
/// bottom-right, key padding over all `qlen + t` positions); rows that see no key return
/// zeros.
///
/// # Shapes
/// - `q`: `[b, hq, sq, d]`, `hq` a multiple of `hkv`; returns `[b, hq, sq, d]`
///
/// # Errors
/// [`KvCacheError::ShapeMismatch`] when the view's parts disagree with each other or with
/// `q`, or a causal query is longer than the keys; [`KvCacheError::DTypeMismatch`] when the
/// tail or the scales are not in the query's dtype.
pub fn quant_attention(
    q: Tensor<4>,
    view: &QuantAttnView,
    opts: &AttnOptions,
) -> Result<Tensor<4>, KvCacheError> {
    let [b, hq, sq, d] = q.dims();
    let mismatch =
        |left: Vec<usize>, right: Vec<usize>| KvCacheError::ShapeMismatch { left, right };
    let n = view.qlen;
    let t = match &view.tail {
        Some((tk, tv)) => {
            let [tb, _, tt, td] = tk.dims();
            if tv.dims() != tk.dims() || tb != b || td != d {
                return Err(mismatch(tk.dims().to_vec(), tv.dims().to_vec()));
            }
            if tk.dtype() != q.dtype() || tv.dtype() != q.dtype() {
                return Err(KvCacheError::DTypeMismatch);
            }
            tt
        }
        None => 0,
    };
    let hkv = view.kv_heads(b);
    if hkv == 0 || hq % hkv != 0 {
        return Err(mismatch(vec![b, hq, sq, d], vec![b, hkv, t, d]));
    }
    match (&view.keys, &view.values) {
        (Some((kp, kl)), Some((vp, vl))) => {
            let g = kl.cols;
            if g == 0 || !n.is_multiple_of(g) || kl.groups() != 1 || vl.cols != d {
                return Err(mismatch(vec![n, d], vec![g, vl.cols]));
            }
            let (krows, vrows) = (b * hkv * (n / g) * d, b * hkv * n);
            let shapes_ok = kp.scale.dims() == [krows, 1]
                && kp.min.dims() == [krows, 1]
                && kp.words.dims() == [krows, kl.words_per_group()]
                && vp.scale.dims() == [vrows, vl.groups()]
                && vp.min.dims() == [vrows, vl.groups()]
                && vp.words.dims() == [vrows, vl.groups() * vl.words_per_group()];
            if !shapes_ok || kl.bits != vl.bits {
                return Err(mismatch(kp.scale.dims().to_vec(), vp.scale.dims().to_vec()));
            }
            if [&kp.scale, &kp.min, &vp.scale, &vp.min]
                .iter()
                .any(|x| x.dtype() != q.dtype())
            {
                return Err(KvCacheError::DTypeMismatch);
            }
        }
        (None, None) if n == 0 && t > 0 => {}
        _ => return Err(mismatch(vec![n], vec![t])),
    }
    let skv = n + t;
    if opts.causal && sq > skv {
        return Err(mismatch(vec![sq], vec![skv]));
    }
    if let Some(m) = &opts.key_padding
        && m.dims() != [b, skv]
    {
        return Err(mismatch(vec![b, skv], m.dims().to_vec()));
    }
    let (Some((kp, kl)), Some((vp, vl))) = (&view.keys, &view.values) else {
        // Only full-precision positions: nothing to dequantize.
        let (k, v) = view
            .tail
            .clone()
            .expect("validated: a view holds positions");
        return Ok(decode_attention(q, k, v, opts, |q, _, _| {
            reference::quant_attention(q, view, opts)
        }));
    };
    let unsupported = kp.unsupported().or_else(|| vp.unsupported());
    if !kernel("kv_quant_attention", &q.device(), unsupported) {
        return Ok(reference::quant_attention(q, view, opts));
    }
    let tail = match view.tail.clone() {
        Some((k, v)) => KvTail::Present {
            k: k.into_dispatch(),
            v: v.into_dispatch(),
        },
        None => KvTail::Absent,
    };
    let plan = QuantAttnPlan {
        keys: *kl,
        values: *vl,
        qlen: n,
        kv_heads: hkv,
        scale: opts.scale,
        causal: opts.causal,
    };
    Ok(Tensor::from_dispatch(Dispatch::kv_quant_attention(
        q.into_dispatch(),
        kp.clone().into_primitive(),
        vp.clone().into_primitive(),
        tail,
        key_mask(opts),
        plan,
    )))
}
