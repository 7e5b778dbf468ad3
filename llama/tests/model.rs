//! The model on the real SmolLM2-135M-Instruct weights (fetched by `./scripts/setup.sh`).

use crate::common::{checkpoint, paragraph_tokens, paragraph_tokens_on, tiny_config};

use burn::tensor::{DType, Device};
use std::sync::Arc;

use burn_kernels_core::{
    AttentionImpl, BurnAttention, FullKvCache, FusedLayers, Greedy, ReferenceAttention,
};
use burn_kernels_testing::testgen;
use burn_kvcache::DecodeAttention;
use burn_llama::eval::{perplexity_with_cache, perplexity_with_cache_chunked};
use burn_llama::generate::{GenerateOptions, generate, perplexity};
use burn_llama::model::Llama;

fn model(device: &Device) -> Llama {
    Llama::from_checkpoint(checkpoint(), device, DType::F32).expect("valid checkpoint")
}

fn greedy(
    model: &Llama,
    prompts: &[Vec<u32>],
    max_new_tokens: usize,
    attention: &dyn AttentionImpl,
) -> Vec<Vec<u32>> {
    let mut cache = FullKvCache::new(model.config.num_layers);
    let opts = GenerateOptions {
        max_new_tokens,
        stop_tokens: checkpoint().tokenizer.eos_token_ids().to_vec(),
    };
    generate(
        model,
        prompts,
        &mut cache,
        attention,
        &mut Greedy,
        &opts,
        &mut |_, _| {},
    )
    .expect("valid prompts")
    .tokens
}

#[test]
fn greedy_capital_of_france_is_paris() {
    let tok = &checkpoint().tokenizer;
    let model = model(&Device::flex());
    let prompt = tok.encode("The capital of France is").unwrap();
    let out = greedy(&model, &[prompt], 8, &ReferenceAttention);
    let text = tok.decode(&out[0]).unwrap();
    println!("The capital of France is|{text}");
    assert!(text.contains("Paris"), "continuation: {text:?}");
}

#[test]
fn chat_prompt_gets_an_english_answer() {
    let tok = &checkpoint().tokenizer;
    let model = model(&Device::flex());
    let prompt = tok.chat_prompt(&[("user", "What is the capital of France?")], true);
    let out = greedy(
        &model,
        &[tok.encode(&prompt).unwrap()],
        40,
        &ReferenceAttention,
    );
    let text = tok.decode(&out[0]).unwrap();
    println!("chat answer: {text}");
    let words: Vec<&str> = text.split_whitespace().collect();
    assert!(words.len() >= 3, "answer too short: {text:?}");
    assert!(text.is_ascii(), "expected plain English: {text:?}");
    assert!(text.contains("Paris"), "answer: {text:?}");
}

#[test]
fn batched_generation_matches_one_prompt_at_a_time() {
    let tok = &checkpoint().tokenizer;
    let model = model(&Device::flex());
    let prompts: Vec<Vec<u32>> = [
        "The capital of France is",
        "Once upon a time, in a small village by the sea, there lived",
        "Water boils at",
    ]
    .iter()
    .map(|p| tok.encode(p).unwrap())
    .collect();
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    assert!(
        lens[0] != lens[1] && lens[1] != lens[2],
        "prompt lengths {lens:?}"
    );
    let batched = greedy(&model, &prompts, 12, &ReferenceAttention);
    for (i, p) in prompts.iter().enumerate() {
        let alone = greedy(&model, std::slice::from_ref(p), 12, &ReferenceAttention);
        println!("[{i}] {}", tok.decode(&batched[i]).unwrap());
        assert_eq!(batched[i], alone[0], "prompt {i}: batched vs alone");
    }
}

#[test]
fn perplexity_of_the_committed_paragraph_is_low() {
    let ids = paragraph_tokens();
    let model = model(&Device::flex());
    let ppl = perplexity(&model, &ids, &ReferenceAttention).expect("fits the context");
    println!(
        "perplexity (cpu, reference attention) {ppl:.4} over {} tokens",
        ids.len()
    );
    assert!(ids.len() >= 200, "paragraph has {} tokens", ids.len());
    assert!(ppl < 30.0, "perplexity {ppl}");
    let ppl_fused = perplexity(&model, &ids, &BurnAttention).expect("fits the context");
    assert!(
        ((ppl_fused - ppl) / ppl).abs() < 1e-3,
        "burn-fused {ppl_fused} vs reference {ppl}"
    );
}

/// The CPU's perplexity comes out on `B` too, with both attention implementations (on the
/// paragraph's first tokens on wgpu, see `paragraph_tokens_on`).
fn perplexity_matches_cpu(device: &Device) {
    let ids = paragraph_tokens_on(device);
    let cpu =
        perplexity(&model(&Device::flex()), &ids, &ReferenceAttention).expect("fits the context");
    let gpu_model = model(device);
    for attention in [&ReferenceAttention as &dyn AttentionImpl, &BurnAttention] {
        let other = perplexity(&gpu_model, &ids, attention).expect("fits the context");
        println!(
            "perplexity cpu {cpu:.5}, {device:?}/{} {other:.5}",
            attention.name()
        );
        assert!(((other - cpu) / cpu).abs() < 1e-3, "{other} vs cpu {cpu}");
    }
}

/// The decode kernels (fused layer ops, split-K decode attention) scoring the second half of
/// the paragraph in decode steps of 1 and 4 tokens through a full cache give the CPU's
/// perplexity of those positions (prefill: Burn's attention op with the fused layer ops).
fn decode_kernels_match_cpu(device: &Device) {
    let ids = paragraph_tokens_on(device);
    let prefix = ids.len() / 2;
    let cpu_model = model(&Device::flex());
    let mut cpu_cache = FullKvCache::new(cpu_model.config.num_layers);
    let cpu = perplexity_with_cache(
        &cpu_model,
        &ids,
        prefix,
        &mut cpu_cache,
        &ReferenceAttention,
    );
    let gpu_model = model(device);
    let kernels = FusedLayers::new(Arc::new(DecodeAttention::default()));
    for chunk in [1, 4] {
        let mut cache = FullKvCache::new(gpu_model.config.num_layers);
        let got =
            perplexity_with_cache_chunked(&gpu_model, &ids, prefix, &mut cache, &kernels, chunk);
        println!(
            "perplexity of {} decoded positions: cpu {:.5}, {device:?} decode kernels (steps of \
             {chunk}) {:.5}",
            cpu.scored, cpu.perplexity, got.perplexity
        );
        assert_eq!(got.scored, cpu.scored);
        assert!(
            ((got.perplexity - cpu.perplexity) / cpu.perplexity).abs() < 1e-3,
            "{} vs cpu {}",
            got.perplexity,
            cpu.perplexity
        );
    }
}

testgen! {
    backend: [perplexity_matches_cpu, decode_kernels_match_cpu],
    autodiff: [],
}

/// Bad input to `generate` is a typed error, and nothing runs: no prompts, an empty prompt, and
/// a prompt plus new tokens past the model's context (its RoPE tables), on a tiny random model.
/// The longest generation that fits runs to its end.
#[test]
fn generate_refuses_bad_input_with_typed_errors() {
    use burn_kernels_core::KvCache;
    use burn_llama::generate::{GenerateError, positions_needed};
    let cfg = tiny_config(29, 1, 12);
    let device = Device::flex();
    let model = Llama::random(&cfg, &device, DType::F32);
    assert_eq!(model.max_positions(), 12);
    let run = |prompts: &[Vec<u32>], max_new_tokens: usize| {
        let mut cache = FullKvCache::new(cfg.num_layers);
        let opts = GenerateOptions {
            max_new_tokens,
            stop_tokens: Vec::new(),
        };
        let mut streamed = 0;
        let out = generate(
            &model,
            prompts,
            &mut cache,
            &ReferenceAttention,
            &mut Greedy,
            &opts,
            &mut |_, _| streamed += 1,
        );
        (out, streamed, cache.seq_len())
    };
    let (out, streamed, held) = run(&[], 4);
    assert_eq!(out.unwrap_err(), GenerateError::NoPrompts);
    assert_eq!((streamed, held), (0, 0));
    let (out, _, held) = run(&[vec![3, 4], vec![]], 4);
    assert_eq!(out.unwrap_err(), GenerateError::EmptyPrompt { index: 1 });
    assert_eq!(held, 0, "nothing ran");
    // 5 prompt tokens + 9 new ones feed 13 positions; the tables cover 12.
    let (out, streamed, held) = run(&[vec![1, 2], vec![5, 6, 7, 8, 9]], 9);
    assert_eq!(
        out.unwrap_err(),
        GenerateError::ContextTooLong {
            prompt: 5,
            new_tokens: 9,
            needed: 13,
            max: 12
        }
    );
    assert_eq!((streamed, held), (0, 0));
    // 5 + 8 feed exactly 12: runs, every token produced.
    assert_eq!(positions_needed(5, 8), 12);
    let (out, streamed, _) = run(&[vec![1, 2], vec![5, 6, 7, 8, 9]], 8);
    let g = out.expect("fits the context");
    assert!(g.tokens.iter().all(|t| t.len() == 8));
    assert_eq!(streamed, 16);
    // Perplexity: two tokens at least, and no more than the context.
    assert_eq!(
        perplexity(&model, &[3], &ReferenceAttention).unwrap_err(),
        GenerateError::TooFewTokens { got: 1 }
    );
    let text: Vec<u32> = (0..13).map(|i| (i * 5 % 29) as u32).collect();
    assert_eq!(
        perplexity(&model, &text, &ReferenceAttention).unwrap_err(),
        GenerateError::Forward(burn_llama::model::ForwardError::ContextTooLong {
            needed: 13,
            max: 12
        })
    );
    let ppl = perplexity(&model, &text[..12], &ReferenceAttention).expect("fits");
    assert!(ppl.is_finite() && ppl > 1.0, "{ppl}");
}

/// The CLI's attention and KV-cache names come from their enums: every name the CLI documented
/// before they were typed still parses, to the implementation it named, and an unknown name
/// does not.
#[test]
fn cli_names_parse_to_their_choices() {
    use burn_kernels_core::AttentionKind;
    use burn_llama::attention::{AttentionChoice, SageQk};
    use burn_llama::eval::CacheKind;
    use burn_sage::PvPrecision;
    let sage = |qk, pv| Some(AttentionChoice::Sage { qk, pv });
    let expected = [
        (
            "reference",
            Some(AttentionChoice::Builtin(AttentionKind::Reference)),
        ),
        (
            "burn-fused",
            Some(AttentionChoice::Builtin(AttentionKind::BurnFused)),
        ),
        (
            "burn",
            Some(AttentionChoice::Builtin(AttentionKind::BurnFused)),
        ),
        ("decode", Some(AttentionChoice::Decode)),
        ("sage", sage(SageQk::Int8, PvPrecision::Fp16)),
        ("sage-fp8", sage(SageQk::Int8, PvPrecision::Fp8E4m3)),
        ("sage-int4", sage(SageQk::Int4, PvPrecision::Fp16)),
        ("sage-int4-fp8", sage(SageQk::Int4, PvPrecision::Fp8E4m3)),
        ("sage-adaptive", sage(SageQk::Adaptive, PvPrecision::Fp16)),
        (
            "sage-adaptive-fp8",
            sage(SageQk::Adaptive, PvPrecision::Fp8E4m3),
        ),
        ("sage-int8", None),
        ("", None),
    ];
    for (name, choice) in expected {
        assert_eq!(AttentionChoice::parse(name), choice, "--attention {name}");
    }
    assert_eq!(
        AttentionChoice::names(),
        "reference, burn-fused, decode, sage, sage-fp8, sage-int4, sage-int4-fp8, \
         sage-adaptive, sage-adaptive-fp8"
    );
    let caches = [
        ("full", Some(CacheKind::Full)),
        ("minicache", Some(CacheKind::MiniCache)),
        ("quant4", Some(CacheKind::Quant4)),
        ("quant2", Some(CacheKind::Quant2)),
        ("minicache+quant4", Some(CacheKind::MiniCacheQuant4)),
        ("shadowkv", Some(CacheKind::ShadowKv)),
        ("quant3", None),
    ];
    for (name, kind) in caches {
        assert_eq!(CacheKind::parse(name), kind, "--kv-cache {name}");
    }
    assert_eq!(
        CacheKind::names(),
        "full, minicache, quant4, quant2, minicache+quant4, shadowkv"
    );
}

/// A KV cache that cannot attend: its error reaches `generate`'s caller typed, with the layer.
#[test]
fn cache_failures_are_typed_errors() {
    use burn::tensor::Tensor;
    use burn_kernels_core::{AttnOptions, CacheError, KvCache};
    use burn_llama::generate::GenerateError;
    use burn_llama::model::ForwardError;

    #[derive(Debug)]
    struct Broken;
    impl KvCache for Broken {
        fn attend(
            &mut self,
            _layer: usize,
            _q: Tensor<4>,
            _k: Tensor<4>,
            _v: Tensor<4>,
            _attention: &dyn AttentionImpl,
            _opts: &AttnOptions,
        ) -> Result<Tensor<4>, CacheError> {
            Err("out of slots".into())
        }
        fn seq_len(&self) -> usize {
            0
        }
        fn truncate(&mut self, _len: usize) {}
        fn bytes_held(&self) -> usize {
            0
        }
        fn name(&self) -> String {
            "broken".into()
        }
    }

    let cfg = tiny_config(29, 2, 12);
    let model = Llama::random(&cfg, &Device::flex(), DType::F32);
    let opts = GenerateOptions {
        max_new_tokens: 3,
        stop_tokens: Vec::new(),
    };
    let err = generate(
        &model,
        &[vec![1, 2, 3]],
        &mut Broken,
        &ReferenceAttention,
        &mut Greedy,
        &opts,
        &mut |_, _| panic!("no token without attention"),
    )
    .unwrap_err();
    assert_eq!(
        err,
        GenerateError::Forward(ForwardError::Cache {
            layer: 0,
            message: "out of slots".into()
        })
    );
    assert_eq!(
        err.to_string(),
        "KV cache, layer 0: out of slots",
        "the message names the layer and the cache's reason"
    );
    // The model refuses positions past its RoPE tables itself.
    let ids: Vec<i64> = (0..13).collect();
    let tokens = burn::tensor::Tensor::<2, burn::tensor::Int>::from_data(
        burn::tensor::TensorData::new(ids, [1, 13]),
        &Device::flex(),
    );
    let mut cache = FullKvCache::new(cfg.num_layers);
    assert_eq!(
        model
            .try_forward(tokens, &[], &mut cache, &ReferenceAttention)
            .unwrap_err(),
        ForwardError::ContextTooLong {
            needed: 13,
            max: 12
        }
    );
}
