//! The caches after speculation: rollback to the emitted tokens, truncated drafts sharing the
//! target's weights, and compressed (linear) target caches.

use crate::common::{checkpoint, last_logits};

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_kernels_core::{KvCache, ReferenceAttention};
use burn_llama::eval::CacheKind;
use burn_llama::model::Llama;
use burn_llama::spec::{
    BranchKvCache, Draft, speculative_generate, speculative_generate_with_cache, truncated_draft,
};
use burn_specdec::Scheme;

use super::fixtures::*;

/// (c) Rollback: after a sampled run the target cache holds exactly prompt + generated − 1
/// tokens per sequence (the last emitted token is fed by the next call, as in plain
/// generation), and continuing every cache (target and both draft models) gives the logits of a
/// fresh forward pass over the same tokens.
pub(super) fn caches_hold_exactly_the_emitted_tokens_after_rollback() {
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

/// A truncated-layer draft is the target's first layers, final norm and (tied) head.
pub(super) fn truncated_draft_shares_the_target_weights() {
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

/// (d) Compressed caches speculate through truncation: with a greedy target, single-draft SD on
/// a full cache and on ShadowKV (exact keys, whole-prompt budget) wrapped as linear caches
/// emits exactly plain greedy decoding's tokens; with sampling on 4-bit KIVI the cache ends
/// holding prompt + emitted − 1 positions; and a full linear cache continued after the
/// rollbacks gives a fresh forward pass's logits.
pub(super) fn linear_caches_speculate_with_one_draft() {
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
