//! ShadowKV (Sun et al., 2024, arXiv 2410.21465): low-rank pre-RoPE keys on the device,
//! values offloaded to host memory, and sparse retrieval of chunks at decode time.
//!
//! # What a long prompt becomes (per layer, per sequence of `L` real tokens)
//!
//! The prefill's own attention is exact (over the full prompt); the cache compresses after it:
//!
//! - **Chunks.** `chunks = L / chunk − local_chunks`; positions `[0, chunks·chunk)` are split
//!   into chunks of `chunk` tokens; the rest (`local_chunks` chunks plus the `L mod chunk`
//!   remainder) is the **local window**, kept on the device as given (post-RoPE keys, values),
//!   as the official code's `prefill_local`.
//! - **Low-rank keys.** The keys are un-rotated to pre-RoPE with the model's RoPE
//!   ([`RopeParams`]), reshaped `[L, kv_heads·d]`, and factored `K ≈ A·Wᵀ` with `W` the top
//!   `rank` eigenvectors of `KᵀK` ([`low_rank`]: Gram matrix on the device, `nalgebra`
//!   eigen-decomposition on the host). `A [L, rank]` and `Wᵀ` stay on the device, in the
//!   model dtype. This is the official `U[:, :r]`, `diag(s)·Vᵀ` up to where `diag(s)` sits.
//! - **Values** of the chunked positions go to host memory as raw bytes, chunk-major
//!   ([`HostValues`]): round trips are bit-exact.
//! - **Landmarks** are the per-chunk means of the post-RoPE keys, per KV head.
//! - **Outliers.** Per KV head, the `outlier_chunks` chunks whose least similar token (cosine
//!   similarity to the chunk mean) is lowest keep exact keys and values on the device and get
//!   no landmark.
//!
//! # Decode (every call after the prefill)
//!
//! The queries score the landmarks, `softmax(q·lᵀ·scale)` over chunks, summed over the call's
//! queries and maxed over the GQA group (as the official code); each `(sequence, KV head)`
//! takes its top `budget / chunk` chunks. Their values come host→device, reusing the chunks
//! the previous step of the layer already uploaded; their keys are rebuilt by the fused
//! [`crate::gather_reconstruct_rope`] kernel. Attention (the given [`AttentionImpl`]) runs over
//! `local | outliers | selected | generated`, the generated tokens (every token after the
//! prompt, this call's included) held exactly on the device.
//!
//! # Batches, padding, fallbacks
//!
//! Every sequence of a batch is compressed on its own (its own SVD, landmarks, outliers,
//! selection). Left padding (`opts.key_padding`, a run of masked leading positions per row) is
//! read at the prefill; a sequence's positions are then counted from its first real token, as
//! the model's RoPE does. Sequences of different lengths give different local-window and
//! landmark counts: the shorter ones are padded and masked with a key-padding mask the cache
//! builds for the attention. A prompt shorter than [`ShadowKvConfig::min_tokens`] (in any
//! sequence of the batch), or a padding mask that is not left padding, keeps that layer as a
//! full cache: transparent and exact.
//!
//! `truncate` below the prompt length turns a layer back into a full cache with the prompt
//! rebuilt (exact local window, outliers and values; low-rank keys elsewhere).

mod host;
mod lowrank;

pub use host::{HostValues, tune_host_allocator};
pub use lowrank::{LowRank, RopeParams, low_rank, rope_tables, unrope};

use std::time::{Duration, Instant};

use burn::tensor::{
    Bool, DType, Device, Int, Tensor, TensorCreationOptions, TensorData, activation,
};
use burn_kernels_core::{AttentionImpl, AttnOptions, KvCache, append_kv};

use crate::{KvCacheError, bytes_of, gather_reconstruct_rope};
use host::upload_rows;
use rayon::prelude::*;

/// ShadowKV settings (defaults: the paper's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShadowKvConfig {
    /// Rank of the key factorization (≤ kv_heads · head_dim).
    pub rank: usize,
    /// Tokens per chunk (landmark, selection and transfer unit).
    pub chunk: usize,
    /// Tokens selected per decode step and KV head (a multiple of `chunk`).
    pub budget: usize,
    /// Chunks at the end of the prompt kept exactly on the device (≥ 1).
    pub local_chunks: usize,
    /// Chunks per KV head kept exactly on the device for their low key self-similarity.
    pub outlier_chunks: usize,
    /// Prompts shorter than this use the full cache (see [`ShadowKvConfig::min_tokens`]).
    pub min_prompt: usize,
}

impl Default for ShadowKvConfig {
    fn default() -> Self {
        Self {
            rank: 160,
            chunk: 8,
            budget: 2048,
            local_chunks: 4,
            outlier_chunks: 48,
            min_prompt: 4096,
        }
    }
}

impl ShadowKvConfig {
    /// # Errors
    /// [`KvCacheError::NoKvHeads`], [`KvCacheError::OddHeadDim`], [`KvCacheError::ZeroChunk`],
    /// [`KvCacheError::ZeroRank`], [`KvCacheError::RankTooLarge`],
    /// [`KvCacheError::ZeroLocalWindow`], [`KvCacheError::BudgetNotChunkMultiple`],
    /// [`KvCacheError::BudgetBelowLocalWindow`].
    pub fn validate(&self, kv_heads: usize, head_dim: usize) -> Result<(), KvCacheError> {
        if kv_heads == 0 {
            return Err(KvCacheError::NoKvHeads);
        }
        if head_dim == 0 || head_dim % 2 == 1 {
            return Err(KvCacheError::OddHeadDim(head_dim));
        }
        if self.chunk == 0 {
            return Err(KvCacheError::ZeroChunk);
        }
        if self.rank == 0 {
            return Err(KvCacheError::ZeroRank);
        }
        if self.rank > kv_heads * head_dim {
            return Err(KvCacheError::RankTooLarge {
                rank: self.rank,
                max: kv_heads * head_dim,
            });
        }
        if self.local_chunks == 0 {
            return Err(KvCacheError::ZeroLocalWindow);
        }
        if !self.budget.is_multiple_of(self.chunk) {
            return Err(KvCacheError::BudgetNotChunkMultiple {
                budget: self.budget,
                chunk: self.chunk,
            });
        }
        let local = self.local_chunks * self.chunk;
        if self.budget < local {
            return Err(KvCacheError::BudgetBelowLocalWindow {
                budget: self.budget,
                local,
            });
        }
        Ok(())
    }

    /// Chunks selected per step and KV head.
    pub fn select_chunks(&self) -> usize {
        self.budget / self.chunk
    }

    /// The shortest prompt (real tokens of every sequence) that is compressed: `min_prompt`,
    /// and at least enough for the local window, the outliers and one landmark chunk.
    pub fn min_tokens(&self) -> usize {
        self.min_prompt
            .max((self.local_chunks + self.outlier_chunks + 1) * self.chunk)
    }
}

/// Where a decode step's time went, summed over layers and steps. Durations are measured
/// only with [`ShadowKvCache::set_profiling`] on (it synchronizes the device after each
/// phase, which slows decoding); the chunk counts always.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DecodeTimings {
    /// Sparse layer-steps decoded.
    pub layer_steps: usize,
    /// Landmark scores, their read-back and the host top-k.
    pub scoring: Duration,
    /// Host→device value upload and the reuse gather (the three parts below and the rest).
    pub transfer: Duration,
    /// Part of `transfer`: picking reused slots and listing the chunks to fetch.
    pub transfer_host: Duration,
    /// Part of `transfer`: gathering the fetched chunks into staging buffers (on every core)
    /// and creating the device tensor from them (the runtime's copy of each buffer and the
    /// pageable host→device copy).
    pub transfer_upload: Duration,
    /// Part of `transfer`: joining the reused and fetched rows on the device, in slot order.
    pub transfer_assemble: Duration,
    /// The gather-reconstruct-rope kernel.
    pub reconstruct: Duration,
    /// Concatenation, mask and attention.
    pub attention: Duration,
    /// `(sequence, head, chunk)` values uploaded.
    pub chunks_fetched: usize,
    /// `(sequence, head, chunk)` values reused from the previous step.
    pub chunks_reused: usize,
}

/// Device and host bytes of a [`ShadowKvCache`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShadowBytes {
    pub device: usize,
    pub host: usize,
}

/// The values uploaded by the previous step of a layer, for reuse.
#[derive(Debug)]
struct Prev {
    /// `[b][h]`: the chunk ids of the slots (valid ones first, ascending).
    chunks: Vec<Vec<Vec<usize>>>,
    /// Valid slots per sequence.
    valid: Vec<usize>,
    /// `[b · h · k, chunk · d]`.
    values: Tensor<2>,
}

/// One layer of a compressed prompt plus its generated tokens.
#[derive(Debug)]
struct Sparse {
    /// Slots of the prompt (padding included).
    prompt_len: usize,
    pads: Vec<usize>,
    /// Chunked positions per sequence.
    chunks: Vec<usize>,
    /// `[b, max chunks·chunk, rank]`.
    a: Tensor<3>,
    /// `[b, h, rank, d]`.
    wt: Tensor<4>,
    /// `[b, h, C, d]`, zero rows past a sequence's landmark count.
    landmarks: Tensor<4>,
    /// `[b, 1, 1, C]`, `true` past a sequence's landmark count; `None` when all are valid.
    land_pad: Option<Tensor<4, Bool>>,
    /// Landmarks per sequence (`chunks − outliers`).
    n_land: Vec<usize>,
    /// `[b][h][landmark]` → chunk id.
    land_chunk: Vec<Vec<Vec<usize>>>,
    /// `[b, h, W, d]`, right-aligned: sequence `i` holds `local_len[i]` real slots at the end.
    local: (Tensor<4>, Tensor<4>),
    local_len: Vec<usize>,
    /// Per sequence `[h][outliers]` chunk ids, and their keys/values `[b, h, O·chunk, d]`.
    outlier_chunk: Vec<Vec<Vec<usize>>>,
    outliers: Option<(Tensor<4>, Tensor<4>)>,
    values: Vec<HostValues>,
    generated: Option<(Tensor<4>, Tensor<4>)>,
    prev: Option<Prev>,
}

// One per layer, rarely moved: the size of Burn's tensor values does not call for a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Layer {
    Empty,
    Full(Option<(Tensor<4>, Tensor<4>)>),
    Sparse(Box<Sparse>),
}

/// ShadowKV over a model's layers. See the module docs.
///
/// A benchmark drives it through [`KvCache::attend`]: the first call per layer with a long
/// prompt is the prefill, later calls are decode steps; [`ShadowKvCache::timings`] gives the
/// per-phase breakdown.
#[derive(Debug)]
pub struct ShadowKvCache {
    cfg: ShadowKvConfig,
    rope: RopeParams,
    kv_heads: usize,
    head_dim: usize,
    layers: Vec<Layer>,
    lens: Vec<usize>,
    last: usize,
    /// `(cos, sin)` `[positions, d/2]` f32, grown to the longest prompt.
    tables: Option<(Tensor<2>, Tensor<2>)>,
    profile: bool,
    timings: DecodeTimings,
    /// `Wᵀ [rank, kv_heads·head_dim]` every prompt is projected on, instead of its own.
    key_basis: Option<Tensor<2>>,
}

/// Row `i` of a batch tensor with positions `from..to`.
fn item(x: &Tensor<4>, i: usize, from: usize, to: usize) -> Tensor<3> {
    let [_, h, _, d] = x.dims();
    x.clone()
        .slice([i..i + 1, 0..h, from..to, 0..d])
        .reshape([h, to - from, d])
}

fn idx_tensor<const D: usize>(v: Vec<i64>, shape: [usize; D], device: &Device) -> Tensor<D, Int> {
    Tensor::from_data(TensorData::new(v, shape), device)
}

fn i32_tensor<const D: usize>(v: Vec<i32>, shape: [usize; D], device: &Device) -> Tensor<D, Int> {
    Tensor::from_data(
        TensorData::new(v, shape),
        TensorCreationOptions::new(device.clone()).with_dtype(DType::I32),
    )
}

/// Leading masked positions per row, or `None` if some row is not a left padding.
fn left_pads(mask: &[bool], b: usize, s: usize) -> Option<Vec<usize>> {
    (0..b)
        .map(|i| {
            let row = &mask[i * s..(i + 1) * s];
            let p = row.iter().take_while(|&&m| m).count();
            row[p..].iter().all(|&m| !m).then_some(p)
        })
        .collect()
}

fn sync(on: bool, device: &Device) {
    if on {
        let _ = device.sync();
    }
}

impl ShadowKvCache {
    /// An empty cache for a model of `num_layers` layers of `kv_heads` KV heads of `head_dim`
    /// whose keys were rotated with `rope`. Tunes the process's allocator for the value
    /// uploads once ([`tune_host_allocator`]).
    ///
    /// # Errors
    /// [`KvCacheError::NoLayers`] and those of [`ShadowKvConfig::validate`].
    pub fn new(
        num_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        cfg: ShadowKvConfig,
        rope: RopeParams,
    ) -> Result<Self, KvCacheError> {
        if num_layers == 0 {
            return Err(KvCacheError::NoLayers);
        }
        cfg.validate(kv_heads, head_dim)?;
        tune_host_allocator();
        Ok(Self {
            cfg,
            rope,
            kv_heads,
            head_dim,
            layers: (0..num_layers).map(|_| Layer::Empty).collect(),
            lens: vec![0; num_layers],
            last: 0,
            tables: None,
            profile: false,
            timings: DecodeTimings::default(),
            key_basis: None,
        })
    }

    pub fn config(&self) -> &ShadowKvConfig {
        &self.cfg
    }

    /// Whether `layer` holds a compressed prompt (else it is a full cache or empty).
    pub fn is_sparse(&self, layer: usize) -> bool {
        matches!(self.layers.get(layer), Some(Layer::Sparse(_)))
    }

    /// Synchronizes the device after each decode phase so [`DecodeTimings`] has durations.
    pub fn set_profiling(&mut self, on: bool) {
        self.profile = on;
    }

    pub fn timings(&self) -> DecodeTimings {
        self.timings
    }

    pub fn reset_timings(&mut self) {
        self.timings = DecodeTimings::default();
    }

    /// Fixes the key basis of every prompt compressed from now on: `basis` is `Wᵀ`, `[rank,
    /// kv_heads·head_dim]` with orthonormal rows (e.g. the `wt` of a [`low_rank`] of
    /// representative pre-RoPE keys), and each prompt's pre-RoPE keys are projected on it
    /// (`A = K·W`, one device matmul) instead of getting their own eigen-decomposition (a host
    /// `(kv_heads·head_dim)²` eigen-problem per layer and sequence, ~1 s at 1024). Decoding
    /// costs the same either way; the approximation is only as good as the basis fits the
    /// keys. Benchmarks use it to fill long caches with synthetic keys of one known subspace
    /// quickly. `None` goes back to a basis per sequence.
    ///
    /// # Errors
    /// [`KvCacheError::ShapeMismatch`] unless `basis` is `[rank, kv_heads·head_dim]`.
    pub fn set_key_basis(&mut self, basis: Option<Tensor<2>>) -> Result<(), KvCacheError> {
        if let Some(w) = &basis {
            let want = [self.cfg.rank, self.kv_heads * self.head_dim];
            if w.dims() != want {
                return Err(KvCacheError::ShapeMismatch {
                    left: want.to_vec(),
                    right: w.dims().to_vec(),
                });
            }
        }
        self.key_basis = basis;
        Ok(())
    }

    /// Device and host bytes held (the RoPE tables counted once, on the device).
    pub fn bytes_split(&self) -> ShadowBytes {
        let mut out = ShadowBytes::default();
        if let Some((c, s)) = &self.tables {
            out.device += bytes_of(c) + bytes_of(s);
        }
        let pair = |x: &Option<(Tensor<4>, Tensor<4>)>| {
            x.as_ref().map_or(0, |(k, v)| bytes_of(k) + bytes_of(v))
        };
        for layer in &self.layers {
            match layer {
                Layer::Empty => {}
                Layer::Full(kv) => out.device += pair(kv),
                Layer::Sparse(s) => {
                    out.device += bytes_of(&s.a)
                        + bytes_of(&s.wt)
                        + bytes_of(&s.landmarks)
                        + bytes_of(&s.local.0)
                        + bytes_of(&s.local.1)
                        + pair(&s.outliers)
                        + pair(&s.generated)
                        + s.prev.as_ref().map_or(0, |p| bytes_of(&p.values));
                    out.host += s.values.iter().map(HostValues::bytes).sum::<usize>();
                }
            }
        }
        out
    }

    /// The RoPE tables covering positions `0..n`.
    fn tables_for(&mut self, n: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
        match &self.tables {
            Some((c, s)) if c.dims()[0] >= n => (c.clone(), s.clone()),
            _ => {
                let t = rope_tables(self.head_dim, n, self.rope, device);
                self.tables = Some(t.clone());
                t
            }
        }
    }

    /// Decides at a layer's first call whether its prompt is compressed: returns the left
    /// padding per sequence if so.
    fn eligible(
        &self,
        b: usize,
        s: usize,
        key_padding: Option<&Tensor<2, Bool>>,
    ) -> Option<Vec<usize>> {
        let pads = match key_padding {
            None => vec![0; b],
            Some(mask) => {
                let [_, cols] = mask.dims();
                // Through ints: the bool storage differs between backends (u8, u32).
                let mask: Vec<bool> = mask
                    .clone()
                    .int()
                    .into_data()
                    .convert::<i64>()
                    .try_to_vec::<i64>()
                    .ok()?
                    .into_iter()
                    .map(|x| x != 0)
                    .collect();
                let p = left_pads(&mask, b, cols)?;
                // New positions only: the mask covers this call (the cache is empty).
                if cols != s {
                    return None;
                }
                p
            }
        };
        let shortest = pads.iter().map(|p| s - p.min(&s)).min().unwrap_or(0);
        (shortest >= self.cfg.min_tokens()).then_some(pads)
    }

    /// Stores a prompt into an empty layer: compressed when eligible, else full.
    fn install(
        &mut self,
        layer: usize,
        k: Tensor<4>,
        v: Tensor<4>,
        key_padding: Option<&Tensor<2, Bool>>,
    ) -> Result<bool, KvCacheError> {
        let [b, _, s, _] = k.dims();
        let state = match self.eligible(b, s, key_padding) {
            Some(pads) => Layer::Sparse(Box::new(self.prefill(k, v, pads)?)),
            None => Layer::Full(Some((k, v))),
        };
        let sparse = matches!(state, Layer::Sparse(_));
        self.layers[layer] = state;
        Ok(sparse)
    }

    /// Takes the keys and values of a prompt computed elsewhere (prefilled in pieces, or
    /// shared between caches) into an empty `layer`, without attention: compressed when
    /// eligible (returns `true`), else held in full.
    ///
    /// # Shapes
    /// - `k` (RoPE applied), `v`: `[batch, kv_heads, seq, head_dim]`; `key_padding`: `[batch,
    ///   seq]`, `true` on left padding
    ///
    /// # Errors
    /// [`KvCacheError::LayerOutOfRange`], [`KvCacheError::LayerNotEmpty`],
    /// [`KvCacheError::ShapeMismatch`] when the heads or head dim are not the cache's.
    pub fn compress_prompt(
        &mut self,
        layer: usize,
        k: Tensor<4>,
        v: Tensor<4>,
        key_padding: Option<&Tensor<2, Bool>>,
    ) -> Result<bool, KvCacheError> {
        let num_layers = self.layers.len();
        if layer >= num_layers {
            return Err(KvCacheError::LayerOutOfRange { layer, num_layers });
        }
        if !matches!(self.layers[layer], Layer::Empty) {
            return Err(KvCacheError::LayerNotEmpty(layer));
        }
        let [b, h, s, d] = k.dims();
        if h != self.kv_heads || d != self.head_dim || v.dims() != k.dims() {
            return Err(KvCacheError::ShapeMismatch {
                left: vec![b, self.kv_heads, s, self.head_dim],
                right: v.dims().to_vec(),
            });
        }
        if let Some(m) = key_padding
            && m.dims() != [b, s]
        {
            return Err(KvCacheError::ShapeMismatch {
                left: vec![b, s],
                right: m.dims().to_vec(),
            });
        }
        self.lens[layer] += s;
        self.last = layer;
        self.install(layer, k, v, key_padding)
    }

    /// Compresses one layer's prompt. See the module docs.
    fn prefill(
        &mut self,
        k: Tensor<4>,
        v: Tensor<4>,
        pads: Vec<usize>,
    ) -> Result<Sparse, KvCacheError> {
        let [b, h, s, d] = k.dims();
        let device = k.device();
        let dtype = k.dtype();
        let (cs, o, rank) = (self.cfg.chunk, self.cfg.outlier_chunks, self.cfg.rank);
        let max_len = pads.iter().map(|p| s - p).max().unwrap_or(0);
        let (cos, sin) = self.tables_for(max_len, &device);

        let mut a_rows = Vec::with_capacity(b);
        let mut wts = Vec::with_capacity(b);
        let mut lms = Vec::with_capacity(b);
        let mut locals = Vec::with_capacity(b);
        let mut outs = Vec::with_capacity(b);
        let mut sp = Sparse {
            prompt_len: s,
            pads: pads.clone(),
            chunks: Vec::new(),
            a: Tensor::zeros([1, 1, 1], (&device, dtype)),
            wt: Tensor::zeros([1, 1, 1, 1], (&device, dtype)),
            landmarks: Tensor::zeros([1, 1, 1, 1], (&device, dtype)),
            land_pad: None,
            n_land: Vec::new(),
            land_chunk: Vec::new(),
            local: (
                Tensor::zeros([1, 1, 1, 1], (&device, dtype)),
                Tensor::zeros([1, 1, 1, 1], (&device, dtype)),
            ),
            local_len: Vec::new(),
            outlier_chunk: Vec::new(),
            outliers: None,
            values: Vec::new(),
            generated: None,
            prev: None,
        };
        for (i, &pad) in pads.iter().enumerate() {
            let len = s - pad;
            let chunks = len / cs - self.cfg.local_chunks;
            let ctx = chunks * cs;
            let ki = item(&k, i, pad, s);
            let vi = item(&v, i, pad, s);

            // Low-rank pre-RoPE keys, [L, h·d].
            let pre = unrope(ki.clone(), &cos, &sin)
                .swap_dims(0, 1)
                .reshape([len, h * d]);
            let (a, wt) = match &self.key_basis {
                // The same product `low_rank` forms with the basis it finds.
                Some(w) => {
                    let w = w.clone().cast(DType::F32);
                    (pre.matmul(w.clone().transpose()), w)
                }
                None => {
                    let lr = low_rank(pre, rank)?;
                    (lr.a, lr.wt)
                }
            };
            a_rows.push(a.slice([0..ctx, 0..rank]).cast(dtype));
            wts.push(
                wt.reshape([rank, h, d])
                    .swap_dims(0, 1)
                    .cast(dtype)
                    .unsqueeze_dim::<4>(0),
            );

            // Landmarks and the least self-similar chunks, from the post-RoPE keys.
            let kc = ki.clone().slice([0..h, 0..ctx, 0..d]);
            let kc32 = kc.clone().cast(DType::F32).reshape([h, chunks, cs, d]);
            let mean = kc32.clone().mean_dim(2);
            let dot = (kc32.clone() * mean.clone()).sum_dim(3);
            let nk = kc32.powi_scalar(2).sum_dim(3).sqrt();
            let nm = mean.clone().powi_scalar(2).sum_dim(3).sqrt();
            let sim = dot / (nk * nm).clamp_min(1e-8);
            let worst = sim
                .min_dim(2)
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .expect("f32");
            let mut out_ids = Vec::with_capacity(h);
            let mut land_ids = Vec::with_capacity(h);
            for hh in 0..h {
                let row = &worst[hh * chunks..(hh + 1) * chunks];
                let mut order: Vec<usize> = (0..chunks).collect();
                order.sort_by(|&x, &y| row[x].total_cmp(&row[y]).then(x.cmp(&y)));
                let mut out: Vec<usize> = order[..o].to_vec();
                let mut rest: Vec<usize> = order[o..].to_vec();
                out.sort_unstable();
                rest.sort_unstable();
                out_ids.push(out);
                land_ids.push(rest);
            }
            let flat = |ids: &[Vec<usize>]| -> Vec<i64> {
                ids.iter()
                    .enumerate()
                    .flat_map(|(hh, c)| c.iter().map(move |&c| (hh * chunks + c) as i64))
                    .collect()
            };
            let n_land = chunks - o;
            let li = flat(&land_ids);
            let lm = mean
                .reshape([h * chunks, d])
                .select(0, idx_tensor::<1>(li, [h * n_land], &device))
                .reshape([h, n_land, d])
                .cast(dtype);
            lms.push(lm);
            if o > 0 {
                let oi = idx_tensor::<1>(flat(&out_ids), [h * o], &device);
                let rows = |x: Tensor<3>| {
                    x.slice([0..h, 0..ctx, 0..d])
                        .reshape([h * chunks, cs * d])
                        .select(0, oi.clone())
                        .reshape([h, o * cs, d])
                };
                outs.push((rows(ki.clone()), rows(vi.clone())));
            }
            locals.push((
                ki.slice([0..h, ctx..len, 0..d]),
                vi.clone().slice([0..h, ctx..len, 0..d]),
            ));
            sp.values.push(HostValues::from_tensor(vi, cs, chunks));
            sp.chunks.push(chunks);
            sp.n_land.push(n_land);
            sp.land_chunk.push(land_ids);
            sp.outlier_chunk.push(out_ids);
            sp.local_len.push(len - ctx);
        }

        // Pad the per-sequence pieces to common sizes and stack them.
        let amax = sp.chunks.iter().max().copied().unwrap_or(0) * cs;
        let a: Vec<Tensor<3>> = a_rows
            .into_iter()
            .map(|x| {
                let rows = x.dims()[0];
                let x = if rows < amax {
                    Tensor::cat(
                        vec![x, Tensor::zeros([amax - rows, rank], (&device, dtype))],
                        0,
                    )
                } else {
                    x
                };
                x.unsqueeze_dim::<3>(0)
            })
            .collect();
        sp.a = Tensor::cat(a, 0);
        sp.wt = Tensor::cat(wts, 0);
        let cmax = sp.n_land.iter().max().copied().unwrap_or(0);
        let pad_to = |x: Tensor<3>, n: usize, left: bool| -> Tensor<4> {
            let [hh, m, dd] = x.dims();
            let x = if m < n {
                let z = Tensor::zeros([hh, n - m, dd], (&device, dtype));
                Tensor::cat(if left { vec![z, x] } else { vec![x, z] }, 1)
            } else {
                x
            };
            x.unsqueeze_dim::<4>(0)
        };
        sp.landmarks = Tensor::cat(lms.into_iter().map(|x| pad_to(x, cmax, false)).collect(), 0);
        if sp.n_land.iter().any(|&n| n < cmax) {
            let mask: Vec<bool> = sp
                .n_land
                .iter()
                .flat_map(|&n| (0..cmax).map(move |c| c >= n))
                .collect();
            sp.land_pad = Some(
                Tensor::<1, Bool>::from_data(TensorData::new(mask, [b * cmax]), &device)
                    .reshape([b, 1, 1, cmax]),
            );
        }
        let wmax = sp.local_len.iter().max().copied().unwrap_or(0);
        let (lk, lv): (Vec<_>, Vec<_>) = locals
            .into_iter()
            .map(|(k, v)| (pad_to(k, wmax, true), pad_to(v, wmax, true)))
            .unzip();
        sp.local = (Tensor::cat(lk, 0), Tensor::cat(lv, 0));
        if o > 0 {
            let (ok, ov): (Vec<_>, Vec<_>) = outs
                .into_iter()
                .map(|(k, v)| (k.unsqueeze_dim::<4>(0), v.unsqueeze_dim::<4>(0)))
                .unzip();
            sp.outliers = Some((Tensor::cat(ok, 0), Tensor::cat(ov, 0)));
        }
        Ok(sp)
    }

    /// One decode step of a sparse layer. See the module docs.
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &mut self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Tensor<4> {
        let (cs, select) = (self.cfg.chunk, self.cfg.select_chunks());
        let profile = self.profile;
        let device = q.device();
        let (cos, sin) = self.tables.clone().expect("set at the prefill");
        let Layer::Sparse(sp) = &mut self.layers[layer] else {
            unreachable!("decode on a sparse layer")
        };
        let [b, hq, sq, d] = q.dims();
        let h = self.kv_heads;
        let g = hq / h;
        let dtype = v.dtype();
        append_kv(&mut sp.generated, k, v);

        // Scoring: softmax over chunks, summed over queries, max over the GQA group.
        let t0 = Instant::now();
        let cmax = sp.landmarks.dims()[2];
        let scores = q
            .clone()
            .cast(DType::F32)
            .reshape([b, h, g * sq, d])
            .matmul(sp.landmarks.clone().cast(DType::F32).swap_dims(2, 3))
            * opts.scale;
        let scores = match &sp.land_pad {
            Some(m) => scores.mask_fill(m.clone().expand([b, h, g * sq, cmax]), -1.0e30),
            None => scores,
        };
        let scores = activation::softmax(scores, 3)
            .reshape([b, h, g, sq, cmax])
            .sum_dim(3)
            .max_dim(2)
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .expect("f32");
        let kk = select.min(sp.n_land.iter().max().copied().unwrap_or(0));
        let valid: Vec<usize> = sp.n_land.iter().map(|&n| kk.min(n)).collect();
        // Top-k per (sequence, KV head), on every core: at batch 8 and 128K a layer has 64
        // rows of 16K landmarks.
        let (n_land, land_chunk) = (&sp.n_land, &sp.land_chunk);
        let flat: Vec<Vec<usize>> = (0..b * h)
            .into_par_iter()
            .map(|ih| {
                let (i, hh) = (ih / h, ih % h);
                let (n, nv) = (n_land[i], valid[i]);
                let row = &scores[ih * cmax..ih * cmax + n];
                let mut ids: Vec<usize> = (0..n).collect();
                if nv < n {
                    ids.select_nth_unstable_by(nv, |&x, &y| row[y].total_cmp(&row[x]));
                    ids.truncate(nv);
                }
                let mut chunks: Vec<usize> = ids.iter().map(|&l| land_chunk[i][hh][l]).collect();
                chunks.sort_unstable();
                // Padding slots (masked below) repeat a valid chunk.
                chunks.resize(kk, chunks[0]);
                chunks
            })
            .collect();
        let mut flat = flat.into_iter();
        let sel: Vec<Vec<Vec<usize>>> = (0..b).map(|_| flat.by_ref().take(h).collect()).collect();
        self.timings.scoring += t0.elapsed();

        // Reconstruct the selected keys, launched before the transfer: the device rebuilds
        // them while the host gathers and copies the values.
        let t2 = Instant::now();
        let ids: Vec<i32> = sel
            .iter()
            .flat_map(|per_head| per_head.iter().flat_map(|c| c.iter().map(|&c| c as i32)))
            .collect();
        let ids = i32_tensor::<3>(ids, [b, h, kk], &device);
        let sel_k = gather_reconstruct_rope(sp.a.clone(), sp.wt.clone(), ids, cos, sin, cs)
            .expect("the layer's own factors");
        sync(profile, &device);
        self.timings.reconstruct += t2.elapsed();

        // Transfer: reuse what the previous step uploaded, fetch the rest.
        let t1 = Instant::now();
        let prev_rows = sp.prev.as_ref().map_or(0, |p| p.values.dims()[0]);
        let prev_ids = sp.prev.as_ref().map(|p| (&p.chunks, &p.valid));
        // Per valid slot: the previous step's row holding its chunk, if any.
        let hits: Vec<Vec<Option<i64>>> = (0..b * h)
            .into_par_iter()
            .map(|ih| {
                let (i, hh) = (ih / h, ih % h);
                sel[i][hh][..valid[i]]
                    .iter()
                    .map(|&c| {
                        let (chunks, pvalid) = prev_ids?;
                        let ids = &chunks[i][hh];
                        ids[..pvalid[i]]
                            .binary_search(&c)
                            .ok()
                            .map(|j| (ih * ids.len() + j) as i64)
                    })
                    .collect()
            })
            .collect();
        let mut src = vec![0i64; b * h * kk];
        let mut rows: Vec<&[u8]> = Vec::new();
        for (ih, hit) in hits.iter().enumerate() {
            let (i, hh) = (ih / h, ih % h);
            let base = ih * kk;
            for (slot, r) in hit.iter().enumerate() {
                src[base + slot] = r.unwrap_or_else(|| {
                    rows.push(sp.values[i].chunk_slice(hh, sel[i][hh][slot]));
                    (prev_rows + rows.len() - 1) as i64
                });
            }
            // Padding slots reuse the sequence-head's first slot.
            for slot in valid[i]..kk {
                src[base + slot] = src[base];
            }
        }
        let fetched = rows.len();
        self.timings.chunks_fetched += fetched;
        self.timings.chunks_reused += b * h * kk - fetched;
        let t_up = Instant::now();
        self.timings.transfer_host += t_up - t1;
        let fresh = (fetched > 0).then(|| upload_rows(&rows, cs * d, dtype, &device));
        sync(profile, &device);
        let t_asm = Instant::now();
        self.timings.transfer_upload += t_asm - t_up;
        let pool = match (sp.prev.take(), fresh) {
            (Some(p), Some(f)) => Tensor::cat(vec![p.values, f], 0),
            (Some(p), None) => p.values,
            (None, Some(f)) => f,
            (None, None) => unreachable!("k ≥ 1 slots"),
        };
        let identity = sp.prev.is_none() && fetched == b * h * kk;
        let values = if identity {
            pool
        } else {
            pool.select(0, idx_tensor::<1>(src, [b * h * kk], &device))
        };
        sp.prev = Some(Prev {
            chunks: sel.clone(),
            valid: valid.clone(),
            values: values.clone(),
        });
        sync(profile, &device);
        self.timings.transfer_assemble += t_asm.elapsed();
        self.timings.transfer += t1.elapsed();

        // Attention over local | outliers | selected | generated.
        let t3 = Instant::now();
        let sel_v = values.reshape([b, h, kk * cs, d]);
        let (gk, gv) = sp.generated.clone().expect("appended above");
        let mut ks = vec![sp.local.0.clone()];
        let mut vs = vec![sp.local.1.clone()];
        if let Some((ok, ov)) = &sp.outliers {
            ks.push(ok.clone());
            vs.push(ov.clone());
        }
        ks.extend([sel_k, gk]);
        vs.extend([sel_v, gv]);
        let keys = Tensor::cat(ks, 2);
        let vals = Tensor::cat(vs, 2);
        let wmax = sp.local.0.dims()[2];
        let n_out = sp.outliers.as_ref().map_or(0, |(k, _)| k.dims()[2]);
        let n_gen = keys.dims()[2] - wmax - n_out - kk * cs;
        let masked = sp.local_len.iter().any(|&l| l < wmax) || valid.iter().any(|&n| n < kk);
        let key_padding = if masked || opts.key_padding.is_some() {
            let head: Vec<bool> = (0..b)
                .flat_map(|i| {
                    let (ll, nv) = (sp.local_len[i], valid[i]);
                    (0..wmax)
                        .map(move |j| j < wmax - ll)
                        .chain((0..n_out).map(|_| false))
                        .chain((0..kk * cs).map(move |j| j / cs >= nv))
                })
                .collect();
            let cols = wmax + n_out + kk * cs;
            let head = Tensor::<1, Bool>::from_data(TensorData::new(head, [b * cols]), &device)
                .reshape([b, cols]);
            let tail = match &opts.key_padding {
                Some(m) => {
                    let total = m.dims()[1];
                    m.clone().slice([0..b, total - n_gen..total])
                }
                None => Tensor::<1, Bool>::from_data(
                    TensorData::new(vec![false; b * n_gen], [b * n_gen]),
                    &device,
                )
                .reshape([b, n_gen]),
            };
            Some(Tensor::cat(vec![head, tail], 1))
        } else {
            None
        };
        let opts = AttnOptions {
            causal: opts.causal,
            scale: opts.scale,
            key_padding,
        };
        let out = attention.attend(layer, q, keys, vals, &opts);
        sync(profile, &device);
        self.timings.attention += t3.elapsed();
        self.timings.layer_steps += 1;
        out
    }

    /// Rebuilds a sparse layer's prompt as full keys and values `[b, h, prompt_len, d]`:
    /// exact local window, outliers and values; low-rank keys elsewhere; zeros in padding.
    fn densify(&self, sp: &Sparse) -> (Tensor<4>, Tensor<4>) {
        let (cs, o) = (self.cfg.chunk, self.cfg.outlier_chunks);
        let (cos, sin) = self.tables.clone().expect("set at the prefill");
        let device = sp.a.device();
        let dtype = sp.a.dtype();
        let [b, h, _, d] = sp.wt.dims();
        let r = sp.a.dims()[2];
        let amax = sp.a.dims()[1];
        let wmax = sp.local.0.dims()[2];
        let mut ks = Vec::with_capacity(b);
        let mut vs = Vec::with_capacity(b);
        for i in 0..b {
            let chunks = sp.chunks[i];
            let ids: Vec<i32> = (0..h).flat_map(|_| (0..chunks).map(|c| c as i32)).collect();
            let ids = i32_tensor::<3>(ids, [1, h, chunks], &device);
            let a = sp.a.clone().slice([i..i + 1, 0..amax, 0..r]);
            let wt = sp.wt.clone().slice([i..i + 1, 0..h, 0..r, 0..d]);
            let rec = gather_reconstruct_rope(a, wt, ids, cos.clone(), sin.clone(), cs)
                .expect("the layer's own factors")
                .reshape([h * chunks, cs * d]);
            // Outlier chunks from their exact copies.
            let key_rows = match &sp.outliers {
                Some((ok, _)) if o > 0 => {
                    let exact = ok
                        .clone()
                        .slice([i..i + 1, 0..h, 0..o * cs, 0..d])
                        .reshape([h * o, cs * d]);
                    let mut src: Vec<i64> = (0..(h * chunks) as i64).collect();
                    for (hh, cids) in sp.outlier_chunk[i].iter().enumerate() {
                        for (j, &c) in cids.iter().enumerate() {
                            src[hh * chunks + c] = (h * chunks + hh * o + j) as i64;
                        }
                    }
                    Tensor::cat(vec![rec, exact], 0)
                        .select(0, idx_tensor::<1>(src, [h * chunks], &device))
                }
                _ => rec,
            };
            let all: Vec<Vec<usize>> = (0..h).map(|_| (0..chunks).collect()).collect();
            let vals = sp.values[i].gather(&all, &device);
            let ll = sp.local_len[i];
            let lk = item(&sp.local.0, i, wmax - ll, wmax);
            let lv = item(&sp.local.1, i, wmax - ll, wmax);
            let pad = sp.pads[i];
            let z = || Tensor::<3>::zeros([h, pad, d], (&device, dtype));
            let mut kparts = Vec::new();
            let mut vparts = Vec::new();
            if pad > 0 {
                kparts.push(z());
                vparts.push(z());
            }
            kparts.extend([key_rows.reshape([h, chunks * cs, d]), lk]);
            vparts.extend([vals, lv]);
            ks.push(Tensor::cat(kparts, 1).unsqueeze_dim::<4>(0));
            vs.push(Tensor::cat(vparts, 1).unsqueeze_dim::<4>(0));
        }
        (Tensor::cat(ks, 0), Tensor::cat(vs, 0))
    }
}

impl KvCache for ShadowKvCache {
    fn attend(
        &mut self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Tensor<4> {
        let s = k.dims()[2];
        self.lens[layer] += s;
        self.last = layer;
        match &mut self.layers[layer] {
            Layer::Full(slot) => {
                append_kv(slot, k, v);
                let (k, v) = slot.clone().expect("just appended");
                attention.attend(layer, q, k, v, opts)
            }
            Layer::Sparse(_) => self.decode(layer, q, k, v, attention, opts),
            Layer::Empty => {
                // The prefill's attention is exact; the prompt is compressed after it.
                let out = attention.attend(layer, q, k.clone(), v.clone(), opts);
                if let Err(e) = self.install(layer, k.clone(), v.clone(), opts.key_padding.as_ref())
                {
                    log::warn!("shadowkv layer {layer}: {e}; keeping the full cache");
                    self.layers[layer] = Layer::Full(Some((k, v)));
                }
                out
            }
        }
    }

    fn seq_len(&self) -> usize {
        self.lens[self.last]
    }

    fn truncate(&mut self, len: usize) {
        for l in 0..self.layers.len() {
            let layer = std::mem::replace(&mut self.layers[l], Layer::Empty);
            self.layers[l] = match layer {
                Layer::Empty => Layer::Empty,
                Layer::Full(Some((k, v))) => {
                    let [b, h, s, d] = k.dims();
                    if len == 0 {
                        Layer::Empty
                    } else if len < s {
                        Layer::Full(Some((
                            k.slice([0..b, 0..h, 0..len, 0..d]),
                            v.slice([0..b, 0..h, 0..len, 0..d]),
                        )))
                    } else {
                        Layer::Full(Some((k, v)))
                    }
                }
                Layer::Full(None) => Layer::Full(None),
                Layer::Sparse(mut sp) if len >= sp.prompt_len => {
                    let keep = len - sp.prompt_len;
                    if let Some((k, v)) = sp.generated.take() {
                        let [b, h, g, d] = k.dims();
                        sp.generated = (keep > 0).then(|| {
                            let n = keep.min(g);
                            (
                                k.slice([0..b, 0..h, 0..n, 0..d]),
                                v.slice([0..b, 0..h, 0..n, 0..d]),
                            )
                        });
                    }
                    Layer::Sparse(sp)
                }
                Layer::Sparse(sp) if len == 0 => {
                    drop(sp);
                    Layer::Empty
                }
                Layer::Sparse(sp) => {
                    let (k, v) = self.densify(&sp);
                    let [b, h, _, d] = k.dims();
                    Layer::Full(Some((
                        k.slice([0..b, 0..h, 0..len, 0..d]),
                        v.slice([0..b, 0..h, 0..len, 0..d]),
                    )))
                }
            };
            self.lens[l] = self.lens[l].min(len);
        }
    }

    fn bytes_held(&self) -> usize {
        let b = self.bytes_split();
        b.device + b.host
    }

    fn name(&self) -> String {
        format!(
            "shadowkv(rank={},budget={},chunk={},local={},outliers={})",
            self.cfg.rank,
            self.cfg.budget,
            self.cfg.chunk,
            self.cfg.local_chunks,
            self.cfg.outlier_chunks
        )
    }
}
