//! The target model, prompts, options and drafts the speculative-decoding tests share.

use crate::common::checkpoint;

use burn::tensor::{DType, Device};
use burn_kernels_core::{FullKvCache, Greedy, ReferenceAttention, SamplingConfig};
use burn_kvcache::ShadowKvConfig;
use burn_llama::eval::{CacheKind, CacheSpec};
use burn_llama::generate::{GenerateOptions, generate};
use burn_llama::model::Llama;
use burn_llama::spec::{BranchKvCache, Draft, LinearSpecCache, SpecOptions, forward_rows};
use burn_specdec::Scheme;

pub(super) const DRAFT_LAYERS: usize = 8;

pub(super) fn target() -> Llama {
    Llama::from_checkpoint(checkpoint(), &Device::flex(), DType::F32).expect("valid checkpoint")
}

pub(super) fn prompts() -> Vec<Vec<u32>> {
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

pub(super) fn eos() -> Vec<u32> {
    checkpoint().tokenizer.eos_token_ids().to_vec()
}

pub(super) fn plain_greedy(
    model: &Llama,
    prompts: &[Vec<u32>],
    n: usize,
    stop: &[u32],
) -> Vec<Vec<u32>> {
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

pub(super) fn sampling(temperature: f32) -> SamplingConfig {
    SamplingConfig {
        temperature,
        ..SamplingConfig::default()
    }
}

pub(super) fn options(
    scheme: Scheme,
    draft_len: usize,
    target_temperature: f32,
    n: usize,
) -> SpecOptions {
    SpecOptions {
        scheme,
        draft_len,
        target_sampling: sampling(target_temperature),
        max_new_tokens: n,
        stop_tokens: eos(),
        seed: 7,
    }
}

pub(super) fn identical<'a>(model: &'a Llama, k: usize, temperature: f32) -> Vec<Draft<'a>> {
    vec![Draft::model(model, sampling(temperature)); k]
}

/// Layers of the draft in the exactness tests: SmolLM2's truncated-layer drafts are not trained
/// to exit early, so shallow ones (8 layers) almost never agree with the target's argmax; 24
/// layers agree ~40% of the time, which exercises accepted runs and bonus tokens too.
pub(super) const EXACTNESS_DRAFT_LAYERS: usize = 24;

/// Last-position logits of `rows` continued from `cache`, `[rows][vocab]`.
pub(super) fn continue_from(
    model: &Llama,
    cache: &mut BranchKvCache,
    rows: &[Vec<u32>],
) -> Vec<Vec<f32>> {
    let hidden = forward_rows(model, cache, rows, &ReferenceAttention).expect("forward");
    let [b, s, h] = hidden.dims();
    let logits = model.logits(hidden.slice([0..b, s - 1..s, 0..h]));
    let vocab = logits.dims()[2];
    let data = logits.into_data().try_to_vec::<f32>().unwrap();
    data.chunks(vocab).map(<[f32]>::to_vec).collect()
}

pub(super) fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A compressed target cache (in a [`LinearSpecCache`]) of `kind`, with ShadowKV's rank at the
/// full key width (exact keys) and a budget over the whole prompt, so that it attends exactly
/// as the full cache does while still offloading values and selecting chunks.
pub(super) fn compressed_cache(model: &Llama, kind: CacheKind) -> LinearSpecCache {
    let mut spec = CacheSpec::new(kind);
    let cfg = &model.config;
    spec.shadowkv = ShadowKvConfig {
        rank: cfg.num_kv_heads * cfg.head_dim,
        chunk: 2,
        budget: 64,
        local_chunks: 1,
        outlier_chunks: 1,
        min_prompt: 4,
        scoring: Default::default(),
        candidates: 1,
        pinned_uploads: true,
        reuse_min_percent: ShadowKvConfig::default().reuse_min_percent,
    };
    spec.quant.residual = 4;
    LinearSpecCache::new(spec.build_for(cfg).expect("valid cache config"))
}
