//! `llama generate` and `llama perplexity` on CPU, Vulkan or CUDA.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use burn::tensor::{DType, Device};
use burn_llama::attention::{AttentionChoice, AttentionName};
use burn_llama::eval::{CacheKind, CacheSpec, full_kv_bytes, perplexity_with_cache};
use burn_llama::generate::{GenerateOptions, generate, perplexity};
use burn_llama::graph::{DecodeMode, generate_captured};
use burn_llama::loader::{default_model_path, load};
use burn_llama::model::Llama;
use burn_llama::spec::{
    Draft, LinearSpecCache, SpecOptions, check_cache, speculative_generate,
    speculative_generate_with_cache, truncated_draft,
};
use burn_llama::tokenizer::Tokenizer;

use super::{BackendArg, DTypeArg, value_name};
use burn_kernels_core::{AttentionImpl, FusedLayers, KvCache, SamplingConfig};
use burn_kvcache::{MiniCacheConfig, QuantConfig, ShadowKvConfig};
use burn_sage::adaptive::DEFAULT_INT4_THRESHOLD;
use burn_specdec::{PromptLookup, Scheme};
use clap::{Args, Parser, Subcommand, ValueEnum};

/// How the layer's small ops run (`--ops`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OpsArg {
    /// One CubeCL kernel per op (burn-kernels-core's `FusedLayers`).
    Fused,
    /// Burn tensor ops.
    Tensor,
}

#[derive(Debug, Args)]
struct Common {
    /// A .gguf file or an HF directory (config.json, model.safetensors, tokenizer.json).
    /// Default: the SmolLM2-135M-Instruct GGUF that `cargo xtask fetch-model` caches.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Where to run: cpu (Burn's Flex backend), vulkan, wgpu or cuda.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendArg,
    /// Weight and activation dtype (f16/bf16 on GPUs).
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
    /// Attention implementation (the Sage variants are burn-sage's SageAttention2; on the CPU
    /// they run their tensor-op reference, with the kernels' rounding). Default: the fastest
    /// exact one, `decode` on a GPU backend, `reference` on the CPU.
    #[arg(long, value_enum)]
    attention: Option<AttentionName>,
    /// The layer's RMSNorms, RoPE and SwiGLU gate: one kernel each (`fused`, burn-kernels-core's
    /// fused layer ops; inference only) or Burn tensor ops (`tensor`). Default: `fused` on a GPU
    /// backend, `tensor` on the CPU.
    #[arg(long, value_enum)]
    ops: Option<OpsArg>,
    /// Same as `--ops fused` (kept for older command lines).
    #[arg(long, hide = true)]
    fused_ops: bool,
    /// sage-adaptive: a layer keeps INT4 where cos_sim·(1 − rel_l1) of its INT4 output against
    /// exact attention reaches this.
    #[arg(long, default_value_t = DEFAULT_INT4_THRESHOLD)]
    int4_threshold: f64,
}

/// KV-cache compression (burn-kvcache).
#[derive(Debug, Args)]
struct KvArgs {
    /// KV cache (burn-kvcache). For `perplexity`, giving it scores the second half of the text
    /// in decode steps through that cache.
    #[arg(long, value_enum)]
    kv_cache: Option<CacheKind>,
    /// MiniCache: first merged layer (default: num_layers / 2).
    #[arg(long)]
    kv_start_layer: Option<usize>,
    /// MiniCache: SLERP interpolation t in [0, 1].
    #[arg(long, default_value_t = 0.6)]
    kv_t: f32,
    /// MiniCache: retention threshold on the normalized angle θ/π.
    #[arg(long, default_value_t = 0.05)]
    kv_gamma: f32,
    /// MiniCache: positions held full before a merge.
    #[arg(long, default_value_t = 16)]
    kv_window: usize,
    /// Quantization bits (2 or 4), overriding the cache name's.
    #[arg(long)]
    kv_bits: Option<u32>,
    /// Quantization group size.
    #[arg(long, default_value_t = 32)]
    kv_group: usize,
    /// Most recent tokens kept in full precision by the quantized caches.
    #[arg(long, default_value_t = 32)]
    kv_residual: usize,
    /// perplexity --kv-cache: tokens prefilled before scoring (default: half the text).
    #[arg(long)]
    kv_prefix: Option<usize>,
    /// ShadowKV: rank of the pre-RoPE key factorization.
    #[arg(long, default_value_t = ShadowKvConfig::default().rank)]
    rank: usize,
    /// ShadowKV: tokens selected per decode step and KV head (a multiple of --kv-chunk).
    #[arg(long, default_value_t = ShadowKvConfig::default().budget)]
    budget: usize,
    /// ShadowKV: tokens per chunk.
    #[arg(long, default_value_t = ShadowKvConfig::default().chunk)]
    kv_chunk: usize,
    /// ShadowKV: chunks at the end of the prompt kept exactly.
    #[arg(long, default_value_t = ShadowKvConfig::default().local_chunks)]
    kv_local_chunks: usize,
    /// ShadowKV: outlier chunks per KV head kept exactly.
    #[arg(long, default_value_t = ShadowKvConfig::default().outlier_chunks)]
    kv_outlier_chunks: usize,
    /// ShadowKV: prompts shorter than this keep the full cache.
    #[arg(long, default_value_t = ShadowKvConfig::default().min_prompt)]
    kv_min_prompt: usize,
}

impl KvArgs {
    fn spec(&self) -> Result<CacheSpec, String> {
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
            },
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SpecScheme {
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
    fn scheme(self) -> Scheme {
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
struct SpecArgs {
    /// Verification scheme; enables speculative decoding.
    #[arg(long, value_enum)]
    spec: Option<SpecScheme>,
    /// Number of drafts K per step (1 with a compressed --kv-cache, which has no draft
    /// branches and rolls rejected tokens back by truncation).
    #[arg(long, default_value_t = 1)]
    drafts: usize,
    /// Draft length L (tokens per draft per step).
    #[arg(long, default_value_t = 4)]
    draft_len: usize,
    /// A separate draft model (same tokenizer): a .gguf, an HF folder, or a `finetune` run
    /// folder (e.g. a distilled draft); default: the first --draft-layers layers of the target.
    #[arg(long)]
    draft_model: Option<PathBuf>,
    /// Layers of the truncated-layer draft (without --draft-model).
    #[arg(long, default_value_t = 8)]
    draft_layers: usize,
    /// Draft sampling temperature: one value for all drafts, or one per draft (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1.0")]
    draft_temperature: Vec<f32>,
    /// The first draft is prompt lookup (copies what followed an earlier occurrence of the last
    /// 1-3 tokens; no model, no forward passes); the other K − 1 drafts are models.
    #[arg(long)]
    lookup_draft: bool,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Generate a continuation (or a chat answer) and stream it to stdout.
    Generate {
        #[command(flatten)]
        common: Common,
        #[arg(long)]
        prompt: String,
        /// Wrap the prompt in the model's chat template.
        #[arg(long)]
        chat: bool,
        #[arg(long, default_value_t = 64)]
        max_new_tokens: usize,
        /// 0 = greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long)]
        top_k: Option<usize>,
        #[arg(long)]
        top_p: Option<f32>,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Decode steps: `graph` captures one step and replays it (a CUDA graph on CUDA; other
        /// backends re-run it), `eager` runs every op of every step. `graph` needs the full KV
        /// cache and no --spec; otherwise decoding is eager.
        #[arg(long, value_enum, default_value = "graph")]
        decode: DecodeMode,
        #[command(flatten)]
        spec: SpecArgs,
        #[command(flatten)]
        kv: KvArgs,
    },
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
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

pub fn main() {
    let started = std::time::Instant::now();
    let cli = Cli::parse();
    let common = match &cli.cmd {
        Cmd::Generate { common, .. } | Cmd::Perplexity { common, .. } => common,
    };
    if common.backend != BackendArg::Cpu {
        super::keep_compiled_kernels();
    }
    let result = common
        .backend
        .device()
        .and_then(|device| run(&cli, &device, started));
    super::exit_on_error(result);
}

fn run(cli: &Cli, device: &Device, started: std::time::Instant) -> Result<(), String> {
    let common = match &cli.cmd {
        Cmd::Generate { common, .. } | Cmd::Perplexity { common, .. } => common,
    };
    let path = common.model.clone().unwrap_or_else(default_model_path);
    let gpu = common.backend != BackendArg::Cpu;
    let attention_name = common.attention.unwrap_or(if gpu {
        AttentionName::Decode
    } else {
        AttentionName::Reference
    });
    let ops = match (common.ops, common.fused_ops) {
        (Some(ops), _) => ops,
        (None, true) => OpsArg::Fused,
        (None, false) if gpu => OpsArg::Fused,
        (None, false) => OpsArg::Tensor,
    };
    let choice = AttentionChoice::from(attention_name);
    let dtype = DType::from(common.dtype);
    eprintln!("loading {} ...", path.display());
    let t = std::time::Instant::now();
    let ckpt = load(&path).map_err(|e| e.to_string())?;
    let model = Llama::from_checkpoint(&ckpt, device, dtype).map_err(|e| e.to_string())?;
    let tokenizer = &ckpt.tokenizer;
    eprintln!(
        "loaded {} layers, hidden {}, vocab {} in {:.1}s on {:?} ({:?})",
        ckpt.config.num_layers,
        ckpt.config.hidden_size,
        ckpt.config.vocab_size,
        t.elapsed().as_secs_f64(),
        device,
        dtype,
    );
    // The tokens adaptive Sage calibrates on: the prompt (as fed) or the text.
    let input_ids = match &cli.cmd {
        Cmd::Generate { prompt, chat, .. } => {
            let text = if *chat {
                tokenizer.chat_prompt(&[("user", prompt.as_str())], true)
            } else {
                prompt.clone()
            };
            tokenizer.encode(&text).map_err(|e| e.to_string())?
        }
        Cmd::Perplexity { text, .. } => {
            let body =
                std::fs::read_to_string(text).map_err(|e| format!("{}: {e}", text.display()))?;
            let ids = tokenizer.encode(&body).map_err(|e| e.to_string())?;
            if ids.len() < 2 {
                return Err(format!("{}: needs at least two tokens", text.display()));
            }
            ids
        }
    };
    let mut attention = build_attention(&choice, &model, &input_ids, common.int4_threshold)?;
    if ops == OpsArg::Fused {
        attention = Box::new(FusedLayers::new(Arc::from(attention)));
    }
    eprintln!(
        "attention {} ({}), layer ops {} ({})",
        attention.name(),
        if common.attention.is_some() {
            "chosen"
        } else {
            "default"
        },
        value_name(ops),
        if common.ops.is_some() || common.fused_ops {
            "chosen"
        } else {
            "default"
        },
    );
    match &cli.cmd {
        Cmd::Generate {
            prompt,
            chat,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            decode,
            spec,
            kv,
            ..
        } => {
            let ids = input_ids;
            let sampling = SamplingConfig {
                temperature: *temperature,
                top_k: *top_k,
                top_p: *top_p,
                seed: *seed,
            };
            let mut sampler = sampling.build();
            let cache = kv
                .spec()?
                .build_for(&model.config)
                .map_err(|e| e.to_string())?;
            let opts = GenerateOptions {
                max_new_tokens: *max_new_tokens,
                stop_tokens: tokenizer.eos_token_ids().to_vec(),
            };
            // The full cache speculates with draft branches (any K); a compressed cache
            // appends each block and truncates what was rejected. Its layout is checked
            // before anything streams.
            let compressed = kv.kv_cache.is_some_and(|k| k != CacheKind::Full);
            let decoding = match spec.spec {
                None => Decoding::Plain(cache),
                Some(scheme) if compressed => {
                    let linear = LinearSpecCache::new(cache);
                    check_cache(&linear, 1, spec.drafts).map_err(|e| e.to_string())?;
                    Decoding::Speculative(scheme, Some(linear))
                }
                Some(scheme) => Decoding::Speculative(scheme, None),
            };
            print!("{prompt}");
            if *chat {
                println!();
            }
            let mut stream = StreamPrinter::new(tokenizer);
            let mut cache = match decoding {
                Decoding::Plain(cache) => cache,
                Decoding::Speculative(scheme, target_cache) => {
                    return run_speculative(
                        &model,
                        target_cache,
                        spec,
                        SpecOptions {
                            scheme: scheme.scheme(),
                            draft_len: spec.draft_len,
                            target_sampling: sampling,
                            max_new_tokens: opts.max_new_tokens,
                            stop_tokens: opts.stop_tokens,
                            seed: *seed,
                        },
                        &ids,
                        device,
                        dtype,
                        attention.as_ref(),
                        &mut stream,
                    );
                }
            };
            let mut first_token = None;
            let mut on_token = |_, tok| {
                first_token.get_or_insert_with(|| started.elapsed().as_secs_f64());
                stream.push(tok)
            };
            let (g, cache_name) = if *decode == DecodeMode::Graph && !compressed {
                let (g, info) = generate_captured(
                    &model,
                    &[ids],
                    attention.as_ref(),
                    sampler.as_mut(),
                    &opts,
                    &mut on_token,
                )
                .map_err(|e| e.to_string())?;
                println!();
                eprintln!("{info}");
                (g, "static".to_string())
            } else {
                if *decode == DecodeMode::Graph {
                    eprintln!("decode: eager (graph decoding needs the full KV cache)");
                }
                let g = generate(
                    &model,
                    &[ids],
                    cache.as_mut(),
                    attention.as_ref(),
                    sampler.as_mut(),
                    &opts,
                    &mut on_token,
                )
                .map_err(|e| e.to_string())?;
                println!();
                (g, cache.name())
            };
            let cached = g.prefill_tokens + g.decode_steps;
            let full = full_kv_bytes(&model.config, 1, cached, model.embed.val().dtype().size());
            eprintln!(
                "KV cache {cache_name}: {} bytes held vs {} full ({:.2}x)",
                g.cache_bytes,
                full,
                full as f64 / g.cache_bytes.max(1) as f64
            );
            eprintln!(
                "prefill {} tokens at {:.1} tok/s, decode {} tokens at {:.1} tok/s; time to first \
                 token {:.0} ms after the prompt ({:.2} s after start)",
                g.prefill_tokens,
                g.prefill_tokens_per_sec(),
                g.tokens[0].len(),
                g.decode_tokens_per_sec(),
                g.prefill_secs * 1e3,
                first_token.unwrap_or(f64::NAN),
            );
        }
        Cmd::Perplexity { kv, .. } => {
            let ids = input_ids;
            if kv.kv_cache.is_none() {
                let ppl =
                    perplexity(&model, &ids, attention.as_ref()).map_err(|e| e.to_string())?;
                println!("perplexity {ppl:.4} over {} tokens", ids.len());
                return Ok(());
            }
            let mut cache = kv
                .spec()?
                .build_for(&model.config)
                .map_err(|e| e.to_string())?;
            let prefix = kv
                .kv_prefix
                .unwrap_or(ids.len() / 2)
                .clamp(1, ids.len() - 1);
            let e = perplexity_with_cache(&model, &ids, prefix, cache.as_mut(), attention.as_ref());
            println!(
                "perplexity {:.4} over tokens {prefix}..{} (prefix {prefix} prefilled) with KV \
                 cache {}: {} bytes held vs {} full ({:.2}x)",
                e.perplexity,
                ids.len(),
                e.cache,
                e.bytes_held,
                e.full_bytes,
                e.compression()
            );
        }
    }
    Ok(())
}

/// The attention implementation; adaptive Sage calibrates on `tokens` and reports its choice
/// per layer.
fn build_attention(
    choice: &AttentionChoice,
    model: &Llama,
    tokens: &[u32],
    int4_threshold: f64,
) -> Result<Box<dyn AttentionImpl>, String> {
    let t = std::time::Instant::now();
    let (attention, reports) = choice
        .build(Some((model, tokens)), int4_threshold)
        .map_err(|e| e.to_string())?;
    if !reports.is_empty() {
        eprintln!(
            "sage-adaptive: calibrated on {} tokens in {:.1}s (INT4 where cos_sim·(1 − rel_l1) \
             ≥ {int4_threshold})",
            tokens.len(),
            t.elapsed().as_secs_f64()
        );
        for r in &reports {
            eprintln!(
                "  layer {:2}: int4 {} | int8 {} -> {}",
                r.layer,
                r.int4,
                r.int8,
                r.choice.name()
            );
        }
    }
    Ok(attention)
}

/// How `llama generate` decodes: through the chosen cache, or speculatively (with a
/// compressed target cache wrapped for truncation rollback, or the branching full cache).
enum Decoding {
    Plain(Box<dyn KvCache>),
    Speculative(SpecScheme, Option<LinearSpecCache>),
}

/// `llama generate --spec ...`: speculative decoding of one prompt, streamed, then its metrics.
/// `compressed` is the target cache when `--kv-cache` is not the full one.
#[allow(clippy::too_many_arguments)]
fn run_speculative(
    target: &Llama,
    compressed: Option<LinearSpecCache>,
    args: &SpecArgs,
    opts: SpecOptions,
    ids: &[u32],
    device: &Device,
    dtype: DType,
    attention: &dyn AttentionImpl,
    stream: &mut StreamPrinter<'_>,
) -> Result<(), String> {
    let lookups = usize::from(args.lookup_draft).min(args.drafts);
    let models = args.drafts - lookups;
    let draft_model = match (&args.draft_model, models) {
        (_, 0) => None,
        (Some(path), _) => {
            eprintln!("loading draft {} ...", path.display());
            Some(burn_llama::finetune::load_model(path, device, dtype)?)
        }
        (None, _) => Some(truncated_draft(target, args.draft_layers).map_err(|e| e.to_string())?),
    };
    let temperatures = match args.draft_temperature.as_slice() {
        [t] => vec![*t; models],
        ts if ts.len() == models => ts.to_vec(),
        ts => {
            return Err(format!(
                "--draft-temperature: give 1 or {models} values (one per model draft), got {}",
                ts.len()
            ));
        }
    };
    let mut drafts: Vec<Draft<'_>> = vec![Draft::lookup(PromptLookup::default()); lookups];
    if let Some(model) = &draft_model {
        drafts.extend(temperatures.iter().map(|&temperature| {
            let sampling = SamplingConfig {
                temperature,
                ..SamplingConfig::default()
            };
            Draft::model(model, sampling)
        }));
    }
    let draft_name = match (&draft_model, lookups) {
        (Some(m), 0) => format!("{} layers", m.layers.len()),
        (Some(m), _) => format!("prompt lookup + {} layers", m.layers.len()),
        (None, _) => "prompt lookup".to_string(),
    };
    let prompts = [ids.to_vec()];
    let mut on_token = |_, tok| stream.push(tok);
    let (stats, cache_name, held, cached) = match compressed {
        Some(cache) => {
            let g = speculative_generate_with_cache(
                target,
                cache,
                &drafts,
                &prompts,
                attention,
                &opts,
                &mut on_token,
            )
            .map_err(|e| e.to_string())?;
            let c = &g.target_cache;
            (g.stats, c.name(), c.bytes_held(), c.seq_len())
        }
        None => {
            let g =
                speculative_generate(target, &drafts, &prompts, attention, &opts, &mut on_token)
                    .map_err(|e| e.to_string())?;
            let c = &g.target_cache;
            (g.stats, c.name(), c.bytes_held(), c.sequence_len(0))
        }
    };
    println!();
    let s = &stats;
    let rates: Vec<String> = s
        .acceptance_rate_per_position()
        .iter()
        .map(|r| format!("{r:.2}"))
        .collect();
    eprintln!(
        "{} K={} L={} (draft: {}): block efficiency {:.2}, acceptance per position [{}], \
         {} target calls, {} draft calls, decode {} tokens at {:.1} tok/s \
         (draft {:.1}s, target {:.1}s, verify {:.1}s)",
        opts.scheme.name(),
        s.num_drafts,
        s.draft_len,
        draft_name,
        s.block_efficiency(),
        rates.join(", "),
        s.target_calls,
        s.draft_calls,
        s.emitted,
        s.tokens_per_sec(),
        s.draft_secs,
        s.target_secs,
        s.verify_secs
    );
    let full = full_kv_bytes(&target.config, 1, cached, target.embed.val().dtype().size());
    eprintln!(
        "target KV cache {cache_name}: {held} bytes held vs {full} full ({:.2}x)",
        full as f64 / held.max(1) as f64
    );
    Ok(())
}

/// Prints the text of the generated tokens as it grows (decoding the whole sequence each
/// time, so multi-byte characters split across tokens come out whole).
struct StreamPrinter<'a> {
    tokenizer: &'a Tokenizer,
    tokens: Vec<u32>,
    printed: usize,
}

impl<'a> StreamPrinter<'a> {
    fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            tokens: Vec::new(),
            printed: 0,
        }
    }

    fn push(&mut self, token: u32) {
        self.tokens.push(token);
        if let Ok(text) = self.tokenizer.decode(&self.tokens)
            && text.len() > self.printed
            && text.is_char_boundary(self.printed)
            && !text.ends_with('\u{FFFD}')
        {
            print!("{}", &text[self.printed..]);
            let _ = std::io::stdout().flush();
            self.printed = text.len();
        }
    }
}
