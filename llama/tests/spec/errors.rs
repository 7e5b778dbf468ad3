//! Typed errors for bad configurations and cache layouts, and edge-case prompts.

use crate::common::checkpoint;

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_kernels_core::ReferenceAttention;
use burn_llama::eval::CacheKind;
use burn_llama::spec::{
    Draft, LinearSpecCache, SpecError, SpecOptions, speculative_generate,
    speculative_generate_with_cache, truncated_draft,
};
use burn_specdec::{PromptLookup, Scheme};

use super::fixtures::*;

pub(super) fn bad_configurations_are_typed_errors() {
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
pub(super) fn one_token_prompts_and_zero_new_tokens() {
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

/// A linear cache holds one sequence and one branch, and must start empty.
pub(super) fn linear_cache_layout_errors_are_typed() {
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
