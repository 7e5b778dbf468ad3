//! Speculative decoding on the real SmolLM2-135M-Instruct weights (fetched by
//! `./scripts/setup.sh` or `cargo xtask fetch-model`), CPU backend, truncated-layer drafts.

use crate::common::{checkpoint, last_logits};

use std::sync::OnceLock;
use std::time::Instant;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_kernels_core::{FullKvCache, Greedy, KvCache, ReferenceAttention, SamplingConfig};
use burn_kvcache::ShadowKvConfig;
use burn_llama::eval::{CacheKind, CacheSpec};
use burn_llama::generate::{GenerateOptions, generate};
use burn_llama::model::Llama;
use burn_llama::spec::{
    BranchKvCache, Draft, LinearSpecCache, SpecError, SpecOptions, forward_rows,
    speculative_generate, speculative_generate_with_cache, truncated_draft,
};
use burn_specdec::{PromptLookup, Scheme};

const DRAFT_LAYERS: usize = 8;

fn target() -> Llama {
    Llama::from_checkpoint(checkpoint(), &Device::flex(), DType::F32).expect("valid checkpoint")
}

fn prompts() -> Vec<Vec<u32>> {
    let tok = &checkpoint().tokenizer;
    let p: Vec<Vec<u32>> = [
        "The capital of France is",
        "Once upon a time, in a small village by the sea, there lived",
    ]
    .iter()
    .map(|p| tok.encode(p).unwrap())
    .collect();
    assert_ne!(p[0].len(), p[1].len(), "prompts of different lengths");
    p
}

fn eos() -> Vec<u32> {
    checkpoint().tokenizer.eos_token_ids().to_vec()
}

fn plain_greedy(model: &Llama, prompts: &[Vec<u32>], n: usize, stop: &[u32]) -> Vec<Vec<u32>> {
    let mut cache = FullKvCache::new(model.config.num_layers);
    let opts = GenerateOptions {
        max_new_tokens: n,
        stop_tokens: stop.to_vec(),
    };
    generate(
        model,
        prompts,
        &mut cache,
        &ReferenceAttention,
        &mut Greedy,
        &opts,
        &mut |_, _| {},
    )
    .expect("valid prompts")
    .tokens
}

fn sampling(temperature: f32) -> SamplingConfig {
    SamplingConfig {
        temperature,
        ..SamplingConfig::default()
    }
}

fn options(scheme: Scheme, draft_len: usize, target_temperature: f32, n: usize) -> SpecOptions {
    SpecOptions {
        scheme,
        draft_len,
        target_sampling: sampling(target_temperature),
        max_new_tokens: n,
        stop_tokens: eos(),
        seed: 7,
    }
}

fn identical<'a>(model: &'a Llama, k: usize, temperature: f32) -> Vec<Draft<'a>> {
    vec![Draft::model(model, sampling(temperature)); k]
}

/// Layers of the draft in the exactness tests: SmolLM2's truncated-layer drafts are not trained
/// to exit early, so shallow ones (8 layers) almost never agree with the target's argmax; 24
/// layers agree ~40% of the time, which exercises accepted runs and bonus tokens too.
const EXACTNESS_DRAFT_LAYERS: usize = 24;

/// (a) With a greedy target `scheme` reproduces plain greedy decoding, for K = 2 and 3 drafts
/// (sampled at temperature 0.7; K = 1 is single-draft SD's test) and L = 1 and 4 (SD: L = 1, 2,
/// 4), on a batch of two prompts of different lengths. Fewer (K, L) than a GPU could afford:
/// each is 16 tokens of a 30-layer target and a 24-layer draft on the CI's two CPU cores.
fn greedy_matches_plain_greedy(scheme: Scheme) {
    let model = target();
    let draft = truncated_draft(&model, EXACTNESS_DRAFT_LAYERS).unwrap();
    let prompts = prompts();
    const N: usize = 16;
    // The five scheme tests share the reference.
    static PLAIN: OnceLock<Vec<Vec<u32>>> = OnceLock::new();
    let plain = PLAIN.get_or_init(|| plain_greedy(&model, &prompts, N, &eos()));
    let t = Instant::now();
    let (ks, lens): (&[usize], &[usize]) = if scheme == Scheme::SingleDraft {
        (&[1], &[1, 2, 4])
    } else {
        (&[2, 3], &[1, 4])
    };
    for &k in ks {
        for &len in lens {
            let drafts = identical(&draft, k, 0.7);
            let g = speculative_generate(
                &model,
                &drafts,
                &prompts,
                &ReferenceAttention,
                &options(scheme, len, 0.0, N),
                &mut |_, _| {},
            )
            .unwrap();
            let s = &g.stats;
            println!(
                "{:16} K={k} L={len}: block efficiency {:.2}, {} target calls, {:.1}s",
                scheme.name(),
                s.block_efficiency(),
                s.target_calls,
                s.prefill_secs + s.decode_secs
            );
            assert_eq!(&g.tokens, plain, "{} K={k} L={len}", scheme.name());
        }
    }
    println!("{}: {:.1}s", scheme.name(), t.elapsed().as_secs_f64());
}

#[test]
fn greedy_single_draft_matches_plain_greedy() {
    greedy_matches_plain_greedy(Scheme::SingleDraft);
}

#[test]
fn greedy_specinfer_matches_plain_greedy() {
    greedy_matches_plain_greedy(Scheme::SpecInfer);
}

#[test]
fn greedy_spectr_matches_plain_greedy() {
    greedy_matches_plain_greedy(Scheme::SpecTr);
}

#[test]
fn greedy_importance_sampling_matches_plain_greedy() {
    greedy_matches_plain_greedy(Scheme::SequentialImportance);
}

#[test]
fn greedy_optimal_matches_plain_greedy() {
    greedy_matches_plain_greedy(Scheme::OPTIMAL);
}

/// Greedy speculation stops exactly where plain greedy decoding does when a stop token is hit
/// inside an accepted block.
#[test]
fn greedy_speculation_stops_at_stop_tokens() {
    let model = target();
    // A full-depth draft at a low temperature gets most blocks accepted, so the stop token
    // falls inside accepted runs.
    let draft = truncated_draft(&model, model.config.num_layers).unwrap();
    let prompts = prompts();
    let free = plain_greedy(&model, &prompts, 12, &eos());
    // Stop at the 4th token of the first continuation (wherever it occurs in either).
    let stop = vec![free[0][3]];
    let plain = plain_greedy(&model, &prompts, 12, &stop);
    assert!(plain[0].len() <= 4);
    for scheme in [Scheme::SpecInfer, Scheme::SequentialImportance] {
        let mut opts = options(scheme, 4, 0.0, 12);
        opts.stop_tokens = stop.clone();
        let g = speculative_generate(
            &model,
            &identical(&draft, 2, 0.5),
            &prompts,
            &ReferenceAttention,
            &opts,
            &mut |_, _| {},
        )
        .unwrap();
        assert_eq!(g.tokens, plain, "{}", scheme.name());
    }
}

/// (b) Sampled generation (temperature 1) completes, respects `max_new_tokens` and stop tokens
/// (EOS only for single-draft SD, so it runs to the limit; punctuation for the others), streams
/// every token, and reports consistent metrics.
#[test]
fn sampled_speculation_respects_limits_and_reports_metrics() {
    let model = target();
    let draft = truncated_draft(&model, DRAFT_LAYERS).unwrap();
    let tok = &checkpoint().tokenizer;
    let prompts = prompts();
    let mut stop = eos();
    stop.extend([".", ",", " and"].iter().map(|s| tok.encode(s).unwrap()[0]));
    const N: usize = 24;
    const L: usize = 3;
    for (scheme, k) in [
        (Scheme::SingleDraft, 1),
        (Scheme::SpecTr, 3),
        (Scheme::SequentialImportance, 3),
    ] {
        let mut opts = options(scheme, L, 1.0, N);
        if k > 1 {
            opts.stop_tokens = stop.clone();
        }
        let mut streamed = vec![Vec::new(); prompts.len()];
        let g = speculative_generate(
            &model,
            &identical(&draft, k, 1.2),
            &prompts,
            &ReferenceAttention,
            &opts,
            &mut |i, t| streamed[i].push(t),
        )
        .unwrap();
        let s = &g.stats;
        println!(
            "{} K={k}: {:?} | block efficiency {:.3}, acceptance per position {:?}, {} target calls, {:.1} tok/s",
            scheme.name(),
            g.tokens
                .iter()
                .map(|t| tok.decode(t).unwrap())
                .collect::<Vec<_>>(),
            s.block_efficiency(),
            s.acceptance_rate_per_position(),
            s.target_calls,
            s.tokens_per_sec()
        );
        assert_eq!(streamed, g.tokens);
        for out in &g.tokens {
            assert!(!out.is_empty() && out.len() <= N);
            let first_stop = out.iter().position(|t| opts.stop_tokens.contains(t));
            if let Some(i) = first_stop {
                assert_eq!(i, out.len() - 1, "nothing after a stop token: {out:?}");
            } else {
                assert_eq!(out.len(), N, "stopped early without a stop token: {out:?}");
            }
        }
        let be = s.block_efficiency();
        assert!(
            (1.0..=(L + 1) as f64).contains(&be),
            "block efficiency {be}"
        );
        let rates = s.acceptance_rate_per_position();
        assert_eq!(rates.len(), L);
        assert!(rates.windows(2).all(|w| w[0] >= w[1]), "{rates:?}");
        assert_eq!(s.emitted, g.tokens.iter().map(Vec::len).sum::<usize>());
        assert!(s.emitted <= s.blocks + s.accepted);
        assert!(s.target_calls <= s.blocks && s.blocks <= prompts.len() * s.target_calls);
        assert_eq!(s.draft_calls, L * s.target_calls);
    }
}

/// Last-position logits of `rows` continued from `cache`, `[rows][vocab]`.
fn continue_from(model: &Llama, cache: &mut BranchKvCache, rows: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let hidden = forward_rows(model, cache, rows, &ReferenceAttention).expect("forward");
    let [b, s, h] = hidden.dims();
    let logits = model.logits(hidden.slice([0..b, s - 1..s, 0..h]));
    let vocab = logits.dims()[2];
    let data = logits.into_data().try_to_vec::<f32>().unwrap();
    data.chunks(vocab).map(<[f32]>::to_vec).collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// (c) Rollback: after a sampled run the target cache holds exactly prompt + generated − 1
/// tokens per sequence (the last emitted token is fed by the next call, as in plain
/// generation), and continuing every cache (target and both draft models) gives the logits of a
/// fresh forward pass over the same tokens.
#[test]
fn caches_hold_exactly_the_emitted_tokens_after_rollback() {
    let model = target();
    // A full-depth copy of the target (q = p at the target's temperature) accepts most drafts,
    // a 16-layer one few, so sequences and caches advance by different amounts.
    let deep = truncated_draft(&model, model.config.num_layers).unwrap();
    let shallow = truncated_draft(&model, 16).unwrap();
    let prompts = prompts();
    let drafts = [
        Draft::model(&deep, sampling(1.3)),
        Draft::model(&shallow, sampling(1.0)),
        Draft::model(&deep, sampling(1.0)),
    ];
    let g = speculative_generate(
        &model,
        &drafts,
        &prompts,
        &ReferenceAttention,
        &options(Scheme::SpecInfer, 3, 1.0, 20),
        &mut |_, _| {},
    )
    .unwrap();
    println!(
        "block efficiency {:.2}, acceptance per position {:?}",
        g.stats.block_efficiency(),
        g.stats.acceptance_rate_per_position()
    );
    assert!(
        g.stats.accepted_at[2] > 0,
        "some block accepted all L drafts"
    );
    let seqs: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&g.tokens)
        .map(|(p, t)| [p.as_slice(), t].concat())
        .collect();
    let mut target_cache = g.target_cache;
    for (b, (prompt, new)) in prompts.iter().zip(&g.tokens).enumerate() {
        assert_eq!(
            target_cache.sequence_len(b),
            prompt.len() + new.len() - 1,
            "sequence {b}"
        );
    }
    let check = |name: &str, model: &Llama, cache: &mut BranchKvCache| {
        let rows: Vec<Vec<u32>> = seqs
            .iter()
            .enumerate()
            .map(|(b, s)| {
                let held = cache.sequence_len(b);
                assert!(held < s.len(), "{name}: {held} cached of {}", s.len());
                s[held..].to_vec()
            })
            .collect();
        let cont = continue_from(model, cache, &rows);
        for (b, s) in seqs.iter().enumerate() {
            let diff = max_abs_diff(&cont[b], &last_logits(model, s));
            println!(
                "{name} sequence {b}: pending {}, max |Δlogit| {diff:.2e}",
                rows[b].len()
            );
            assert!(diff < 1e-3, "{name} sequence {b}: max |Δlogit| {diff}");
        }
    };
    check("target", &model, &mut target_cache);
    let mut caches = g.draft_caches;
    assert_eq!(caches.len(), 2);
    check("draft (30 layers)", &deep, &mut caches[0]);
    check("draft (16 layers)", &shallow, &mut caches[1]);
}

#[test]
fn bad_configurations_are_typed_errors() {
    let model = target();
    let draft = truncated_draft(&model, 2).unwrap();
    let prompts = prompts();
    let run = |drafts: &[Draft<'_>], prompts: &[Vec<u32>], opts: &SpecOptions| {
        speculative_generate(
            &model,
            drafts,
            prompts,
            &ReferenceAttention,
            opts,
            &mut |_, _| {},
        )
        .unwrap_err()
    };
    let opts = options(Scheme::SpecInfer, 2, 0.0, 4);
    assert_eq!(run(&[], &prompts, &opts), SpecError::NoDrafts);
    assert_eq!(
        run(
            &identical(&draft, 2, 1.0),
            &prompts,
            &options(Scheme::SpecInfer, 0, 0.0, 4)
        ),
        SpecError::ZeroDraftLength
    );
    assert_eq!(
        run(
            &identical(&draft, 2, 1.0),
            &prompts,
            &options(Scheme::SingleDraft, 2, 0.0, 4)
        ),
        SpecError::SingleDraftNeedsOneDraft { drafts: 2 }
    );
    let mut other_vocab = draft.clone();
    other_vocab.config.vocab_size = 1000;
    let drafts = [
        Draft::model(&draft, sampling(1.0)),
        Draft::model(&other_vocab, sampling(1.0)),
    ];
    assert_eq!(
        run(&drafts, &prompts, &opts),
        SpecError::VocabularyMismatch {
            draft: 1,
            expected: model.config.vocab_size,
            found: 1000
        }
    );
    assert_eq!(
        run(&identical(&draft, 1, 1.0), &[], &opts),
        SpecError::NoPrompts
    );
    assert_eq!(
        run(&identical(&draft, 1, 1.0), &[vec![1], vec![]], &opts),
        SpecError::EmptyPrompt { index: 1 }
    );
    let vocab = model.config.vocab_size;
    assert_eq!(
        run(
            &[Draft::lookup(PromptLookup::default())],
            &[vec![1], vec![2, vocab as u32]],
            &opts
        ),
        SpecError::PromptTokenOutOfVocab {
            index: 1,
            token: vocab as u32,
            vocab
        }
    );
    for layers in [0, model.config.num_layers + 1] {
        assert_eq!(
            truncated_draft(&model, layers).unwrap_err(),
            SpecError::DraftLayers {
                requested: layers,
                available: model.config.num_layers
            }
        );
    }
}

/// A one-token prompt (nothing to prefill) next to a longer one, and `max_new_tokens = 0`.
#[test]
fn one_token_prompts_and_zero_new_tokens() {
    let model = target();
    let draft = truncated_draft(&model, DRAFT_LAYERS).unwrap();
    let tok = &checkpoint().tokenizer;
    let prompts = vec![
        tok.encode("Hello").unwrap(),
        tok.encode("The sky is").unwrap(),
    ];
    assert_eq!(prompts[0].len(), 1);
    let plain = plain_greedy(&model, &prompts, 6, &eos());
    let run = |n: usize| {
        speculative_generate(
            &model,
            &identical(&draft, 2, 1.0),
            &prompts,
            &ReferenceAttention,
            &options(Scheme::SpecTr, 3, 0.0, n),
            &mut |_, _| {},
        )
        .unwrap()
    };
    assert_eq!(run(6).tokens, plain);
    let none = run(0);
    assert_eq!(none.tokens, vec![Vec::<u32>::new(); 2]);
    assert_eq!(none.stats.target_calls, 0);
}

/// A truncated-layer draft is the target's first layers, final norm and (tied) head.
#[test]
fn truncated_draft_shares_the_target_weights() {
    let model = target();
    let draft = truncated_draft(&model, 3).unwrap();
    assert_eq!(draft.layers.len(), 3);
    assert_eq!(draft.config.num_layers, 3);
    let full = model.embed.val().into_data();
    assert_eq!(draft.embed.val().into_data(), full);
    for (a, b) in draft.layers.iter().zip(&model.layers) {
        assert_eq!(a.wq.val().into_data(), b.wq.val().into_data());
        assert_eq!(a.w_down.val().into_data(), b.w_down.val().into_data());
    }
    assert_eq!(
        draft.norm.gamma.val().into_data(),
        model.norm.gamma.val().into_data()
    );
    let ids = checkpoint()
        .tokenizer
        .encode("The capital of France is")
        .unwrap();
    assert!(last_logits(&draft, &ids).iter().all(|x| x.is_finite()));
}

/// A compressed target cache (in a [`LinearSpecCache`]) of `kind`, with ShadowKV's rank at the
/// full key width (exact keys) and a budget over the whole prompt, so that it attends exactly
/// as the full cache does while still offloading values and selecting chunks.
fn compressed_cache(model: &Llama, kind: CacheKind) -> LinearSpecCache {
    let mut spec = CacheSpec::new(kind);
    let cfg = &model.config;
    spec.shadowkv = ShadowKvConfig {
        rank: cfg.num_kv_heads * cfg.head_dim,
        chunk: 2,
        budget: 64,
        local_chunks: 1,
        outlier_chunks: 1,
        min_prompt: 4,
    };
    spec.quant.residual = 4;
    LinearSpecCache::new(spec.build_for(cfg).expect("valid cache config"))
}

/// (d) Compressed caches speculate through truncation: with a greedy target, single-draft SD on
/// a full cache and on ShadowKV (exact keys, whole-prompt budget) wrapped as linear caches
/// emits exactly plain greedy decoding's tokens; with sampling on 4-bit KIVI the cache ends
/// holding prompt + emitted − 1 positions; and a full linear cache continued after the
/// rollbacks gives a fresh forward pass's logits.
#[test]
fn linear_caches_speculate_with_one_draft() {
    let model = target();
    let draft = truncated_draft(&model, EXACTNESS_DRAFT_LAYERS).unwrap();
    let prompt = vec![prompts()[1].clone()];
    const N: usize = 12;
    let plain = plain_greedy(&model, &prompt, N, &eos());
    for kind in [CacheKind::Full, CacheKind::ShadowKv] {
        let g = speculative_generate_with_cache(
            &model,
            compressed_cache(&model, kind),
            &identical(&draft, 1, 0.7),
            &prompt,
            &ReferenceAttention,
            &options(Scheme::SingleDraft, 3, 0.0, N),
            &mut |_, _| {},
        )
        .unwrap();
        println!(
            "{:?} ({}): block efficiency {:.2}, {} bytes held",
            kind,
            g.target_cache.name(),
            g.stats.block_efficiency(),
            g.target_cache.bytes_held()
        );
        assert!(g.stats.accepted > 0, "{kind:?}: some draft token accepted");
        assert_eq!(g.tokens, plain, "{kind:?}");
        assert_eq!(g.target_cache.seq_len(), prompt[0].len() + N - 1);
    }

    for (kind, scheme) in [
        (CacheKind::Quant4, Scheme::SequentialImportance),
        (CacheKind::Full, Scheme::SingleDraft),
    ] {
        let g = speculative_generate_with_cache(
            &model,
            compressed_cache(&model, kind),
            &identical(&draft, 1, 1.0),
            &prompt,
            &ReferenceAttention,
            &options(scheme, 3, 1.0, N),
            &mut |_, _| {},
        )
        .unwrap();
        let new = &g.tokens[0];
        assert!(!new.is_empty() && new.len() <= N);
        let mut cache = g.target_cache;
        assert_eq!(cache.seq_len(), prompt[0].len() + new.len() - 1, "{kind:?}");
        if kind == CacheKind::Full {
            let seq = [prompt[0].as_slice(), new].concat();
            let last = Tensor::<2, Int>::from_data(
                TensorData::new(vec![i64::from(*new.last().unwrap())], [1, 1]),
                &Device::flex(),
            );
            let hidden = model.forward(last, &[], &mut cache, &ReferenceAttention);
            let cont = model
                .logits(hidden)
                .into_data()
                .try_to_vec::<f32>()
                .unwrap();
            let diff = max_abs_diff(&cont, &last_logits(&model, &seq));
            println!("full linear cache after rollback: max |Δlogit| {diff:.2e}");
            assert!(diff < 1e-3, "max |Δlogit| {diff}");
        }
    }
}

/// A linear cache holds one sequence and one branch, and must start empty.
#[test]
fn linear_cache_layout_errors_are_typed() {
    let model = target();
    let draft = truncated_draft(&model, 2).unwrap();
    let prompts = prompts();
    let opts = options(Scheme::SpecInfer, 2, 0.0, 4);
    let run = |cache: LinearSpecCache, k: usize, prompts: &[Vec<u32>]| {
        speculative_generate_with_cache(
            &model,
            cache,
            &identical(&draft, k, 1.0),
            prompts,
            &ReferenceAttention,
            &opts,
            &mut |_, _| {},
        )
        .unwrap_err()
    };
    let layout = |batch, drafts| SpecError::CacheLayout {
        cache: "full".into(),
        max_batch: 1,
        max_fan: 1,
        batch,
        drafts,
    };
    let full = || compressed_cache(&model, CacheKind::Full);
    assert_eq!(run(full(), 2, &prompts[..1]), layout(1, 2));
    assert_eq!(run(full(), 1, &prompts), layout(2, 1));
    let mut used = full();
    let ids = Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 2], [1, 2]), &Device::flex());
    draft.forward(ids, &[], &mut used, &ReferenceAttention);
    assert_eq!(
        run(used, 1, &prompts[..1]),
        SpecError::CacheNotEmpty { held: 2 }
    );
}

/// (e) Prompt-lookup drafts: with a greedy target, a lookup draft alone (K = 1, SD, on the
/// branching cache for a batch of two and on a linear full cache) and a lookup draft beside a
/// model draft (K = 2, SpecInfer) emit exactly plain greedy decoding's tokens; on a prompt that
/// repeats itself the lookup drafts are accepted.
#[test]
fn lookup_drafts_match_plain_greedy() {
    let model = target();
    let tok = &checkpoint().tokenizer;
    let repeating = tok
        .encode(
            "The grass is green. The sky is blue. The sun is yellow. Here we go. There and \
             back again. The grass is green. The sky is blue. The sun is yellow. Here we go. \
             There and back again. The grass is green. The sky is blue.",
        )
        .unwrap();
    let batch = vec![repeating.clone(), prompts()[0].clone()];
    const N: usize = 12;
    let plain = plain_greedy(&model, &batch, N, &eos());
    let lookup = Draft::lookup(PromptLookup::default());

    let g = speculative_generate(
        &model,
        &[lookup],
        &batch,
        &ReferenceAttention,
        &options(Scheme::SingleDraft, 4, 0.0, N),
        &mut |_, _| {},
    )
    .unwrap();
    let s = &g.stats;
    println!(
        "lookup K=1 batch 2: block efficiency {:.2}, {} target calls, {} draft calls",
        s.block_efficiency(),
        s.target_calls,
        s.draft_calls
    );
    assert_eq!(g.tokens, plain);
    assert_eq!(s.draft_calls, 0, "a lookup draft runs no model");
    assert!(g.draft_caches.is_empty());
    assert!(s.accepted > 0, "lookup drafts accepted");

    let one = vec![repeating];
    let g = speculative_generate_with_cache(
        &model,
        compressed_cache(&model, CacheKind::Full),
        &[lookup],
        &one,
        &ReferenceAttention,
        &options(Scheme::SingleDraft, 3, 0.0, N),
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!(g.tokens[0], plain[0], "linear cache");
    let e = g.stats.block_efficiency();
    println!("lookup K=1 L=3, the repeating prompt alone: block efficiency {e:.2}");
    assert!(
        e > 2.0,
        "the repeating prompt's continuation is drafted: {e:.2}"
    );
    assert_eq!(g.target_cache.seq_len(), one[0].len() + N - 1);

    let draft = truncated_draft(&model, DRAFT_LAYERS).unwrap();
    let mixed = [lookup, Draft::model(&draft, sampling(0.7))];
    let g = speculative_generate(
        &model,
        &mixed,
        &batch,
        &ReferenceAttention,
        &options(Scheme::SpecInfer, 2, 0.0, N),
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!(g.tokens, plain, "lookup + model, SpecInfer");
    assert!(g.stats.draft_calls > 0);
    assert_eq!(g.draft_caches.len(), 1, "one cache, for the model draft");
}
