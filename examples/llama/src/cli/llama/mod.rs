//! `llama generate` and `llama perplexity` on CPU, Vulkan or CUDA.

use std::io::Write;
use std::sync::Arc;

use burn::tensor::Device;
use burn_kernels_core::{AttentionImpl, FusedLayers, SamplingConfig};
use burn_llama::attention::{AttentionChoice, AttentionName};
use burn_llama::eval::{CacheKind, full_kv_bytes, perplexity_with_cache};
use burn_llama::generate::{GenerateOptions, generate, perplexity};
use burn_llama::graph::{DecodeMode, generate_captured};
use burn_llama::loader::{default_model_path, load};
use burn_llama::model::Llama;
use burn_llama::spec::{LinearSpecCache, SpecOptions, check_cache};
use burn_llama::tokenizer::Tokenizer;
use clap::Parser;

use super::{BackendArg, value_name};

mod args;
mod spec;

use args::{Cli, Cmd, Common, GenerateArgs, KvArgs, OpsArg};
use spec::{Decoding, run_speculative};

pub fn main() {
    let started = std::time::Instant::now();
    let cli = Cli::parse();
    let common = cli.cmd.common();
    if common.backend != BackendArg::Cpu {
        super::keep_compiled_kernels();
    }
    let result = common
        .backend
        .device()
        .and_then(|device| run(&cli, &device, started));
    super::exit_on_error(result);
}

impl Cmd {
    fn common(&self) -> &Common {
        match self {
            Cmd::Generate(GenerateArgs { common, .. }) | Cmd::Perplexity { common, .. } => common,
        }
    }
}

fn run(cli: &Cli, device: &Device, started: std::time::Instant) -> Result<(), String> {
    let common = cli.cmd.common();
    let dtype = common.dtype();
    let path = common.model.clone().unwrap_or_else(default_model_path);
    eprintln!("loading {} ...", path.display());
    let t = std::time::Instant::now();
    let ckpt = load(&path).map_err(|e| e.to_string())?;
    let model = Llama::from_checkpoint(&ckpt, device, dtype).map_err(|e| e.to_string())?;
    eprintln!(
        "loaded {} layers, hidden {}, vocab {} in {:.1}s on {:?} ({:?})",
        ckpt.config.num_layers,
        ckpt.config.hidden_size,
        ckpt.config.vocab_size,
        t.elapsed().as_secs_f64(),
        device,
        dtype,
    );
    let tokenizer = &ckpt.tokenizer;
    let input_ids = input_ids(&cli.cmd, tokenizer)?;
    let attention = layer_attention(common, &model, &input_ids)?;
    match &cli.cmd {
        Cmd::Generate(args) => run_generate(
            args,
            &model,
            tokenizer,
            input_ids,
            attention.as_ref(),
            device,
            started,
        ),
        Cmd::Perplexity { kv, .. } => run_perplexity(kv, &model, &input_ids, attention.as_ref()),
    }
}

/// The tokens the command reads (adaptive Sage calibrates on them too): the prompt as fed
/// (in the chat template with `--chat`), or the text file's.
fn input_ids(cmd: &Cmd, tokenizer: &Tokenizer) -> Result<Vec<u32>, String> {
    match cmd {
        Cmd::Generate(GenerateArgs { prompt, chat, .. }) => {
            let text = if *chat {
                tokenizer.chat_prompt(&[("user", prompt.as_str())], true)
            } else {
                prompt.clone()
            };
            tokenizer.encode(&text).map_err(|e| e.to_string())
        }
        Cmd::Perplexity { text, .. } => {
            let body =
                std::fs::read_to_string(text).map_err(|e| format!("{}: {e}", text.display()))?;
            let ids = tokenizer.encode(&body).map_err(|e| e.to_string())?;
            if ids.len() < 2 {
                return Err(format!("{}: needs at least two tokens", text.display()));
            }
            Ok(ids)
        }
    }
}

/// The attention and layer ops asked for, or the defaults of the backend: the decode kernel
/// and fused ops on a GPU, the reference and tensor ops on the CPU. Says which it runs.
fn layer_attention(
    common: &Common,
    model: &Llama,
    input_ids: &[u32],
) -> Result<Box<dyn AttentionImpl>, String> {
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
    let mut attention = build_attention(&choice, model, input_ids, common.int4_threshold)?;
    if ops == OpsArg::Fused {
        attention = Box::new(FusedLayers::new(Arc::from(attention)));
    }
    let how = |chosen: bool| if chosen { "chosen" } else { "default" };
    eprintln!(
        "attention {} ({}), layer ops {} ({})",
        attention.name(),
        how(common.attention.is_some()),
        value_name(ops),
        how(common.ops.is_some() || common.fused_ops),
    );
    Ok(attention)
}

/// `llama generate`: streams the continuation (speculatively with `--spec`), then the cache's
/// size and the prefill/decode rates.
fn run_generate(
    args: &GenerateArgs,
    model: &Llama,
    tokenizer: &Tokenizer,
    ids: Vec<u32>,
    attention: &dyn AttentionImpl,
    device: &Device,
    started: std::time::Instant,
) -> Result<(), String> {
    let GenerateArgs {
        common,
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
    } = args;
    let dtype = common.dtype();
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
    // The full cache speculates with draft branches (any K); a compressed cache appends each
    // block and truncates what was rejected. Its layout is checked before anything streams.
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
            let opts = SpecOptions {
                scheme: scheme.scheme(),
                draft_len: spec.draft_len,
                target_sampling: sampling,
                max_new_tokens: opts.max_new_tokens,
                stop_tokens: opts.stop_tokens,
                seed: *seed,
            };
            return run_speculative(
                model,
                target_cache,
                spec,
                opts,
                &ids,
                device,
                dtype,
                attention,
                *decode,
                &mut stream,
            );
        }
    };
    let mut first_token = None;
    let mut on_token = |_, tok| {
        first_token.get_or_insert_with(|| started.elapsed().as_secs_f64());
        stream.push(tok)
    };
    let (g, cache_name, capture, stats) = if *decode == DecodeMode::Graph && !compressed {
        let (g, info) = generate_captured(
            model,
            &[ids],
            attention,
            sampler.as_mut(),
            &opts,
            &mut on_token,
        )
        .map_err(|e| e.to_string())?;
        (g, "static".to_string(), Some(info), None)
    } else {
        if *decode == DecodeMode::Graph {
            eprintln!("decode: eager (graph decoding needs the full KV cache)");
        }
        let g = generate(
            model,
            &[ids],
            cache.as_mut(),
            attention,
            sampler.as_mut(),
            &opts,
            &mut on_token,
        )
        .map_err(|e| e.to_string())?;
        (g, cache.name(), None, cache.stats())
    };
    println!();
    if let Some(info) = capture {
        eprintln!("{info}");
    }
    let cached = g.prefill_tokens + g.decode_steps;
    let full = full_kv_bytes(&model.config, 1, cached, model.embed.val().dtype().size());
    eprintln!(
        "KV cache {cache_name}: {} bytes held vs {} full ({:.2}x)",
        g.cache_bytes,
        full,
        full as f64 / g.cache_bytes.max(1) as f64
    );
    if let Some(stats) = stats {
        eprintln!("{stats}");
    }
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
    Ok(())
}

/// `llama perplexity`: over the whole text in one pass, or (with `--kv-cache`) the text after
/// a prefilled prefix in decode steps through that cache.
fn run_perplexity(
    kv: &KvArgs,
    model: &Llama,
    ids: &[u32],
    attention: &dyn AttentionImpl,
) -> Result<(), String> {
    if kv.kv_cache.is_none() {
        let ppl = perplexity(model, ids, attention).map_err(|e| e.to_string())?;
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
    let e = perplexity_with_cache(model, ids, prefix, cache.as_mut(), attention);
    println!(
        "perplexity {:.4} over tokens {prefix}..{} (prefix {prefix} prefilled) with KV cache {}: \
         {} bytes held vs {} full ({:.2}x)",
        e.perplexity,
        ids.len(),
        e.cache,
        e.bytes_held,
        e.full_bytes,
        e.compression()
    );
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
