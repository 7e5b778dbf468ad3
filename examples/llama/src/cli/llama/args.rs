//! `llama`'s command line: the subcommands, the options they share, and the KV-cache and
//! speculative-decoding option groups.

use std::path::PathBuf;

use burn_kvcache::{ChunkScoring, MiniCacheConfig, QuantConfig, ShadowKvConfig};
use burn_llama::attention::AttentionName;
use burn_llama::eval::{CacheKind, CacheSpec};
use burn_llama::graph::DecodeMode;
use burn_sage::adaptive::DEFAULT_INT4_THRESHOLD;
use burn_specdec::Scheme;
use clap::{Args, Parser, Subcommand, ValueEnum};

use super::super::{BackendArg, DTypeArg};

/// How the layer's small ops run (`--ops`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(super) enum OpsArg {
    /// One CubeCL kernel per op (burn-kernels-core's `FusedLayers`).
    Fused,
    /// Burn tensor ops.
    Tensor,
}

#[derive(Debug, Args)]
pub(super) struct Common {
    /// A .gguf file or an HF directory (config.json, model.safetensors, tokenizer.json).
    /// Default: the SmolLM2-135M-Instruct GGUF that `cargo xtask fetch-model` caches.
    #[arg(long)]
    pub(super) model: Option<PathBuf>,
    /// Where to run: cpu (Burn's Flex backend), vulkan, wgpu or cuda.
    #[arg(long, value_enum, default_value = "cpu")]
    pub(super) backend: BackendArg,
    /// Weight and activation dtype. Default: bf16 on CUDA (SmolLM2's own dtype, half of
    /// f32's bytes), f32 elsewhere.
    #[arg(long, value_enum)]
    pub(super) dtype: Option<DTypeArg>,
    /// Attention implementation (the Sage variants are burn-sage's SageAttention2; on the CPU
    /// they run their tensor-op reference, with the kernels' rounding). Default: the fastest
    /// exact one, `decode` on a GPU backend, `reference` on the CPU.
    #[arg(long, value_enum)]
    pub(super) attention: Option<AttentionName>,
    /// The layer's RMSNorms, RoPE and SwiGLU gate: one kernel each (`fused`, burn-kernels-core's
    /// fused layer ops; inference only) or Burn tensor ops (`tensor`). Default: `fused` on a GPU
    /// backend, `tensor` on the CPU.
    #[arg(long, value_enum)]
    pub(super) ops: Option<OpsArg>,
    /// Same as `--ops fused` (kept for older command lines).
    #[arg(long, hide = true)]
    pub(super) fused_ops: bool,
    /// sage-adaptive: a layer keeps INT4 where cos_sim·(1 − rel_l1) of its INT4 output against
    /// exact attention reaches this.
    #[arg(long, default_value_t = DEFAULT_INT4_THRESHOLD)]
    pub(super) int4_threshold: f64,
}

impl Common {
    /// `--dtype`, or the backend's default: bf16 on CUDA, f32 elsewhere.
    pub(super) fn dtype(&self) -> burn::tensor::DType {
        match (self.dtype, self.backend) {
            (Some(d), _) => d.into(),
            (None, BackendArg::Cuda) => burn::tensor::DType::BF16,
            (None, _) => burn::tensor::DType::F32,
        }
    }
}

/// KV-cache compression (burn-kvcache).
#[derive(Debug, Args)]
pub(super) struct KvArgs {
    /// KV cache (burn-kvcache). For `perplexity`, giving it scores the second half of the text
    /// in decode steps through that cache.
    #[arg(long, value_enum)]
    pub(super) kv_cache: Option<CacheKind>,
    /// MiniCache: first merged layer (default: num_layers / 2).
    #[arg(long)]
    pub(super) kv_start_layer: Option<usize>,
    /// MiniCache: SLERP interpolation t in [0, 1].
    #[arg(long, default_value_t = 0.6)]
    pub(super) kv_t: f32,
    /// MiniCache: retention threshold on the normalized angle θ/π.
    #[arg(long, default_value_t = 0.05)]
    pub(super) kv_gamma: f32,
    /// MiniCache: positions held full before a merge.
    #[arg(long, default_value_t = 16)]
    pub(super) kv_window: usize,
    /// Quantization bits (2 or 4), overriding the cache name's.
    #[arg(long)]
    pub(super) kv_bits: Option<u32>,
    /// Quantization group size.
    #[arg(long, default_value_t = 32)]
    pub(super) kv_group: usize,
    /// Most recent tokens kept in full precision by the quantized caches.
    #[arg(long, default_value_t = 32)]
    pub(super) kv_residual: usize,
    /// perplexity --kv-cache: tokens prefilled before scoring (default: half the text).
    #[arg(long)]
    pub(super) kv_prefix: Option<usize>,
    /// ShadowKV: rank of the pre-RoPE key factorization.
    #[arg(long, default_value_t = ShadowKvConfig::default().rank)]
    pub(super) rank: usize,
    /// ShadowKV: tokens selected per decode step and KV head (a multiple of --kv-chunk).
    #[arg(long, default_value_t = ShadowKvConfig::default().budget)]
    pub(super) budget: usize,
    /// ShadowKV: tokens per chunk.
    #[arg(long, default_value_t = ShadowKvConfig::default().chunk)]
    pub(super) kv_chunk: usize,
    /// ShadowKV: chunks at the end of the prompt kept exactly.
    #[arg(long, default_value_t = ShadowKvConfig::default().local_chunks)]
    pub(super) kv_local_chunks: usize,
    /// ShadowKV: outlier chunks per KV head kept exactly.
    #[arg(long, default_value_t = ShadowKvConfig::default().outlier_chunks)]
    pub(super) kv_outlier_chunks: usize,
    /// ShadowKV: how a decode step scores the chunks it selects.
    #[arg(long, value_enum, default_value_t = ChunkScoring::default())]
    pub(super) kv_scoring: ChunkScoring,
    /// ShadowKV: candidate chunks per selected chunk for two-stage selection (1: off).
    #[arg(long, default_value_t = ShadowKvConfig::default().candidates)]
    pub(super) kv_candidates: usize,
    /// ShadowKV: prompts shorter than this keep the full cache.
    #[arg(long, default_value_t = ShadowKvConfig::default().min_prompt)]
    pub(super) kv_min_prompt: usize,
}

impl KvArgs {
    pub(super) fn spec(&self) -> Result<CacheSpec, String> {
        let kind = self.kv_cache.unwrap_or(CacheKind::Full);
        Ok(CacheSpec {
            kind,
            minicache: MiniCacheConfig {
                start_layer: self.kv_start_layer,
                t: self.kv_t,
                gamma: self.kv_gamma,
                window: self.kv_window,
            },
            quant: QuantConfig {
                bits: 4,
                group_size: self.kv_group,
                residual: self.kv_residual,
                ..QuantConfig::default()
            },
            bits_override: self.kv_bits,
            shadowkv: ShadowKvConfig {
                rank: self.rank,
                chunk: self.kv_chunk,
                budget: self.budget,
                local_chunks: self.kv_local_chunks,
                outlier_chunks: self.kv_outlier_chunks,
                min_prompt: self.kv_min_prompt,
                scoring: self.kv_scoring,
                candidates: self.kv_candidates,
                pinned_uploads: true,
                reuse_min_percent: ShadowKvConfig::default().reuse_min_percent,
            },
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(super) enum SpecScheme {
    /// Single-draft speculative sampling (K = 1).
    Sd,
    Specinfer,
    Spectr,
    /// Sequential importance-sampling selection (closed-form weights), then single-draft SD.
    Is,
    /// The paper's weighted importance sampling: selection with its LP's weights, then
    /// single-draft SD against the selection's law.
    Wis,
    /// LP-optimal coupling (default truncation).
    Optimal,
}

impl SpecScheme {
    pub(super) fn scheme(self) -> Scheme {
        match self {
            Self::Sd => Scheme::SingleDraft,
            Self::Specinfer => Scheme::SpecInfer,
            Self::Spectr => Scheme::SpecTr,
            Self::Is => Scheme::SequentialImportance,
            Self::Wis => Scheme::WEIGHTED_IMPORTANCE,
            Self::Optimal => Scheme::OPTIMAL,
        }
    }
}

/// Speculative decoding (off unless --spec is given).
#[derive(Debug, Args)]
pub(super) struct SpecArgs {
    /// Verification scheme; enables speculative decoding.
    #[arg(long, value_enum)]
    pub(super) spec: Option<SpecScheme>,
    /// Number of drafts K per step (1 with a compressed --kv-cache, which has no draft
    /// branches and rolls rejected tokens back by truncation).
    #[arg(long, default_value_t = 1)]
    pub(super) drafts: usize,
    /// Draft length L (tokens per draft per step).
    #[arg(long, default_value_t = 4)]
    pub(super) draft_len: usize,
    /// A separate draft model (same tokenizer): a .gguf, an HF folder, or a `finetune` run
    /// folder (e.g. a distilled draft); default: the first --draft-layers layers of the target.
    #[arg(long)]
    pub(super) draft_model: Option<PathBuf>,
    /// Layers of the truncated-layer draft (without --draft-model).
    #[arg(long, default_value_t = 8)]
    pub(super) draft_layers: usize,
    /// Draft sampling temperature: one value for all drafts, or one per draft (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1.0")]
    pub(super) draft_temperature: Vec<f32>,
    /// The first draft is prompt lookup (copies what followed an earlier occurrence of the last
    /// 1-3 tokens; no model, no forward passes); the other K − 1 drafts are models.
    #[arg(long)]
    pub(super) lookup_draft: bool,
}

#[derive(Debug, Subcommand)]
pub(super) enum Cmd {
    /// Generate a continuation (or a chat answer) and stream it to stdout.
    Generate(GenerateArgs),
    /// Perplexity of a text file.
    Perplexity {
        #[command(flatten)]
        common: Common,
        #[arg(long)]
        text: PathBuf,
        #[command(flatten)]
        kv: KvArgs,
    },
}

#[derive(Debug, Parser)]
#[command(about = "Llama-architecture inference with Burn")]
pub(super) struct Cli {
    #[command(subcommand)]
    pub(super) cmd: Cmd,
}

/// `llama generate`'s arguments.
#[derive(Debug, Args)]
pub(super) struct GenerateArgs {
    #[command(flatten)]
    pub(super) common: Common,
    #[arg(long)]
    pub(super) prompt: String,
    /// Wrap the prompt in the model's chat template.
    #[arg(long)]
    pub(super) chat: bool,
    #[arg(long, default_value_t = 64)]
    pub(super) max_new_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub(super) temperature: f32,
    #[arg(long)]
    pub(super) top_k: Option<usize>,
    #[arg(long)]
    pub(super) top_p: Option<f32>,
    #[arg(long, default_value_t = 0)]
    pub(super) seed: u64,
    /// Decode steps: `graph` captures one step and replays it (a CUDA graph on CUDA; other
    /// backends re-run it), `eager` runs every op of every step. `graph` needs the full KV
    /// cache, and with --spec model drafts only (no --lookup-draft); otherwise decoding is
    /// eager.
    #[arg(long, value_enum, default_value = "graph")]
    pub(super) decode: DecodeMode,
    #[command(flatten)]
    pub(super) spec: SpecArgs,
    #[command(flatten)]
    pub(super) kv: KvArgs,
}
