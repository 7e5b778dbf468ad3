use thiserror::Error;

/// Invalid arguments to a burn-cce op.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum CceError {
    /// The reduction dimension does not exist.
    #[error("dimension {dim} is out of range for a tensor of rank {rank}")]
    DimOutOfRange { dim: usize, rank: usize },
    /// The reduced dimension has size 0, so the log-sum-exp is undefined.
    #[error("dimension {dim} of shape {shape:?} is empty")]
    EmptyDimension { dim: usize, shape: Vec<usize> },
    /// The softcap must be positive and finite.
    #[error("softcap must be positive and finite, got {0}")]
    InvalidSoftcap(f32),
    /// Embeddings and classifier disagree on the hidden size `D`.
    #[error("embeddings have hidden size {embeddings} but the classifier rows have {classifier}")]
    HiddenSizeMismatch {
        embeddings: usize,
        classifier: usize,
    },
    /// The targets do not have the embeddings' leading shape.
    #[error("targets of shape {targets:?} do not match embeddings of shape {embeddings:?}")]
    TargetShapeMismatch {
        targets: Vec<usize>,
        embeddings: Vec<usize>,
    },
    /// The bias is not a vector of one entry per vocabulary row.
    #[error("bias of shape {bias:?} does not match a vocabulary of {vocab}")]
    BiasShapeMismatch { bias: Vec<usize>, vocab: usize },
    /// A target that is not `ignore_index` lies outside `[0, V)`.
    #[error(
        "target {value} at flat position {position} is outside [0, {vocab}) and is not the ignore index"
    )]
    TargetOutOfRange {
        position: usize,
        value: i64,
        vocab: usize,
    },
    /// The classifier has no rows.
    #[error("the classifier has an empty vocabulary")]
    EmptyVocabulary,
    /// The gradient filter threshold is negative or not finite.
    #[error("filter_eps must be finite and ≥ 0, got {0}")]
    InvalidFilterEps(f32),
}
