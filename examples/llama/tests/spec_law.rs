//! Sampled speculative decoding has the target's law: whole two-token continuations drawn by
//! `speculative_generate` (K = 2 drafts of another random model, L = 3) against the exact law of
//! plain sampling from the target, computed from its logits, on a tiny random-weight Llama
//! (vocabulary 8, CPU). A χ² test per scheme; shown able to fail against a wrong law.

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_kernels_core::{FullKvCache, ReferenceAttention, SamplingConfig};
use burn_llama::config::LlamaConfig;
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
    let cfg = LlamaConfig {
        vocab_size: V,
        hidden_size: 16,
        intermediate_size: 24,
        num_layers: 1,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 8,
        max_seq_len: 16,
        ..LlamaConfig::smollm2_135m()
    };
    let device = Device::flex();
    device.seed(seed);
    Llama::random(&cfg, &device, DType::F32)
}

/// The next-token law after `tokens` at temperature `t`, in f64.
fn next_law(model: &Llama, tokens: &[u32], t: f32) -> Vec<f64> {
    let n = tokens.len();
    let ids: Vec<i64> = tokens.iter().map(|&x| x as i64).collect();
    let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, n]), &Device::flex());
    let mut cache = FullKvCache::new(model.config.num_layers);
    let hidden = model.forward(input, &[], &mut cache, &ReferenceAttention);
    let h = hidden.dims()[2];
    let logits = model.logits(hidden.slice([0..1, n - 1..n, 0..h]));
    let z: Vec<f64> = logits
        .into_data()
        .try_to_vec::<f32>()
        .unwrap()
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

/// Pearson's χ² of `counts` against `law`, cells expected below 5 pooled into one, and its
/// degrees of freedom.
fn chi_square(counts: &[u64], law: &[f64]) -> (f64, usize) {
    let n: u64 = counts.iter().sum();
    let (mut stat, mut cells) = (0.0, 0);
    let (mut pooled_c, mut pooled_e) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(law) {
        let e = p * n as f64;
        if e < 5.0 {
            pooled_c += c as f64;
            pooled_e += e;
        } else {
            stat += (c as f64 - e).powi(2) / e;
            cells += 1;
        }
    }
    if pooled_e > 0.0 {
        stat += (pooled_c - pooled_e).powi(2) / pooled_e.max(1e-12);
        cells += 1;
    }
    (stat, cells - 1)
}

/// The χ² value a statistic with `df` degrees of freedom exceeds with probability 1e-4
/// (Wilson–Hilferty: `(χ²/df)^(1/3)` is close to normal; z = 3.719).
fn critical(df: usize) -> f64 {
    let k = df as f64;
    let v = 2.0 / (9.0 * k);
    k * (1.0 - v + 3.719 * v.sqrt()).powi(3)
}

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
        Scheme::ImportanceSampling,
        Scheme::OPTIMAL,
    ] {
        let c = counts(scheme, &target, &draft);
        let (stat, df) = chi_square(&c, &law);
        assert!(
            stat <= critical(df),
            "{}: χ² {stat:.1} > {:.1} ({df} df) against the target's law; counts {c:?}",
            scheme.name(),
            critical(df)
        );
        let (wrong_stat, wrong_df) = chi_square(&c, &wrong);
        println!(
            "{}: χ² {stat:.1} ({df} df, bound {:.1}); against the wrong law {wrong_stat:.1}",
            scheme.name(),
            critical(df)
        );
        assert!(
            wrong_stat > critical(wrong_df),
            "{}: the test cannot tell the target's law from a wrong one (χ² {wrong_stat:.1})",
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
