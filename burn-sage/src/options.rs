//! Options of the op and the plan derived from them and the input shapes.

use burn::tensor::DType;

/// How Q and K are quantized for the integer `QKᵀ`.
///
/// A *group* is a set of rows (tokens) that share one scale `max|x| / qmax`. Groups are laid
/// out per block of `block` rows; inside a block, rows `r` with the same `r mod interleave`
/// form one group. `interleave = 1` is one scale per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QkQuant {
    /// INT8, one scale per block: Q blocks of 128 rows, K blocks of 64 (SageAttention 1).
    Int8PerBlock,
    /// INT8, Q one scale per 32 rows (a warp's tile), K per 64-row block.
    #[default]
    Int8PerWarp,
    /// INT8 with the granularity of an mma fragment: in each 16-row Q tile the rows `r` and
    /// `r + 8` share a scale; in each 64-key K block the keys with equal `key mod 8` do.
    Int8PerThread,
    /// INT4 (values in `[-7, 7]`) with the per-thread granularity.
    Int4PerThread,
}

/// Rows per group layout: `(block, interleave)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupLayout {
    pub block: usize,
    pub interleave: usize,
}

impl GroupLayout {
    /// Groups for `rows` rows.
    pub fn groups(&self, rows: usize) -> usize {
        rows.div_ceil(self.block) * self.interleave
    }

    /// The group of row `r`.
    pub fn group_of(&self, r: usize) -> usize {
        (r / self.block) * self.interleave + (r % self.block) % self.interleave
    }
}

impl QkQuant {
    pub fn q_layout(self) -> GroupLayout {
        match self {
            Self::Int8PerBlock => GroupLayout {
                block: 128,
                interleave: 1,
            },
            Self::Int8PerWarp => GroupLayout {
                block: 32,
                interleave: 1,
            },
            Self::Int8PerThread | Self::Int4PerThread => GroupLayout {
                block: 16,
                interleave: 8,
            },
        }
    }

    pub fn k_layout(self) -> GroupLayout {
        match self {
            Self::Int8PerBlock | Self::Int8PerWarp => GroupLayout {
                block: 64,
                interleave: 1,
            },
            Self::Int8PerThread | Self::Int4PerThread => GroupLayout {
                block: 64,
                interleave: 8,
            },
        }
    }

    /// Largest integer magnitude.
    pub fn qmax(self) -> f32 {
        match self {
            Self::Int4PerThread => 7.0,
            _ => 127.0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Int8PerBlock => "int8-block",
            Self::Int8PerWarp => "int8-warp",
            Self::Int8PerThread => "int8-thread",
            Self::Int4PerThread => "int4-thread",
        }
    }
}

/// Precision of the `P̃·V` product (always accumulated in f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PvPrecision {
    /// `P̃` and `V` rounded to f16 (bf16 for bf16 inputs).
    #[default]
    Fp16,
    /// `P̃·448` and `V / scale_c` rounded to FP8 E4M3, with a per-channel V scale
    /// `max_t |V[t, c]| / 448` applied in the epilogue; each KV tile's product is accumulated
    /// in a fresh buffer, then added into the f32 output accumulator (two-level accumulation).
    Fp8E4m3,
}

/// A float format as the kernels round to it: mantissa bits, smallest normal exponent, largest
/// finite value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grid {
    pub mantissa: u32,
    pub min_exp: i32,
    pub max: f32,
}

impl Grid {
    pub const F16: Grid = Grid {
        mantissa: 10,
        min_exp: -14,
        max: 65504.0,
    };
    pub const BF16: Grid = Grid {
        mantissa: 7,
        min_exp: -126,
        max: 3.389_531_4e38,
    };
    pub const E4M3: Grid = Grid {
        mantissa: 3,
        min_exp: -6,
        max: 448.0,
    };

    /// Rounds `x` to the nearest value of the format (ties away from zero), saturating.
    pub fn round(&self, x: f32) -> f32 {
        let a = x.abs();
        if a == 0.0 || a.is_nan() {
            return x;
        }
        let e = a.log2().floor().max(self.min_exp as f32);
        let step = (e - self.mantissa as f32).exp2();
        ((a / step + 0.5).floor() * step).min(self.max).copysign(x)
    }
}

/// Options of [`sage_attention`](crate::sage_attention).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SageOptions {
    /// Causal mask aligned bottom-right: query `i` of `q_len` sees keys `j ≤ i + kv_len − q_len`
    /// (needs `q_len ≤ kv_len`).
    pub causal: bool,
    /// Softmax scale; `None` is `1/√head_dim`.
    pub scale: Option<f32>,
    pub qk: QkQuant,
    pub pv: PvPrecision,
    /// Subtract the mean of K over tokens (per batch and KV head) before quantizing; softmax is
    /// invariant to it.
    pub smooth_k: bool,
    /// Subtract the mean of each block of `q_smooth_block` queries before quantizing and add
    /// back `ΔS = mean(Q_block)·Kᵀ` in full precision.
    pub smooth_q: bool,
    /// Also return the log-sum-exp of each query row's scaled scores (natural log).
    pub return_lse: bool,
    /// The attention kernel to run on a `CubeBackend`; `None` picks the fastest the runtime
    /// has for the plan, timed at each shape's first launch where there are several (see
    /// [`crate::kernels::choose`]). A kernel the runtime or the configuration does not allow
    /// runs the reference instead, with a log line.
    pub kernel: Option<crate::kernels::KernelChoice>,
}

impl Default for SageOptions {
    fn default() -> Self {
        Self {
            causal: false,
            scale: None,
            qk: QkQuant::default(),
            pv: PvPrecision::default(),
            smooth_k: true,
            smooth_q: false,
            return_lse: false,
            kernel: None,
        }
    }
}

/// Queries per Q-smoothing block (the paper's Q block).
pub const Q_SMOOTH_BLOCK: usize = 128;

/// Everything the forward needs, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct SagePlan {
    pub opts: SageOptions,
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub head_dim: usize,
    pub dtype: DType,
    /// The softmax scale actually used.
    pub scale: f32,
}

impl SagePlan {
    pub fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// The grid `P̃` and `V` are rounded to.
    pub fn pv_grid(&self) -> Grid {
        match (self.opts.pv, self.dtype) {
            (PvPrecision::Fp8E4m3, _) => Grid::E4M3,
            (PvPrecision::Fp16, DType::BF16) => Grid::BF16,
            (PvPrecision::Fp16, _) => Grid::F16,
        }
    }

    /// Scale `P̃` is multiplied by before rounding (and divided by in the epilogue).
    pub fn p_scale(&self) -> f32 {
        match self.opts.pv {
            PvPrecision::Fp8E4m3 => 448.0,
            PvPrecision::Fp16 => 1.0,
        }
    }

    /// Rows per Q mean block (the whole sequence when Q is not smoothed).
    pub fn q_mean_block(&self) -> usize {
        if self.opts.smooth_q {
            Q_SMOOTH_BLOCK
        } else {
            self.q_len
        }
    }
}
