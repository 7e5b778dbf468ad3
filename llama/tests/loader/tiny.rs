//! A tiny random Llama, written as GGUF and as a safetensors directory: the writers and their
//! inputs.

use burn_llama::config::LlamaConfig;
use burn_llama::loader::HostTensor;
use half::bf16;
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::dequant::h;

/// A scratch directory removed on drop.
pub(super) struct TempDir(pub(super) PathBuf);

impl TempDir {
    pub(super) fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("burn-llama-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// xorshift64*: deterministic values without a dependency.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        x as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// GPT-2's byte → printable character table.
pub(super) fn byte_chars() -> Vec<char> {
    let mut bs: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec!['\0'; 256];
    for (b, c) in bs.into_iter().zip(cs) {
        table[b as usize] = char::from_u32(c).unwrap();
    }
    table
}

/// Three control tokens, the 256 byte characters, and a few merges.
pub(super) fn tiny_vocab() -> (Vec<String>, Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .map(String::from)
        .to_vec();
    let mut types = vec![3; 3];
    tokens.extend(byte_chars().into_iter().map(String::from));
    types.resize(tokens.len(), 1);
    let merges: Vec<String> = ["Ġ t", "h e", "Ġt he", "l l", "e ll"]
        .map(String::from)
        .to_vec();
    tokens.extend(["Ġt", "he", "Ġthe", "ll", "ell"].map(String::from));
    types.resize(tokens.len(), 1);
    (tokens, merges, types)
}

pub(super) fn tiny_config(vocab_size: usize, tie: bool) -> LlamaConfig {
    LlamaConfig {
        vocab_size,
        hidden_size: 64,
        intermediate_size: 96,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        rope_theta: 10_000.0,
        rope_scaling: None,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: tie,
        max_seq_len: 256,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    }
}

/// Random weights with Hugging Face names and shapes. Norm weights are multiples of 1/64
/// so that they survive a trip through f16 exactly.
pub(super) fn tiny_weights(config: &LlamaConfig, seed: u64) -> HashMap<String, HostTensor> {
    let mut rng = Rng(seed);
    burn_llama::loader::expected_shapes(config)
        .into_iter()
        .map(|(name, shape)| {
            let n = shape.iter().product();
            let data = if shape.len() == 1 {
                (0..n).map(|_| (rng.next() * 64.0).round() / 64.0).collect()
            } else {
                (0..n).map(|_| rng.next() * 0.1).collect()
            };
            (name, HostTensor { shape, data })
        })
        .collect()
}

/// The permutation llama.cpp's converter applies to Q and K, written independently of the
/// loader: `w.reshape(n_head, 2, hd / 2, cols).swapaxes(1, 2)`.
pub(super) fn permute_like_llama_cpp(
    w: &[f32],
    n_head: usize,
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    let half = rows / n_head / 2;
    let mut out = Vec::with_capacity(w.len());
    for h in 0..n_head {
        for i in 0..half {
            for t in 0..2 {
                let src = (h * 2 + t) * half + i;
                out.extend_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// A GGUF metadata value.
pub(super) enum Meta {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

/// A GGUF v3 file, written by hand from the format description (not with the parser's
/// crate), with 32-byte alignment. Tensors: name, GGML type id, dims innermost first, bytes.
pub(super) fn write_gguf(
    path: &Path,
    meta: &[(&str, Meta)],
    tensors: &[(String, u32, Vec<u64>, Vec<u8>)],
) {
    fn s(out: &mut Vec<u8>, v: &str) {
        out.extend((v.len() as u64).to_le_bytes());
        out.extend(v.as_bytes());
    }
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((meta.len() as u64).to_le_bytes());
    for (key, v) in meta {
        s(&mut out, key);
        match v {
            Meta::U32(x) => {
                out.extend(4u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Meta::F32(x) => {
                out.extend(6u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Meta::Bool(x) => {
                out.extend(7u32.to_le_bytes());
                out.push(*x as u8);
            }
            Meta::Str(x) => {
                out.extend(8u32.to_le_bytes());
                s(&mut out, x);
            }
            Meta::Strs(xs) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((xs.len() as u64).to_le_bytes());
                for x in xs {
                    s(&mut out, x);
                }
            }
            Meta::I32s(xs) => {
                out.extend(9u32.to_le_bytes());
                out.extend(5u32.to_le_bytes());
                out.extend((xs.len() as u64).to_le_bytes());
                for x in xs {
                    out.extend(x.to_le_bytes());
                }
            }
        }
    }
    let mut offset = 0u64;
    let mut offsets = Vec::new();
    for (name, ty, dims, data) in tensors {
        s(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(ty.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offsets.push(offset);
        offset += (data.len() as u64).div_ceil(32) * 32;
    }
    let pad = |out: &mut Vec<u8>| out.resize(out.len().div_ceil(32) * 32, 0);
    pad(&mut out);
    for (_, _, _, data) in tensors {
        out.extend(data);
        pad(&mut out);
    }
    std::fs::write(path, out).unwrap();
}

/// GGUF name and GGML dims of a Hugging Face tensor.
pub(super) fn gguf_name(hf: &str) -> String {
    let fixed = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, part) = rest.split_once('.').unwrap();
    let g = match part {
        "input_layernorm.weight" => "attn_norm",
        "self_attn.q_proj.weight" => "attn_q",
        "self_attn.k_proj.weight" => "attn_k",
        "self_attn.v_proj.weight" => "attn_v",
        "self_attn.o_proj.weight" => "attn_output",
        "post_attention_layernorm.weight" => "ffn_norm",
        "mlp.gate_proj.weight" => "ffn_gate",
        "mlp.up_proj.weight" => "ffn_up",
        "mlp.down_proj.weight" => "ffn_down",
        other => panic!("{other}"),
    };
    format!("blk.{layer}.{g}.weight")
}

pub(super) fn tiny_meta(config: &LlamaConfig) -> Vec<(&'static str, Meta)> {
    let (tokens, merges, types) = tiny_vocab();
    let c = config;
    vec![
        ("general.architecture", Meta::Str("llama".into())),
        ("llama.block_count", Meta::U32(c.num_layers as u32)),
        ("llama.context_length", Meta::U32(c.max_seq_len as u32)),
        ("llama.embedding_length", Meta::U32(c.hidden_size as u32)),
        (
            "llama.feed_forward_length",
            Meta::U32(c.intermediate_size as u32),
        ),
        ("llama.attention.head_count", Meta::U32(c.num_heads as u32)),
        (
            "llama.attention.head_count_kv",
            Meta::U32(c.num_kv_heads as u32),
        ),
        ("llama.rope.freq_base", Meta::F32(c.rope_theta)),
        (
            "llama.attention.layer_norm_rms_epsilon",
            Meta::F32(c.rms_norm_eps),
        ),
        ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
        ("tokenizer.ggml.pre", Meta::Str("smollm".into())),
        ("tokenizer.ggml.tokens", Meta::Strs(tokens)),
        ("tokenizer.ggml.merges", Meta::Strs(merges)),
        ("tokenizer.ggml.token_type", Meta::I32s(types)),
        ("tokenizer.ggml.bos_token_id", Meta::U32(1)),
        ("tokenizer.ggml.eos_token_id", Meta::U32(2)),
        ("tokenizer.ggml.add_bos_token", Meta::Bool(false)),
    ]
}

/// The tiny model as GGUF tensors: Q and K permuted like llama.cpp, norms in F16, the rest
/// F32, dims reversed.
pub(super) fn tiny_gguf_tensors(
    config: &LlamaConfig,
    weights: &HashMap<String, HostTensor>,
) -> Vec<(String, u32, Vec<u64>, Vec<u8>)> {
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let t = &weights[name];
            let mut data = t.data.clone();
            let heads = if name.ends_with("q_proj.weight") {
                Some(config.num_heads)
            } else if name.ends_with("k_proj.weight") {
                Some(config.num_kv_heads)
            } else {
                None
            };
            if let Some(n) = heads {
                data = permute_like_llama_cpp(&data, n, t.shape[0], t.shape[1]);
            }
            let dims: Vec<u64> = t.shape.iter().rev().map(|&d| d as u64).collect();
            let (ty, bytes) = if t.shape.len() == 1 {
                (1, data.iter().flat_map(|&v| h(v)).collect())
            } else {
                (0, data.iter().flat_map(|v| v.to_le_bytes()).collect())
            };
            (gguf_name(name), ty, dims, bytes)
        })
        .collect()
}

/// A Hugging Face directory: config.json, tokenizer.json and the weights (BF16 norms, F32
/// otherwise), in one file or in two shards with an index.
pub(super) fn write_hf_dir(
    dir: &Path,
    config: &LlamaConfig,
    weights: &HashMap<String, HostTensor>,
    sharded: bool,
) {
    let (tokens, merges, types) = tiny_vocab();
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<_> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, ty))| **ty == 3)
        .map(|(i, (t, _))| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
        ]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();

    let mut cfg = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_seq_len,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids,
        "torch_dtype": "float32",
    });
    if let Some(s) = config.rope_scaling {
        cfg["rope_scaling"] = json!({
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        });
    }
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();

    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    let encoded: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = names
        .iter()
        .map(|&name| {
            let t = &weights[name];
            let (dtype, bytes) = if t.shape.len() == 1 {
                let b = t
                    .data
                    .iter()
                    .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                    .collect();
                (safetensors::Dtype::BF16, b)
            } else {
                let b = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
                (safetensors::Dtype::F32, b)
            };
            (name.clone(), dtype, t.shape.clone(), bytes)
        })
        .collect();
    let write = |file: &str, part: &[(String, safetensors::Dtype, Vec<usize>, Vec<u8>)]| {
        let views = part.iter().map(|(n, dt, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(*dt, shape.clone(), bytes).unwrap();
            (n.clone(), view)
        });
        let bytes = safetensors::serialize(views, None).unwrap();
        std::fs::write(dir.join(file), bytes).unwrap();
    };
    if sharded {
        let (a, b) = encoded.split_at(encoded.len() / 2);
        let files = [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ];
        write(files[0], a);
        write(files[1], b);
        let map: serde_json::Map<String, serde_json::Value> = a
            .iter()
            .map(|t| (t.0.clone(), json!(files[0])))
            .chain(b.iter().map(|t| (t.0.clone(), json!(files[1]))))
            .collect();
        let index = json!({"metadata": {"total_size": 0}, "weight_map": map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    } else {
        write("model.safetensors", &encoded);
    }
}
