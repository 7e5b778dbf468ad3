//! Multi-draft speculative decoding with a target [`Llama`] and one or more draft [`Llama`]s
//! that share its tokenizer.
//!
//! # One step (a *block*)
//! 1. **Draft.** Each of the K drafts proposes L tokens autoregressively from its own model and
//!    sampling settings (identical drafts: the same model and temperature K times; or different
//!    models or temperatures). Per distinct draft model, one call feeds the emitted tokens that
//!    its cache lacks (they are final, so they go straight into its prefix) and gives the
//!    distribution of every draft's first token; then L − 1 calls run `batch × K_m` rows (the
//!    model's K_m drafts per sequence) that share the sequence's prefix. A prompt-lookup draft
//!    ([`DraftSource::Lookup`]) runs no model: it copies what followed an earlier occurrence of
//!    the sequence's last tokens, with a one-hot distribution, so verification stays exact.
//! 2. **Verify in one target call.** The target runs `[pending, x_{k,1} .. x_{k,L}]` for every
//!    draft k as `batch × K` rows of a single forward pass, where `pending` is the last emitted
//!    token (the only one the target cache does not hold yet). Row `(b, k)` sees sequence b's
//!    cached prefix and its own L draft tokens, so position j of row k gives
//!    `p(. | prefix, x_{k,<j})` for `j = 1..L+1`: every node of the drafts' token tree. Logits
//!    are only computed for the distinct nodes (drafts that share their first j tokens share
//!    the node).
//! 3. **Token-tree verification** ([`burn_specdec::verify_block`]): position by position, the
//!    drafts still consistent with the accepted tokens compete under the chosen [`Scheme`]; a
//!    draft rejected at an earlier position drops out; a residual token ends the block; if all L
//!    positions are accepted the target's distribution after the last draft token gives a bonus
//!    token. A block emits `accepted + 1` tokens (cut at a stop token or `max_new_tokens`).
//! 4. **Roll back.** Each cache keeps, per sequence, one branch row whose tokens agree with what
//!    was emitted, and drops the rest (rejected tokens and the other rows); see
//!    [`BranchKvCache::merge`]. The target cache then holds every emitted token but the last
//!    (the next block feeds it, as plain decoding does); a draft cache holds the longest run of
//!    the emitted tokens but the last that its best-matching row had computed, and is fed the
//!    rest at the next step. A target cache without branch rows (the compressed caches, in a
//!    [`LinearSpecCache`]: one prompt, one draft) appends the block's tokens and is truncated to
//!    what was kept.
//!
//! Why K rows rather than one flattened token tree: [`Llama::forward`] gives the tokens of a
//! row consecutive RoPE positions and attention masks are causal plus key padding, so a
//! flattened tree (positions repeating across branches, a tree-shaped mask) is not expressible
//! without changing the model. K rows are: the shared prefix lives once in the
//! [`BranchKvCache`] and is broadcast to the K rows inside each attention call (a transient
//! copy, not K caches), and the pending token is recomputed K times (cheap next to L drafts).
//!
//! # Batching
//! Sequences advance by different amounts, so one batched cache would get ragged. The
//! [`BranchKvCache`] keeps a per-slot validity mask instead of plain left padding: after each
//! block every sequence's tokens are packed right-aligned (left-padded) into one
//! `[batch, kv_heads, max_len, head_dim]` tensor, and the cache masks padding and the dummy
//! tokens that pad ragged inputs itself. RoPE positions are per row: [`forward_rows`] passes
//! [`Llama::forward`] a `left_pad` such that each row's first real token lands at the row's own
//! length (`position = start + t − left_pad`). Finished sequences stay in the batch with their
//! caches frozen (their rows are computed and discarded) until every sequence is done.
//!
//! # Greedy decoding
//! With target temperature 0 the target distribution is one-hot at the argmax, every scheme
//! emits that argmax at every position, and speculative decoding reproduces [`generate`]'s
//! greedy tokens (up to floating-point ties between logits, since the target sees the tokens in
//! differently shaped batches).
//!
//! # Metrics
//! As in vLLM: block efficiency (mean tokens a sequence gets per target call, `1 + accepted`
//! per block, before cutting at stop tokens or `max_new_tokens`), acceptance rate per draft
//! position (fraction of blocks whose position j was accepted), tokens per second, and the
//! number of target and draft calls.
//!
//! [`generate`]: crate::generate::generate

use std::collections::HashMap;
use std::time::Instant;

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use burn_kernels_core::{
    AttentionImpl, AttnOptions, Greedy, KvCache, Sampler, SamplingConfig, TopKTopP, append_kv,
};
use burn_specdec::{PromptLookup, Scheme, SpecDecError, verify_block};
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::model::Llama;

/// Bad configuration or a failed verification.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    /// No draft was given (K = 0).
    #[error("at least one draft is required (K = 0)")]
    NoDrafts,
    /// The draft length is 0.
    #[error("the draft length L must be at least 1")]
    ZeroDraftLength,
    /// [`Scheme::SingleDraft`] with K ≠ 1.
    #[error("single-draft speculative sampling needs exactly one draft, got {drafts}")]
    SingleDraftNeedsOneDraft {
        /// K.
        drafts: usize,
    },
    /// A draft model's vocabulary differs from the target's.
    #[error("draft {draft} has a vocabulary of {found} tokens, the target {expected}")]
    VocabularyMismatch {
        /// Draft index k.
        draft: usize,
        /// The target's vocabulary size.
        expected: usize,
        /// The draft's vocabulary size.
        found: usize,
    },
    /// A truncated-layer draft asked for no layers or more layers than the target has.
    #[error("a truncated-layer draft needs 1..={available} layers, got {requested}")]
    DraftLayers {
        /// Requested number of layers.
        requested: usize,
        /// The target's number of layers.
        available: usize,
    },
    /// No prompts were given.
    #[error("no prompts")]
    NoPrompts,
    /// A prompt has no tokens.
    #[error("prompt {index} is empty")]
    EmptyPrompt {
        /// Index of the prompt.
        index: usize,
    },
    /// A prompt token is outside the target's vocabulary.
    #[error("prompt {index} has token {token}, outside the vocabulary of {vocab}")]
    PromptTokenOutOfVocab {
        /// Index of the prompt.
        index: usize,
        /// The token.
        token: u32,
        /// The target's vocabulary size.
        vocab: usize,
    },
    /// The target cache cannot hold this batch or this many draft branches (a
    /// [`LinearSpecCache`] holds one sequence and one branch: batch 1, K = 1).
    #[error(
        "the target KV cache `{cache}` holds {max_batch} sequence(s) with up to {max_fan} \
         draft branch(es); got {batch} prompt(s) and K = {drafts} (compressed caches \
         speculate with one prompt and a single draft; use the branching full cache for more)"
    )]
    CacheLayout {
        /// The cache's name.
        cache: String,
        max_batch: usize,
        max_fan: usize,
        batch: usize,
        drafts: usize,
    },
    /// The target cache already holds tokens.
    #[error("the target KV cache must start empty, it holds {held} positions")]
    CacheNotEmpty {
        /// Positions held.
        held: usize,
    },
    /// The verification scheme rejected its inputs.
    #[error(transparent)]
    Verify(#[from] SpecDecError),
}

/// Where a draft's tokens come from.
#[derive(Debug)]
pub enum DraftSource<'a> {
    /// A model that shares the target's tokenizer (drafts may share one), sampled with the
    /// draft's settings.
    Model(&'a Llama),
    /// Prompt lookup over the sequence so far ([`PromptLookup`]): no model and no forward
    /// passes; its distribution is one-hot at the drafted token.
    Lookup(PromptLookup),
}

impl Clone for DraftSource<'_> {
    fn clone(&self) -> Self {
        *self
    }
}

impl Copy for DraftSource<'_> {}

/// One draft: its source and the sampling settings a model draft's tokens are drawn with
/// (temperature, top-k, top-p; the seed is unused, see [`SpecOptions::seed`]).
#[derive(Debug)]
pub struct Draft<'a> {
    pub source: DraftSource<'a>,
    pub sampling: SamplingConfig,
}

impl Clone for Draft<'_> {
    fn clone(&self) -> Self {
        *self
    }
}

impl Copy for Draft<'_> {}

impl<'a> Draft<'a> {
    /// A draft model sampled with `sampling`.
    pub fn model(model: &'a Llama, sampling: SamplingConfig) -> Self {
        Self {
            source: DraftSource::Model(model),
            sampling,
        }
    }

    /// A prompt-lookup draft (see [`PromptLookup`]).
    pub fn lookup(lookup: PromptLookup) -> Self {
        Self {
            source: DraftSource::Lookup(lookup),
            sampling: SamplingConfig::default(),
        }
    }

    /// The model, for a model draft.
    pub fn model_ref(&self) -> Option<&'a Llama> {
        match self.source {
            DraftSource::Model(m) => Some(m),
            DraftSource::Lookup(_) => None,
        }
    }
}

/// Options of [`speculative_generate`].
#[derive(Debug, Clone, PartialEq)]
pub struct SpecOptions {
    /// The token-level verification scheme.
    pub scheme: Scheme,
    /// Draft tokens per draft and step (L ≥ 1).
    pub draft_len: usize,
    /// The target's sampling settings (temperature 0 is greedy; top-k/top-p apply; the seed
    /// is unused).
    pub target_sampling: SamplingConfig,
    pub max_new_tokens: usize,
    /// Generation of a sequence stops after it emits one of these.
    pub stop_tokens: Vec<u32>,
    /// Seeds every random draw: one stream for the draft tokens, and one per sequence and
    /// block for the verification uniforms (so sequences verify in parallel, reproducibly).
    pub seed: u64,
}

/// Counters and timings of a speculative run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecStats {
    /// K.
    pub num_drafts: usize,
    /// L.
    pub draft_len: usize,
    /// Verification forward passes of the target (the prefill is not counted).
    pub target_calls: usize,
    /// Forward passes of draft models (L per step per distinct draft model).
    pub draft_calls: usize,
    /// Verified blocks, i.e. (sequence, target call) pairs of unfinished sequences.
    pub blocks: usize,
    /// Accepted draft tokens over all blocks.
    pub accepted: usize,
    /// `accepted_at[j]`: blocks whose draft position `j + 1` was accepted (length L).
    pub accepted_at: Vec<usize>,
    /// Tokens emitted (after stop tokens and `max_new_tokens`).
    pub emitted: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    /// Parts of `decode_secs`: draft forwards and sampling, the target forward, verification.
    pub draft_secs: f64,
    pub target_secs: f64,
    pub verify_secs: f64,
}

impl SpecStats {
    /// Mean tokens per sequence per target call, `1 + accepted` per block (between 1 and L + 1).
    pub fn block_efficiency(&self) -> f64 {
        (self.blocks + self.accepted) as f64 / self.blocks.max(1) as f64
    }

    /// Per draft position j = 1..L: the fraction of blocks that accepted position j.
    pub fn acceptance_rate_per_position(&self) -> Vec<f64> {
        self.accepted_at
            .iter()
            .map(|&n| n as f64 / self.blocks.max(1) as f64)
            .collect()
    }

    /// Emitted tokens per second of decoding (all sequences).
    pub fn tokens_per_sec(&self) -> f64 {
        self.emitted as f64 / self.decode_secs.max(1e-9)
    }
}

/// What [`speculative_generate`] (or [`speculative_generate_with_cache`], with its target
/// cache type `C`) produced.
#[derive(Debug)]
pub struct SpecGeneration<C = BranchKvCache> {
    /// The new tokens of each prompt (a stop token, if hit, is the last one).
    pub tokens: Vec<Vec<u32>>,
    pub stats: SpecStats,
    /// The target's cache at the end: sequence b holds its prompt and every generated token but
    /// the last ([`BranchKvCache::sequence_len`]).
    pub target_cache: C,
    /// One cache per distinct draft model (in order of first use in the draft list).
    pub draft_caches: Vec<BranchKvCache>,
}

/// A draft model from `path`: a training checkpoint (a `finetune --init-layers` run folder, see
/// [`crate::finetune::load_trained`]) or a model the loader reads (.gguf or HF folder). It must
/// share the target's tokenizer; [`speculative_generate`] checks the vocabulary size.
///
/// # Errors
/// The loader's or the checkpoint's error, as text.
pub fn load_draft(
    path: &std::path::Path,
    device: &Device,
    dtype: burn::tensor::DType,
) -> Result<Llama, String> {
    if crate::finetune::checkpoint_dir(path).is_some() {
        return crate::finetune::load_trained(path, device, dtype).map_err(|e| e.to_string());
    }
    let ckpt = crate::loader::load(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Llama::from_checkpoint(&ckpt, device, dtype).map_err(|e| e.to_string())
}

/// The first `layers` blocks of `target` with its final norm and LM head: a self-speculative
/// draft (shares the target's weights, no extra memory beyond handles).
///
/// # Errors
/// [`SpecError::DraftLayers`] unless `1 <= layers <= target layers`.
pub fn truncated_draft(target: &Llama, layers: usize) -> Result<Llama, SpecError> {
    let available = target.layers.len();
    if layers == 0 || layers > available {
        return Err(SpecError::DraftLayers {
            requested: layers,
            available,
        });
    }
    let mut config = target.config.clone();
    config.num_layers = layers;
    Ok(Llama {
        embed: target.embed.clone(),
        layers: target.layers[..layers].to_vec(),
        norm: target.norm.clone(),
        lm_head: target.lm_head.clone(),
        config,
        rope: target.rope.clone(),
    })
}

/// Per layer: committed keys/values `[batch, kv_heads, s, head_dim]` and, while forked, branch
/// keys/values `[batch × fan, kv_heads, t, head_dim]`.
#[derive(Debug, Clone, Default)]
struct LayerKv {
    prefix: Option<(Tensor<4>, Tensor<4>)>,
    branch: Option<(Tensor<4>, Tensor<4>)>,
}

/// A KV cache for speculative decoding: a committed *prefix* per sequence and, while a block is
/// drafted or verified, `fan` *branch* rows per sequence that share that prefix.
///
/// Attention rows are the sequences (`batch`) when not forked, and `batch × fan` rows (row
/// `b × fan + i` = branch i of sequence b) while forked: the prefix is broadcast to the fan
/// rows for each attention call instead of being copied into K caches. Every slot has a
/// validity bit; invalid slots (left padding, dummy tokens of ragged inputs) are masked as keys,
/// so the [`AttnOptions::key_padding`] that [`Llama::forward`] derives from `left_pad` is
/// replaced by the cache's own mask.
///
/// # Shapes
/// - `attend`: `q` `[rows, q_heads, s_new, head_dim]`, `k`/`v` `[rows, kv_heads, s_new,
///   head_dim]`, with `rows` = `batch` or `batch × fan`
#[derive(Debug, Clone)]
pub struct BranchKvCache {
    layers: Vec<LayerKv>,
    /// `[batch][s]`.
    prefix_valid: Vec<Vec<bool>>,
    /// `[batch × fan][t]` while forked.
    branch_valid: Vec<Vec<bool>>,
    fan: Option<usize>,
    /// Validity of the tokens of the next forward pass, `[rows][s_new]` (all valid if `None`).
    incoming: Option<Vec<Vec<bool>>>,
    /// The key mask of the current layout, built once for all layers.
    mask: Option<Option<Tensor<2, Bool>>>,
}

impl BranchKvCache {
    /// An empty cache for `batch` sequences of a `num_layers` model.
    pub fn new(num_layers: usize, batch: usize) -> Self {
        Self {
            layers: vec![LayerKv::default(); num_layers],
            prefix_valid: vec![Vec::new(); batch],
            branch_valid: Vec::new(),
            fan: None,
            incoming: None,
            mask: None,
        }
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.prefix_valid.len()
    }

    /// Attention rows of the next forward pass: `batch`, or `batch × fan` while forked.
    pub fn rows(&self) -> usize {
        self.batch() * self.fan.unwrap_or(1)
    }

    /// Branch rows per sequence while forked.
    pub fn fan(&self) -> Option<usize> {
        self.fan
    }

    /// Tokens of sequence `b` in the committed prefix.
    pub fn sequence_len(&self, b: usize) -> usize {
        self.prefix_valid[b].iter().filter(|&&v| v).count()
    }

    /// Tokens attention row `row` sees (its sequence's prefix and, while forked, its branch).
    pub fn row_len(&self, row: usize) -> usize {
        match self.fan {
            None => self.sequence_len(row),
            Some(fan) => {
                self.sequence_len(row / fan) + self.branch_valid[row].iter().filter(|&&v| v).count()
            }
        }
    }

    /// Starts a block: `fan` branch rows per sequence, all empty.
    ///
    /// # Panics
    /// If already forked or `fan == 0`.
    pub fn fork(&mut self, fan: usize) {
        assert!(self.fan.is_none(), "already forked");
        assert!(fan > 0, "fan must be positive");
        self.fan = Some(fan);
        self.branch_valid = vec![Vec::new(); self.batch() * fan];
        self.mask = None;
    }

    /// Ends a block: for each sequence b, `keep[b] = (i, n)` appends the first `n` branch slots
    /// of branch row i to b's prefix (their valid tokens) and drops everything else in the
    /// branches (the rollback of rejected tokens). The prefix is then repacked so that every
    /// sequence's tokens are right-aligned with no holes.
    ///
    /// # Panics
    /// If not forked, `keep.len() != batch`, `i >= fan` or `n` exceeds the branch length.
    pub fn merge(&mut self, keep: &[(usize, usize)]) {
        let fan = self.fan.take().expect("merge needs a forked cache");
        let batch = self.batch();
        assert_eq!(keep.len(), batch, "one choice per sequence");
        let prefix_len = self.prefix_valid[0].len();
        let branch_len = self.branch_valid[0].len();
        // Source columns (in `prefix ++ chosen branch row`) of each sequence's valid tokens.
        let sources: Vec<Vec<usize>> = keep
            .iter()
            .enumerate()
            .map(|(b, &(i, n))| {
                assert!(i < fan && n <= branch_len, "bad merge choice {:?}", keep[b]);
                let row = &self.branch_valid[b * fan + i];
                let old = self.prefix_valid[b].iter().enumerate().filter(|(_, v)| **v);
                let new = row[..n].iter().enumerate().filter(|(_, v)| **v);
                old.map(|(c, _)| c)
                    .chain(new.map(|(t, _)| prefix_len + t))
                    .collect()
            })
            .collect();
        let new_len = sources.iter().map(Vec::len).max().unwrap_or(0);
        // Nothing kept from the branches and the prefix already packed: just drop the branches.
        let unchanged = new_len == prefix_len
            && sources
                .iter()
                .all(|src| src.iter().copied().eq(prefix_len - src.len()..prefix_len));
        if unchanged {
            for layer in &mut self.layers {
                layer.branch = None;
            }
            self.branch_valid.clear();
            self.mask = None;
            return;
        }
        let rows: Vec<i64> = keep
            .iter()
            .enumerate()
            .map(|(b, &(i, _))| (b * fan + i) as i64)
            .collect();
        let mut index = None;
        for layer in &mut self.layers {
            let prefix = layer.prefix.take();
            let branch = layer.branch.take();
            if new_len == 0 {
                continue;
            }
            let device = match (&prefix, &branch) {
                (Some((k, _)), _) | (None, Some((k, _))) => k.device(),
                (None, None) => continue,
            };
            let rows = Tensor::<1, Int>::from_data(TensorData::new(rows.clone(), [batch]), &device);
            let pick = |t: Tensor<4>| t.select(0, rows.clone());
            let (k, v) = match (prefix, branch) {
                (Some((pk, pv)), Some((bk, bv))) => (
                    Tensor::cat(vec![pk, pick(bk)], 2),
                    Tensor::cat(vec![pv, pick(bv)], 2),
                ),
                (Some(kv), None) => kv,
                (None, Some((bk, bv))) => (pick(bk), pick(bv)),
                (None, None) => unreachable!(),
            };
            let [_, h, _, d] = k.dims();
            let index = index
                .get_or_insert_with(|| {
                    // Left-pad each sequence by pointing its padding slots at column 0 (masked).
                    let mut data = Vec::with_capacity(batch * h * new_len * d);
                    for src in &sources {
                        let cols: Vec<i64> = std::iter::repeat_n(0, new_len - src.len())
                            .chain(src.iter().map(|&c| c as i64))
                            .collect();
                        for _ in 0..h {
                            for &c in &cols {
                                data.extend(std::iter::repeat_n(c, d));
                            }
                        }
                    }
                    Tensor::<4, Int>::from_data(
                        TensorData::new(data, [batch, h, new_len, d]),
                        &device,
                    )
                })
                .clone();
            layer.prefix = Some((k.gather(2, index.clone()), v.gather(2, index)));
        }
        debug_assert!(sources.iter().all(|s| s.len() <= prefix_len + branch_len));
        self.prefix_valid = sources
            .iter()
            .map(|s| {
                let mut v = vec![false; new_len - s.len()];
                v.resize(new_len, true);
                v
            })
            .collect();
        self.branch_valid.clear();
        self.mask = None;
    }

    /// Marks which tokens of the next forward pass are real, `[rows][s_new]`; the others are
    /// masked as keys forever (dummies that pad ragged inputs).
    pub fn set_incoming_validity(&mut self, valid: Vec<Vec<bool>>) {
        assert_eq!(valid.len(), self.rows(), "one row per attention row");
        self.incoming = Some(valid);
    }

    /// The `[rows, total]` key mask (`true` = hidden), `None` if every key is visible.
    fn key_mask(&mut self, device: &Device) -> Option<Tensor<2, Bool>> {
        if let Some(mask) = &self.mask {
            return mask.clone();
        }
        let rows = self.rows();
        let fan = self.fan.unwrap_or(1);
        let forked = self.fan.is_some();
        let mut data = Vec::new();
        for r in 0..rows {
            data.extend(self.prefix_valid[r / fan].iter().map(|v| !v));
            if forked {
                data.extend(self.branch_valid[r].iter().map(|v| !v));
            }
        }
        let total = data.len() / rows.max(1);
        let mask = data
            .iter()
            .any(|&m| m)
            .then(|| Tensor::from_data(TensorData::new(data, [rows, total]), device));
        self.mask = Some(mask.clone());
        mask
    }
}

impl KvCache for BranchKvCache {
    fn attend(
        &mut self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Tensor<4> {
        let [rows, _, s_new, _] = k.dims();
        assert_eq!(rows, self.rows(), "attention rows vs cache layout");
        let device = k.device();
        let slot = &mut self.layers[layer];
        let (keys, values, len, valid) = match self.fan {
            None => {
                let len = append_kv(&mut slot.prefix, k, v);
                let (k, v) = slot.prefix.clone().expect("just appended");
                (k, v, len, &mut self.prefix_valid)
            }
            Some(fan) => {
                let len = append_kv(&mut slot.branch, k, v);
                let (bk, bv) = slot.branch.clone().expect("just appended");
                let (k, v) = match &slot.prefix {
                    Some((pk, pv)) => {
                        // The shared prefix is broadcast to the fan rows of its sequence.
                        let widen = |t: Tensor<4>| {
                            let [b, h, s, d] = t.dims();
                            t.unsqueeze_dim::<5>(1).expand([b, fan, h, s, d]).reshape([
                                b * fan,
                                h,
                                s,
                                d,
                            ])
                        };
                        (
                            Tensor::cat(vec![widen(pk.clone()), bk], 2),
                            Tensor::cat(vec![widen(pv.clone()), bv], 2),
                        )
                    }
                    None => (bk, bv),
                };
                (k, v, len, &mut self.branch_valid)
            }
        };
        // The first layer of a forward pass extends the host-side validity of the new slots.
        if valid.first().map_or(0, Vec::len) < len {
            let incoming = self.incoming.take();
            for (r, row) in valid.iter_mut().enumerate() {
                match &incoming {
                    Some(inc) => {
                        assert_eq!(inc[r].len(), s_new, "incoming validity length");
                        row.extend_from_slice(&inc[r]);
                    }
                    None => row.extend(std::iter::repeat_n(true, s_new)),
                }
            }
            self.mask = None;
        }
        let opts = AttnOptions {
            causal: opts.causal,
            scale: opts.scale,
            key_padding: self.key_mask(&device),
        };
        attention.attend(layer, q, keys, values, &opts)
    }

    fn seq_len(&self) -> usize {
        let last = self
            .layers
            .iter()
            .rev()
            .find(|l| l.prefix.is_some() || l.branch.is_some());
        last.map_or(0, |l| {
            let len =
                |s: &Option<(Tensor<4>, Tensor<4>)>| s.as_ref().map_or(0, |(k, _)| k.dims()[2]);
            len(&l.prefix) + len(&l.branch)
        })
    }

    /// Drops every slot from `len` on (prefix slots included if `len` reaches into the prefix);
    /// per-sequence rollback is [`BranchKvCache::merge`].
    fn truncate(&mut self, len: usize) {
        let prefix_len = self.prefix_valid.first().map_or(0, Vec::len);
        let cut = |slot: &mut Option<(Tensor<4>, Tensor<4>)>, keep: usize| {
            if let Some((k, v)) = slot.take()
                && keep > 0
            {
                let [b, h, s, d] = k.dims();
                let keep = keep.min(s);
                *slot = Some((
                    k.slice([0..b, 0..h, 0..keep, 0..d]),
                    v.slice([0..b, 0..h, 0..keep, 0..d]),
                ));
            }
        };
        for layer in &mut self.layers {
            cut(&mut layer.prefix, len);
            cut(&mut layer.branch, len.saturating_sub(prefix_len));
        }
        for row in &mut self.prefix_valid {
            row.truncate(len);
        }
        for row in &mut self.branch_valid {
            row.truncate(len.saturating_sub(prefix_len));
        }
        self.mask = None;
    }

    fn bytes_held(&self) -> usize {
        let bytes = |s: &Option<(Tensor<4>, Tensor<4>)>| {
            s.as_ref().map_or(0, |(k, v)| {
                (k.shape().num_elements() + v.shape().num_elements()) * k.dtype().size()
            })
        };
        self.layers
            .iter()
            .map(|l| bytes(&l.prefix) + bytes(&l.branch))
            .sum()
    }

    fn name(&self) -> String {
        "branch".into()
    }
}

/// A target KV cache that speculative decoding can fork into draft branches and roll back:
/// [`BranchKvCache`] (any batch, any K) or a [`LinearSpecCache`] around any [`KvCache`] (the
/// compressed ones: one sequence, one draft).
pub trait SpecCache: KvCache {
    /// Number of sequences.
    fn batch(&self) -> usize;
    /// The most branch rows per sequence [`SpecCache::fork`] accepts.
    fn max_fan(&self) -> usize;
    /// Attention rows of the next forward pass ([`BranchKvCache::rows`]).
    fn rows(&self) -> usize;
    /// Tokens attention row `row` sees ([`BranchKvCache::row_len`]).
    fn row_len(&self, row: usize) -> usize;
    /// Starts a block with `fan` branch rows per sequence ([`BranchKvCache::fork`]).
    fn fork(&mut self, fan: usize);
    /// Ends a block, keeping `keep[b] = (row, n)` ([`BranchKvCache::merge`]).
    fn merge(&mut self, keep: &[(usize, usize)]);
    /// Validity of the next forward pass's tokens ([`BranchKvCache::set_incoming_validity`]).
    fn set_incoming_validity(&mut self, valid: Vec<Vec<bool>>);
}

impl SpecCache for BranchKvCache {
    fn batch(&self) -> usize {
        BranchKvCache::batch(self)
    }

    fn max_fan(&self) -> usize {
        usize::MAX
    }

    fn rows(&self) -> usize {
        BranchKvCache::rows(self)
    }

    fn row_len(&self, row: usize) -> usize {
        BranchKvCache::row_len(self, row)
    }

    fn fork(&mut self, fan: usize) {
        BranchKvCache::fork(self, fan);
    }

    fn merge(&mut self, keep: &[(usize, usize)]) {
        BranchKvCache::merge(self, keep);
    }

    fn set_incoming_validity(&mut self, valid: Vec<Vec<bool>>) {
        BranchKvCache::set_incoming_validity(self, valid);
    }
}

/// Any [`KvCache`] as the target cache of single-draft speculative decoding of one sequence:
/// a block appends the pending token and the L draft tokens to the cache, and the rollback is
/// [`KvCache::truncate`] to what was kept. This is how the compressed caches (ShadowKV,
/// MiniCache, quantized) speculate: they have no branch rows, so batch 1 and K = 1 (any
/// scheme; with one draft they all reduce to single-draft verification).
///
/// A ShadowKV cache scores its landmarks with all L + 1 queries of a block (summed, as for a
/// multi-token step), so its selection, and thus its sampled tokens, can differ from
/// one-token decoding unless the budget covers the whole prompt.
pub struct LinearSpecCache {
    inner: Box<dyn KvCache>,
    /// Positions held when the current block forked.
    forked_at: Option<usize>,
}

impl LinearSpecCache {
    /// Wraps an empty `inner` cache.
    pub fn new(inner: Box<dyn KvCache>) -> Self {
        Self {
            inner,
            forked_at: None,
        }
    }
}

impl std::fmt::Debug for LinearSpecCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinearSpecCache")
            .field("inner", &self.inner.name())
            .field("forked_at", &self.forked_at)
            .finish()
    }
}

impl KvCache for LinearSpecCache {
    fn attend(
        &mut self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Tensor<4> {
        self.inner.attend(layer, q, k, v, attention, opts)
    }

    fn seq_len(&self) -> usize {
        self.inner.seq_len()
    }

    fn truncate(&mut self, len: usize) {
        self.inner.truncate(len);
    }

    fn bytes_held(&self) -> usize {
        self.inner.bytes_held()
    }

    fn name(&self) -> String {
        self.inner.name()
    }
}

impl SpecCache for LinearSpecCache {
    fn batch(&self) -> usize {
        1
    }

    fn max_fan(&self) -> usize {
        1
    }

    fn rows(&self) -> usize {
        1
    }

    fn row_len(&self, row: usize) -> usize {
        assert_eq!(row, 0, "a linear cache has one row");
        self.inner.seq_len()
    }

    fn fork(&mut self, fan: usize) {
        assert!(self.forked_at.is_none(), "already forked");
        assert_eq!(fan, 1, "a linear cache has one branch");
        self.forked_at = Some(self.inner.seq_len());
    }

    fn merge(&mut self, keep: &[(usize, usize)]) {
        let base = self.forked_at.take().expect("merge needs a forked cache");
        let [(0, n)] = keep else {
            panic!("a linear cache keeps (0, n) of its one branch, got {keep:?}");
        };
        self.inner.truncate(base + n);
    }

    fn set_incoming_validity(&mut self, valid: Vec<Vec<bool>>) {
        // One row is never padded: every token of a forward pass is real.
        assert!(
            valid.len() == 1 && valid[0].iter().all(|&v| v),
            "a linear cache has one row of real tokens"
        );
    }
}

/// Runs ragged rows of tokens through `model` after what `cache` holds, each row at its own
/// positions: row r's tokens continue attention row r of the cache. Shorter rows are left-padded
/// with dummy tokens that the cache masks.
///
/// # Shapes
/// - `rows.len()` = [`BranchKvCache::rows`]
/// - returns `[rows, s, hidden]` with `s` the longest row; row r's tokens are its last
///   `rows[r].len()` positions
pub fn forward_rows(
    model: &Llama,
    cache: &mut dyn SpecCache,
    rows: &[Vec<u32>],
    attention: &dyn AttentionImpl,
) -> Tensor<3> {
    let n = rows.len();
    let s = rows.iter().map(Vec::len).max().unwrap_or(0);
    assert!(s > 0, "forward_rows needs at least one token");
    let start = cache.seq_len();
    let mut ids = Vec::with_capacity(n * s);
    let mut valid = Vec::with_capacity(n);
    let mut left_pad = Vec::with_capacity(n);
    for (r, row) in rows.iter().enumerate() {
        let dummies = s - row.len();
        let filler = row.first().copied().unwrap_or(0);
        ids.extend(
            std::iter::repeat_n(filler, dummies)
                .chain(row.iter().copied())
                .map(i64::from),
        );
        valid.push((0..s).map(|t| t >= dummies).collect());
        // Llama::forward puts token t at position `start + t - left_pad`: the first real token
        // lands at this row's length.
        left_pad.push(start + dummies - cache.row_len(r));
    }
    cache.set_incoming_validity(valid);
    let device = model.embed.device();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [n, s]), &device);
    model.forward(tokens, &left_pad, cache, attention)
}

/// Logits of selected positions, on the host: `positions` index the rows of `hidden` flattened
/// to `[rows × s, hidden]`.
///
/// # Shapes
/// - `hidden`: `[rows, s, hidden]`; returns `[positions.len()][vocab]` flattened
fn logits_at(model: &Llama, hidden: Tensor<3>, positions: &[usize]) -> Vec<f32> {
    if positions.is_empty() {
        return Vec::new();
    }
    let [b, s, h] = hidden.dims();
    let device = hidden.device();
    let index: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
    let index = Tensor::<1, Int>::from_data(TensorData::new(index, [positions.len()]), &device);
    let x = hidden.reshape([b * s, h]).select(0, index);
    model
        .logits(x.unsqueeze::<3>())
        .into_data()
        .try_to_vec::<f32>()
        .expect("f32 logits")
}

/// Next-token distributions for one sampling setting (the sampler's own distribution, so
/// speculative and plain decoding sample from the same rows).
struct Distribution {
    cfg: SamplingConfig,
    sampler: TopKTopP,
}

impl Distribution {
    fn new(cfg: SamplingConfig) -> Self {
        Self {
            cfg,
            sampler: TopKTopP::new(cfg),
        }
    }

    fn of(&self, logits: &[f32]) -> Vec<f32> {
        if self.cfg.temperature <= 0.0 {
            return Greedy.distribution(logits);
        }
        self.sampler.distribution(logits)
    }
}

/// Inverse-CDF draw from a probability row; only tokens with positive mass are returned.
fn draw(row: &[f32], u: f64) -> usize {
    let total: f64 = row.iter().map(|&x| f64::from(x)).sum();
    let target = u * total;
    let mut acc = 0.0;
    let mut last = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > 0.0 {
            acc += f64::from(x);
            last = i;
            if target < acc {
                return i;
            }
        }
    }
    last
}

/// `f(0)..f(n)` spread over the machine's cores, in order (the result does not depend on the
/// number of threads); one core or one item runs inline.
fn par_map<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(n)
        .max(1);
    if threads == 1 {
        return (0..n).map(f).collect();
    }
    let per = n.div_ceil(threads);
    std::thread::scope(|scope| {
        let f = &f;
        let handles: Vec<_> = (0..n)
            .step_by(per)
            .map(|start| {
                scope.spawn(move || (start..(start + per).min(n)).map(f).collect::<Vec<_>>())
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a worker thread panicked"))
            .collect()
    })
}

/// Draft tokens and the rows they are drawn from, for `jobs` = (row of `logits`, sequence,
/// draft) in order. The uniforms are drawn from `rng` in job order before the rows are computed
/// in parallel (a 49K-entry row per draft and sequence is the draft step's host cost at large
/// batches), so the tokens do not depend on the number of threads.
fn sample_drafts(
    logits: &[f32],
    vocab: usize,
    jobs: &[(usize, usize, usize)],
    dists: &[Distribution],
    rng: &mut StdRng,
) -> Vec<(Vec<f32>, u32)> {
    let us: Vec<f64> = jobs.iter().map(|_| rng.random()).collect();
    par_map(jobs.len(), |i| {
        let (row, _, k) = jobs[i];
        let dist = dists[k].of(&logits[row * vocab..(row + 1) * vocab]);
        let token = draw(&dist, us[i]) as u32;
        (dist, token)
    })
}

/// Draft models with the drafts (global indices) that run on each.
struct Group<'a> {
    model: &'a Llama,
    members: Vec<usize>,
}

fn validate(
    target: &Llama,
    drafts: &[Draft<'_>],
    prompts: &[Vec<u32>],
    opts: &SpecOptions,
) -> Result<(), SpecError> {
    if drafts.is_empty() {
        return Err(SpecError::NoDrafts);
    }
    if opts.draft_len == 0 {
        return Err(SpecError::ZeroDraftLength);
    }
    if opts.scheme == Scheme::SingleDraft && drafts.len() != 1 {
        return Err(SpecError::SingleDraftNeedsOneDraft {
            drafts: drafts.len(),
        });
    }
    let expected = target.config.vocab_size;
    for (k, model) in drafts
        .iter()
        .enumerate()
        .filter_map(|(k, d)| Some((k, d.model_ref()?)))
    {
        let found = model.config.vocab_size;
        if found != expected {
            return Err(SpecError::VocabularyMismatch {
                draft: k,
                expected,
                found,
            });
        }
    }
    if prompts.is_empty() {
        return Err(SpecError::NoPrompts);
    }
    if let Some(index) = prompts.iter().position(Vec::is_empty) {
        return Err(SpecError::EmptyPrompt { index });
    }
    for (index, prompt) in prompts.iter().enumerate() {
        if let Some(&token) = prompt.iter().find(|&&t| t as usize >= expected) {
            return Err(SpecError::PromptTokenOutOfVocab {
                index,
                token,
                vocab: expected,
            });
        }
    }
    Ok(())
}

/// Length of the common prefix of two token slices.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Prefills `cache` with every prompt token but the last (the first block feeds the last).
fn prefill(
    model: &Llama,
    cache: &mut dyn SpecCache,
    prompts: &[Vec<u32>],
    attention: &dyn AttentionImpl,
) {
    let rows: Vec<Vec<u32>> = prompts.iter().map(|p| p[..p.len() - 1].to_vec()).collect();
    if rows.iter().any(|r| !r.is_empty()) {
        forward_rows(model, cache, &rows, attention);
    }
}

/// Generates a continuation of every prompt by multi-draft speculative decoding (algorithm,
/// batching and metrics in the module docs). `on_token(i, token)` is called as each token of
/// prompt `i` is emitted.
///
/// # Errors
/// [`SpecError`] for a bad configuration (K = 0, L = 0, single-draft SD with K ≠ 1, a draft
/// vocabulary ≠ the target's, no or empty prompts, a prompt token outside the vocabulary);
/// [`SpecError::Verify`] if a scheme rejects its inputs.
pub fn speculative_generate(
    target: &Llama,
    drafts: &[Draft<'_>],
    prompts: &[Vec<u32>],
    attention: &dyn AttentionImpl,
    opts: &SpecOptions,
    on_token: &mut dyn FnMut(usize, u32),
) -> Result<SpecGeneration, SpecError> {
    let cache = BranchKvCache::new(target.layers.len(), prompts.len());
    speculative_generate_with_cache(target, cache, drafts, prompts, attention, opts, on_token)
}

/// Whether `cache` can be the target cache of `batch` prompts with `drafts` drafts: it holds
/// that many sequences and branch rows, and nothing yet.
///
/// # Errors
/// [`SpecError::CacheLayout`], [`SpecError::CacheNotEmpty`].
pub fn check_cache(cache: &dyn SpecCache, batch: usize, drafts: usize) -> Result<(), SpecError> {
    if cache.batch() != batch || drafts > cache.max_fan() {
        return Err(SpecError::CacheLayout {
            cache: cache.name(),
            max_batch: cache.batch(),
            max_fan: cache.max_fan(),
            batch,
            drafts,
        });
    }
    match cache.seq_len() {
        0 => Ok(()),
        held => Err(SpecError::CacheNotEmpty { held }),
    }
}

/// [`speculative_generate`] with the target's cache given: a [`BranchKvCache`] for
/// `prompts.len()` sequences, or a [`LinearSpecCache`] around a compressed cache (one prompt,
/// one draft). The drafts keep [`BranchKvCache`]s.
///
/// # Errors
/// Those of [`speculative_generate`]; [`SpecError::CacheLayout`] if the cache cannot hold the
/// batch or K branch rows, [`SpecError::CacheNotEmpty`] if it holds tokens.
pub fn speculative_generate_with_cache<C: SpecCache>(
    target: &Llama,
    mut target_cache: C,
    drafts: &[Draft<'_>],
    prompts: &[Vec<u32>],
    attention: &dyn AttentionImpl,
    opts: &SpecOptions,
    on_token: &mut dyn FnMut(usize, u32),
) -> Result<SpecGeneration<C>, SpecError> {
    validate(target, drafts, prompts, opts)?;
    check_cache(&target_cache, prompts.len(), drafts.len())?;
    let batch = prompts.len();
    let k_drafts = drafts.len();
    let len = opts.draft_len;
    let mut groups: Vec<Group<'_>> = Vec::new();
    let mut lookups: Vec<(usize, PromptLookup)> = Vec::new();
    for (k, d) in drafts.iter().enumerate() {
        let model = match d.source {
            DraftSource::Model(model) => model,
            DraftSource::Lookup(lookup) => {
                lookups.push((k, lookup));
                continue;
            }
        };
        match groups.iter_mut().find(|g| std::ptr::eq(g.model, model)) {
            Some(g) => g.members.push(k),
            None => groups.push(Group {
                model,
                members: vec![k],
            }),
        }
    }
    let target_dist = Distribution::new(opts.target_sampling);
    let draft_dist: Vec<Distribution> = drafts
        .iter()
        .map(|d| Distribution::new(d.sampling))
        .collect();
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let mut stats = SpecStats {
        num_drafts: k_drafts,
        draft_len: len,
        accepted_at: vec![0; len],
        ..SpecStats::default()
    };

    let t0 = Instant::now();
    prefill(target, &mut target_cache, prompts, attention);
    let mut draft_caches: Vec<BranchKvCache> = groups
        .iter()
        .map(|g| {
            let mut cache = BranchKvCache::new(g.model.layers.len(), batch);
            prefill(g.model, &mut cache, prompts, attention);
            cache
        })
        .collect();
    stats.prefill_secs = t0.elapsed().as_secs_f64();

    // Full sequences; each cache holds a prefix of every sequence and is fed the rest.
    let mut seqs: Vec<Vec<u32>> = prompts.to_vec();
    let mut target_held: Vec<usize> = prompts.iter().map(|p| p.len() - 1).collect();
    let mut draft_held: Vec<Vec<usize>> = vec![target_held.clone(); groups.len()];
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); batch];
    let mut done = vec![opts.max_new_tokens == 0; batch];
    let t1 = Instant::now();
    let vocab = target.config.vocab_size;
    while !done.iter().all(|&d| d) {
        let active: Vec<usize> = (0..batch).filter(|&b| !done[b]).collect();
        // 1. Draft: tokens[k][b] (L tokens) and the rows they were drawn from, q[k][b][j].
        // Finished sequences get placeholder tokens; their rows are computed and discarded.
        let td = Instant::now();
        let mut tokens: Vec<Vec<Vec<u32>>> = (0..k_drafts)
            .map(|_| {
                (0..batch)
                    .map(|b| match done[b] {
                        true => vec![*seqs[b].last().expect("non-empty"); len],
                        false => Vec::with_capacity(len),
                    })
                    .collect()
            })
            .collect();
        let mut q = vec![vec![Vec::with_capacity(len); batch]; k_drafts];
        for &(k, lookup) in &lookups {
            for &b in &active {
                tokens[k][b] = lookup.propose(&seqs[b], len);
                q[k][b] = tokens[k][b]
                    .iter()
                    .map(|&t| {
                        // In the vocabulary: lookup copies prompt tokens, checked by
                        // `validate`, and emitted ones.
                        let mut row = vec![0.0; vocab];
                        row[t as usize] = 1.0;
                        row
                    })
                    .collect();
            }
        }
        for (g, group) in groups.iter().enumerate() {
            let fan = group.members.len();
            let cache = &mut draft_caches[g];
            // The emitted tokens this draft lacks are final, so they go straight into its
            // prefix; the drafts of a sequence then share the logits of their first token.
            let rows: Vec<Vec<u32>> = (0..batch)
                .map(|b| match done[b] {
                    true => Vec::new(),
                    false => seqs[b][draft_held[g][b]..].to_vec(),
                })
                .collect();
            let hidden = forward_rows(group.model, cache, &rows, attention);
            stats.draft_calls += 1;
            for &b in &active {
                draft_held[g][b] = seqs[b].len();
            }
            let s = hidden.dims()[1];
            let last: Vec<usize> = active.iter().map(|&b| b * s + s - 1).collect();
            let logits = logits_at(group.model, hidden, &last);
            let jobs: Vec<(usize, usize, usize)> = active
                .iter()
                .enumerate()
                .flat_map(|(row, &b)| group.members.iter().map(move |&k| (row, b, k)))
                .collect();
            let drawn = sample_drafts(&logits, vocab, &jobs, &draft_dist, &mut rng);
            for (&(_, b, k), (dist, token)) in jobs.iter().zip(drawn) {
                tokens[k][b].push(token);
                q[k][b].push(dist);
            }
            cache.fork(fan);
            for j in 1..len {
                let rows: Vec<Vec<u32>> = (0..batch * fan)
                    .map(|r| vec![tokens[group.members[r % fan]][r / fan][j - 1]])
                    .collect();
                let hidden = forward_rows(group.model, cache, &rows, attention);
                stats.draft_calls += 1;
                let live: Vec<usize> = (0..batch * fan).filter(|&r| !done[r / fan]).collect();
                let logits = logits_at(group.model, hidden, &live);
                let jobs: Vec<(usize, usize, usize)> = live
                    .iter()
                    .enumerate()
                    .map(|(row, &r)| (row, r / fan, group.members[r % fan]))
                    .collect();
                let drawn = sample_drafts(&logits, vocab, &jobs, &draft_dist, &mut rng);
                for (&(_, b, k), (dist, token)) in jobs.iter().zip(drawn) {
                    tokens[k][b].push(token);
                    q[k][b].push(dist);
                }
            }
        }
        stats.draft_secs += td.elapsed().as_secs_f64();

        // 2. One target forward over batch × K rows: pending token(s), then the L draft tokens.
        let tt = Instant::now();
        target_cache.fork(k_drafts);
        let rows: Vec<Vec<u32>> = (0..batch * k_drafts)
            .map(|r| {
                let (b, k) = (r / k_drafts, r % k_drafts);
                [&seqs[b][target_held[b]..], &tokens[k][b][..]].concat()
            })
            .collect();
        let width = rows.iter().map(Vec::len).max().unwrap_or(0);
        let hidden = forward_rows(target, &mut target_cache, &rows, attention);
        stats.target_calls += 1;
        // Logits only for the distinct nodes of each token tree: drafts that share their first
        // j tokens share the target distribution at position j.
        let node_index = |b: usize, k: usize, j: usize| (b * k_drafts + k) * (len + 1) + j;
        let mut node_of = vec![usize::MAX; batch * k_drafts * (len + 1)];
        let mut positions = Vec::new();
        let mut nodes: HashMap<(usize, &[u32]), usize> = HashMap::new();
        for &b in &active {
            for k in 0..k_drafts {
                for j in 0..=len {
                    let node = *nodes.entry((b, &tokens[k][b][..j])).or_insert_with(|| {
                        let row = b * k_drafts + k;
                        positions.push(row * width + width - (len + 1) + j);
                        positions.len() - 1
                    });
                    node_of[node_index(b, k, j)] = node;
                }
            }
        }
        let logits = logits_at(target, hidden, &positions);
        stats.target_secs += tt.elapsed().as_secs_f64();

        // 3. Verify each unfinished sequence's token tree; 4. choose what each cache keeps.
        let tv = Instant::now();
        let mut target_keep = vec![(0, 0); batch];
        let mut draft_keep: Vec<Vec<(usize, usize)>> = vec![vec![(0, 0); batch]; groups.len()];
        // Each sequence verifies with its own random stream (seeded by seed, block and
        // sequence), so the sequences verify in parallel and the result does not depend on the
        // number of threads; the host verification of IS/Optimal costs tens of ms per sequence.
        let verify_one = |b: usize| {
            let drafted: Vec<Vec<usize>> = (0..k_drafts)
                .map(|k| tokens[k][b].iter().map(|&t| t as usize).collect())
                .collect();
            let p = |k: usize, j: usize| {
                let node = node_of[node_index(b, k, j)];
                target_dist.of(&logits[node * vocab..(node + 1) * vocab])
            };
            let mut rng = StdRng::seed_from_u64(
                opts.seed
                    ^ (stats.target_calls as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    ^ (b as u64).wrapping_mul(0xD1B5_4A32_D192_ED03),
            );
            verify_block(
                opts.scheme,
                &drafted,
                p,
                |k, j| q[k][b][j].clone(),
                &mut rng,
            )
        };
        let outcomes = par_map(active.len(), |i| verify_one(active[i]));
        for (&b, outcome) in active.iter().zip(outcomes) {
            let outcome = outcome?;
            stats.blocks += 1;
            stats.accepted += outcome.accepted;
            for hit in &mut stats.accepted_at[..outcome.accepted] {
                *hit += 1;
            }
            let mut emitted = Vec::with_capacity(outcome.tokens.len());
            for &t in &outcome.tokens {
                let t = t as u32;
                emitted.push(t);
                out[b].push(t);
                on_token(b, t);
                if opts.stop_tokens.contains(&t) || out[b].len() >= opts.max_new_tokens {
                    done[b] = true;
                    break;
                }
            }
            stats.emitted += emitted.len();
            let e = emitted.len();
            // The target keeps its pending token(s) and the emitted drafts but the last one, so
            // it holds everything but the last emitted token (which the next block feeds).
            let pending = seqs[b].len() - target_held[b];
            let dummies = width - (pending + len);
            target_keep[b] = (outcome.survivors[0], dummies + pending + e - 1);
            target_held[b] += pending + e - 1;
            // A draft branch holds drafts 1..L-1 (the L-th was never fed): keep the longest run
            // that matches the emitted tokens but the last.
            for (g, group) in groups.iter().enumerate() {
                let (best, matched) = (0..group.members.len())
                    .map(|i| {
                        let d = &tokens[group.members[i]][b][..len - 1];
                        (i, common_prefix(d, &emitted[..e - 1]))
                    })
                    .max_by_key(|&(i, m)| (m, std::cmp::Reverse(i)))
                    .expect("a group has a member");
                draft_keep[g][b] = (best, matched);
                draft_held[g][b] += matched;
            }
            seqs[b].extend_from_slice(&emitted);
        }
        target_cache.merge(&target_keep);
        for (cache, keep) in draft_caches.iter_mut().zip(&draft_keep) {
            cache.merge(keep);
        }
        stats.verify_secs += tv.elapsed().as_secs_f64();
    }
    stats.decode_secs = t1.elapsed().as_secs_f64();
    Ok(SpecGeneration {
        tokens: out,
        stats,
        target_cache,
        draft_caches,
    })
}
