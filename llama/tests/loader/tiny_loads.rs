//! The tiny Llama's files loaded back, and malformed or incomplete ones rejected.

use burn_llama::config::Llama3RopeScaling;
use burn_llama::loader::{LoadError, load, load_gguf, load_safetensors_dir, validate};
use burn_llama::tokenizer::Tokenizer;
use std::path::Path;

use super::tiny::*;

pub(super) fn tiny_gguf_loads_exactly() {
    let dir = TempDir::new("tiny-gguf");
    let vocab = tiny_vocab().0.len();
    let config = tiny_config(vocab, true);
    let weights = tiny_weights(&config, 7);
    let path = dir.0.join("tiny.gguf");
    write_gguf(
        &path,
        &tiny_meta(&config),
        &tiny_gguf_tensors(&config, &weights),
    );

    let ckpt = load(&path).unwrap();
    // No `llama.vocab_size` in this file: the token list gives it.
    assert_eq!(ckpt.config, config);
    assert_eq!(ckpt.tensors.len(), weights.len());
    for (name, want) in &weights {
        assert_eq!(&ckpt.tensors[name], want, "{name}");
    }

    let tok = &ckpt.tokenizer;
    let ids = tok.encode("<|im_start|>the the tell").unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(tok.decode(&ids).unwrap(), "the the tell");
    assert!(ids.contains(&tok.token_id("Ġthe").unwrap()));
    assert!(ids.contains(&tok.token_id("ell").unwrap()));
}

pub(super) fn tiny_gguf_wrong_shape_is_shape_mismatch() {
    let dir = TempDir::new("tiny-gguf-shape");
    let config = tiny_config(tiny_vocab().0.len(), true);
    let mut weights = tiny_weights(&config, 8);

    // V projection with a row too many.
    let v = "model.layers.1.self_attn.v_proj.weight";
    let t = weights.get_mut(v).unwrap();
    t.shape[0] += 1;
    t.data.extend(vec![0.0; t.shape[1]]);
    let path = dir.0.join("bad-v.gguf");
    write_gguf(
        &path,
        &tiny_meta(&config),
        &tiny_gguf_tensors(&config, &weights),
    );
    match load_gguf(&path).unwrap_err() {
        LoadError::ShapeMismatch {
            tensor,
            expected,
            found,
        } => {
            assert_eq!(tensor, v);
            assert_eq!(expected, [32, 64]);
            assert_eq!(found, [33, 64]);
        }
        e => panic!("{e}"),
    }

    // Q projection with too few rows for its heads: caught before un-permuting.
    let mut weights = tiny_weights(&config, 8);
    let q = "model.layers.0.self_attn.q_proj.weight";
    let t = weights.get_mut(q).unwrap();
    t.shape[0] = 32;
    t.data.truncate(32 * 64);
    let path = dir.0.join("bad-q.gguf");
    write_gguf(
        &path,
        &tiny_meta(&config),
        &tiny_gguf_tensors(&config, &weights),
    );
    let err = load_gguf(&path).unwrap_err();
    assert!(
        matches!(&err, LoadError::ShapeMismatch { tensor, .. } if tensor == q),
        "{err}"
    );
}

pub(super) fn validate_reports_missing_and_misshapen_tensors() {
    let config = tiny_config(tiny_vocab().0.len(), false);
    let mut weights = tiny_weights(&config, 9);
    validate(&config, &weights).unwrap();

    let name = "model.layers.1.mlp.up_proj.weight";
    weights.get_mut(name).unwrap().shape = vec![64, 96];
    match validate(&config, &weights).unwrap_err() {
        LoadError::ShapeMismatch {
            tensor,
            expected,
            found,
        } => {
            assert_eq!(tensor, name);
            assert_eq!(expected, [96, 64]);
            assert_eq!(found, [64, 96]);
        }
        e => panic!("{e}"),
    }

    let mut weights = tiny_weights(&config, 9);
    weights.remove("lm_head.weight");
    let err = validate(&config, &weights).unwrap_err();
    assert!(
        matches!(&err, LoadError::MissingTensor { name } if name == "lm_head.weight"),
        "{err}"
    );
}

pub(super) fn unsupported_quant_is_reported_with_tensor_and_type() {
    let dir = TempDir::new("unsupported");
    let config = tiny_config(tiny_vocab().0.len(), true);

    // A K-quant (Q4_K, id 12): a valid file, but a type the loader cannot decode.
    let path = dir.0.join("q4k.gguf");
    let tensors = vec![(
        "blk.0.ffn_up.weight".to_string(),
        12,
        vec![256, 1],
        vec![0u8; 144],
    )];
    write_gguf(&path, &tiny_meta(&config), &tensors);
    let err = load(&path).unwrap_err();
    assert!(
        matches!(&err, LoadError::UnsupportedQuant { tensor, quant }
            if tensor == "blk.0.ffn_up.weight" && quant == "Q4K"),
        "{err}"
    );
    assert!(err.to_string().contains("blk.0.ffn_up.weight"), "{err}");

    // A type id no GGML version has.
    let path = dir.0.join("unknown.gguf");
    let tensors = vec![(
        "token_embd.weight".to_string(),
        99,
        vec![32, 4],
        vec![0u8; 64],
    )];
    write_gguf(&path, &[], &tensors);
    let err = load(&path).unwrap_err();
    assert!(
        matches!(&err, LoadError::UnsupportedQuant { tensor, quant }
            if tensor == "token_embd.weight" && quant.contains("99")),
        "{err}"
    );
}

pub(super) fn missing_paths_are_not_found() {
    let missing = Path::new("/nonexistent/burn-llama/model.gguf");
    for err in [
        load(missing).unwrap_err(),
        load_gguf(missing).unwrap_err(),
        load_safetensors_dir(Path::new("/nonexistent/burn-llama")).unwrap_err(),
        Tokenizer::from_file(Path::new("/nonexistent/tokenizer.json")).unwrap_err(),
    ] {
        assert!(matches!(err, LoadError::NotFound { .. }), "{err}");
    }
    assert!(
        load(missing)
            .unwrap_err()
            .to_string()
            .contains("/nonexistent/burn-llama/model.gguf")
    );
}

pub(super) fn malformed_files_are_format_errors() {
    let dir = TempDir::new("malformed");
    let mut rng = Rng(42);
    let garbage: Vec<u8> = (0..4096)
        .map(|_| (rng.next() * 127.0) as i8 as u8)
        .collect();
    let mut gguf_then_garbage = b"GGUF".to_vec();
    gguf_then_garbage.extend(3u32.to_le_bytes());
    gguf_then_garbage.extend(&garbage);
    let mut bad_meta_type = b"GGUF".to_vec();
    bad_meta_type.extend(3u32.to_le_bytes());
    bad_meta_type.extend(0u64.to_le_bytes());
    bad_meta_type.extend(1u64.to_le_bytes());
    bad_meta_type.extend(3u64.to_le_bytes());
    bad_meta_type.extend(b"key");
    bad_meta_type.extend(77u32.to_le_bytes());

    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("garbage.gguf", garbage),
        ("empty.gguf", Vec::new()),
        ("gguf-then-garbage.gguf", gguf_then_garbage),
        ("bad-meta-type.gguf", bad_meta_type),
    ];
    for (name, bytes) in cases {
        let path = dir.0.join(name);
        std::fs::write(&path, bytes).unwrap();
        let err = load(&path).unwrap_err();
        assert!(matches!(err, LoadError::Format { .. }), "{name}: {err}");
        assert!(err.to_string().contains(name), "{err}");
    }

    // A GGUF cut short: the tensor table is whole but the data is missing.
    let config = tiny_config(tiny_vocab().0.len(), true);
    let path = dir.0.join("truncated.gguf");
    write_gguf(
        &path,
        &tiny_meta(&config),
        &tiny_gguf_tensors(&config, &tiny_weights(&config, 3)),
    );
    let full = std::fs::read(&path).unwrap();
    std::fs::write(&path, &full[..full.len() - 1000]).unwrap();
    let err = load(&path).unwrap_err();
    assert!(matches!(err, LoadError::Format { .. }), "{err}");

    // A safetensors directory whose weights file is garbage.
    let st = TempDir::new("malformed-st");
    write_hf_dir(&st.0, &config, &tiny_weights(&config, 3), false);
    std::fs::write(st.0.join("model.safetensors"), b"not safetensors").unwrap();
    let err = load(&st.0).unwrap_err();
    assert!(matches!(err, LoadError::Format { .. }), "{err}");
}

pub(super) fn tiny_safetensors_dir_loads_exactly() {
    let (tokens, _, _) = tiny_vocab();
    let mut config = tiny_config(tokens.len(), false);
    config.eos_token_ids = vec![2, 0];
    config.rope_scaling = Some(Llama3RopeScaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 128,
    });
    let weights = tiny_weights(&config, 11);

    for sharded in [false, true] {
        let dir = TempDir::new(if sharded { "st-sharded" } else { "st" });
        write_hf_dir(&dir.0, &config, &weights, sharded);
        let ckpt = load(&dir.0).unwrap();
        assert_eq!(ckpt.config, config);
        assert_eq!(ckpt.tensors.len(), weights.len());
        for (name, want) in &weights {
            assert_eq!(&ckpt.tensors[name], want, "{name} (sharded: {sharded})");
        }
        let tok = &ckpt.tokenizer;
        assert_eq!(tok.vocab_size(), tokens.len());
        let ids = tok.encode("<|im_start|>the hello 42<|im_end|>").unwrap();
        assert_eq!(ids.first(), Some(&1));
        assert_eq!(ids.last(), Some(&2));
        assert_eq!(tok.decode(&ids).unwrap(), "the hello 42");
        assert!(tok.eos_token_ids().contains(&2) && tok.eos_token_ids().contains(&0));
    }

    // The same directory through a path to its config file, and a missing tensor.
    let dir = TempDir::new("st-missing");
    let mut partial = weights.clone();
    partial.remove("model.layers.1.self_attn.o_proj.weight");
    write_hf_dir(&dir.0, &config, &partial, false);
    let err = load(&dir.0.join("config.json")).unwrap_err();
    assert!(
        matches!(&err, LoadError::MissingTensor { name }
            if name == "model.layers.1.self_attn.o_proj.weight"),
        "{err}"
    );
}

pub(super) fn tokenizer_from_gguf_vocab_directly() {
    let (tokens, merges, types) = tiny_vocab();
    let n = tokens.len();
    let tok = Tokenizer::from_gguf_vocab(
        tokens.clone(),
        merges.clone(),
        Some(types.clone()),
        Some("smollm"),
        Some(1),
        vec![0],
    )
    .unwrap();
    assert_eq!(tok.vocab_size(), n);
    assert_eq!(tok.eos_token_ids(), [0, 2], "eos, then <|im_end|> for chat");
    // Digits are split one by one, as SmolLM2's pre-tokenizer does.
    let ids = tok.encode("123").unwrap();
    assert_eq!(ids.len(), 3);
    assert_eq!(tok.decode(&ids).unwrap(), "123");

    // Llama 3's pre-tokenizer (its split regex must compile) puts BOS in front.
    let llama3 = Tokenizer::from_gguf_vocab(
        tokens.clone(),
        merges,
        Some(types.clone()),
        Some("llama-bpe"),
        Some(1),
        vec![2],
    )
    .unwrap();
    let ids = llama3.encode("the tell 2025").unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(llama3.decode(&ids).unwrap(), "the tell 2025");

    let bad = Tokenizer::from_gguf_vocab(
        tokens,
        vec!["nospace".into()],
        Some(types),
        None,
        None,
        vec![],
    );
    assert!(matches!(bad, Err(LoadError::Tokenizer { .. })));
}

/// Llama-3 RoPE scaling is stored by llama.cpp as `rope_freqs.weight` (per-frequency
/// divisors); the loader recovers the parameters from it.
pub(super) fn tiny_gguf_llama3_rope_scaling() {
    let dir = TempDir::new("rope-freqs");
    let mut config = tiny_config(tiny_vocab().0.len(), true);
    config.rope_theta = 500_000.0;
    config.rope_scaling = Some(Llama3RopeScaling {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    });
    let weights = tiny_weights(&config, 5);
    // llama.cpp's convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors.
    let divisors = |factor: f64| -> Vec<f32> {
        (0..config.head_dim / 2)
            .map(|i| {
                let freq = 1.0 / 500_000f64.powf(2.0 * i as f64 / config.head_dim as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let d = if wavelen < 8192.0 / 4.0 {
                    1.0
                } else if wavelen > 8192.0 / 1.0 {
                    factor
                } else {
                    let smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                };
                d as f32
            })
            .collect()
    };
    let write = |path: &Path, divisors: Vec<f32>| {
        let mut tensors = tiny_gguf_tensors(&config, &weights);
        let bytes = divisors.iter().flat_map(|v| v.to_le_bytes()).collect();
        tensors.push(("rope_freqs.weight".into(), 0, vec![8], bytes));
        write_gguf(path, &tiny_meta(&config), &tensors);
    };

    let path = dir.0.join("llama3.gguf");
    write(&path, divisors(32.0));
    let ckpt = load(&path).unwrap();
    assert_eq!(ckpt.config, config);
    assert!(!ckpt.tensors.contains_key("rope_freqs.weight"));

    // Divisors that no Llama-3 parameters produce.
    let mut odd = divisors(32.0);
    odd[4] = 3.0;
    write(&path, odd);
    let err = load(&path).unwrap_err();
    assert!(matches!(err, LoadError::Format { .. }), "{err}");
}
