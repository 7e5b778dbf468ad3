//! Speculative generation against plain generation: greedy exactness for every scheme, stop
//! tokens, sampled runs' limits and metrics, and prompt-lookup drafts.

use crate::common::checkpoint;

use std::sync::OnceLock;
use std::time::Instant;

use burn_kernels_core::{KvCache, ReferenceAttention};
use burn_llama::eval::CacheKind;
use burn_llama::spec::{
    Draft, speculative_generate, speculative_generate_with_cache, truncated_draft,
};
use burn_specdec::{PromptLookup, Scheme};

use super::fixtures::*;

/// (a) With a greedy target `scheme` reproduces plain greedy decoding, for K = 2 and 3 drafts
/// (sampled at temperature 0.7; K = 1 is single-draft SD's test) and L = 1 and 4 (SD: L = 1, 2,
/// 4), on a batch of two prompts of different lengths. Fewer (K, L) than a GPU could afford:
/// each is 16 tokens of a 30-layer target and a 24-layer draft on the CI's two CPU cores.
pub(super) fn greedy_matches_plain_greedy(scheme: Scheme) {
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

/// Greedy speculation stops exactly where plain greedy decoding does when a stop token is hit
/// inside an accepted block.
pub(super) fn greedy_speculation_stops_at_stop_tokens() {
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
pub(super) fn sampled_speculation_respects_limits_and_reports_metrics() {
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

/// (e) Prompt-lookup drafts: with a greedy target, a lookup draft alone (K = 1, SD, on the
/// branching cache for a batch of two and on a linear full cache) and a lookup draft beside a
/// model draft (K = 2, SpecInfer) emit exactly plain greedy decoding's tokens; on a prompt that
/// repeats itself the lookup drafts are accepted.
pub(super) fn lookup_drafts_match_plain_greedy() {
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
