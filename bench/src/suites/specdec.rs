//! Multi-draft speculative decoding (burn-specdec's schemes in burn-llama's generation loop)
//! against plain autoregressive decoding of the same target, in the same run.
//!
//! Target: SmolLM2-135M-Instruct, with its real weights when the GGUF is in the model cache
//! (`cargo xtask fetch-model`, or `$BURN_KERNELS_MODEL`), else random weights of its shape (the
//! record says which; with random weights acceptance says nothing about real text). Drafts: its
//! first [`DRAFT_LAYERS`] layers with its final norm and LM head (a self-speculative draft that
//! shares the target's weights), and the trained ones of `--draft-model`. Target and drafts
//! sample at temperature 1 (K = 1, 2, 4, or `--spec-drafts`) and greedily (K = 1: greedy drafts
//! would be identical; a draft token is accepted when it is the target's top token), with L =
//! 4 (or `--draft-lens`), f32 weights, Burn's fused attention (or `--decode-kernels`), batch 1.
//! With K = 1 the target cache is the autoregressive one, rolled back by truncation.
//!
//! Each scheme also runs as `<scheme> (graph)` beside `autoregressive (graph)`: the draft and
//! verification steps captured once per generation and replayed
//! ([`burn_llama::spec::graph`]); their notes give the capture time and the rate after it.
//!
//! One repetition: the prefill of the prompt, then [`NEW_TOKENS`] (or `--spec-new-tokens`)
//! generated tokens (no stop
//! token, so every repetition emits the same count); tokens/s counts the generated tokens.
//! Block efficiency (tokens per target call), the acceptance rate per draft position and the
//! split of the decode time (drafting, target forward, verification per target call) are the
//! last repetition's.

use std::path::PathBuf;
use std::sync::OnceLock;

use burn::tensor::{DType, Device};
use burn_kernels_core::{AttentionImpl, BurnAttention, FullKvCache, FusedLayers, SamplingConfig};
use burn_kvcache::DecodeAttention;
use burn_llama::generate::{GenerateOptions, generate};
use burn_llama::graph::generate_captured;
use burn_llama::loader::{Checkpoint, default_model_path, load};
use burn_llama::spec::graph::speculative_generate_captured;
use burn_llama::spec::{
    BranchKvCache, Draft, LinearSpecCache, SpecCache, SpecOptions, SpecStats,
    speculative_generate_with_cache, truncated_draft,
};
use burn_llama::{Llama, LlamaConfig};
use burn_specdec::Scheme;
use serde_json::json;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use super::SuiteOptions;
use crate::harness::{Candidate, Extra, Problem, Suite, params};

/// Layers of the truncated-layer draft (the CLI's default).
pub const DRAFT_LAYERS: usize = 8;
/// Tokens generated per repetition.
pub const NEW_TOKENS: usize = 64;
/// Draft length L (`--draft-lens` times others).
const DRAFT_LEN: usize = 4;
/// Prompt tokens (the start of the committed paragraph, or token ids with random weights).
const PROMPT_TOKENS: usize = 64;

pub fn suite(opts: SuiteOptions) -> Suite {
    let (default_drafts, new_tokens): (&[usize], usize) = if opts.quick {
        (&[1, 2], 8)
    } else {
        (&[1, 2, 4], opts.spec_new_tokens.unwrap_or(NEW_TOKENS))
    };
    let drafts = match opts.spec_drafts.is_empty() {
        true => default_drafts.to_vec(),
        false => opts.spec_drafts.clone(),
    };
    let lens = match opts.draft_lens.is_empty() {
        true => vec![DRAFT_LEN],
        false => opts.draft_lens.clone(),
    };
    let mut choices = vec![DraftChoice::Truncated(DRAFT_LAYERS)];
    choices.extend(opts.draft_model.iter().cloned().map(DraftChoice::Trained));
    // Sampling at temperature 1 with K drafts, and greedy decoding (single draft: greedy
    // drafts are identical) where acceptance is the draft's top token matching the target's.
    let mut problems = Vec::new();
    for c in &choices {
        for &len in &lens {
            let cells = drafts.iter().map(|&k| (k, 1.0)).chain([(1, 0.0)]);
            for (k, t) in cells {
                let shape = Shape {
                    k,
                    len,
                    temperature: t,
                };
                problems.push(problem(
                    c.clone(),
                    shape,
                    new_tokens,
                    opts.quick,
                    opts.decode_kernels,
                ));
            }
        }
    }
    Suite {
        name: "specdec",
        description: "speculative decoding of SmolLM2-135M (real weights when cached) with its \
                      first 8 layers as the draft (and trained drafts with --draft-model), K \
                      drafts of L tokens (L = 4 unless --draft-lens), temperature 1 (and \
                      greedy, single draft), batch 1: each scheme vs plain autoregressive \
                      decoding at the same temperature; tokens/s of generated tokens; with K = 1 \
                      the target cache is the autoregressive one, rolled back by truncation",
        baseline: "autoregressive",
        problems,
        measure_memory: false,
        plot: None,
    }
}

/// The cached SmolLM2 checkpoint, loaded once; `None` when it is not in the model cache.
pub(super) fn checkpoint() -> Option<&'static Checkpoint> {
    static CKPT: OnceLock<Option<Checkpoint>> = OnceLock::new();
    CKPT.get_or_init(|| match load(&default_model_path()) {
        Ok(c) => Some(c),
        Err(e) => {
            eprintln!("specdec: random weights ({e})");
            None
        }
    })
    .as_ref()
}

/// The schemes timed with K drafts: single-draft SD at K = 1, the multi-draft ones above.
fn schemes(k: usize) -> Vec<Scheme> {
    if k == 1 {
        vec![Scheme::SingleDraft]
    } else {
        vec![
            Scheme::SpecInfer,
            Scheme::SpecTr,
            Scheme::SequentialImportance,
            Scheme::WEIGHTED_IMPORTANCE,
            Scheme::OPTIMAL,
        ]
    }
}

fn sampling(temperature: f32, seed: u64) -> SamplingConfig {
    SamplingConfig {
        temperature,
        seed,
        ..SamplingConfig::default()
    }
}

/// The target model and one prompt on `device`, and whether the weights are real.
fn target(device: &Device, quick: bool) -> (Llama, Vec<u32>, bool) {
    let prompt_len = if quick { 16 } else { PROMPT_TOKENS };
    match checkpoint().filter(|_| !quick) {
        Some(ckpt) => {
            let model =
                Llama::from_checkpoint(ckpt, device, DType::F32).expect("a valid checkpoint");
            let text = include_str!("../../../llama/data/paragraph.txt");
            let mut ids = ckpt
                .tokenizer
                .encode(text)
                .expect("the paragraph tokenizes");
            ids.truncate(prompt_len);
            (model, ids, true)
        }
        None => {
            let (model, ids) = random_target(device, quick, prompt_len);
            (model, ids, false)
        }
    }
}

/// Random weights of SmolLM2-135M's shape (a tiny model deep enough for the draft with
/// `quick`) and a prompt of `prompt_len` spread token ids.
pub(super) fn random_target(device: &Device, quick: bool, prompt_len: usize) -> (Llama, Vec<u32>) {
    let cfg = if quick {
        super::tiny_llama(DRAFT_LAYERS + 2, 512)
    } else {
        LlamaConfig::smollm2_135m()
    };
    let model = Llama::random(&cfg, device, DType::F32);
    let ids = (0..prompt_len as u32)
        .map(|i| (i * 7919) % cfg.vocab_size as u32)
        .collect();
    (model, ids)
}

/// The draft of a problem: the target's first layers, or a trained model.
#[derive(Debug, Clone)]
pub(super) enum DraftChoice {
    Truncated(usize),
    Trained(PathBuf),
}

impl DraftChoice {
    pub(super) fn label(&self) -> String {
        match self {
            Self::Truncated(n) => format!("first{n}"),
            Self::Trained(p) => p
                .file_name()
                .map_or_else(|| "trained".into(), |n| n.to_string_lossy().into_owned()),
        }
    }

    pub(super) fn build(&self, target: &Llama, device: &Device) -> Llama {
        match self {
            Self::Truncated(n) => truncated_draft(target, *n).expect("enough layers"),
            Self::Trained(p) => burn_llama::finetune::load_model(p, device, DType::F32)
                .unwrap_or_else(|e| panic!("draft model {}: {e}", p.display())),
        }
    }
}

/// The drafting of one problem: K drafts of L tokens, both models at one temperature.
#[derive(Debug, Clone, Copy)]
struct Shape {
    k: usize,
    len: usize,
    temperature: f32,
}

fn problem(
    choice: DraftChoice,
    shape: Shape,
    new_tokens: usize,
    quick: bool,
    decode_kernels: bool,
) -> Problem {
    let Shape {
        k,
        len: draft_len,
        temperature,
    } = shape;
    let mut mode = if temperature == 0.0 {
        " greedy".to_string()
    } else {
        String::new()
    };
    if decode_kernels {
        mode.push_str(" decode-kernels");
    }
    let attention: Arc<dyn AttentionImpl> = if decode_kernels {
        Arc::new(FusedLayers::new(Arc::new(DecodeAttention::default())))
    } else {
        Arc::new(BurnAttention)
    };
    Problem {
        label: format!("draft={} K={k} L={draft_len}{mode}", choice.label()),
        params: params([
            ("temperature", json!(temperature)),
            ("drafts", json!(k)),
            ("draft_len", json!(draft_len)),
            ("draft", json!(choice.label())),
            ("new_tokens", json!(new_tokens)),
            ("batch", json!(1)),
        ]),
        flops: None,
        bytes: None,
        tokens: Some(new_tokens as f64),
        setup: Box::new(move |device| {
            let (model, prompt, real) = target(device, quick);
            let draft = choice.build(&model, device);
            let weights = if real { "real" } else { "random" };
            let mut candidates = Vec::new();

            let (m, p, att) = (model.clone(), prompt.clone(), attention.clone());
            let mut seed = 0;
            candidates.push(
                Candidate::timed_here("autoregressive", move || {
                    seed += 1;
                    let mut cache = FullKvCache::new(m.config.num_layers);
                    let opts = GenerateOptions {
                        max_new_tokens: new_tokens,
                        stop_tokens: Vec::new(),
                    };
                    let g = generate(
                        &m,
                        std::slice::from_ref(&p),
                        &mut cache,
                        att.as_ref(),
                        sampling(temperature, seed).build().as_mut(),
                        &opts,
                        &mut |_, _| {},
                    )
                    .expect("the prompt fits the model's context");
                    assert_eq!(g.tokens[0].len(), new_tokens, "no stop tokens");
                })
                .with_extra(move || weights_extra(weights)),
            );

            candidates.push(autoregressive_graph(
                &model, &prompt, &attention, shape, new_tokens,
            ));
            for scheme in schemes(k) {
                candidates.push(spec_graph(
                    (&model, &draft, &prompt),
                    &attention,
                    scheme,
                    shape,
                    new_tokens,
                    weights,
                ));
            }
            for scheme in schemes(k) {
                let (m, d, p) = (model.clone(), draft.clone(), prompt.clone());
                let att = attention.clone();
                let last: Rc<RefCell<Option<SpecStats>>> = Rc::default();
                let seen = last.clone();
                let mut seed = 0;
                candidates.push(
                    Candidate::timed_here(scheme.name(), move || {
                        seed += 1;
                        let drafts = vec![Draft::model(&d, sampling(temperature, 0)); k];
                        let opts = spec_options(scheme, shape, new_tokens, seed);
                        let prompts = std::slice::from_ref(&p);
                        // One sequence and one draft: the target cache is the autoregressive
                        // one, rolled back by truncation (no branch rows to widen and merge).
                        let (tokens, stats) = if k == 1 {
                            let inner = FullKvCache::new(m.config.num_layers);
                            let cache = LinearSpecCache::new(Box::new(inner));
                            run_spec(&m, cache, &drafts, prompts, att.as_ref(), &opts)
                        } else {
                            let cache = BranchKvCache::new(m.config.num_layers, 1);
                            run_spec(&m, cache, &drafts, prompts, att.as_ref(), &opts)
                        };
                        assert_eq!(tokens[0].len(), new_tokens, "no stop tokens");
                        *seen.borrow_mut() = Some(stats);
                    })
                    .with_extra(move || spec_extra(weights, last.borrow().as_ref())),
                );
            }
            candidates
        }),
    }
}

/// The options of one timed speculative generation: no stop tokens, the target at the shape's
/// temperature, the repetition's seed.
fn spec_options(scheme: Scheme, shape: Shape, new_tokens: usize, seed: u64) -> SpecOptions {
    SpecOptions {
        scheme,
        draft_len: shape.len,
        target_sampling: sampling(shape.temperature, 0),
        max_new_tokens: new_tokens,
        stop_tokens: Vec::new(),
        seed,
    }
}

/// Plain decoding with the step captured and replayed (`generate_captured`): the baseline of
/// the `(graph)` rows.
fn autoregressive_graph(
    model: &Llama,
    prompt: &[u32],
    attention: &Arc<dyn AttentionImpl>,
    shape: Shape,
    new_tokens: usize,
) -> Candidate<'static> {
    let (m, p, att) = (model.clone(), prompt.to_vec(), attention.clone());
    let mut seed = 0;
    Candidate::timed_here("autoregressive (graph)", move || {
        seed += 1;
        let opts = GenerateOptions {
            max_new_tokens: new_tokens,
            stop_tokens: Vec::new(),
        };
        let (g, _) = generate_captured(
            &m,
            std::slice::from_ref(&p),
            att.as_ref(),
            sampling(shape.temperature, seed).build().as_mut(),
            &opts,
            &mut |_, _| {},
        )
        .expect("the prompt fits the model's context");
        assert_eq!(g.tokens[0].len(), new_tokens, "no stop tokens");
    })
}

/// `scheme` with the draft and target steps captured and replayed
/// (`speculative_generate_captured`).
fn spec_graph(
    (model, draft, prompt): (&Llama, &Llama, &[u32]),
    attention: &Arc<dyn AttentionImpl>,
    scheme: Scheme,
    shape: Shape,
    new_tokens: usize,
    weights: &'static str,
) -> Candidate<'static> {
    let (m, d, p, att) = (
        model.clone(),
        draft.clone(),
        prompt.to_vec(),
        attention.clone(),
    );
    let last: Rc<RefCell<Option<(SpecStats, f64)>>> = Rc::default();
    let seen = last.clone();
    let mut seed = 0;
    // Candidate names are static; one short name per scheme and problem.
    let name = &*Box::leak(format!("{} (graph)", scheme.name()).into_boxed_str());
    Candidate::timed_here(name, move || {
        seed += 1;
        let drafts = vec![Draft::model(&d, sampling(shape.temperature, 0)); shape.k];
        let opts = spec_options(scheme, shape, new_tokens, seed);
        let g = speculative_generate_captured(&m, &drafts, &p, att.as_ref(), &opts, &mut |_| {})
            .expect("a valid configuration");
        assert_eq!(g.tokens.len(), new_tokens, "no stop tokens");
        *seen.borrow_mut() = Some((g.stats, g.capture_secs));
    })
    .with_extra(move || {
        let last = last.borrow();
        let mut x = spec_extra(weights, last.as_ref().map(|(s, _)| s));
        if let Some((s, capture)) = last.as_ref() {
            let steady = s.emitted as f64 / (s.decode_secs - capture).max(1e-9);
            x.params.insert("capture_secs".into(), json!(capture));
            x.params
                .insert("decode_tokens_per_sec_after_capture".into(), json!(steady));
            let note = x.note.take().unwrap_or_default();
            x.note = Some(format!(
                "{note}; capture {capture:.2} s, then {steady:.0} tok/s"
            ));
        }
        x
    })
}

/// One speculative generation with `cache` as the target cache: its tokens and statistics.
fn run_spec<C: SpecCache>(
    target: &Llama,
    cache: C,
    drafts: &[Draft<'_>],
    prompts: &[Vec<u32>],
    attention: &dyn AttentionImpl,
    opts: &SpecOptions,
) -> (Vec<Vec<u32>>, SpecStats) {
    let g = speculative_generate_with_cache(
        target,
        cache,
        drafts,
        prompts,
        attention,
        opts,
        &mut |_, _| {},
    )
    .expect("a valid configuration");
    (g.tokens, g.stats)
}

fn weights_extra(weights: &str) -> Extra {
    let mut x = Extra::default();
    x.params.insert("weights".into(), json!(weights));
    x
}

/// Block efficiency, acceptance per position and the decode-time split of the last run.
fn spec_extra(weights: &str, stats: Option<&SpecStats>) -> Extra {
    let mut x = weights_extra(weights);
    let Some(s) = stats else {
        return x;
    };
    let per_call = |secs: f64| 1e3 * secs / s.target_calls.max(1) as f64;
    let rates = s.acceptance_rate_per_position();
    x.params
        .insert("block_efficiency".into(), json!(s.block_efficiency()));
    x.params
        .insert("acceptance_per_position".into(), json!(rates));
    x.params
        .insert("target_calls".into(), json!(s.target_calls));
    x.params
        .insert("draft_ms_per_call".into(), json!(per_call(s.draft_secs)));
    x.params
        .insert("target_ms_per_call".into(), json!(per_call(s.target_secs)));
    x.params
        .insert("verify_ms_per_call".into(), json!(per_call(s.verify_secs)));
    x.note = Some(format!(
        "{weights} weights; block efficiency {:.2}; per target call: draft {:.1} ms, target \
         {:.1} ms, verify {:.2} ms",
        s.block_efficiency(),
        per_call(s.draft_secs),
        per_call(s.target_secs),
        per_call(s.verify_secs)
    ));
    x
}
