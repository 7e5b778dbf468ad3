//! Sequence-level distillation data for speculative-decoding drafts: continuations of the
//! training text sampled from the target model (re-exported by [`crate::finetune`]).

use burn_kernels_core::{AttentionImpl, FullKvCache, SamplingConfig};
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::finetune::TrainError;
use crate::generate::{GenerateOptions, generate};
use crate::model::Llama;

/// How [`teacher_samples`] draws its training text.
#[derive(Debug, Clone)]
pub struct TeacherOptions {
    /// Samples to draw.
    pub samples: usize,
    /// Prompt tokens of each sample: a window of the source text at a random position.
    pub prompt_len: usize,
    /// Tokens of each sample, prompt included (the training window, `seq + 1`).
    pub sample_len: usize,
    /// Prompts decoded together.
    pub batch: usize,
    pub temperature: f32,
    pub seed: u64,
}

/// Sequence-level distillation data: continuations of random windows of `source` sampled from
/// `teacher` (no stop tokens, so every sample has `sample_len` tokens: the prompt, then what
/// the teacher wrote). A draft trained on them learns the teacher's distribution, which is
/// what raises speculative acceptance. `on_batch(done)` reports progress.
///
/// # Errors
/// [`TrainError::Config`] for zero sizes, `prompt_len >= sample_len`, a source shorter than a
/// prompt, or a sample longer than the teacher's context.
pub fn teacher_samples(
    teacher: &Llama,
    source: &[u32],
    opts: &TeacherOptions,
    attention: &dyn AttentionImpl,
    mut on_batch: impl FnMut(usize),
) -> Result<Vec<Vec<u32>>, TrainError> {
    let bad = |why: &str| Err(TrainError::Config(format!("teacher samples: {why}")));
    if opts.samples == 0 || opts.batch == 0 || opts.prompt_len == 0 {
        return bad("samples, batch and prompt length must be at least 1");
    }
    if opts.prompt_len >= opts.sample_len {
        return bad("the prompt must be shorter than the sample");
    }
    if source.len() < opts.prompt_len {
        return bad("the source text is shorter than one prompt");
    }
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let mut out = Vec::with_capacity(opts.samples);
    while out.len() < opts.samples {
        let n = opts.batch.min(opts.samples - out.len());
        let prompts: Vec<Vec<u32>> = (0..n)
            .map(|_| {
                let s = rng.random_range(0..=source.len() - opts.prompt_len);
                source[s..s + opts.prompt_len].to_vec()
            })
            .collect();
        let mut cache = FullKvCache::new(teacher.config.num_layers);
        let sampling = SamplingConfig {
            temperature: opts.temperature,
            seed: opts.seed ^ (out.len() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            ..SamplingConfig::default()
        };
        let g = generate(
            teacher,
            &prompts,
            &mut cache,
            attention,
            sampling.build().as_mut(),
            &GenerateOptions {
                max_new_tokens: opts.sample_len - opts.prompt_len,
                stop_tokens: Vec::new(),
            },
            &mut |_, _| {},
        )
        .map_err(|e| TrainError::Config(format!("teacher samples: {e}")))?;
        out.extend(prompts.into_iter().zip(g.tokens).map(|(mut p, t)| {
            p.extend(t);
            p
        }));
        on_batch(out.len());
    }
    Ok(out)
}
