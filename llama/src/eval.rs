//! Perplexity read through a (compressed) KV cache, and the KV-cache choices of the CLI and
//! the `kv_table` example.
//!
//! [`perplexity_with_cache`] prefills the first `prefix_len` tokens into the cache, then
//! scores the rest teacher-forced in decode steps of a few tokens, each step attending over
//! what the cache holds (compressed) plus its own new tokens. Its perplexity covers the
//! positions `prefix_len..n` only: the prefill is computed exactly by every cache here
//! (compression happens after a call's attention), so scoring it would dilute the
//! difference between caches.

use burn::tensor::{Int, Tensor, TensorData, activation};
use burn_kernels_core::{AttentionImpl, FullKvCache, KvCache, Sampler};
use burn_kvcache::{
    DecodeTimings, KvCacheError, MiniCacheConfig, MiniCacheKv, QuantConfig, QuantKv, RopeParams,
    ShadowKvCache, ShadowKvConfig,
};

use crate::config::LlamaConfig;
use crate::model::Llama;

/// Tokens per teacher-forced decode step of [`perplexity_with_cache`].
pub const DEFAULT_CHUNK: usize = 4;

/// What [`perplexity_with_cache`] measured.
#[derive(Debug, Clone)]
pub struct CacheEval {
    /// The cache's name.
    pub cache: String,
    /// `exp(mean −log p)` over the scored positions.
    pub perplexity: f64,
    /// Positions scored (`tokens.len() − prefix_len`).
    pub scored: usize,
    /// Positions cached at the end.
    pub cached: usize,
    /// `KvCache::bytes_held` at the end.
    pub bytes_held: usize,
    /// What a full cache holds for the same positions.
    pub full_bytes: usize,
}

impl CacheEval {
    /// `full_bytes / bytes_held`.
    pub fn compression(&self) -> f64 {
        self.full_bytes as f64 / self.bytes_held.max(1) as f64
    }
}

/// Bytes of an uncompressed cache of `seq` positions of `batch` sequences.
pub fn full_kv_bytes(config: &LlamaConfig, batch: usize, seq: usize, dtype_size: usize) -> usize {
    config.num_layers * 2 * batch * config.num_kv_heads * seq * config.head_dim * dtype_size
}

/// [`perplexity_with_cache_chunked`] with steps of [`DEFAULT_CHUNK`] tokens.
pub fn perplexity_with_cache(
    model: &Llama,
    tokens: &[u32],
    prefix_len: usize,
    cache: &mut dyn KvCache,
    attention: &dyn AttentionImpl,
) -> CacheEval {
    perplexity_with_cache_chunked(model, tokens, prefix_len, cache, attention, DEFAULT_CHUNK)
}

/// Prefills `tokens[..prefix_len]` into `cache` (which must be empty), then feeds the rest in
/// steps of `chunk` tokens and scores every token from `prefix_len` on by the logits of the
/// position before it. The last token is scored but never fed.
///
/// # Panics
/// Unless `1 ≤ prefix_len < tokens.len()` and `chunk ≥ 1`.
pub fn perplexity_with_cache_chunked(
    model: &Llama,
    tokens: &[u32],
    prefix_len: usize,
    cache: &mut dyn KvCache,
    attention: &dyn AttentionImpl,
    chunk: usize,
) -> CacheEval {
    let n = tokens.len();
    assert!(
        prefix_len >= 1 && prefix_len < n && chunk >= 1,
        "need 1 ≤ prefix_len < tokens.len() and chunk ≥ 1"
    );
    assert_eq!(cache.seq_len(), 0, "the cache must start empty");
    let device = model.embed.device();
    let dtype_size = model.embed.val().dtype().size();
    let run = |cache: &mut dyn KvCache, from: usize, to: usize| -> f64 {
        // Feeds tokens[from..to] and scores tokens[from + 1..=to] (to ≤ n − 1).
        let ids: Vec<i64> = tokens[from..to].iter().map(|&t| t as i64).collect();
        let len = to - from;
        let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, len]), &device);
        let hidden = model.forward(input, &[], cache, attention);
        let log_probs = activation::log_softmax(model.logits(hidden), 2);
        let targets: Vec<i64> = tokens[from + 1..=to].iter().map(|&t| t as i64).collect();
        let targets = Tensor::<3, Int>::from_data(TensorData::new(targets, [1, len, 1]), &device);
        let nll = log_probs.gather(2, targets).neg().sum();
        nll.into_data()
            .convert::<f64>()
            .try_to_vec::<f64>()
            .expect("float")[0]
    };
    // The prefill's last position scores tokens[prefix_len]; only that one is kept.
    let ids: Vec<i64> = tokens[..prefix_len].iter().map(|&t| t as i64).collect();
    let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, prefix_len]), &device);
    let hidden = model.forward(input, &[], cache, attention);
    let [_, _, h] = hidden.dims();
    let last = hidden.slice([0..1, prefix_len - 1..prefix_len, 0..h]);
    let log_probs = activation::log_softmax(model.logits(last), 2);
    let target = Tensor::<3, Int>::from_data(
        TensorData::new(vec![tokens[prefix_len] as i64], [1, 1, 1]),
        &device,
    );
    let mut nll = log_probs
        .gather(2, target)
        .neg()
        .sum()
        .into_data()
        .convert::<f64>()
        .try_to_vec::<f64>()
        .expect("float")[0];
    let mut from = prefix_len;
    while from < n - 1 {
        let to = (from + chunk).min(n - 1);
        nll += run(cache, from, to);
        from = to;
    }
    let scored = n - prefix_len;
    let cached = cache.seq_len();
    CacheEval {
        cache: cache.name(),
        perplexity: (nll / scored as f64).exp(),
        scored,
        cached,
        bytes_held: cache.bytes_held(),
        full_bytes: full_kv_bytes(&model.config, 1, cached, dtype_size),
    }
}

/// The KV caches of the CLI (`--kv-cache`) and the `kv_table` example; the names and help
/// the CLI shows come from this enum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CacheKind {
    /// Every key and value, uncompressed.
    Full,
    /// MiniCache: the upper half of the layers merged pairwise (SLERP), outliers kept.
    #[value(name = "minicache")]
    MiniCache,
    /// KIVI 4-bit keys (per channel) and values (per token), recent tokens in full precision.
    Quant4,
    /// KIVI 2-bit.
    Quant2,
    /// MiniCache over a 4-bit KIVI cache.
    #[value(name = "minicache+quant4")]
    MiniCacheQuant4,
    /// ShadowKV: low-rank pre-RoPE keys on the device, values in host memory, sparse decode.
    #[value(name = "shadowkv")]
    ShadowKv,
}

impl CacheKind {
    /// The CLI names, comma-separated.
    pub fn names() -> String {
        crate::names::value_names::<Self>()
    }

    /// The cache a CLI name stands for.
    pub fn parse(s: &str) -> Option<Self> {
        <Self as clap::ValueEnum>::from_str(s, false).ok()
    }
}

/// A KV cache choice with its settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheSpec {
    pub kind: CacheKind,
    pub minicache: MiniCacheConfig,
    /// Group size and residual window; `bits` is taken from the kind unless
    /// `bits_override` is set.
    pub quant: QuantConfig,
    pub bits_override: Option<u32>,
    /// ShadowKV settings (rank, budget, chunks, threshold).
    pub shadowkv: ShadowKvConfig,
}

impl CacheSpec {
    pub fn new(kind: CacheKind) -> Self {
        Self {
            kind,
            minicache: MiniCacheConfig::default(),
            quant: QuantConfig::default(),
            bits_override: None,
            shadowkv: ShadowKvConfig::default(),
        }
    }

    fn quant_with(&self, bits: u32) -> QuantConfig {
        QuantConfig {
            bits: self.bits_override.unwrap_or(bits),
            ..self.quant
        }
    }

    /// An empty cache for `config`'s model (ShadowKV needs its heads, head dim and RoPE).
    ///
    /// # Errors
    /// The configuration errors of `burn-kvcache`.
    pub fn build_for(&self, config: &LlamaConfig) -> Result<Box<dyn KvCache>, KvCacheError> {
        match self.kind {
            CacheKind::ShadowKv => Ok(Box::new(shadowkv_for(config, self.shadowkv)?)),
            _ => self.build(config.num_layers),
        }
    }

    /// An empty cache for a model of `num_layers` layers.
    ///
    /// # Errors
    /// The configuration errors of `burn-kvcache`; [`KvCacheError::NeedsModelShape`] for
    /// ShadowKV (use [`CacheSpec::build_for`]).
    pub fn build(&self, num_layers: usize) -> Result<Box<dyn KvCache>, KvCacheError> {
        Ok(match self.kind {
            CacheKind::ShadowKv => return Err(KvCacheError::NeedsModelShape("shadowkv")),
            CacheKind::Full => Box::new(FullKvCache::new(num_layers)),
            CacheKind::MiniCache => Box::new(MiniCacheKv::new(num_layers, self.minicache)?),
            CacheKind::Quant4 => Box::new(QuantKv::new(num_layers, self.quant_with(4))?),
            CacheKind::Quant2 => Box::new(QuantKv::new(num_layers, self.quant_with(2))?),
            CacheKind::MiniCacheQuant4 => Box::new(MiniCacheKv::with_quant(
                num_layers,
                self.minicache,
                self.quant_with(4),
            )?),
        })
    }
}

/// An empty ShadowKV cache for `config`'s model (its layers, KV heads, head dim and RoPE).
///
/// # Errors
/// [`ShadowKvConfig::validate`]'s.
pub fn shadowkv_for(
    config: &LlamaConfig,
    shadowkv: ShadowKvConfig,
) -> Result<ShadowKvCache, KvCacheError> {
    ShadowKvCache::new(
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
        shadowkv,
        RopeParams {
            theta: config.rope_theta,
            scaling: config.rope_scaling,
        },
    )
}

/// A cache [`greedy_answers`] answers through, seeded from one exact prefill.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SeededCache {
    /// The prefill's own full cache.
    Full,
    /// ShadowKV compressing the prefill's keys and values ([`ShadowKvCache::compress_prompt`]).
    ShadowKv(ShadowKvConfig),
}

/// Why [`greedy_answers`] stopped.
#[derive(Debug, thiserror::Error)]
pub enum AnswerError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error(transparent)]
    Forward(#[from] crate::model::ForwardError),
    #[error(transparent)]
    Cache(#[from] KvCacheError),
    #[error(transparent)]
    Generate(#[from] crate::generate::GenerateError),
    /// ShadowKV keeps prompts shorter than its `min_prompt` (or its budget) uncompressed.
    #[error(
        "ShadowKV left the {0}-token prompt uncompressed (shorter than its budget or min_prompt)"
    )]
    NotCompressed(usize),
}

/// What [`greedy_answers`] produced for each cache, in the order given.
#[derive(Debug, Clone, PartialEq)]
pub struct Answers {
    /// Greedy tokens after the prompt (the first one from the shared prefill).
    pub tokens: Vec<Vec<u32>>,
    /// Seconds of the shared prefill.
    pub prefill_secs: f64,
    /// Seconds each cache took to be seeded and to decode.
    pub decode_secs: Vec<f64>,
    /// Bytes each cache held at the end: (device, host).
    pub bytes: Vec<(usize, usize)>,
    /// ShadowKV's counts over the decode ([`DecodeTimings`]; `None` for the full cache).
    pub shadow: Vec<Option<DecodeTimings>>,
}

/// The greedy token after the last position of `hidden` (one row), as `generate` picks it.
fn greedy_last(
    model: &Llama,
    hidden: Tensor<3>,
    attention: &dyn AttentionImpl,
) -> Result<u32, AnswerError> {
    let logits = crate::generate::last_logits(model, hidden, attention)?;
    Ok(burn_kernels_core::Greedy.sample(&logits[0]))
}

/// Answers `prompt` greedily through each of `caches`: the prompt is prefilled once through a
/// full cache, in pieces of `piece` tokens (so attention holds `heads · piece · S` scores, not
/// `heads · S²`), and its keys and values seed every cache; the first answer token comes from
/// that prefill (a ShadowKV prefill is exact), the next ones from each cache, until `max_new`
/// tokens or a token of `stop`.
///
/// # Errors
/// [`AnswerError::EmptyPrompt`]; the model's and the caches' errors;
/// [`AnswerError::NotCompressed`] when a ShadowKV configuration would not compress the prompt
/// (it would then be the full cache under another name).
pub fn greedy_answers(
    model: &Llama,
    prompt: &[u32],
    caches: &[SeededCache],
    piece: usize,
    max_new: usize,
    stop: &[u32],
    attention: &dyn AttentionImpl,
) -> Result<Answers, AnswerError> {
    if prompt.is_empty() {
        return Err(AnswerError::EmptyPrompt);
    }
    let device = model.embed.val().device();
    let ids = |t: &[u32]| {
        let v: Vec<i64> = t.iter().map(|&x| i64::from(x)).collect();
        let n = v.len();
        Tensor::<2, Int>::from_data(TensorData::new(v, [1, n]), &device)
    };
    let t = std::time::Instant::now();
    let mut prefilled = FullKvCache::new(model.config.num_layers);
    let mut hidden = None;
    for part in prompt.chunks(piece.max(1)) {
        hidden = Some(model.try_forward(ids(part), &[], &mut prefilled, attention)?);
    }
    let first = greedy_last(model, hidden.expect("a non-empty prompt"), attention)?;
    let prefill_secs = t.elapsed().as_secs_f64();
    let mut out = Answers {
        tokens: Vec::new(),
        prefill_secs,
        decode_secs: Vec::new(),
        bytes: Vec::new(),
        shadow: Vec::new(),
    };
    for spec in caches {
        let t = std::time::Instant::now();
        let decode = |cache: &mut dyn KvCache| -> Result<Vec<u32>, AnswerError> {
            let mut tokens = vec![first];
            while tokens.len() < max_new && !stop.contains(tokens.last().expect("non-empty")) {
                let last = ids(&tokens[tokens.len() - 1..]);
                let hidden = model.try_forward(last, &[], cache, attention)?;
                tokens.push(greedy_last(model, hidden, attention)?);
            }
            Ok(tokens)
        };
        let (tokens, bytes, shadow) = match spec {
            SeededCache::Full => {
                let mut full = prefilled.clone();
                let tokens = decode(&mut full)?;
                (tokens, (full.bytes_held(), 0), None)
            }
            SeededCache::ShadowKv(config) => {
                let mut shadow = shadowkv_for(&model.config, *config)?;
                for layer in 0..model.config.num_layers {
                    let (k, v) = prefilled.layer(layer).expect("every layer was prefilled");
                    if !shadow.compress_prompt(layer, k, v, None)? {
                        return Err(AnswerError::NotCompressed(prompt.len()));
                    }
                }
                let tokens = decode(&mut shadow)?;
                let b = shadow.bytes_split();
                (tokens, (b.device, b.host), Some(shadow.timings()))
            }
        };
        out.decode_secs.push(t.elapsed().as_secs_f64());
        out.bytes.push(bytes);
        out.shadow.push(shadow);
        out.tokens.push(tokens);
    }
    Ok(out)
}
