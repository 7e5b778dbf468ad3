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
}
