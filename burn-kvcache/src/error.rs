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
    /// ShadowKV chunks need at least one token.
    #[error("ShadowKV chunk size must be >= 1")]
    ZeroChunk,
    /// The low-rank key factor needs a rank of at least 1.
    #[error("ShadowKV rank must be >= 1")]
    ZeroRank,
    /// The rank of the key SVD cannot exceed the width of the reshaped keys.
    #[error("ShadowKV rank {rank} exceeds kv_heads x head_dim = {max}")]
    RankTooLarge { rank: usize, max: usize },
    /// The local window must hold at least one chunk.
    #[error("ShadowKV needs at least one local chunk")]
    ZeroLocalWindow,
    /// The sparse budget must cover at least the local window.
    #[error("ShadowKV budget {budget} is below the local window of {local} tokens")]
    BudgetBelowLocalWindow { budget: usize, local: usize },
    /// The sparse budget is counted in whole chunks.
    #[error("ShadowKV budget {budget} is not a multiple of the chunk size {chunk}")]
    BudgetNotChunkMultiple { budget: usize, chunk: usize },
    /// Rotary embeddings pair the two halves of a head.
    #[error("head_dim must be even for RoPE, got {0}")]
    OddHeadDim(usize),
    /// A model needs at least one KV head.
    #[error("a cache needs at least one KV head")]
    NoKvHeads,
    /// The cache kind needs the model's shape (heads, head_dim, RoPE), not just its depth.
    #[error("the {0} cache needs the model's shape: build it from the model config")]
    NeedsModelShape(&'static str),
    /// The tables must be f32 and the two factors one dtype.
    #[error("dtype mismatch: cos/sin must be f32 and both factors one float dtype")]
    DTypeMismatch,
    /// An op input that must be f32 (named) is not.
    #[error("{0} must be f32")]
    NotF32(&'static str),
    /// A layer index past the model's layers.
    #[error("layer {layer} is out of range for a cache of {num_layers} layers")]
    LayerOutOfRange { layer: usize, num_layers: usize },
    /// A prompt can only be compressed into a layer that holds nothing yet.
    #[error("layer {0} already holds positions")]
    LayerNotEmpty(usize),
}
