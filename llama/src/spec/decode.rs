//! The speculative decode loop: prefill, drafting, batched verification of every draft's
//! block, acceptance and rollback.

use std::time::Instant;

use burn_kernels_core::AttentionImpl;
use burn_specdec::Scheme;
use rand::{SeedableRng, rngs::StdRng};

use crate::model::Llama;

use super::block::{Loop, group_drafts};
use super::rows::{Distribution, forward_rows};
use super::*;

pub(super) fn validate(
    target: &Llama,
    drafts: &[Draft<'_>],
    prompts: &[Vec<u32>],
    opts: &SpecOptions,
) -> Result<(), SpecError> {
    if drafts.is_empty() {
        return Err(SpecError::NoDrafts);
    }
    if opts.draft_len == 0 {
        return Err(SpecError::ZeroDraftLength);
    }
    if opts.scheme == Scheme::SingleDraft && drafts.len() != 1 {
        return Err(SpecError::SingleDraftNeedsOneDraft {
            drafts: drafts.len(),
        });
    }
    let expected = target.config.vocab_size;
    for (k, model) in drafts
        .iter()
        .enumerate()
        .filter_map(|(k, d)| Some((k, d.model_ref()?)))
    {
        let found = model.config.vocab_size;
        if found != expected {
            return Err(SpecError::VocabularyMismatch {
                draft: k,
                expected,
                found,
            });
        }
    }
    if prompts.is_empty() {
        return Err(SpecError::NoPrompts);
    }
    if let Some(index) = prompts.iter().position(Vec::is_empty) {
        return Err(SpecError::EmptyPrompt { index });
    }
    for (index, prompt) in prompts.iter().enumerate() {
        if let Some(&token) = prompt.iter().find(|&&t| t as usize >= expected) {
            return Err(SpecError::PromptTokenOutOfVocab {
                index,
                token,
                vocab: expected,
            });
        }
    }
    Ok(())
}

/// Prefills `cache` with every prompt token but the last (the first block feeds the last).
fn prefill(
    model: &Llama,
    cache: &mut dyn SpecCache,
    prompts: &[Vec<u32>],
    attention: &dyn AttentionImpl,
) -> Result<(), SpecError> {
    let rows: Vec<Vec<u32>> = prompts.iter().map(|p| p[..p.len() - 1].to_vec()).collect();
    if rows.iter().any(|r| !r.is_empty()) {
        forward_rows(model, cache, &rows, attention)?;
    }
    Ok(())
}

/// Generates a continuation of every prompt by multi-draft speculative decoding (algorithm,
/// batching and metrics in the module docs). `on_token(i, token)` is called as each token of
/// prompt `i` is emitted.
///
/// # Errors
/// [`SpecError`] for a bad configuration (K = 0, L = 0, single-draft SD with K ≠ 1, a draft
/// vocabulary ≠ the target's, no or empty prompts, a prompt token outside the vocabulary);
/// [`SpecError::Verify`] if a scheme rejects its inputs.
pub fn speculative_generate(
    target: &Llama,
    drafts: &[Draft<'_>],
    prompts: &[Vec<u32>],
    attention: &dyn AttentionImpl,
    opts: &SpecOptions,
    on_token: &mut dyn FnMut(usize, u32),
) -> Result<SpecGeneration, SpecError> {
    let cache = BranchKvCache::new(target.layers.len(), prompts.len());
    speculative_generate_with_cache(target, cache, drafts, prompts, attention, opts, on_token)
}

/// Whether `cache` can be the target cache of `batch` prompts with `drafts` drafts: it holds
/// that many sequences and branch rows, and nothing yet.
///
/// # Errors
/// [`SpecError::CacheLayout`], [`SpecError::CacheNotEmpty`].
pub fn check_cache(cache: &dyn SpecCache, batch: usize, drafts: usize) -> Result<(), SpecError> {
    if cache.batch() != batch || drafts > cache.max_fan() {
        return Err(SpecError::CacheLayout {
            cache: cache.name(),
            max_batch: cache.batch(),
            max_fan: cache.max_fan(),
            batch,
            drafts,
        });
    }
    match cache.seq_len() {
        0 => Ok(()),
        held => Err(SpecError::CacheNotEmpty { held }),
    }
}

/// [`speculative_generate`] with the target's cache given: a [`BranchKvCache`] for
/// `prompts.len()` sequences, or a [`LinearSpecCache`] around a compressed cache (one prompt,
/// one draft). The drafts keep [`BranchKvCache`]s.
///
/// # Errors
/// Those of [`speculative_generate`]; [`SpecError::CacheLayout`] if the cache cannot hold the
/// batch or K branch rows, [`SpecError::CacheNotEmpty`] if it holds tokens.
pub fn speculative_generate_with_cache<C: SpecCache>(
    target: &Llama,
    mut target_cache: C,
    drafts: &[Draft<'_>],
    prompts: &[Vec<u32>],
    attention: &dyn AttentionImpl,
    opts: &SpecOptions,
    on_token: &mut dyn FnMut(usize, u32),
) -> Result<SpecGeneration<C>, SpecError> {
    validate(target, drafts, prompts, opts)?;
    check_cache(&target_cache, prompts.len(), drafts.len())?;
    let batch = prompts.len();
    let (groups, lookups) = group_drafts(drafts);
    let t0 = Instant::now();
    prefill(target, &mut target_cache, prompts, attention)?;
    let mut draft_caches: Vec<BranchKvCache> = groups
        .iter()
        .map(|g| {
            let mut cache = BranchKvCache::new(g.model.layers.len(), batch);
            prefill(g.model, &mut cache, prompts, attention)?;
            Ok(cache)
        })
        .collect::<Result<_, SpecError>>()?;
    let target_held: Vec<usize> = prompts.iter().map(|p| p.len() - 1).collect();
    let mut state = Loop {
        draft_held: vec![target_held.clone(); groups.len()],
        groups,
        lookups,
        target_dist: Distribution::new(opts.target_sampling),
        draft_dist: drafts
            .iter()
            .map(|d| Distribution::new(d.sampling))
            .collect(),
        attention,
        opts,
        vocab: target.config.vocab_size,
        seqs: prompts.to_vec(),
        target_held,
        out: vec![Vec::new(); batch],
        done: vec![opts.max_new_tokens == 0; batch],
        stats: SpecStats {
            num_drafts: drafts.len(),
            draft_len: opts.draft_len,
            accepted_at: vec![0; opts.draft_len],
            prefill_secs: t0.elapsed().as_secs_f64(),
            ..SpecStats::default()
        },
    };
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let t1 = Instant::now();
    while !state.active().is_empty() {
        let td = Instant::now();
        let drafted = state.draft(&mut draft_caches, &mut rng)?;
        state.stats.draft_secs += td.elapsed().as_secs_f64();
        let tt = Instant::now();
        let scored = state.score(target, &mut target_cache, &drafted)?;
        state.stats.target_secs += tt.elapsed().as_secs_f64();
        let tv = Instant::now();
        state.verify(
            &drafted,
            &scored,
            &mut target_cache,
            &mut draft_caches,
            on_token,
        )?;
        state.stats.verify_secs += tv.elapsed().as_secs_f64();
    }
    let mut stats = state.stats;
    stats.decode_secs = t1.elapsed().as_secs_f64();
    Ok(SpecGeneration {
        tokens: state.out,
        stats,
        target_cache,
        draft_caches,
    })
}
