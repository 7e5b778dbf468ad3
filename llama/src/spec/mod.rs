//! Multi-draft speculative decoding with a target [`Llama`](crate::model::Llama) and one or more draft [`Llama`](crate::model::Llama)s
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
//! Why K rows rather than one flattened token tree: [`Llama::forward`](crate::model::Llama::forward) gives the tokens of a
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
//! [`Llama::forward`](crate::model::Llama::forward) a `left_pad` such that each row's first real token lands at the row's own
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

mod block;
mod cache;
mod decode;
mod draft;
pub mod graph;
mod rows;

pub use cache::*;
pub use decode::*;
pub use draft::*;
pub use rows::forward_rows;

use burn_kernels_core::SamplingConfig;
use burn_specdec::{Scheme, SpecDecError};

/// Bad configuration or a failed verification.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    /// A model's forward pass failed (positions past its context, a cache that could not
    /// attend).
    #[error(transparent)]
    Forward(#[from] crate::model::ForwardError),
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
    /// The captured path ([`graph::speculative_generate_captured`]) cannot run this
    /// configuration.
    #[error("captured speculative decoding: {0}")]
    GraphUnsupported(String),
    /// The prompt and the new tokens exceed a model's context, or the device failed (as plain
    /// generation reports it).
    #[error(transparent)]
    Generate(#[from] crate::generate::GenerateError),
    /// The verification scheme rejected its inputs.
    #[error(transparent)]
    Verify(#[from] SpecDecError),
    /// Reading logits back from the device failed (on CUDA, for one, while another thread
    /// captures a graph: see [`crate::graph`]'s "Threads").
    #[error("reading the logits back from the device failed: {0}")]
    Read(String),
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
