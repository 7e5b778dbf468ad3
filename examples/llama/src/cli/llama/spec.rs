//! `llama generate --spec`: speculative decoding of one prompt, streamed, then its metrics.

use burn::tensor::{DType, Device};
use burn_kernels_core::{AttentionImpl, KvCache, SamplingConfig};
use burn_llama::eval::full_kv_bytes;
use burn_llama::graph::DecodeMode;
use burn_llama::model::Llama;
use burn_llama::spec::graph::speculative_generate_captured;
use burn_llama::spec::{
    Draft, LinearSpecCache, SpecOptions, speculative_generate, speculative_generate_with_cache,
    truncated_draft,
};
use burn_specdec::PromptLookup;

use super::StreamPrinter;
use super::args::{SpecArgs, SpecScheme};

/// How `llama generate` decodes: through the chosen cache, or speculatively (with a
/// compressed target cache wrapped for truncation rollback, or the branching full cache).
pub(super) enum Decoding {
    Plain(Box<dyn KvCache>),
    Speculative(SpecScheme, Option<LinearSpecCache>),
}

/// `llama generate --spec ...`: speculative decoding of one prompt, streamed, then its metrics.
/// `compressed` is the target cache when `--kv-cache` is not the full one; otherwise
/// `--decode graph` (the default) replays captured draft and target steps when every draft is
/// a model.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_speculative(
    target: &Llama,
    compressed: Option<LinearSpecCache>,
    args: &SpecArgs,
    opts: SpecOptions,
    ids: &[u32],
    device: &Device,
    dtype: DType,
    attention: &dyn AttentionImpl,
    decode: DecodeMode,
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
        None if decode == DecodeMode::Graph && lookups == 0 => {
            let g =
                speculative_generate_captured(target, &drafts, ids, attention, &opts, &mut |t| {
                    on_token(0, t)
                })
                .map_err(|e| e.to_string())?;
            eprintln!("\ndraft: {}\ntarget: {}", g.draft, g.target);
            let cached = ids.len() + g.stats.emitted - 1;
            (g.stats, "static".to_string(), g.target_cache_bytes, cached)
        }
        None => {
            if decode == DecodeMode::Graph {
                eprintln!("decode: eager (a prompt-lookup draft runs no model step to capture)");
            }
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
