//! Replayed (CUDA-graph) decode against eager decode, step by step on the same tokens: the
//! logits check shared by `model::captured_decode_matches_eager` and the batched f16 test here.

use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_kernels_core::{AttentionImpl, FullKvCache};
use burn_kernels_testing::compare::to_f32;
use burn_kernels_testing::{Tolerance, assert_close};
use burn_llama::graph::CapturedDecoder;
use burn_llama::model::Llama;

/// Every replayed step's logits against an eager step's on the same tokens (`steps[row][i]`,
/// the eager greedy ones), for `prompts` (ragged: left-padded), within `dtype`'s tolerance for a
/// reduction over the hidden size scaled to the logits' magnitude. `n` steps, the prefill's
/// logits first.
pub fn assert_replay_logits_match(
    model: &Llama,
    attention: &dyn AttentionImpl,
    prompts: &[Vec<u32>],
    steps: &[Vec<u32>],
    n: usize,
    dtype: DType,
) {
    let device = model.embed.device();
    let b = prompts.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap();
    let pad: Vec<usize> = prompts.iter().map(|p| longest - p.len()).collect();
    let ids = |rows: Vec<Vec<u32>>| {
        let s = rows[0].len();
        let flat = rows
            .into_iter()
            .flatten()
            .map(i64::from)
            .collect::<Vec<_>>();
        Tensor::<2, Int>::from_data(TensorData::new(flat, [b, s]), &device)
    };
    let padded = prompts
        .iter()
        .zip(&pad)
        .map(|(p, &n)| {
            std::iter::repeat_n(p[0], n)
                .chain(p.iter().copied())
                .collect()
        })
        .collect();
    let mut cache = FullKvCache::new(model.config.num_layers);
    let eager_last = |hidden: Tensor<3>| -> Vec<f32> {
        let [b, s, h] = hidden.dims();
        to_f32(
            model
                .logits(hidden.slice([0..b, s - 1..s, 0..h]))
                .into_data(),
        )
    };
    let hidden = model
        .try_forward(ids(padded), &pad, &mut cache, attention)
        .expect("prefill");
    let mut want = eager_last(hidden);
    let (mut decoder, first) =
        CapturedDecoder::prefill(model, attention, prompts, n).expect("valid prompts");
    let mut got: Vec<f32> = first.into_iter().flatten().collect();
    for step in 0..n {
        let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs() as f64));
        let tol = Tolerance::for_reduction(dtype, model.config.hidden_size).atol_scaled(scale);
        assert_close(&format!("logits, batch {b}, step {step}"), &got, &want, tol);
        if step + 1 == n {
            break;
        }
        let toks: Vec<u32> = steps.iter().map(|row| row[step]).collect();
        got = to_f32(decoder.step(&toks).expect("a replayed step").into_data());
        let rows = toks.iter().map(|&t| vec![t]).collect();
        let hidden = model
            .try_forward(ids(rows), &pad, &mut cache, attention)
            .expect("an eager step");
        want = eager_last(hidden);
    }
}

/// The batched check on CUDA (on lavapipe a batch-128 step of the 135M model takes minutes).
#[cfg(feature = "cuda")]
mod batched {
    use std::sync::Arc;

    use burn::tensor::{DType, Device};
    use burn_kernels_core::{FullKvCache, FusedLayers, Greedy};
    use burn_kernels_testing::{Dist, random_values};
    use burn_kvcache::DecodeAttention;
    use burn_llama::config::LlamaConfig;
    use burn_llama::generate::{GenerateOptions, generate};
    use burn_llama::graph::generate_captured;
    use burn_llama::model::Llama;

    use super::assert_replay_logits_match;

    /// `batch` ragged prompts of seeded random token ids: row `i` has `3 + 7 i mod 29` tokens.
    fn ragged_prompts(batch: usize, vocab: usize) -> Vec<Vec<u32>> {
        let hi = vocab as f32;
        (0..batch)
            .map(|i| {
                let len = 3 + (7 * i) % 29;
                random_values(len, Dist::Uniform { lo: 0.0, hi }, 1000 + i as u64)
                    .into_iter()
                    .map(|x| (x as u32).min(vocab as u32 - 1))
                    .collect()
            })
            .collect()
    }

    /// SmolLM2-135M's shape with seeded random weights in `dtype` (no checkpoint needed), at batch
    /// 32 and 128, where the projections (more than 16 rows) take
    /// `burn_kernels_core::gemm`'s fixed kernel instead of the GEMVs: the replayed CUDA-graph step
    /// gives the eager step's logits on the same tokens (f16 reduction tolerance), and the greedy
    /// tokens of a captured generation are reported against the eager ones (a near-tie in f16 may
    /// flip a token, so they are not required to be equal).
    pub fn captured_decode_matches_eager_batched(device: &Device, dtype: DType) {
        device.seed(7);
        let config = LlamaConfig::smollm2_135m();
        let model = Llama::random(&config, device, dtype);
        let attention = FusedLayers::new(Arc::new(DecodeAttention::default()));
        let n = 8;
        let opts = GenerateOptions {
            max_new_tokens: n,
            stop_tokens: vec![],
        };
        for batch in [32, 128] {
            let prompts = ragged_prompts(batch, config.vocab_size);
            let mut cache = FullKvCache::new(model.config.num_layers);
            let eager = generate(
                &model,
                &prompts,
                &mut cache,
                &attention,
                &mut Greedy,
                &opts,
                &mut |_, _| {},
            )
            .expect("valid prompts")
            .tokens;
            let (captured, info) = generate_captured(
                &model,
                &prompts,
                &attention,
                &mut Greedy,
                &opts,
                &mut |_, _| {},
            )
            .expect("valid prompts");
            assert!(info.graph, "batch {batch}: {info}");
            assert!(captured.tokens.iter().all(|t| t.len() == n));
            let same = captured
                .tokens
                .iter()
                .zip(&eager)
                .filter(|(a, b)| a == b)
                .count();
            println!("{dtype:?} batch {batch}: {info}; {same}/{batch} rows decode the same tokens");
            assert_replay_logits_match(&model, &attention, &prompts, &eager, n, dtype);
        }
    }

    #[test]
    fn captured_decode_matches_eager_batched_f16_cuda() {
        captured_decode_matches_eager_batched(&Device::cuda(0), DType::F16);
    }
}
