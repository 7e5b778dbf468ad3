//! End to end, part 2: generation with the inference features switched on alone and together,
//! against the plain path in the same run. One problem: greedy generation of [`NEW_TOKENS`]
//! tokens after a pass-key prompt of about [`PROMPT_TOKENS`] tokens (the needle at half
//! depth), batch 1, SmolLM2-135M-Instruct (real weights when the GGUF is in the model cache,
//! else random weights of its shape, where the answer check says nothing).
//!
//! | candidate | attention | KV cache | decoding |
//! |---|---|---|---|
//! | plain (baseline) | Burn's attention op, tensor ops | full | autoregressive |
//! | sage | SageAttention2 (INT8 QK, FP16 PV) | full | autoregressive |
//! | shadowkv | Burn's | ShadowKV, budget 25% of the prompt | autoregressive |
//! | spec-sd | Burn's | full (branching) | single-draft speculative, L = 4 |
//! | kernels | decode attention kernel, fused layer ops | full | autoregressive |
//! | kernels+graph | decode kernel, fused layer ops | static | autoregressive, each step a replayed CUDA graph (captured per generation) |
//! | kernels+spec-sd | decode kernel, fused layer ops | full (branching) | speculative |
//! | kernels+graph+spec-sd | decode kernel, fused layer ops | static, one row per draft | speculative, draft and verification steps replayed graphs (captured per generation) |
//! | sage+shadowkv+spec-sd | Sage | ShadowKV | speculative (truncation rollback) |
//! | fused sage+shadowkv+spec-sd | Sage, fused layer ops | ShadowKV | speculative |
//! | spec-lookup, kernels+spec-lookup, sage+shadowkv+spec-lookup, fused sage+shadowkv+spec-lookup | as above | as above | speculative with a prompt-lookup draft (no model) |
//!
//! With one prompt and ShadowKV the speculation has a single draft, so every scheme reduces to
//! single-draft verification (SD). The draft is the target's first [`super::specdec::DRAFT_LAYERS`]
//! layers, or `--draft-model`. A repetition is the whole generation (prefill and decode); the
//! records also give decode tokens/s, the prefill time, the KV bytes the target cache holds at
//! the end, the answer and whether it holds the pass key.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use burn::tensor::{DType, Device};
use burn_kernels_core::{
    AttentionImpl, BurnAttention, FullKvCache, FusedLayers, KvCache, SamplingConfig,
};
use burn_kvcache::{DecodeAttention, ShadowKvCache, ShadowKvConfig};
use burn_llama::attention::AttentionChoice;
use burn_llama::eval::shadowkv_for;
use burn_llama::generate::{GenerateOptions, Generation, generate};
use burn_llama::graph::generate_captured;
use burn_llama::passkey::{holds_key, passkey_prompt};
use burn_llama::spec::graph::speculative_generate_captured;
use burn_llama::spec::{
    Draft, LinearSpecCache, SpecOptions, speculative_generate, speculative_generate_with_cache,
};
use burn_llama::{Llama, LlamaConfig};
use burn_specdec::{PromptLookup, Scheme};
use serde_json::json;

use super::SuiteOptions;
use super::specdec::{DRAFT_LAYERS, DraftChoice, checkpoint, random_target};
use crate::harness::{Candidate, Extra, PlotSpec, Problem, Suite, params};

/// Prompt tokens (SmolLM2's context is 8K).
pub const PROMPT_TOKENS: usize = 6000;
/// Tokens generated per repetition.
pub const NEW_TOKENS: usize = 32;
/// Draft length L.
const DRAFT_LEN: usize = 4;
/// The pass key and its relative depth.
const KEY: u32 = 72_931;
const DEPTH: f64 = 0.5;
/// ShadowKV's sparse budget as a fraction of the prompt.
const BUDGET_FRACTION: f64 = 0.25;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Att {
    Burn,
    Sage,
    Kernels,
    FusedSage,
}

/// Where the speculative drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Spec {
    /// The draft model (the target's first layers, or `--draft-model`).
    Model,
    /// Prompt lookup (no model).
    Lookup,
}

#[derive(Debug, Clone, Copy)]
struct Combo {
    name: &'static str,
    attention: Att,
    shadowkv: bool,
    spec: Option<Spec>,
    /// Decode steps captured once into a CUDA graph and replayed (static cache).
    graph: bool,
}

const COMBOS: &[Combo] = &[
    Combo {
        name: "plain",
        attention: Att::Burn,
        shadowkv: false,
        spec: None,
        graph: false,
    },
    Combo {
        name: "sage",
        attention: Att::Sage,
        shadowkv: false,
        spec: None,
        graph: false,
    },
    Combo {
        name: "shadowkv",
        attention: Att::Burn,
        shadowkv: true,
        spec: None,
        graph: false,
    },
    Combo {
        name: "spec-sd",
        attention: Att::Burn,
        shadowkv: false,
        spec: Some(Spec::Model),
        graph: false,
    },
    Combo {
        name: "kernels",
        attention: Att::Kernels,
        shadowkv: false,
        spec: None,
        graph: false,
    },
    Combo {
        name: "kernels+graph",
        attention: Att::Kernels,
        shadowkv: false,
        spec: None,
        graph: true,
    },
    Combo {
        name: "kernels+spec-sd",
        attention: Att::Kernels,
        shadowkv: false,
        spec: Some(Spec::Model),
        graph: false,
    },
    Combo {
        name: "kernels+graph+spec-sd",
        attention: Att::Kernels,
        shadowkv: false,
        spec: Some(Spec::Model),
        graph: true,
    },
    Combo {
        name: "sage+shadowkv+spec-sd",
        attention: Att::Sage,
        shadowkv: true,
        spec: Some(Spec::Model),
        graph: false,
    },
    Combo {
        name: "fused sage+shadowkv+spec-sd",
        attention: Att::FusedSage,
        shadowkv: true,
        spec: Some(Spec::Model),
        graph: false,
    },
    Combo {
        name: "spec-lookup",
        attention: Att::Burn,
        shadowkv: false,
        spec: Some(Spec::Lookup),
        graph: false,
    },
    Combo {
        name: "kernels+spec-lookup",
        attention: Att::Kernels,
        shadowkv: false,
        spec: Some(Spec::Lookup),
        graph: false,
    },
    Combo {
        name: "sage+shadowkv+spec-lookup",
        attention: Att::Sage,
        shadowkv: true,
        spec: Some(Spec::Lookup),
        graph: false,
    },
    Combo {
        name: "fused sage+shadowkv+spec-lookup",
        attention: Att::FusedSage,
        shadowkv: true,
        spec: Some(Spec::Lookup),
        graph: false,
    },
];

pub fn suite(opts: SuiteOptions) -> Suite {
    let (prompt_tokens, new_tokens) = if opts.quick {
        (64, 8)
    } else {
        (PROMPT_TOKENS, NEW_TOKENS)
    };
    let draft = opts
        .draft_model
        .first()
        .cloned()
        .map_or(DraftChoice::Truncated(DRAFT_LAYERS), DraftChoice::Trained);
    Suite {
        name: "e2e-generate",
        description: "greedy generation after a pass-key prompt, batch 1, SmolLM2-135M (real \
                      weights when cached): Sage attention, ShadowKV (25% budget), \
                      single-draft speculative decoding (L = 4; a draft model, or prompt lookup) \
                      and the decode kernels, alone and together, vs the plain path (Burn's attention op, full cache, \
                      autoregressive); a repetition is prefill + decode",
        baseline: "plain",
        problems: vec![problem(draft, prompt_tokens, new_tokens, opts.quick)],
        measure_memory: false,
        plot: Some(PlotSpec {
            y: "median_ms".into(),
            bars: true,
            bar_part: Some("prefill_ms".into()),
            ..PlotSpec::default()
        }),
    }
}

/// The model, the prompt and whether the weights are real (the answer check needs them).
fn model_and_prompt(device: &Device, prompt_tokens: usize, quick: bool) -> (Llama, Vec<u32>, bool) {
    match checkpoint().filter(|_| !quick) {
        Some(ckpt) => {
            let model =
                Llama::from_checkpoint(ckpt, device, DType::F32).expect("a valid checkpoint");
            let ids = passkey_prompt(&ckpt.tokenizer, prompt_tokens, DEPTH, KEY)
                .expect("the prompt tokenizes");
            (model, ids, true)
        }
        None => {
            let (model, ids) = random_target(device, quick, prompt_tokens);
            (model, ids, false)
        }
    }
}

fn attention(att: Att) -> Arc<dyn AttentionImpl> {
    let sage = || -> Arc<dyn AttentionImpl> {
        let choice = AttentionChoice::parse("sage").expect("a known attention");
        let (built, _) = choice
            .build(None, 0.0)
            .expect("INT8 Sage needs no calibration");
        Arc::from(built)
    };
    match att {
        Att::Burn => Arc::new(BurnAttention),
        Att::Sage => sage(),
        Att::Kernels => Arc::new(FusedLayers::new(Arc::new(DecodeAttention::default()))),
        Att::FusedSage => Arc::new(FusedLayers::new(sage())),
    }
}

/// ShadowKV at [`BUDGET_FRACTION`] of a `prompt_len` prompt, outlier chunks scaled with the
/// budget as the paper's defaults (48 per 2048 tokens).
fn shadowkv(cfg: &LlamaConfig, prompt_len: usize) -> ShadowKvCache {
    let chunk = 8;
    let budget = (((prompt_len as f64 * BUDGET_FRACTION) as usize) / chunk).max(4) * chunk;
    let sc = ShadowKvConfig {
        rank: ShadowKvConfig::default()
            .rank
            .min(cfg.num_kv_heads * cfg.head_dim),
        chunk,
        budget,
        local_chunks: 4,
        outlier_chunks: (budget * 24).div_ceil(1024),
        min_prompt: 0,
        ..ShadowKvConfig::default()
    };
    shadowkv_for(cfg, sc).expect("a valid ShadowKV configuration")
}

/// What the last repetition of a candidate produced.
#[derive(Debug, Default, Clone)]
struct Outcome {
    tokens: Vec<u32>,
    prefill_secs: f64,
    decode_tokens_per_sec: f64,
    cache: String,
    cache_bytes: usize,
    block_efficiency: Option<f64>,
}

fn problem(draft: DraftChoice, prompt_tokens: usize, new_tokens: usize, quick: bool) -> Problem {
    Problem {
        label: format!(
            "passkey ~{prompt_tokens} tokens + {new_tokens} new, draft={}",
            draft.label()
        ),
        params: params([
            ("prompt_tokens", json!(prompt_tokens)),
            ("new_tokens", json!(new_tokens)),
            ("draft", json!(draft.label())),
            ("draft_len", json!(DRAFT_LEN)),
            ("budget_fraction", json!(BUDGET_FRACTION)),
            ("batch", json!(1)),
        ]),
        flops: None,
        bytes: None,
        tokens: Some(new_tokens as f64),
        setup: Box::new(move |device| {
            let (model, prompt, real) = model_and_prompt(device, prompt_tokens, quick);
            let draft_model = draft.build(&model, device);
            let weights = if real { "real" } else { "random" };
            COMBOS
                .iter()
                .map(|&combo| {
                    let (m, d, p) = (model.clone(), draft_model.clone(), prompt.clone());
                    let att = attention(combo.attention);
                    let last: Rc<RefCell<Outcome>> = Rc::default();
                    let seen = last.clone();
                    Candidate::timed_here(combo.name, move || {
                        let outcome = run(&m, &d, &p, att.as_ref(), combo, new_tokens);
                        assert_eq!(outcome.tokens.len(), new_tokens, "no stop tokens");
                        *seen.borrow_mut() = outcome;
                    })
                    .with_extra(move || extra(weights, real, &last.borrow()))
                })
                .collect()
        }),
    }
}

/// One greedy generation with `combo`.
fn run(
    model: &Llama,
    draft: &Llama,
    prompt: &[u32],
    attention: &dyn AttentionImpl,
    combo: Combo,
    new_tokens: usize,
) -> Outcome {
    let cfg = &model.config;
    let greedy = SamplingConfig {
        temperature: 0.0,
        ..SamplingConfig::default()
    };
    let prompts = [prompt.to_vec()];
    let opts = GenerateOptions {
        max_new_tokens: new_tokens,
        stop_tokens: Vec::new(),
    };
    let autoregressive = |g: Generation, cache: String| Outcome {
        tokens: g.tokens[0].clone(),
        prefill_secs: g.prefill_secs,
        decode_tokens_per_sec: g.decode_tokens_per_sec(),
        cache,
        cache_bytes: g.cache_bytes,
        block_efficiency: None,
    };
    let sampler = || greedy.build();
    if combo.graph && combo.spec.is_none() {
        let (g, _) = generate_captured(
            model,
            &prompts,
            attention,
            sampler().as_mut(),
            &opts,
            &mut |_, _| {},
        )
        .expect("the prompt fits the model's context");
        return autoregressive(g, "static".into());
    }
    let Some(spec) = combo.spec else {
        let mut cache: Box<dyn KvCache> = if combo.shadowkv {
            Box::new(shadowkv(cfg, prompt.len()))
        } else {
            Box::new(FullKvCache::new(cfg.num_layers))
        };
        let g = generate(
            model,
            &prompts,
            cache.as_mut(),
            attention,
            sampler().as_mut(),
            &opts,
            &mut |_, _| {},
        )
        .expect("the prompt fits the model's context");
        return autoregressive(g, cache.name());
    };
    let drafts = [match spec {
        Spec::Model => Draft::model(draft, greedy),
        Spec::Lookup => Draft::lookup(PromptLookup::default()),
    }];
    let opts = SpecOptions {
        scheme: Scheme::SingleDraft,
        draft_len: DRAFT_LEN,
        target_sampling: greedy,
        max_new_tokens: new_tokens,
        stop_tokens: Vec::new(),
        seed: 0,
    };
    let (tokens, stats, cache, cache_bytes) = if combo.graph {
        let g =
            speculative_generate_captured(model, &drafts, prompt, attention, &opts, &mut |_| {})
                .expect("a valid configuration");
        (
            vec![g.tokens],
            g.stats,
            "static".to_string(),
            g.target_cache_bytes,
        )
    } else if combo.shadowkv {
        let cache = LinearSpecCache::new(Box::new(shadowkv(cfg, prompt.len())));
        let g = speculative_generate_with_cache(
            model,
            cache,
            &drafts,
            &prompts,
            attention,
            &opts,
            &mut |_, _| {},
        )
        .expect("a valid configuration");
        let c = &g.target_cache;
        (g.tokens, g.stats, c.name(), c.bytes_held())
    } else {
        let g = speculative_generate(model, &drafts, &prompts, attention, &opts, &mut |_, _| {})
            .expect("a valid configuration");
        let c = &g.target_cache;
        (g.tokens, g.stats, c.name(), c.bytes_held())
    };
    Outcome {
        tokens: tokens.into_iter().next().expect("one prompt"),
        prefill_secs: stats.prefill_secs,
        decode_tokens_per_sec: stats.tokens_per_sec(),
        cache,
        cache_bytes,
        block_efficiency: Some(stats.block_efficiency()),
    }
}

fn extra(weights: &str, real: bool, o: &Outcome) -> Extra {
    let mut x = Extra::default();
    x.params.insert("weights".into(), json!(weights));
    x.params.insert(
        "decode_tokens_per_sec".into(),
        json!(o.decode_tokens_per_sec),
    );
    x.params
        .insert("prefill_ms".into(), json!(1e3 * o.prefill_secs));
    x.params.insert("kv_cache".into(), json!(o.cache));
    x.params
        .insert("kv_bytes_held".into(), json!(o.cache_bytes));
    if let Some(e) = o.block_efficiency {
        x.params.insert("block_efficiency".into(), json!(e));
    }
    let answer = checkpoint().filter(|_| real).map(|c| {
        let text = c.tokenizer.decode(&o.tokens).unwrap_or_default();
        let ok = holds_key(&text, KEY);
        (text, ok)
    });
    let quality = match &answer {
        Some((text, ok)) => {
            x.params.insert("answer".into(), json!(text));
            x.params.insert("pass_key_found".into(), json!(ok));
            format!(
                "pass key {} in `{}`",
                if *ok { "found" } else { "NOT found" },
                text.trim().replace('\n', " ")
            )
        }
        None => "random weights: no answer check".into(),
    };
    let spec = o
        .block_efficiency
        .map_or_else(String::new, |e| format!(", block efficiency {e:.2}"));
    x.note = Some(format!(
        "decode {:.1} tok/s, prefill {:.0} ms, KV {} {:.1} MB{spec}; {quality}",
        o.decode_tokens_per_sec,
        1e3 * o.prefill_secs,
        o.cache,
        o.cache_bytes as f64 / 1e6
    ));
    x
}
