//! The model on the real SmolLM2-135M-Instruct weights (fetched by `./scripts/setup.sh`).

use crate::common::{
    checkpoint, decode_attention_for, paragraph_tokens, paragraph_tokens_on, tiny_config,
};
use crate::replay::assert_replay_logits_match;

use burn::tensor::{DType, Device};
use std::sync::Arc;

use burn_kernels_core::{
    AttentionImpl, BurnAttention, FullKvCache, FusedLayers, Greedy, ReferenceAttention,
};
use burn_kernels_testing::testgen;
use burn_kvcache::DecodeAttention;
use burn_llama::eval::{perplexity_with_cache, perplexity_with_cache_chunked};
use burn_llama::generate::{GenerateError, GenerateOptions, generate, perplexity};
use burn_llama::graph::{CapturedDecoder, generate_captured};
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
fn captured_decode_on_the_cpu() {
    captured_decode_matches_eager(&Device::flex());
    // One new token needs no decode step; none needs nothing; bad input is the eager path's
    // typed error.
    let model = model(&Device::flex());
    let prompt = vec![checkpoint().tokenizer.encode("Hello").unwrap()];
    for n in [0, 1] {
        let opts = GenerateOptions {
            max_new_tokens: n,
            stop_tokens: vec![],
        };
        let (g, info) = generate_captured(
            &model,
            &prompt,
            &ReferenceAttention,
            &mut Greedy,
            &opts,
            &mut |_, _| {},
        )
        .expect("valid prompt");
        assert_eq!(g.tokens[0].len(), n);
        assert_eq!(g.decode_steps, 0);
        assert!(!info.graph && info.reason.is_none(), "{info}");
    }
    let opts = GenerateOptions {
        max_new_tokens: 4,
        stop_tokens: vec![],
    };
    let err = generate_captured(
        &model,
        &[],
        &ReferenceAttention,
        &mut Greedy,
        &opts,
        &mut |_, _| {},
    )
    .expect_err("no prompts");
    assert_eq!(err, GenerateError::NoPrompts);
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

/// Captured steps up to the cache's capacity run; the next one is refused with the sizes, and
/// nothing runs.
fn captured_decode_stops_at_capacity(
    model: &Llama,
    attention: &dyn AttentionImpl,
    prompts: &[Vec<u32>],
) {
    let (mut decoder, _) =
        CapturedDecoder::prefill(model, attention, prompts, 2).expect("valid prompts");
    let capacity = decoder.info().capacity;
    for _ in 0..2 {
        decoder
            .step(&[1, 2, 3])
            .expect("a step within the capacity");
    }
    assert_eq!(decoder.len(), capacity);
    match decoder.step(&[1, 2, 3]) {
        Err(GenerateError::ContextTooLong { needed, max, .. }) => {
            assert_eq!((needed, max), (capacity + 1, capacity));
        }
        other => panic!("a step past the capacity: {:?}", other.map(|t| t.dims())),
    }
}

/// Greedy generation with the decode step captured once and replayed (a CUDA graph on CUDA, the
/// step re-run elsewhere) gives the eager path's tokens: one prompt, and three of different
/// lengths (the shorter left-padded), over 64 steps (5 on lavapipe), the decode kernels (fused
/// layer ops, decode attention) on GPUs, the reference on the CPU. The cache fills to its
/// capacity, and a step past it is a typed error. On CUDA the step must have replayed as a
/// hardware graph (CubeCL's wgpu runtime replays one too).
fn captured_decode_matches_eager(device: &Device) {
    let tok = &checkpoint().tokenizer;
    let model = model(device);
    let encode = |texts: &[&str]| -> Vec<Vec<u32>> {
        texts.iter().map(|p| tok.encode(p).unwrap()).collect()
    };
    let batches = [
        encode(&["The capital of France is"]),
        encode(&[
            "The capital of France is",
            "Once upon a time, there lived",
            "Water",
        ]),
    ];
    assert_ne!(batches[1][0].len(), batches[1][1].len());
    let attention = decode_attention_for(device);
    let n = if burn_kernels_testing::is_wgpu(device) {
        5
    } else {
        64
    };
    let opts = GenerateOptions {
        max_new_tokens: n,
        stop_tokens: vec![],
    };
    let mut eager_tokens = Vec::new();
    for prompts in &batches {
        let (eager, g, info) =
            crate::common::eager_and_captured(&model, prompts, attention.as_ref(), &opts);
        println!("{device:?}: {info}; {:?}", g.tokens);
        assert_eq!(
            g.tokens,
            eager,
            "captured vs eager decode, batch {}",
            prompts.len()
        );
        assert!(g.tokens.iter().all(|t| t.len() == n));
        assert_eq!(g.decode_steps, n - 1);
        let longest = prompts.iter().map(Vec::len).max().unwrap();
        assert_eq!(info.capacity, longest + n);
        // CUDA must replay a hardware graph; CubeCL's wgpu runtime also replays one, the CPU
        // re-runs the step.
        if burn_kernels_testing::is_cuda(device) {
            assert!(info.graph, "{info}");
        }
        if *device == Device::flex() {
            assert!(!info.graph, "{info}");
        }
        eager_tokens.push(eager);
    }

    // Logits: every replayed step against an eager step on the same tokens (the greedy ones),
    // batch 3 with ragged prompts, within f32's tolerance.
    let prompts = &batches[1];
    assert_replay_logits_match(
        &model,
        attention.as_ref(),
        prompts,
        &eager_tokens[1],
        n,
        DType::F32,
    );

    captured_decode_stops_at_capacity(&model, attention.as_ref(), prompts);
}

testgen! {
    backend: [perplexity_matches_cpu, decode_kernels_match_cpu, captured_decode_matches_eager],
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

/// `eval::greedy_answers` (the `needle` example's loop): through the full cache it gives
/// plain greedy generation's tokens, whatever the prefill pieces (67 tokens in pieces of 16,
/// a tail of 3, or whole); through ShadowKV it shares the first token and decodes to the
/// limit; a stop token ends an answer; bad input and an uncompressed prompt are typed errors.
#[test]
fn greedy_answers_follow_greedy_generation() {
    use burn_kvcache::ShadowKvConfig;
    use burn_llama::eval::{AnswerError, SeededCache, greedy_answers};
    let device = Device::flex();
    device.seed(11);
    let cfg = tiny_config(41, 2, 128);
    let model = Llama::random(&cfg, &device, DType::F32);
    let prompt: Vec<u32> = (0..67u32).map(|i| (i * 7 + 3) % 41).collect();
    let n = 9;
    let mut cache = FullKvCache::new(cfg.num_layers);
    let opts = GenerateOptions {
        max_new_tokens: n,
        stop_tokens: vec![],
    };
    let want = generate(
        &model,
        std::slice::from_ref(&prompt),
        &mut cache,
        &ReferenceAttention,
        &mut Greedy,
        &opts,
        &mut |_, _| {},
    )
    .unwrap()
    .tokens[0]
        .clone();
    let shadow = ShadowKvConfig {
        rank: 8,
        chunk: 8,
        budget: 32,
        local_chunks: 2,
        outlier_chunks: 1,
        min_prompt: 0,
        scoring: Default::default(),
        candidates: 1,
        pinned_uploads: true,
        reuse_min_percent: ShadowKvConfig::default().reuse_min_percent,
    };
    let caches = [SeededCache::Full, SeededCache::ShadowKv(shadow)];
    for piece in [16, 1000] {
        let got =
            greedy_answers(&model, &prompt, &caches, piece, n, &[], &ReferenceAttention).unwrap();
        assert_eq!(got.tokens[0], want, "pieces of {piece}");
        assert_eq!(got.tokens[1].len(), n);
        assert_eq!(got.tokens[1][0], want[0]);
        assert!(got.bytes[0].1 == 0 && got.bytes[1].1 > 0, "{:?}", got.bytes);
    }
    let stop = [want[2]];
    let first_stop = want.iter().position(|t| *t == want[2]).unwrap();
    let got = greedy_answers(
        &model,
        &prompt,
        &caches[..1],
        16,
        n,
        &stop,
        &ReferenceAttention,
    )
    .unwrap();
    assert_eq!(got.tokens[0], want[..=first_stop]);
    assert!(matches!(
        greedy_answers(&model, &[], &caches, 16, n, &[], &ReferenceAttention),
        Err(AnswerError::EmptyPrompt)
    ));
    let keep = SeededCache::ShadowKv(ShadowKvConfig {
        min_prompt: 1000,
        ..shadow
    });
    assert!(matches!(
        greedy_answers(&model, &prompt, &[keep], 16, n, &[], &ReferenceAttention),
        Err(AnswerError::NotCompressed(67))
    ));
}
