//! Typed errors of the verification schemes.

use std::fmt;

/// Names one of the input distributions in an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DistributionId {
    /// The target distribution `p`.
    Target,
    /// The draft distribution `q_k` (0-based `k`).
    Draft(usize),
}

impl fmt::Display for DistributionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Target => write!(f, "target distribution p"),
            Self::Draft(k) => write!(f, "draft distribution q_{k}"),
        }
    }
}

/// Everything that can go wrong when preparing or running a verification scheme.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SpecDecError {
    /// No draft distribution was given (K = 0).
    #[error("at least one draft is required (K = 0)")]
    NoDrafts,
    /// The target distribution has no entries.
    #[error("the target distribution is empty")]
    EmptyVocabulary,
    /// A draft distribution does not have the target's vocabulary size.
    #[error("{which} has {found} entries but the target has {expected}")]
    VocabularyMismatch {
        /// The offending distribution.
        which: DistributionId,
        /// The target's vocabulary size.
        expected: usize,
        /// The offending distribution's length.
        found: usize,
    },
    /// A probability is NaN or infinite.
    #[error("{which}[{index}] = {value} is not finite")]
    NonFinite {
        /// The offending distribution.
        which: DistributionId,
        /// Index of the entry.
        index: usize,
        /// The entry, widened to `f64`.
        value: f64,
    },
    /// A probability is negative.
    #[error("{which}[{index}] = {value} is negative")]
    Negative {
        /// The offending distribution.
        which: DistributionId,
        /// Index of the entry.
        index: usize,
        /// The entry, widened to `f64`.
        value: f64,
    },
    /// The entries sum to zero (or overflow), so the row cannot be normalised.
    #[error("{which} cannot be normalised (sum = {sum})")]
    NotNormalisable {
        /// The offending distribution.
        which: DistributionId,
        /// The sum of its entries.
        sum: f64,
    },
    /// The number of drafted tokens differs from the number of draft distributions.
    #[error("{drafts} drafted tokens given for {distributions} draft distributions")]
    DraftCountMismatch {
        /// Number of drafted tokens.
        drafts: usize,
        /// Number of draft distributions (K).
        distributions: usize,
    },
    /// A drafted token is not in the vocabulary.
    #[error("draft {draft}: token {token} is outside the vocabulary of size {vocab}")]
    TokenOutOfRange {
        /// Draft index k.
        draft: usize,
        /// The drafted token.
        token: usize,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A drafted token has probability zero under the distribution it was drafted from.
    #[error("draft {draft}: token {token} has probability zero under q_{draft}")]
    ZeroDraftProbability {
        /// Draft index k.
        draft: usize,
        /// The drafted token.
        token: usize,
    },
    /// The caller supplied the wrong number of uniforms (see [`crate::uniforms_per_token`]).
    #[error("{expected} uniforms are consumed per token, {got} were given")]
    UniformCount {
        /// `K + 2`.
        expected: usize,
        /// Length of the given slice.
        got: usize,
    },
    /// A supplied uniform is NaN or outside `[0, 1)`.
    #[error("uniform #{index} = {value} is outside [0, 1)")]
    UniformOutOfRange {
        /// Index in the uniform slice.
        index: usize,
        /// The value.
        value: f64,
    },
    /// [`crate::Scheme::SingleDraft`] was asked to verify K != 1 drafts.
    #[error("single-draft speculative sampling needs exactly one draft, got {drafts}")]
    SingleDraftOnly {
        /// The number of drafts given.
        drafts: usize,
    },
    /// The drafts of a block do not all have the same length.
    #[error("draft {draft} has {found} tokens, draft 0 has {expected}")]
    DraftLengthMismatch {
        /// Draft index k.
        draft: usize,
        /// Length of draft 0.
        expected: usize,
        /// Length of draft k.
        found: usize,
    },
    /// The LP solver failed on the (truncated) optimal-coupling program.
    #[error("the optimal-coupling linear program failed: {0}")]
    Lp(String),
    /// The scheme has no device kernel (the LP-optimal scheme is host-only); verify on the host
    /// with [`crate::verify_block`] instead.
    #[error("the {} scheme has no device kernel; verify it on the host", .scheme.name())]
    UnsupportedOnDevice {
        /// The requested scheme.
        scheme: crate::Scheme,
    },
    /// The tensors given to [`crate::device::verify_blocks`] live on a device that runs no kernel
    /// of this crate (not a CubeCL device of a runtime this build enables, or a device with
    /// autodiff: the kernel is forward only). There is no tensor-op fallback for this op;
    /// verify on the host with [`crate::verify_block`] instead.
    #[error("{device} runs no block-verification kernel ({reason}); verify on the host")]
    NoDeviceKernel {
        /// The tensors' device (its `Debug` form).
        device: String,
        /// Why it runs no kernel.
        reason: &'static str,
    },
    /// The scheme's device kernel is not trusted at this vocabulary size (importance sampling
    /// above [`crate::device::IS_MAX_VOCAB`]: wrong tokens were observed on lavapipe at larger
    /// V and the cause is not understood); verify on the host with [`crate::verify_block`].
    #[error(
        "the {} device kernel supports vocabularies up to {max} (got {vocab}); verify it on the host",
        .scheme.name()
    )]
    DeviceVocabTooLarge {
        /// The requested scheme.
        scheme: crate::Scheme,
        /// V.
        vocab: usize,
        /// The largest V the kernel runs.
        max: usize,
    },
    /// A tensor given to [`crate::device::verify_blocks`] does not have the shape the other
    /// inputs imply.
    #[error("{tensor} has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        /// Which input.
        tensor: &'static str,
        /// The shape implied by `target_probs` and `drafts`.
        expected: Vec<usize>,
        /// The given shape.
        found: Vec<usize>,
    },
    /// A [`crate::PromptLookup`] n-gram range that is empty or starts at 0.
    #[error("prompt lookup needs 1 <= min_ngram <= max_ngram, got {min}..={max}")]
    NgramRange {
        /// The shortest n-gram.
        min: usize,
        /// The longest n-gram.
        max: usize,
    },
    /// An exact enumeration (draft tuples, alphabet subsets) would be too large.
    #[error("exact {what} would visit {needed} items, more than the limit {limit}")]
    TooLarge {
        /// What would be enumerated.
        what: &'static str,
        /// How many items it would visit.
        needed: u128,
        /// The limit.
        limit: u128,
    },
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, SpecDecError>;
