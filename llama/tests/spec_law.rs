//! Sampled speculative decoding has the target's law: whole two-token continuations drawn by
//! `speculative_generate` (K = 2 drafts of another random model, L = 3) against the exact law of
//! plain sampling from the target, computed from its logits, on a tiny random-weight Llama
//! (vocabulary 8, CPU). A χ² test per scheme (cells expected below 5 pooled); shown able to fail
//! against a wrong law.

use crate::common::{last_logits, tiny_config};
use burn_kernels_testing::chi_square_p_value;

use burn::tensor::{DType, Device};
use burn_kernels_core::{ReferenceAttention, SamplingConfig};
use burn_llama::model::Llama;
use burn_llama::spec::{Draft, SpecOptions, speculative_generate};
use burn_specdec::Scheme;

const V: usize = 8;
const PROMPT: [u32; 2] = [1, 5];
/// Sequences per call (independent: one verification stream per sequence and block).
const BATCH: usize = 250;
const CALLS: u64 = 40;
const TARGET_T: f32 = 0.4;
const DRAFT_T: f32 = 1.0;

fn tiny(seed: u64) -> Llama {
    let device = Device::flex();
    device.seed(seed);
    Llama::random(&tiny_config(V, 1, 16), &device, DType::F32)
}

/// The next-token law after `tokens` at temperature `t`, in f64.
fn next_law(model: &Llama, tokens: &[u32], t: f32) -> Vec<f64> {
    let z: Vec<f64> = last_logits(model, tokens)
        .iter()
        .map(|&l| l as f64 / t as f64)
        .collect();
    let max = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = z.iter().map(|&x| (x - max).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

/// The law of two sampled tokens after the prompt, `[t1 · V + t2]`.
fn two_token_law(model: &Llama, t: f32) -> Vec<f64> {
    let first = next_law(model, &PROMPT, t);
    let mut law = vec![0.0; V * V];
    for (t1, &p1) in first.iter().enumerate() {
        let second = next_law(model, &[PROMPT[0], PROMPT[1], t1 as u32], t);
        for (t2, &p2) in second.iter().enumerate() {
            law[t1 * V + t2] = p1 * p2;
        }
    }
    law
}

/// A χ² p-value below this rejects a law (per scheme).
const P_MIN: f64 = 1e-4;

fn counts(scheme: Scheme, target: &Llama, draft: &Llama) -> Vec<u64> {
    let drafts = vec![
        Draft::model(
            draft,
            SamplingConfig {
                temperature: DRAFT_T,
                ..SamplingConfig::default()
            }
        );
        2
    ];
    let prompts = vec![PROMPT.to_vec(); BATCH];
    let mut counts = vec![0u64; V * V];
    for call in 0..CALLS {
        let opts = SpecOptions {
            scheme,
            draft_len: 3,
            target_sampling: SamplingConfig {
                temperature: TARGET_T,
                ..SamplingConfig::default()
            },
            max_new_tokens: 2,
            stop_tokens: Vec::new(),
            seed: 1000 + call,
        };
        let g = speculative_generate(
            target,
            &drafts,
            &prompts,
            &ReferenceAttention,
            &opts,
            &mut |_, _| {},
        )
        .expect("valid configuration");
        for t in &g.tokens {
            assert_eq!(t.len(), 2, "{t:?}");
            counts[t[0] as usize * V + t[1] as usize] += 1;
        }
    }
    counts
}

#[test]
fn sampled_speculation_has_the_targets_law() {
    let target = tiny(3);
    let draft = tiny(4);
    let law = two_token_law(&target, TARGET_T);
    // A wrong law the test must reject: the target at the drafts' temperature.
    let wrong = two_token_law(&target, DRAFT_T);
    for scheme in [
        Scheme::SpecInfer,
        Scheme::SpecTr,
        Scheme::SequentialImportance,
        Scheme::OPTIMAL,
    ] {
        let c = counts(scheme, &target, &draft);
        let p = chi_square_p_value(&c, &law);
        let wrong_p = chi_square_p_value(&c, &wrong);
        println!(
            "{}: χ² p-value {p:.3e} against the target's law, {wrong_p:.1e} against the wrong one",
            scheme.name()
        );
        assert!(
            p >= P_MIN,
            "{}: χ² p-value {p:.3e} against the target's law; counts {c:?}",
            scheme.name()
        );
        assert!(
            wrong_p < P_MIN,
            "{}: the test cannot tell the target's law from a wrong one (p {wrong_p:.3e})",
            scheme.name()
        );
    }
}

/// Speculation past the model's context stops with a typed error (it read RoPE angles past the
/// tables before), not a panic.
#[test]
fn speculation_past_the_context_is_a_typed_error() {
    use burn_llama::model::ForwardError;
    use burn_llama::spec::SpecError;
    let target = tiny(3);
    let drafts = vec![Draft::model(&target, SamplingConfig::default()); 2];
    let opts = SpecOptions {
        scheme: Scheme::SpecTr,
        draft_len: 3,
        target_sampling: SamplingConfig::default(),
        max_new_tokens: 40,
        stop_tokens: Vec::new(),
        seed: 1,
    };
    let err = speculative_generate(
        &target,
        &drafts,
        &[PROMPT.to_vec()],
        &ReferenceAttention,
        &opts,
        &mut |_, _| {},
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            SpecError::Forward(ForwardError::ContextTooLong { max: 16, .. })
        ),
        "{err:?}"
    );
}
