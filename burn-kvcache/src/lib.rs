//! # burn-kvcache: KV-cache compression for Burn
//!
//! Three compressions of the KV cache (and one composition), each a
//! [`KvCache`](burn_kernels_core::KvCache) the Llama example can run with:
//!
//! - [`ShadowKvCache`]: ShadowKV (Sun et al., 2024, arXiv 2410.21465): low-rank pre-RoPE keys
//!   on the device, values in host memory, chunk landmarks scored at each decode step and the
//!   top chunks' keys rebuilt by the fused [`gather_reconstruct_rope`] kernel. See
//!   [`shadowkv`].
//! - [`MiniCacheKv`]: MiniCache (Liu et al., 2024, arXiv 2405.14366) cross-layer merging:
//!   adjacent layers from a start layer on share one direction per token, each keeping its own
//!   magnitude; tokens whose two directions are too far apart are retained unmerged.
//! - [`QuantKv`]: KIVI-style quantization (keys per channel, values per token, 2 or 4 bits,
//!   asymmetric min/scale, codes packed into `u32` words, the most recent tokens in full
//!   precision).
//! - [`MiniCacheKv::with_quant`]: both; the shared directions, the unmerged layers and the
//!   retained tokens are quantized, the magnitudes stay in the model dtype.
//!
//! The ops they are built on are public and validated: [`merge`], [`restore`], [`quantize`],
//! [`dequantize`], [`quant_attention`], [`gather_reconstruct_rope`] (and [`DecodeAttention`]).
//! Each runs as a CubeCL kernel where the tensors live on a CubeCL device of a runtime this
//! build enables, through the backend extension [`KvKernels`] (Burn's `Dispatch`, fused or
//! not; [`kernels`]), and as plain tensor ops everywhere else ([`reference`](mod@reference)),
//! decided by `burn_kernels_core::route`.
//!
//! ## MiniCache: the choices made here (no official code exists)
//!
//! - **Vectors.** A "state" is one token's key (post-RoPE) or value in one KV head, a
//!   `head_dim` vector: magnitudes and directions are per `(batch, kv_head, token)`, and keys
//!   and values are merged (and retained) independently.
//! - **Pairs.** From `start_layer` on, layers `(l, l+1)` for `l = start, start+2, …` are
//!   merged; an odd last layer and the layers below `start_layer` are stored unmerged. The
//!   paper merges from the middle of the model; `start_layer` defaults to `num_layers / 2`.
//! - **Direction.** `u = x_l / ‖x_l‖`, `w = x_{l+1} / ‖x_{l+1}‖`, `θ = 2·atan2(‖u − w‖,
//!   ‖u + w‖)` (the angle between them, accurate near 0 and π), and the shared direction is
//!   `SLERP(u, w; t) = [sin((1−t)θ)·u + sin(tθ)·w] / sin θ`, renormalized; when `sin θ < 1e-6`
//!   it is the normalized linear interpolation. As in the paper's `SLERP(x_{l−1}, x_l; t)`,
//!   `t` weights the deeper layer; the default `t = 0.6` is the paper's setting (the repo's
//!   paper summary does not list `t`; 0.6 is the value the paper's experiments use).
//! - **Retention.** The angular distance is `θ / π ∈ [0, 1]` (the paper's
//!   `arccos(cos)/π`). A token is retained when `θ / π > γ`, an absolute threshold: `γ = 0`
//!   retains every token whose directions differ at all (exactly lossless up to rounding),
//!   `γ ≥ 1` retains none. The paper states its threshold relative to the batch's min/max
//!   distance; an absolute one makes a token's fate independent of the other tokens merged
//!   with it, which incremental (decode-time) merging needs. Default `γ = 0.05`, the paper's
//!   best trade-off.
//! - **Storage of a pair.** The shared direction `[b, h, s, d]`, both magnitudes `[b, h, s]`,
//!   a slot map `[b, h, s]` (0 = merged, `r + 1` = retained row `r`, i32) and the retained rows
//!   `[r, d]`. For a retained token the direction slot holds layer `l`'s own direction, so
//!   `‖x_l‖·u = x_l` is restored exactly and only layer `l+1`'s vector is stored apart: both
//!   full vectors are kept at the cost of one extra row, not two.
//! - **Restore.** `x̂_l = ‖x_l‖·dir`; `x̂_{l+1} = ‖x_{l+1}‖·dir`, or the retained row.
//! - **Decode.** Layer `l` attends before layer `l+1` has produced its K/V for the same
//!   positions, so new positions are held in full precision for both layers (the pending
//!   window) and merged in one batch once layer `l+1` holds `window` pending positions
//!   (default 16): each merge is one launch and one small device→host read (the retained
//!   count). Attention of a call always sees that call's new tokens exactly; compression
//!   happens after it (as the paper compresses after prefill).
//! - **Truncate.** Positions still pending are dropped directly; cutting into the merged part
//!   restores it, cuts, and re-merges (restored merged tokens share a direction, so
//!   re-merging them is idempotent up to rounding).
//!
//! ## Quantization (KIVI-style)
//!
//! Keys are quantized per channel: each channel of a block of `group_size` consecutive tokens
//! has its own min and scale. Values are quantized per token: each group of `group_size`
//! channels of a token has its own. Codes `round((x − min)/scale)` with `scale = (max −
//! min)/(2^bits − 1)` are packed `32/bits` to a `u32` word, little end first. The most recent
//! tokens stay in full precision: after each append, once `residual + group_size` or more
//! tokens are unquantized, the oldest whole groups of `group_size` tokens are quantized,
//! leaving between `residual` and `residual + group_size − 1` in full precision (KIVI's `R`
//! and `G`; defaults 32 and 32). The error of a dequantized element is at most `scale / 2`.
//!
//! ## Composition
//!
//! [`MiniCacheKv::with_quant`] stores every sequence the cache holds through the same
//! quantized store: unmerged layers as in [`QuantKv`], the merged directions as keys/values
//! of their own (per channel / per token), the retained rows per token (groups along
//! channels, no residual window). Magnitudes and slot maps are not quantized (2 scalars and
//! one i32 per token and pair, against `head_dim` elements).
//!
//! ## Bytes
//!
//! `bytes_held` counts every tensor a cache holds at its real element size: packed words (4
//! bytes), scales and mins, magnitudes, slot maps, retained rows, pending and residual
//! windows.

pub mod cache;
mod cube;
mod error;
pub mod kernels;
pub mod reference;
pub mod shadowkv;
pub mod shapes;
mod store;

pub use cache::{MergeStats, MiniCacheConfig, MiniCacheKv, QuantConfig, QuantKv};
pub use cube::{KeyMask, KvKernels, KvTail, PackedPrimitive, QuantAttnPlan};
pub use error::KvCacheError;
pub use shadowkv::{DecodeTimings, RopeParams, ShadowBytes, ShadowKvCache, ShadowKvConfig};

use burn::backend::Dispatch;
use burn::tensor::{DType, Device, Int, IntDType, Tensor};
use burn_kernels_core::route::{Grad, route};
use burn_kernels_core::{AttentionImpl, AttnOptions, BurnAttention};

/// Whether `op` runs its kernel on `device` (see `burn_kernels_core::route::route`); never in a
/// build without a CubeCL runtime feature, whose `KvKernels` has no CubeCL implementation.
fn kernel(op: &'static str, device: &Device, unsupported: Option<String>) -> bool {
    cfg!(feature = "cube") && route(op, device, Grad::ForwardOnly, unsupported)
}

/// The shared direction, both magnitudes and the angular distance of merged row pairs.
#[derive(Debug, Clone)]
pub struct Merged {
    /// `[n, d]`, input dtype; layer `a`'s own direction for retained rows.
    pub dir: Tensor<2>,
    /// `[n]`, input dtype: `‖a_i‖`.
    pub mag_a: Tensor<1>,
    /// `[n]`, input dtype: `‖b_i‖`.
    pub mag_b: Tensor<1>,
    /// `[n]`, f32: `θ_i / π`; row `i` is retained when it is above `gamma`.
    pub dist: Tensor<1>,
}

/// Packed quantization codes with their per-group scale and min.
#[derive(Debug, Clone)]
pub struct Packed {
    /// `[rows, groups · words_per_group]`, u32.
    pub words: Tensor<2, Int>,
    /// `[rows, groups]`, the dtype of the quantized tensor.
    pub scale: Tensor<2>,
    /// `[rows, groups]`, the dtype of the quantized tensor.
    pub min: Tensor<2>,
}

impl Packed {
    /// Bytes of the words, scales and mins.
    pub fn bytes(&self) -> usize {
        bytes_of(&self.scale) + bytes_of(&self.min) + bytes_of_int(&self.words)
    }

    /// The backend primitives, for [`KvKernels`].
    pub fn into_primitive(self) -> PackedPrimitive<Dispatch> {
        PackedPrimitive {
            words: self.words.into_dispatch(),
            scale: self.scale.into_dispatch(),
            min: self.min.into_dispatch(),
        }
    }

    /// The tensors of [`KvKernels`] primitives.
    pub fn from_primitive(p: PackedPrimitive<Dispatch>) -> Self {
        Self {
            words: Tensor::from_dispatch(p.words),
            scale: Tensor::from_dispatch(p.scale),
            min: Tensor::from_dispatch(p.min),
        }
    }

    /// Why the kernels cannot read these words, if they cannot: they read `u32` words and
    /// scales and mins of one dtype.
    fn unsupported(&self) -> Option<String> {
        if self.words.dtype() != DType::U32 {
            Some(format!("the words are {:?}, not U32", self.words.dtype()))
        } else if self.min.dtype() != self.scale.dtype() {
            Some(format!(
                "the scales are {:?}, the mins {:?}",
                self.scale.dtype(),
                self.min.dtype()
            ))
        } else {
            None
        }
    }
}

pub(crate) fn bytes_of<const D: usize>(t: &Tensor<D>) -> usize {
    t.shape().num_elements() * t.dtype().size()
}

pub(crate) fn bytes_of_int<const D: usize>(t: &Tensor<D, Int>) -> usize {
    t.shape().num_elements() * t.dtype().size()
}

/// How rows of `cols` values are grouped and packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantLayout {
    /// 2 or 4.
    pub bits: u32,
    /// Columns per group (the last group of a row may be shorter).
    pub group: usize,
    /// Columns per row.
    pub cols: usize,
}

impl QuantLayout {
    /// A validated layout.
    ///
    /// # Errors
    /// [`KvCacheError::InvalidBits`] unless `bits` is 2 or 4, [`KvCacheError::ZeroGroupSize`]
    /// for `group == 0`.
    pub fn new(bits: u32, group: usize, cols: usize) -> Result<Self, KvCacheError> {
        if bits != 2 && bits != 4 {
            return Err(KvCacheError::InvalidBits(bits));
        }
        if group == 0 {
            return Err(KvCacheError::ZeroGroupSize);
        }
        Ok(Self { bits, group, cols })
    }

    /// Columns of a full group: `min(group, cols)`.
    pub fn group_len(&self) -> usize {
        self.group.min(self.cols).max(1)
    }

    /// Groups per row.
    pub fn groups(&self) -> usize {
        self.cols.div_ceil(self.group_len())
    }

    pub fn codes_per_word(&self) -> usize {
        (32 / self.bits) as usize
    }

    pub fn words_per_group(&self) -> usize {
        self.group_len().div_ceil(self.codes_per_word())
    }

    /// The largest code, `2^bits − 1`.
    pub fn levels(&self) -> u32 {
        (1 << self.bits) - 1
    }
}

pub(crate) fn check_t_gamma(t: f32, gamma: f32) -> Result<(), KvCacheError> {
    if !(0.0..=1.0).contains(&t) {
        return Err(KvCacheError::InvalidInterpolation(t));
    }
    if !gamma.is_finite() || gamma < 0.0 {
        return Err(KvCacheError::InvalidGamma(gamma));
    }
    Ok(())
}

/// Merges row `i` of `a` (layer `l`) with row `i` of `b` (layer `l+1`): magnitudes, the SLERP
/// of their directions with weight `t` on `b`, and the normalized angle `θ/π` between them.
/// Rows with `θ/π > gamma` are retained: their `dir` is `a`'s own direction. See the crate
/// docs for the exact math.
///
/// # Shapes
/// - `a`, `b`: `[n, d]`, one float dtype
/// - returns [`Merged`]: `dir [n, d]`, `mag_a`, `mag_b` `[n]`, `dist [n]` (f32)
///
/// # Errors
/// [`KvCacheError::InvalidInterpolation`], [`KvCacheError::InvalidGamma`],
/// [`KvCacheError::ShapeMismatch`].
pub fn merge(a: Tensor<2>, b: Tensor<2>, t: f32, gamma: f32) -> Result<Merged, KvCacheError> {
    check_t_gamma(t, gamma)?;
    if a.dims() != b.dims() {
        return Err(KvCacheError::ShapeMismatch {
            left: a.dims().to_vec(),
            right: b.dims().to_vec(),
        });
    }
    let unsupported =
        (a.dtype() != b.dtype()).then(|| format!("a is {:?}, b is {:?}", a.dtype(), b.dtype()));
    if !kernel("minicache_merge", &a.device(), unsupported) {
        return Ok(reference::merge(a, b, t, gamma));
    }
    let (dir, mag_a, mag_b, dist) =
        Dispatch::minicache_merge(a.into_dispatch(), b.into_dispatch(), t, gamma);
    Ok(Merged {
        dir: Tensor::from_dispatch(dir),
        mag_a: Tensor::from_dispatch(mag_a),
        mag_b: Tensor::from_dispatch(mag_b),
        dist: Tensor::from_dispatch(dist),
    })
}

/// Restores one layer of merged rows: `mag_i · dir_i`, or retained row `slot_i − 1` where
/// `slot_i > 0`.
///
/// # Shapes
/// - `dir`: `[n, d]`, `mag`: `[n]`, `retained`: `(slot [n], rows [r, d])` with every slot in
///   `[0, r]`
/// - returns `[n, d]` in the dtype of `dir`
///
/// # Errors
/// [`KvCacheError::ShapeMismatch`] when the shapes disagree.
pub fn restore(
    dir: Tensor<2>,
    mag: Tensor<1>,
    retained: Option<(Tensor<1, Int>, Tensor<2>)>,
) -> Result<Tensor<2>, KvCacheError> {
    let [n, d] = dir.dims();
    let mismatch = |right: Vec<usize>| KvCacheError::ShapeMismatch {
        left: vec![n, d],
        right,
    };
    if mag.dims() != [n] {
        return Err(mismatch(mag.dims().to_vec()));
    }
    if let Some((slot, rows)) = &retained {
        if slot.dims() != [n] {
            return Err(mismatch(slot.dims().to_vec()));
        }
        if rows.dims()[1] != d {
            return Err(mismatch(rows.dims().to_vec()));
        }
    }
    let dtype = dir.dtype();
    let unsupported = if mag.dtype() != dtype {
        Some(format!("dir is {dtype:?}, mag is {:?}", mag.dtype()))
    } else {
        retained
            .as_ref()
            .filter(|(_, rows)| rows.dtype() != dtype)
            .map(|(_, rows)| format!("dir is {dtype:?}, the retained rows {:?}", rows.dtype()))
    };
    if !kernel("minicache_restore", &dir.device(), unsupported) {
        return Ok(reference::restore(dir, mag, retained));
    }
    let out = match retained {
        Some((slot, rows)) if rows.dims()[0] > 0 => Dispatch::minicache_restore_retained(
            dir.into_dispatch(),
            mag.into_dispatch(),
            slot.into_dispatch(),
            rows.into_dispatch(),
        ),
        _ => Dispatch::minicache_restore(dir.into_dispatch(), mag.into_dispatch()),
    };
    Ok(Tensor::from_dispatch(out))
}

/// Quantizes each row in groups of `group` columns: per group `min`, `scale = (max −
/// min)/(2^bits − 1)`, codes `round((x − min)/scale)` packed into `u32` words.
///
/// # Shapes
/// - `x`: `[rows, cols]`
/// - returns [`Packed`]: words `[rows, groups · words_per_group]`, scale and min `[rows,
///   groups]` (see [`QuantLayout`])
///
/// # Errors
/// [`KvCacheError::InvalidBits`], [`KvCacheError::ZeroGroupSize`].
pub fn quantize(
    x: Tensor<2>,
    bits: u32,
    group: usize,
) -> Result<(Packed, QuantLayout), KvCacheError> {
    let layout = QuantLayout::new(bits, group, x.dims()[1])?;
    Ok((quantize_rows(x, layout), layout))
}

/// [`quantize`] with a layout already validated for `x`'s columns.
pub(crate) fn quantize_rows(x: Tensor<2>, layout: QuantLayout) -> Packed {
    if !kernel("kv_quantize", &x.device(), None) {
        return reference::quantize(x, layout);
    }
    Packed::from_primitive(Dispatch::kv_quantize(x.into_dispatch(), layout))
}

/// The inverse of [`quantize`]: `min + code·scale`.
///
/// # Shapes
/// - `packed` as returned with `layout`; returns `[rows, layout.cols]`
pub fn dequantize(packed: &Packed, layout: QuantLayout) -> Tensor<2> {
    if !kernel(
        "kv_dequantize",
        &packed.scale.device(),
        packed.unsupported(),
    ) {
        return reference::dequantize(packed, layout);
    }
    Tensor::from_dispatch(Dispatch::kv_dequantize(
        packed.clone().into_primitive(),
        layout,
    ))
}

/// One layer's KIVI-quantized keys and values as [`QuantKv`] holds them, and the
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
/// build enables, without autodiff). [`QuantKv`] then attends straight from its packed keys and
/// values at each step (see [`QuantConfig::fused_attention`]); elsewhere it dequantizes them
/// for the model's attention.
pub fn kv_has_quant_attention(device: &Device) -> bool {
    cfg!(feature = "cube")
        && burn_kernels_core::route::cube_device(device).is_some()
        && !device.is_autodiff()
}

/// The key padding as the kernels read it: `[batch, skv]` i32, non-zero = hidden.
fn key_mask(opts: &AttnOptions) -> KeyMask<Dispatch> {
    match &opts.key_padding {
        Some(m) => KeyMask::Present {
            mask: m.clone().int().cast(IntDType::I32).into_dispatch(),
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

/// ShadowKV's fused key rebuild: for each `(batch, head)` and each of its `k` chunk ids `c`,
/// the keys of positions `pos = c·chunk + t` (`t < chunk`) are rebuilt from the low-rank
/// factors, `a[b, pos] · wt[b, h]`, and rotated by RoPE (rotate-half) with `cos[pos]`,
/// `sin[pos]`. Positions at or past `min(rows, positions)` give zero rows.
///
/// # Shapes
/// - `a`: `[batch, rows, rank]`; `wt`: `[batch, heads, rank, d]`, `a`'s dtype, `d` even
/// - `chunks`: `[batch, heads, k]` int, non-negative
/// - `cos`, `sin`: `[positions, d/2]` f32
/// - returns `[batch, heads, k · chunk, d]` in `a`'s dtype
///
/// # Errors
/// [`KvCacheError::ZeroChunk`], [`KvCacheError::OddHeadDim`], [`KvCacheError::ShapeMismatch`],
/// [`KvCacheError::DTypeMismatch`].
pub fn gather_reconstruct_rope(
    a: Tensor<3>,
    wt: Tensor<4>,
    chunks: Tensor<3, Int>,
    cos: Tensor<2>,
    sin: Tensor<2>,
    chunk: usize,
) -> Result<Tensor<4>, KvCacheError> {
    if chunk == 0 {
        return Err(KvCacheError::ZeroChunk);
    }
    let [b, _, rank] = a.dims();
    let [wb, h, wr, d] = wt.dims();
    if d % 2 == 1 {
        return Err(KvCacheError::OddHeadDim(d));
    }
    let mismatch = |left: &[usize], right: &[usize]| KvCacheError::ShapeMismatch {
        left: left.to_vec(),
        right: right.to_vec(),
    };
    if wb != b || wr != rank {
        return Err(mismatch(&a.dims(), &wt.dims()));
    }
    let [cb, ch, _] = chunks.dims();
    if cb != b || ch != h {
        return Err(mismatch(&wt.dims(), &chunks.dims()));
    }
    if cos.dims() != sin.dims() || cos.dims()[1] != d / 2 {
        return Err(mismatch(&cos.dims(), &sin.dims()));
    }
    if cos.dtype() != DType::F32 || sin.dtype() != DType::F32 || wt.dtype() != a.dtype() {
        return Err(KvCacheError::DTypeMismatch);
    }
    if !kernel("shadowkv_gather_reconstruct_rope", &a.device(), None) {
        return Ok(reference::gather_reconstruct_rope(
            a, wt, chunks, cos, sin, chunk,
        ));
    }
    Ok(Tensor::from_dispatch(
        Dispatch::shadowkv_gather_reconstruct_rope(
            a.into_dispatch(),
            wt.into_dispatch(),
            chunks.into_dispatch(),
            cos.into_dispatch(),
            sin.into_dispatch(),
            chunk,
        ),
    ))
}
