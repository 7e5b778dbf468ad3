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
//! - **Landmarks** are the per-chunk means of the post-RoPE keys, per KV head
//!   ([`ChunkScoring::Mean`], the paper's), or each chunk's channel-wise maxima and minima
//!   ([`ChunkScoring::Bounds`], Quest's upper bound of a query's scores in the chunk).
//! - **Outliers.** Per KV head, the `outlier_chunks` chunks whose least similar token (cosine
//!   similarity to the chunk mean) is lowest keep exact keys and values on the device and get
//!   no landmark.
//!
//! # Decode (every call after the prefill)
//!
//! The queries score the landmarks, `softmax(q·lᵀ·scale)` over chunks (with
//! [`ChunkScoring::Bounds`], `l` is `[max | min]` and `q` is `[max(q, 0) | min(q, 0)]`, so
//! `q·lᵀ` is the largest score any key of the chunk could give `q`), summed over the call's
//! queries and maxed over the GQA group (as the official code); each `(sequence, KV head)`
//! takes its top `budget / chunk` chunks, selected on the device ([`crate::top_k_rows`]: a
//! step reads back the chosen ids, not every score). Their values come host→device, reusing
//! the chunks the previous step of the layer already uploaded; their keys are rebuilt by the
//! fused [`crate::gather_reconstruct_rope`] kernel. Attention (the given [`AttentionImpl`])
//! runs over `local | outliers | selected | generated`, the generated tokens (every token
//! after the prompt, this call's included) held exactly on the device.
//!
//! With [`ShadowKvConfig::candidates`] `m > 1` the selection has two stages: the landmarks pick
//! `m · budget / chunk` candidate chunks, their keys are rebuilt, and the same aggregate over
//! the rebuilt keys keeps the `budget` best tokens per `(sequence, KV head)`; only their values
//! are fetched (no reuse across steps). The transfer and the attention stay the budget's; the
//! key rebuild and the scoring are `m` times the budget's.
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

mod decode;
mod host;
mod lowrank;
mod prefill;
mod refine;

pub use host::{HostValues, UPLOAD_PIECE_BYTES, tune_host_allocator};
pub use lowrank::{LowRank, RopeParams, low_rank, rope_tables, unrope};

use std::time::Duration;

use burn::tensor::{DType, Device, Int, Tensor, TensorCreationOptions, TensorData};
use burn_kernels_core::{AttentionImpl, AttnOptions, CacheError, KvCache, append_kv};

use crate::{KvCacheError, bytes_of};

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
    /// How a decode step scores the chunks it selects from.
    pub scoring: ChunkScoring,
    /// Two-stage selection when > 1: the landmarks pick `candidates` times the budget in
    /// chunks, their keys are rebuilt, and the step keeps the `budget` tokens whose rebuilt keys
    /// score highest (values fetched for those tokens only). 1 (the default): the paper's
    /// selection of whole chunks.
    pub candidates: usize,
    /// Move each step's gathered values into the runtime's pinned (page-locked) host memory
    /// on the gathering cores before they are uploaded (`Device::staging`, pieces of
    /// [`UPLOAD_PIECE_BYTES`]), so that the runtime's device thread does not copy every piece
    /// into its own staging buffer before the DMA. `true` by default; runtimes without pinned
    /// memory (WebGPU, the CPU) upload as before.
    pub pinned_uploads: bool,
    /// Reuse the selected chunks already on the device from the layer's previous step only
    /// where they are at least this percentage of the step's chunks; below it the step fetches
    /// every chunk (0: reuse whatever is found; above 100: never reuse). Reuse saves the found
    /// chunks' upload but adds a device assembly of every chunk (the previous rows and the
    /// fetched ones joined, then picked in slot order). At 128K, batch 10 (H100, 2026-12-07)
    /// the assembly took 14.1 ms a step and uploading 97% of the chunks 74.3 ms, so reuse pays
    /// from about 18% on: the default is 20. The random-weight suite finds 3%; SmolLM2's real
    /// weights 69%.
    pub reuse_min_percent: u32,
}

/// How a decode step scores a chunk against its queries (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum ChunkScoring {
    /// The query against the chunk's mean key (ShadowKV's landmarks): `d` values a chunk.
    #[default]
    Mean,
    /// The largest score any key of the chunk could give the query, from the chunk's
    /// channel-wise maxima and minima (Quest, Tang et al., 2024): `2·d` values a chunk, twice
    /// the landmarks' memory and scoring work. On SmolLM2-135M's RULER-style tasks at a 6%
    /// budget it scored lower than `Mean` (4.2 against 15.3, chunks of 8; the crate README).
    Bounds,
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
            scoring: ChunkScoring::Mean,
            candidates: 1,
            pinned_uploads: true,
            reuse_min_percent: 20,
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
    /// Landmark scores, the top-k on the device and the read-back of the chosen ids. When
    /// profiling, the work queued before the step (the layer's projections) is waited for
    /// first and not counted here.
    pub scoring: Duration,
    /// Part of `scoring`: the host's time until the read-back's wait starts (issuing the
    /// scoring's launches).
    pub scoring_issue: Duration,
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
    /// Part of `attention`: the host's time to issue it (before the profile's wait).
    pub attention_issue: Duration,
    /// `(sequence, head, chunk)` values uploaded.
    pub chunks_fetched: usize,
    /// `(sequence, head, chunk)` values reused from the previous step.
    pub chunks_reused: usize,
    /// Selected `(sequence, head, chunk)` slots (padding excluded).
    pub chunks_selected: usize,
    /// Of `chunks_selected`, those the previous step of the layer had selected too, whether or
    /// not the step reused them ([`ShadowKvConfig::reuse_min_percent`]): how much adjacent
    /// steps' selections overlap.
    pub chunks_overlapping: usize,
}

impl DecodeTimings {
    /// `chunks_overlapping / chunks_selected` (0 before any sparse step).
    pub fn overlap(&self) -> f64 {
        self.chunks_overlapping as f64 / self.chunks_selected.max(1) as f64
    }
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

    /// Switches [`ShadowKvConfig::pinned_uploads`] for the decode steps from now on (the held
    /// cache is the same either way): benchmarks compare both paths on one filled cache.
    pub fn set_pinned_uploads(&mut self, on: bool) {
        self.cfg.pinned_uploads = on;
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
    ) -> Result<Tensor<4>, CacheError> {
        let s = k.dims()[2];
        self.lens[layer] += s;
        self.last = layer;
        Ok(match &mut self.layers[layer] {
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
        })
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

    fn stats(&self) -> Option<String> {
        let t = &self.timings;
        let chunks = t.chunks_fetched + t.chunks_reused;
        (t.layer_steps > 0).then(|| {
            format!(
                "ShadowKV: {} sparse layer-steps; {} of {} selected chunks ({:.1}%) were on the \
                 device from the layer's previous step, {} fetched from host memory; adjacent \
                 steps' selections overlap {:.1}%",
                t.layer_steps,
                t.chunks_reused,
                chunks,
                100.0 * t.chunks_reused as f64 / chunks.max(1) as f64,
                t.chunks_fetched,
                100.0 * t.overlap()
            )
        })
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
