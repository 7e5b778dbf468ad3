//! Options of [`crate::linear_cross_entropy`] and the resolved parameters the backends see.

use burn::tensor::DType;
pub use burn_kernels_core::gemm::GemmKernel;

/// How per-token losses are combined.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Reduction {
    /// Mean over the tokens that are not ignored; 0 when every token is ignored.
    #[default]
    Mean,
    /// Sum over the tokens that are not ignored.
    Sum,
    /// One loss per token, 0 at ignored tokens, in the targets' flattened order.
    None,
}

/// Gradient filtering: vocabulary entries whose `|softmax − onehot|` stays below the threshold
/// for every token are left out of the backward pass.
///
/// The paper's threshold, `eps(dtype) / 32`, drops contributions that a gradient accumulated in
/// that 16-bit dtype could not hold anyway. Where 16-bit inputs accumulate the gradient in f32
/// ([`CceOptions::accum_fp32`], the default) they are not lost, and leaving
/// them out biases training: SmolLM2-135M fine-tuned in bf16 on Shakespeare (60 steps, real
/// weights, H200) ended 2.6% above the f32 run's validation perplexity with the paper's 2⁻¹²
/// and 0.4–0.5% above it with no filter or 2⁻¹⁶, at no cost in time (148 ms a step unfiltered,
/// 154 ms filtered at 2⁻¹², 175 ms at 2⁻¹⁶: on a trained model's logits few entries stay
/// below the threshold for every token of a chunk). Hence [`FilterEps::Auto`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum FilterEps {
    /// The paper's threshold where the gradient accumulates in the inputs' dtype (f32 inputs:
    /// 2⁻²⁸; 16-bit inputs with `accum_fp32` off: 2⁻¹² for bf16, 2⁻¹⁵ for f16); no filtering
    /// where 16-bit inputs accumulate in f32.
    #[default]
    Auto,
    /// The paper's threshold `eps(dtype) / 32` whatever the accumulation: 2⁻¹² for bf16, 2⁻¹⁵
    /// for f16, 2⁻²⁸ for f32.
    Paper,
    /// An explicit threshold (finite, ≥ 0; 0 filters nothing).
    Value(f32),
    /// No filtering: the gradient is exact within the dtype's rounding.
    Off,
}

impl FilterEps {
    /// The threshold for inputs of `dtype` (the gradient accumulated in f32 when
    /// `accum_fp32`), `None` when filtering is off.
    pub fn resolve(self, dtype: DType, accum_fp32: bool) -> Option<f32> {
        let sixteen_bit = matches!(dtype, DType::BF16 | DType::F16);
        match self {
            FilterEps::Auto if sixteen_bit && accum_fp32 => None,
            FilterEps::Auto | FilterEps::Paper => Some(dtype_epsilon(dtype) / 32.0),
            FilterEps::Value(v) if v > 0.0 => Some(v),
            FilterEps::Value(_) | FilterEps::Off => None,
        }
    }
}

/// Machine epsilon of a float dtype (f32's for anything else).
fn dtype_epsilon(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 2f32.powi(-7),
        DType::F16 => 2f32.powi(-10),
        DType::F64 => f64::EPSILON as f32,
        _ => f32::EPSILON,
    }
}

/// How the passes over the vocabulary run on a CubeCL device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum PassKernels {
    /// [`PassKernels::Fused`] where the device and the inputs allow it, else
    /// [`PassKernels::Chunked`] (the reason is logged at info level once per process).
    ///
    /// On an H100 at SmolLM2's shape (8192 tokens, bf16) the fused loss + gradient took 8.5 ms
    /// at 66 MB (1.00× dE + dC), the chunked passes' automatic blocks 42.2 ms at 212 MB and
    /// Burn's plain loss 9.6 ms (session 50), so the fused passes are the default where they
    /// run; Gemma-2's hidden size (2304) and devices before sm90 take the chunked passes.
    #[default]
    Auto,
    /// A GEMM into an f32 logits block and an epilogue kernel per chunk of the vocabulary.
    /// Where the GEMMs run on core's Hopper kernel (f16/bf16, sm90), the forward's and the
    /// scoring pass's reductions happen inside it instead, over chunks of
    /// [`crate::REDUCTION_CHUNK`] entries, and no logit of those passes is stored.
    ///
    /// dE accumulates in f32 (see [`CceOptions::accum_fp32`]). Works for every shape, dtype
    /// and option.
    Chunked,
    /// One kernel per pass; no logit is written (CUDA, f16/bf16, hidden sizes up to 576).
    ///
    /// The logits tile is computed and consumed on the matrix units (the paper's design). Where
    /// the embeddings are tracked by autodiff (training), the forward is one walk over the
    /// vocabulary owned by blocks of tokens that also sums dE for a unit loss gradient (an
    /// online softmax, as FlashAttention's forward), and the backward scales it by the loss
    /// gradient and walks once more, owned by blocks of vocabulary entries, for dC: two kernels
    /// in all, each holding its f32 accumulators in registers, nothing beyond dE and dC held.
    /// Otherwise the forward computes the log-sum-exp alone, and the backward op walks twice
    /// (dE, then dC). Runs for f16/bf16 inputs on a runtime with 16×8×16 manual MMA and bulk
    /// copies (CUDA, sm90 and later), hidden sizes that are a multiple of 64 up to 576 and no
    /// bias; elsewhere the chunked passes run, with a log line (once per reason;
    /// `burn_cce::kernels::fused::unsupported` says why).
    /// The gradient filter ([`CceOptions::filter_eps`]) applies per tile of 64 tokens × 64
    /// entries, as in Apple's kernels: a tile whose every `|softmax − onehot|` is below the
    /// threshold is left out of dC, and of dE where the backward op computes it (in training dE
    /// is summed before any tile's softmax is known, so it is exact).
    Fused,
}

/// How the chunked backward carries 16-bit dE from one vocabulary chunk to the next where
/// [`CceOptions::accum_fp32`] is on (each chunk's product is summed in f32 either way).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum DeCarry {
    /// [`DeCarry::Compensated`] where it can run and the f32 carry would take a second pass
    /// over the vocabulary, if the corrections leave chunks of at least 1024 entries (or the
    /// whole vocabulary); [`DeCarry::F32`] elsewhere. At Gemma-2's shape on an H200 (bf16,
    /// N = 8192, 2026-12-06, session 59, same run) loss + gradient took 86.6 ms compensated
    /// (peak 1.048× dE + dC) and 93.2 ms with the f32 carry (1.030×), since the compensated
    /// store reads and writes dE and its corrections 16 bytes at a time (before that, session
    /// 58 on an H100: 93.1 against 92.9 ms). At SmolLM2's shape the corrections leave chunks of
    /// 32 entries, which rewrite dE too often, so the f32 carry stays there.
    #[default]
    Auto,
    /// In f32: one accumulator for all of dE where it is small, otherwise (at a large vocabulary)
    /// one block of rows at a time in a second pass over the vocabulary, which recomputes each
    /// chunk's logits (`N·V·D` more multiply-adds).
    F32,
    /// In dE itself plus an 8-bit correction per value (`N·D` bytes), both updated as each
    /// chunk's product is stored by the Hopper GEMM
    /// (`burn_kernels_core::gemm::hopper::hopper_gemm_add_compensated`): about 16 significant
    /// bits carried between chunks (bf16 alone keeps 8), no second pass. bf16 inputs on the
    /// Hopper GEMM only; elsewhere [`DeCarry::F32`], with a log line. The corrections take
    /// their place in the working set, so where `N·D` is large beside `V·D` the chunks are
    /// narrow (automatic blocks at SmolLM2's shape, 8192 tokens: 32 entries) and every chunk
    /// rewrites all of dE: slow there.
    Compensated,
}

/// Options of [`crate::linear_cross_entropy`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CceOptions {
    /// Targets equal to this value are ignored (no loss, no gradient). Default −100.
    pub ignore_index: i64,
    /// Gemma-2 style logit soft-capping `c·tanh(x / c)`, `c > 0`.
    pub softcap: Option<f32>,
    /// How per-token losses are combined.
    pub reduction: Reduction,
    /// Next-token targets from the same sequence: position `t` is scored against target
    /// `t + 1` of its sequence, and the last position of each sequence is ignored.
    pub shift: bool,
    /// Gradient filtering threshold.
    pub filter_eps: FilterEps,
    /// Process the vocabulary entries that pass the filter gathered together (dense chunks),
    /// instead of skipping only whole chunks of the natural order that are entirely filtered.
    pub sort_vocab: bool,
    /// Accumulate dE across vocabulary chunks in f32 (default) instead of the input dtype (one
    /// rounding to f16/bf16 per processed chunk, so the error of dE grows with the number of
    /// chunks). dC needs no cross-chunk accumulation: each chunk's rows come from one GEMM with
    /// f32 accumulators. For 16-bit inputs an f32 accumulator for all of dE (`N·D·4` bytes) is
    /// kept only when it is no larger than one logits block; otherwise dE is accumulated in f32
    /// one block of rows at a time (see [`CceOptions::de_block_rows`]) in a second pass over the
    /// kept vocabulary, which recomputes those chunks' logits (one more GEMM over them).
    pub accum_fp32: bool,
    /// Also return the per-token log-sum-exp (f32, not differentiable).
    pub return_lse: bool,
    /// Bytes of one block of f32 logits (`N × chunk`): the vocabulary is processed in chunks of
    /// this size, so `N × V` is never held. `None` (default): automatic, see
    /// [`LceParams::grad_chunk_len`] and [`LceParams::chunk_len`]. `Some(bytes)` sets every
    /// pass.
    pub chunk_bytes: Option<usize>,
    /// Bytes of the forward's and the scoring pass's logits block where `chunk_bytes` is
    /// automatic. `None` (default): the size of dE + dC, within 32–128 MiB (see
    /// [`LceParams::chunk_len`]). Unused where those passes reduce inside the Hopper GEMM (see
    /// [`PassKernels::Chunked`]).
    pub pass_chunk_bytes: Option<usize>,
    /// Rows of dE per f32 block in the backward, at least 1. `None` (default): automatic from
    /// the logits block. With `accum_fp32` and 16-bit inputs, `Some(r)` with `r ≥ N` keeps one
    /// f32 accumulator for all of dE (`N·D·4` bytes, no second pass) and a smaller `r`
    /// accumulates blocks of `r` rows in a second pass; otherwise it sets the rows of each f32
    /// product `G·C_chunk` added into dE. Set, it implies [`DeCarry::F32`].
    pub de_block_rows: Option<usize>,
    /// How dE is carried between vocabulary chunks with `accum_fp32` (default automatic).
    pub de_carry: DeCarry,
    /// How the chunk GEMMs pick their kernel.
    pub gemm: GemmStrategy,
    /// For f32 inputs, run the chunk GEMMs of [`GemmStrategy::Fixed`] and
    /// [`GemmStrategy::Kernel`] on the tensor cores as TF32 (inputs rounded to a 10-bit
    /// mantissa, f32 accumulation), as Burn's own f32 matmul does on CUDA, instead of the
    /// exact CUDA-core kernel (H100, 2026-11-26: a fine-tuning step of an f32 SmolLM2 shape
    /// with CCE was 2.3× the plain loss's time with the exact kernel). Default `true`. No
    /// effect on f16/bf16 inputs, nor where the runtime has no tensor-core kernel (Vulkan on
    /// lavapipe: the exact kernel runs).
    pub tf32: bool,
    /// Fused passes where they run, else chunked (default), or either always.
    pub passes: PassKernels,
}

/// Kernel selection for the GEMMs that recompute and consume logit chunks.
///
/// Measured on an NVIDIA H100 (2026-11-25, bf16, N=8192, Gemma-2 shape V=256000, D=2304): the
/// gradient takes 107.9 ms with [`GemmStrategy::Fixed`] (cubek's specialized TMA kernel) and
/// 110.2 ms with [`GemmStrategy::Autotune`] once tuned, after 225 s of tuning. Tuning
/// benchmarks ~30 candidate kernels for every new GEMM shape, each compiled by the runtime
/// (seconds apiece on CUDA), and the backward meets new shapes as the filtered vocabulary
/// changes: at the SmolLM2 shape the first tuned gradient calls did not finish within minutes.
/// Hence the fixed default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GemmStrategy {
    /// No autotuning: [`GemmKernel::DEFAULT`] for f16/bf16 GEMMs whose dimensions are all
    /// ≥ 16 (and f32 ones as TF32 with [`CceOptions::tf32`]), a unit (CUDA-core) kernel
    /// otherwise — exact f32 — and Burn's autotuned matmul where neither can run.
    #[default]
    Fixed,
    /// As [`GemmStrategy::Fixed`] with the given tensor-core kernel (for comparing kernels).
    Kernel(GemmKernel),
    /// Burn's autotuned matmul (cubek) for every GEMM: faster at steady state, slow to warm up.
    /// On Burn 0.23.0-pre.1 it fails on Hopper at the Gemma-2 chunk shape (a TMA kernel the
    /// CUDA runtime refuses at launch, which leaves the output unwritten; H200, 2026-11-27).
    Autotune,
}

impl GemmStrategy {
    /// The fixed kernel this strategy runs the chunk GEMMs by (`None`: Burn's autotuned matmul).
    pub fn kernel(self) -> Option<GemmKernel> {
        match self {
            GemmStrategy::Fixed => Some(burn_kernels_core::gemm::default_kernel()),
            GemmStrategy::Kernel(kernel) => Some(kernel),
            GemmStrategy::Autotune => None,
        }
    }
}

impl Default for CceOptions {
    fn default() -> Self {
        Self {
            ignore_index: -100,
            softcap: None,
            reduction: Reduction::Mean,
            shift: false,
            filter_eps: FilterEps::Auto,
            sort_vocab: true,
            accum_fp32: true,
            return_lse: false,
            chunk_bytes: None,
            pass_chunk_bytes: None,
            de_block_rows: None,
            de_carry: DeCarry::Auto,
            gemm: GemmStrategy::Fixed,
            tf32: true,
            passes: PassKernels::Auto,
        }
    }
}

/// Bytes of the working blocks [`CceOptions::for_training`] sets.
pub const TRAINING_BLOCK_BYTES: usize = 256 << 20;

impl CceOptions {
    /// The defaults with every pass in blocks of [`TRAINING_BLOCK_BYTES`] (256 MiB of f32
    /// logits): for a training step, where the loss's working set is small beside the
    /// activations. The automatic sizes of [`CceOptions::default`] keep the backward within
    /// about 1.2× dE + dC (3% where the gradients are large, as at Gemma-2's shape) at the
    /// price of narrow chunks and many launches where they are small: SmolLM2-135M's loss at
    /// 8 × 2048 tokens then walks 384 chunks of 128 entries.
    ///
    /// Measured on an H200 (2026-11-30), a bf16 training step of SmolLM2-135M at 8 × 2048
    /// (recomputing attention), same run: 158.4 ms with the automatic sizes, 128.8 with 64 MiB
    /// blocks, 115.2 with 128 MiB, 112.1 with 256 MiB; Burn's plain loss 147.4 ms (min 130.5).
    /// The step's peak memory grew from 10.15 to 10.53 GB (plain: 14.84 GB).
    ///
    /// The blocks are the chunked passes'. Where the fused passes run (the default
    /// [`PassKernels::Auto`]: bf16/f16 on sm90, hidden sizes up to 576) they hold nothing
    /// beyond dE + dC: at the same step on an H100 they took 121.1 ms against the 256 MiB
    /// blocks' 120.0, with 32% less pool growth (session 50).
    pub fn for_training() -> Self {
        Self {
            chunk_bytes: Some(TRAINING_BLOCK_BYTES),
            ..Self::default()
        }
    }
}

/// The parameters the backend ops receive, after validation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LceParams {
    /// Soft-capping constant.
    pub softcap: Option<f32>,
    /// Resolved gradient filter threshold, `None` when off.
    pub filter_eps: Option<f32>,
    /// See [`CceOptions::sort_vocab`].
    pub sort_vocab: bool,
    /// See [`CceOptions::accum_fp32`].
    pub accum_fp32: bool,
    /// See [`CceOptions::chunk_bytes`].
    pub chunk_bytes: Option<usize>,
    /// See [`CceOptions::pass_chunk_bytes`].
    pub pass_chunk_bytes: Option<usize>,
    /// See [`CceOptions::de_block_rows`].
    pub de_block_rows: Option<usize>,
    /// See [`CceOptions::de_carry`].
    pub de_carry: DeCarry,
    /// See [`CceOptions::gemm`].
    pub gemm: GemmStrategy,
    /// See [`CceOptions::tf32`].
    pub tf32: bool,
    /// See [`CceOptions::passes`].
    pub passes: PassKernels,
}

impl CceOptions {
    /// The backend-op parameters these options give for inputs of `dtype`.
    pub fn params(&self, dtype: DType) -> LceParams {
        LceParams {
            softcap: self.softcap,
            filter_eps: self.filter_eps.resolve(dtype, self.accum_fp32),
            sort_vocab: self.sort_vocab,
            accum_fp32: self.accum_fp32,
            chunk_bytes: self.chunk_bytes,
            pass_chunk_bytes: self.pass_chunk_bytes,
            de_block_rows: self.de_block_rows,
            de_carry: self.de_carry,
            gemm: self.gemm,
            tf32: self.tf32,
            passes: self.passes,
        }
    }
}

/// Bounds of the forward's and the scoring pass's automatic logits block.
const PASS_BLOCK_MIN: usize = 32 << 20;
const PASS_BLOCK_MAX: usize = 128 << 20;
/// Share of the gradients' bytes (`dE + dC` in the input dtype) that the backward's working
/// set aims at when `chunk_bytes` is automatic.
const WORK_SHARE: f64 = 0.03;
/// Smallest automatic logits block, in f32 values: 2²¹ outputs are one wave of 128 × 128 GEMM
/// tiles on a 132-SM H100; smaller GEMMs leave the GPU partly idle.
const MIN_BLOCK_VALUES: usize = 1 << 21;
/// Smallest automatic chunk: narrower GEMMs (and the `chunk × D` dC GEMM) run inefficiently.
const MIN_CHUNK: usize = 256;

/// Entries per chunk for a logits block of `bytes`: a multiple of 32, at least 32, at most
/// `vocab`.
fn fit_chunk(bytes: usize, rows: usize, vocab: usize) -> usize {
    let fit = bytes / (rows.max(1) * 4);
    (fit / 32 * 32).max(32).min(vocab.max(1))
}

impl LceParams {
    /// Vocabulary entries per chunk of the forward and the backward's scoring pass for `rows`
    /// tokens, hidden size `d` and inputs of `dtype`: as many as fit `chunk_bytes`, a multiple
    /// of 32, at least 32, at most `vocab`.
    ///
    /// Automatic (`chunk_bytes` and `pass_chunk_bytes` unset): a block the size of the
    /// gradients, `s·(rows + vocab)·d` bytes, within 32–128 MiB, and at least 256 entries.
    /// These passes run while no gradient is held, so a block no larger than dE + dC leaves
    /// the backward's peak where it was, and larger blocks run the chunk GEMMs faster. NVIDIA
    /// H100, 2026-11-26, Gemma-2 shape (N = 8192, V = 256000, D = 2304, bf16): 128 MiB blocks
    /// (4096 entries) against 32 MiB took the loss from 47.7 to 42.0 ms and the backward's
    /// scoring pass from 58.3 to 43.0 ms, with the same live peak (1254 MB); 512 MiB blocks
    /// (39.8 ms) grew the memory pool's reservation by 5.3 GB.
    pub fn chunk_len(&self, rows: usize, vocab: usize, d: usize, dtype: DType) -> usize {
        let grads = dtype.size() * (rows.max(1) + vocab) * d;
        let auto = grads.clamp(PASS_BLOCK_MIN, PASS_BLOCK_MAX);
        match self.chunk_bytes {
            Some(bytes) => fit_chunk(bytes, rows, vocab),
            None => fit_chunk(self.pass_chunk_bytes.unwrap_or(auto), rows, vocab)
                .max(MIN_CHUNK)
                .min(vocab.max(1)),
        }
    }

    /// Vocabulary entries per chunk of the backward's gradient passes for `rows` tokens,
    /// hidden size `d` and inputs of `dtype`; `in_gemm`: `G` is written by the Hopper GEMM
    /// (see [`crate::diagnostics::BackwardBlocks::in_gemm`]), so no f32 logits are stored.
    ///
    /// With `chunk_bytes` set: [`LceParams::chunk_len`]. Automatic: the chunk whose working set
    /// — f32 logits (`4·rows`, unless `in_gemm`), `G` in the input dtype (`s·rows`) and the
    /// chunk's classifier rows (`s·d` bytes per entry, `s` the dtype's size) — is 3% of the
    /// gradients' bytes
    /// `s·(rows + vocab)·d`, rounded down to a multiple of 32, but at least 256 entries and
    /// 2²¹ logits (GEMMs that fill the GPU), at most `vocab`. For example 672 entries (22 MB
    /// of logits) at the Gemma-2 shape (8192 tokens, V = 256000, D = 2304, bf16), 1728 there
    /// `in_gemm`, and the 2²¹-logit floor, 256 entries, at SmolLM2's (V = 49152, D = 576).
    pub fn grad_chunk_len(
        &self,
        rows: usize,
        vocab: usize,
        d: usize,
        dtype: DType,
        in_gemm: bool,
    ) -> usize {
        if self.chunk_bytes.is_some() {
            return self.chunk_len(rows, vocab, d, dtype);
        }
        let (rows, s) = (rows.max(1), dtype.size());
        let bound = s * (rows + vocab) * d;
        let logits = if in_gemm { 0 } else { 4 };
        let per_entry = (logits + s) * rows + s * d;
        let share = (WORK_SHARE * bound as f64 / per_entry as f64) as usize / 32 * 32;
        let floor = MIN_CHUNK.max(MIN_BLOCK_VALUES.div_ceil(rows).next_multiple_of(32));
        share.max(floor).min(vocab.max(1))
    }
}
