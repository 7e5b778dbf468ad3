use thiserror::Error;

/// Invalid configuration of a burn-kvcache cache or op.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum KvCacheError {
    /// The SLERP interpolation factor `t` must lie in `[0, 1]`.
    #[error("interpolation t must be in [0, 1], got {0}")]
    InvalidInterpolation(f32),
    /// The retention threshold `gamma` (a normalized angle) must be finite and ≥ 0.
    #[error("retention threshold gamma must be finite and >= 0, got {0}")]
    InvalidGamma(f32),
    /// Only 2- and 4-bit codes are packed.
    #[error("bits must be 2 or 4, got {0}")]
    InvalidBits(u32),
    /// A quantization group needs at least one element.
    #[error("quantization group size must be >= 1")]
    ZeroGroupSize,
    /// The first merged layer must exist.
    #[error("start_layer {start_layer} is out of range for a model of {num_layers} layers")]
    StartLayerOutOfRange {
        start_layer: usize,
        num_layers: usize,
    },
    /// The full-precision window that batches merges needs at least one token.
    #[error("merge window must be >= 1")]
    ZeroMergeWindow,
    /// A cache needs at least one layer.
    #[error("a cache needs at least one layer")]
    NoLayers,
    /// Two tensors that must have one shape do not.
    #[error("shape mismatch: {left:?} vs {right:?}")]
    ShapeMismatch { left: Vec<usize>, right: Vec<usize> },
}
