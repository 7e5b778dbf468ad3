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
//! [`dequantize`], [`quant_attention`], [`gather_reconstruct_rope`], [`top_k_rows`] (and
//! [`DecodeAttention`]).
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

mod attention;
pub mod cache;
mod cube;
mod error;
pub mod kernels;
mod merging;
mod quantization;
pub mod reference;
pub mod shadowkv;
pub mod shapes;
mod store;

pub use attention::{DecodeAttention, QuantAttnView, kv_has_quant_attention, quant_attention};
pub use cache::{MergeStats, MiniCacheConfig, MiniCacheKv, QuantConfig, QuantKv};
pub use cube::{KeyMask, KvKernels, KvTail, PackedPrimitive, QuantAttnPlan};
pub use error::KvCacheError;
pub(crate) use merging::check_t_gamma;
pub use merging::{Merged, merge, restore};
pub use quantization::{Packed, QuantLayout, dequantize, quantize};
pub(crate) use quantization::{bytes_of, bytes_of_int, quantize_rows};
pub use shadowkv::{
    ChunkScoring, DecodeTimings, RopeParams, ShadowBytes, ShadowKvCache, ShadowKvConfig,
};

use burn::backend::Dispatch;
use burn::tensor::{DType, Device, Int, Tensor};
use burn_kernels_core::route::{Grad, route};

/// Whether `op` runs its kernel on `device` (see `burn_kernels_core::route::route`); never in a
/// build without a CubeCL runtime feature, whose `KvKernels` has no CubeCL implementation.
fn kernel(op: &'static str, device: &Device, unsupported: Option<String>) -> bool {
    cfg!(feature = "cube") && route(op, device, Grad::ForwardOnly, unsupported)
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

/// ShadowKV's landmark scoring: for each (sequence, KV head) row with `n = sizes[row][0]`
/// landmarks, the maximum over the KV head's group of query heads of the sum over their query
/// positions of `softmax(q·lᵀ·scale)` over the row's landmarks (those past `n` masked: they
/// score 0 unless the row has none). Two launches that read the landmarks once in their own
/// dtype; groups of more than 16 query rows (`hq / h · sq`), or whose query rows (`rows · dd`
/// values, about 8 000 at most) do not fit the kernel's 48 KiB of shared memory, take the
/// reference with a log line.
///
/// # Shapes
/// - `q`: `[b, hq, sq, dd]` f32; `landmarks`: `[b, h, t, dd]`, `h` dividing `hq`; `sizes`:
///   `[b·h, 2]` int
/// - returns `[b·h, t]` f32
///
/// # Errors
/// [`KvCacheError::ShapeMismatch`] when the shapes disagree; [`KvCacheError::NotF32`] when `q`
/// is not f32.
pub fn landmark_scores(
    q: Tensor<4>,
    landmarks: Tensor<4>,
    sizes: Tensor<2, Int>,
    scale: f32,
) -> Result<Tensor<2>, KvCacheError> {
    let [b, hq, sq, dd] = q.dims();
    let [lb, h, _, ldd] = landmarks.dims();
    if lb != b || ldd != dd || h == 0 || !hq.is_multiple_of(h) || sizes.dims() != [b * h, 2] {
        return Err(KvCacheError::ShapeMismatch {
            left: q.dims().to_vec(),
            right: landmarks.dims().to_vec(),
        });
    }
    if q.dtype() != DType::F32 {
        return Err(KvCacheError::NotF32("landmark-scoring queries"));
    }
    let unsupported = kernels::landmark_scores::unsupported(hq / h * sq, dd);
    if !kernel("shadowkv_landmark_scores", &q.device(), unsupported) {
        return Ok(reference::landmark_scores(q, landmarks, sizes, scale));
    }
    Ok(Tensor::from_dispatch(Dispatch::shadowkv_landmark_scores(
        q.into_dispatch(),
        landmarks.into_dispatch(),
        sizes.into_dispatch(),
        scale,
    )))
}

/// ShadowKV's selection: for each row `r` with `(n, k) = sizes[r]`, the positions of the `k`
/// largest of the row's first `n` scores in ascending order (ties go to the lowest
/// positions), then the first of them repeated up to `kk` slots (`k` is capped by `n` and
/// `kk`; a row with `k = 0` gets zeros). What the decode step reads back instead of every
/// score.
///
/// # Shapes
/// - `scores`: `[rows, cols]` f32, no NaN; `sizes`: `[rows, 2]` int, non-negative
/// - returns `[rows, kk]` in `sizes`' int dtype
///
/// # Errors
/// [`KvCacheError::ShapeMismatch`] when `sizes` is not `[rows, 2]` or `kk > cols`;
/// [`KvCacheError::NotF32`] when `scores` is not f32.
pub fn top_k_rows(
    scores: Tensor<2>,
    sizes: Tensor<2, Int>,
    kk: usize,
) -> Result<Tensor<2, Int>, KvCacheError> {
    let [rows, cols] = scores.dims();
    if sizes.dims() != [rows, 2] || kk > cols {
        return Err(KvCacheError::ShapeMismatch {
            left: scores.dims().to_vec(),
            right: vec![sizes.dims()[0], sizes.dims()[1], kk],
        });
    }
    if scores.dtype() != DType::F32 {
        return Err(KvCacheError::NotF32("top-k scores"));
    }
    if !kernel("shadowkv_top_k", &scores.device(), None) {
        return Ok(reference::top_k_rows(scores, sizes, kk));
    }
    Ok(Tensor::from_dispatch(Dispatch::shadowkv_top_k(
        scores.into_dispatch(),
        sizes.into_dispatch(),
        kk,
    )))
}
