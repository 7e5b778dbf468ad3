//! Prefill + decode with a KV cache, batched prompts of different lengths, sampling, stop
//! tokens, streaming, and perplexity.

use std::time::Instant;

use burn::tensor::{Int, Tensor, TensorData, activation};
use burn_kernels_core::{AttentionImpl, FullKvCache, KvCache, Sampler, TensorOps};

use crate::model::Llama;

/// Options of [`generate`].
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// Generation of a sequence stops after it emits one of these.
    pub stop_tokens: Vec<u32>,
}

/// Why [`generate`] refused its input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GenerateError {
    #[error("no prompts to continue")]
    NoPrompts,
    #[error("prompt {index} is empty: every prompt needs at least one token")]
    EmptyPrompt { index: usize },
    /// The model's forward pass failed (its KV cache could not attend).
    #[error(transparent)]
    Forward(#[from] crate::model::ForwardError),
    /// Perplexity scores each token after the first: it needs two.
    #[error("perplexity needs at least two tokens, got {got}")]
    TooFewTokens { got: usize },
    /// The longest prompt plus the new tokens reach past the positions the model's RoPE tables
    /// cover (its context length).
    #[error(
        "context too long: {prompt} prompt tokens + {new_tokens} new tokens need {needed} \
         positions, the model covers {max}"
    )]
    ContextTooLong {
        prompt: usize,
        new_tokens: usize,
        needed: usize,
        max: usize,
    },
    /// The device failed to run the step (a kernel launch or an allocation failed); the
    /// runtime's own message.
    #[error("the device failed to run the step: {0}")]
    Device(String),
}

/// Positions a generation of `new_tokens` after a `prompt`-token prompt feeds through the model:
/// the prompt's, then every new token but the last (which is sampled, not fed back).
pub fn positions_needed(prompt: usize, new_tokens: usize) -> usize {
    prompt + new_tokens.saturating_sub(1)
}

/// What [`generate`] produced and how fast.
#[derive(Debug, Clone)]
pub struct Generation {
    /// The new tokens of each prompt (a stop token, if hit, is the last one).
    pub tokens: Vec<Vec<u32>>,
    pub prefill_tokens: usize,
    pub prefill_secs: f64,
    pub decode_steps: usize,
    pub decode_secs: f64,
    /// KV-cache bytes held at the end.
    pub cache_bytes: usize,
}

impl Generation {
    /// Prompt tokens processed per second (all sequences).
    pub fn prefill_tokens_per_sec(&self) -> f64 {
        self.prefill_tokens as f64 / self.prefill_secs.max(1e-9)
    }

    /// New tokens per second over the decode steps (all sequences).
    pub fn decode_tokens_per_sec(&self) -> f64 {
        (self.decode_steps * self.tokens.len()) as f64 / self.decode_secs.max(1e-9)
    }
}

/// The last position's logits of every row, on the host, through `attention`'s layer ops
/// where it has them (with [`burn_kernels_core::FusedOps`] a few rows take the GEMV kernels,
/// the tied head the GEMV-T).
///
/// # Errors
/// [`GenerateError::Device`] when the device failed to compute them.
pub(crate) fn last_logits(
    model: &Llama,
    hidden: Tensor<3>,
    attention: &dyn AttentionImpl,
) -> Result<Vec<Vec<f32>>, GenerateError> {
    let [b, s, h] = hidden.dims();
    let last = hidden.slice([0..b, s - 1..s, 0..h]);
    let ops = attention.layer_ops().unwrap_or(&TensorOps);
    let logits = model.logits_with(last, ops);
    let vocab = logits.dims()[2];
    host_rows(logits.reshape([b, vocab]))
}

/// `[rows, vocab]` f32 logits read to the host, one vector per row.
///
/// # Errors
/// [`GenerateError::Device`] when the device failed to compute them (a failed launch or
/// allocation surfaces at this read).
pub(crate) fn host_rows(logits: Tensor<2>) -> Result<Vec<Vec<f32>>, GenerateError> {
    let [_, vocab] = logits.dims();
    let data = host_logits(logits)?;
    Ok(data.chunks(vocab).map(<[f32]>::to_vec).collect())
}

/// `[rows, vocab]` f32 logits read back to the host, row after row.
pub(crate) fn host_logits(logits: Tensor<2>) -> Result<Vec<f32>, GenerateError> {
    Ok(logits
        .try_into_data()
        .map_err(|e| GenerateError::Device(e.to_string()))?
        .try_to_vec::<f32>()
        .expect("logits are f32"))
}

/// The prompts left-padded into one `[batch, longest]` batch (each row padded with its own
/// first token, masked) and each row's padding, after checking them.
///
/// # Errors
/// [`GenerateError`] for no prompts, an empty prompt, or a prompt plus `max_new_tokens` longer
/// than the model's context.
pub(crate) fn padded_batch(
    model: &Llama,
    prompts: &[Vec<u32>],
    max_new_tokens: usize,
) -> Result<(Tensor<2, Int>, Vec<usize>), GenerateError> {
    if prompts.is_empty() {
        return Err(GenerateError::NoPrompts);
    }
    if let Some(index) = prompts.iter().position(Vec::is_empty) {
        return Err(GenerateError::EmptyPrompt { index });
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let needed = positions_needed(longest, max_new_tokens);
    let max = model.max_positions();
    if needed > max {
        return Err(GenerateError::ContextTooLong {
            prompt: longest,
            new_tokens: max_new_tokens,
            needed,
            max,
        });
    }
    let b = prompts.len();
    let pad: Vec<usize> = prompts.iter().map(|p| longest - p.len()).collect();
    let ids: Vec<i64> = prompts
        .iter()
        .zip(&pad)
        .flat_map(|(p, &n)| std::iter::repeat_n(p[0] as i64, n).chain(p.iter().map(|&t| t as i64)))
        .collect();
    let device = model.embed.device();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [b, longest]), &device);
    Ok((tokens, pad))
}

/// Generates a continuation of every prompt.
///
/// Prompts of different lengths are left-padded into one batch (padding is masked and RoPE
/// positions start at each prompt's first token), so each gets the tokens it would get alone.
/// `on_token(i, token)` is called as each token of prompt `i` is produced.
///
/// # Errors
/// [`GenerateError`] for no prompts, an empty prompt, or a prompt plus `max_new_tokens` longer
/// than the model's context ([`Llama::max_positions`]); nothing runs then.
pub fn generate(
    model: &Llama,
    prompts: &[Vec<u32>],
    cache: &mut dyn KvCache,
    attention: &dyn AttentionImpl,
    sampler: &mut dyn Sampler,
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(usize, u32),
) -> Result<Generation, GenerateError> {
    let (tokens, pad) = padded_batch(model, prompts, opts.max_new_tokens)?;
    let device = model.embed.device();
    let b = prompts.len();

    let t0 = Instant::now();
    let hidden = model.try_forward(tokens, &pad, cache, attention)?;
    let mut logits = last_logits(model, hidden, attention)?;
    let prefill_secs = t0.elapsed().as_secs_f64();

    let mut rows = Rows::new(b, opts);
    let t1 = Instant::now();
    let mut steps = 0;
    while let Some(next) = rows.sample(&logits, sampler, opts, on_token) {
        let next = next.into_iter().map(i64::from).collect();
        let step = Tensor::<2, Int>::from_data(TensorData::new(next, [b, 1]), &device);
        let hidden = model.try_forward(step, &pad, cache, attention)?;
        logits = last_logits(model, hidden, attention)?;
        steps += 1;
    }
    Ok(Generation {
        tokens: rows.out,
        prefill_tokens: prompts.iter().map(Vec::len).sum(),
        prefill_secs,
        decode_steps: steps,
        decode_secs: t1.elapsed().as_secs_f64(),
        cache_bytes: cache.bytes_held(),
    })
}

/// The new tokens of each row of a generation, and which rows are done.
pub(crate) struct Rows {
    pub out: Vec<Vec<u32>>,
    done: Vec<bool>,
}

impl Rows {
    pub fn new(batch: usize, opts: &GenerateOptions) -> Self {
        Self {
            out: vec![Vec::new(); batch],
            done: vec![opts.max_new_tokens == 0; batch],
        }
    }

    /// Samples every row's next token from its logits, keeps (and reports) those of the rows
    /// still running, and returns them all as the next step's input; `None` once every row is
    /// done (a stop token, or `max_new_tokens`).
    pub fn sample(
        &mut self,
        logits: &[Vec<f32>],
        sampler: &mut dyn Sampler,
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Option<Vec<u32>> {
        let mut next = Vec::with_capacity(self.out.len());
        for (i, row) in logits.iter().enumerate() {
            let tok = sampler.sample(row);
            if !self.done[i] {
                self.out[i].push(tok);
                on_token(i, tok);
                self.done[i] =
                    opts.stop_tokens.contains(&tok) || self.out[i].len() >= opts.max_new_tokens;
            }
            next.push(tok);
        }
        (!self.done.iter().all(|&d| d)).then_some(next)
    }
}

/// Perplexity of `tokens` under the model: `exp(mean −log p(tᵢ | t<ᵢ))` over positions 1.., in
/// one forward pass with a full cache.
///
/// # Errors
/// [`GenerateError::TooFewTokens`] for fewer than two tokens; [`GenerateError::Forward`] for more
/// than the model's context ([`Llama::max_positions`]) or a failed forward pass.
pub fn perplexity(
    model: &Llama,
    tokens: &[u32],
    attention: &dyn AttentionImpl,
) -> Result<f64, GenerateError> {
    let n = tokens.len();
    if n < 2 {
        return Err(GenerateError::TooFewTokens { got: n });
    }
    let device = model.embed.device();
    let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
    let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, n]), &device);
    let mut cache = FullKvCache::new(model.config.num_layers);
    let hidden = model.try_forward(input, &[], &mut cache, attention)?;
    let [_, _, h] = hidden.dims();
    let logits = model.logits(hidden.slice([0..1, 0..n - 1, 0..h]));
    let log_probs = activation::log_softmax(logits, 2);
    let targets: Vec<i64> = tokens[1..].iter().map(|&t| t as i64).collect();
    let targets = Tensor::<3, Int>::from_data(TensorData::new(targets, [1, n - 1, 1]), &device);
    let nll = log_probs.gather(2, targets).neg().mean();
    let nll = nll.into_data().try_to_vec::<f32>().expect("f32")[0] as f64;
    Ok(nll.exp())
}
