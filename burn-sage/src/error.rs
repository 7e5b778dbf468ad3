use burn::tensor::DType;
use thiserror::Error;

/// Invalid arguments to [`sage_attention`](crate::sage_attention).
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SageError {
    /// Q, K and V must be `[batch, heads, seq, head_dim]`.
    #[error("{name} has rank {rank}; Sage attention takes [batch, heads, seq, head_dim] (rank 4)")]
    Rank { name: &'static str, rank: usize },
    /// Q, K and V disagree on the batch size.
    #[error("batch sizes differ: q {q}, k {k}, v {v}")]
    BatchMismatch { q: usize, k: usize, v: usize },
    /// Q and K (or K and V) disagree on the head dimension.
    #[error("head dims differ: q {q}, k {k}, v {v}")]
    HeadDimMismatch { q: usize, k: usize, v: usize },
    /// K and V disagree on the number of heads or positions.
    #[error("k is {k:?} but v is {v:?}: keys and values need the same heads and positions")]
    KvShapeMismatch { k: [usize; 4], v: [usize; 4] },
    /// GQA needs the query heads to be a multiple of the KV heads.
    #[error("{kv_heads} kv heads do not divide {q_heads} query heads")]
    KvHeadsNotDividing { q_heads: usize, kv_heads: usize },
    /// Q, K and V must share one float dtype (f16, bf16 or f32).
    #[error("dtypes must be one of f16/bf16/f32 and equal: q {q:?}, k {k:?}, v {v:?}")]
    DtypeMismatch { q: DType, k: DType, v: DType },
    /// Some dimension is zero.
    #[error("empty input: q {q:?}, k {k:?}")]
    Empty { q: [usize; 4], k: [usize; 4] },
    /// Bottom-right causal masking with more queries than keys leaves the first queries with no
    /// key to attend to.
    #[error("causal attention needs q_len ≤ kv_len (bottom-right aligned), got {q_len} > {kv_len}")]
    CausalQueryLongerThanKeys { q_len: usize, kv_len: usize },
    /// The softmax scale must be positive and finite.
    #[error("softmax scale must be positive and finite, got {0}")]
    InvalidScale(f32),
}

/// Why no kernel runs a configuration (the op then runs the tensor-op reference, with a log
/// line on a CubeCL device).
#[derive(Debug, Clone, PartialEq, Error)]
pub enum Unsupported {
    /// The device is not a CubeCL device of a runtime this build enables (the crate's `cuda`,
    /// `vulkan` or `wgpu` feature).
    #[error("the device runs no kernels in this build")]
    NoKernels,
    /// The device has autodiff; the kernels have no backward.
    #[error("the device has autodiff and the kernels have no backward")]
    Autodiff,
    /// The runtime cannot store the quantized integers.
    #[error("the runtime has no {0:?} buffers")]
    Dtype(DType),
    /// The runtime has no integer (i8·i8→i32) or f16 matrix-multiply units of the needed shape.
    #[error("the runtime has no {0} matrix units (cmma 16×16×16)")]
    MatrixUnits(&'static str),
    /// The portable kernel is not used past [`crate::kernels::UNIT_MAX_KV`] keys (its loop over
    /// keys would run past [`crate::kernels::LOOP_BUDGET`] iterations).
    #[error("kv length {0} is above the portable kernel's {max} keys", max = crate::kernels::UNIT_MAX_KV)]
    UnitKernelLength(usize),
    /// The runtime has no manual (register-level) MMA of the needed shape.
    #[error("the runtime has no {0} manual matrix-multiply (mma.sync)")]
    ManualMma(&'static str),
    /// A kernel was asked for (`SageOptions::kernel`) that does not take this configuration.
    #[error("the {0:?} kernel does not take head dim {1}")]
    KernelHeadDim(crate::kernels::KernelChoice, usize),
    /// Head dims above 256 are not compiled.
    #[error("head dim {0} is above the kernels' 256")]
    HeadDim(usize),
}
