//! Loader and tokenizer tests, on the CPU: the real SmolLM2-135M GGUF (fetched by
//! `./scripts/setup.sh`), small GGUF files and safetensors directories written here, and
//! hand-built quantization blocks.

use burn_llama::config::{Llama3RopeScaling, LlamaConfig};
use burn_llama::loader::gguf::{GGmlType, dequantize, unpermute_qk};
use burn_llama::loader::{
    Checkpoint, HostTensor, LoadError, default_model_path, load, load_gguf, load_safetensors_dir,
    validate,
};
use burn_llama::tokenizer::Tokenizer;
use half::{bf16, f16};
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

// ---------------------------------------------------------------------------------------
// The real model
// ---------------------------------------------------------------------------------------

fn smollm2() -> &'static Checkpoint {
    static CKPT: OnceLock<Checkpoint> = OnceLock::new();
    CKPT.get_or_init(|| {
        let path = default_model_path();
        assert!(
            path.is_file(),
            "{} is missing: run ./scripts/setup.sh (or `cargo xtask fetch-model`) first",
            path.display()
        );
        load(&path).unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
    })
}

#[test]
fn smollm2_config_matches_preset() {
    // Every field of the preset comes from the file (metadata, tokenizer ids, no `output`).
    assert_eq!(smollm2().config, LlamaConfig::smollm2_135m());
}

#[test]
fn smollm2_has_every_tensor_with_hf_shapes() {
    let ckpt = smollm2();
    validate(&ckpt.config, &ckpt.tensors).unwrap();
    assert_eq!(ckpt.tensors.len(), 1 + 30 * 9 + 1, "tied: no lm_head");
    assert!(!ckpt.tensors.contains_key("lm_head.weight"));
    let shape = |n: &str| ckpt.tensors[n].shape.clone();
    assert_eq!(shape("model.embed_tokens.weight"), [49152, 576]);
    assert_eq!(shape("model.layers.0.self_attn.k_proj.weight"), [192, 576]);
    assert_eq!(shape("model.layers.29.mlp.down_proj.weight"), [576, 1536]);
    assert_eq!(shape("model.norm.weight"), [576]);
}

/// (row, column, value) of a 2-D tensor.
type Points = &'static [(usize, usize, f32)];

/// Values at a few (row, column) positions of Hugging Face-layout tensors, computed
/// independently with llama.cpp's `gguf` Python package (`gguf.quants.dequantize`) and
/// numpy (`w.reshape(n_head, head_dim / 2, 2, in).swapaxes(1, 2)` for Q and K).
#[test]
fn smollm2_values_match_gguf_py_reference() {
    #[rustfmt::skip]
    let cases: &[(&str, Points)] = &[
        ("model.layers.0.self_attn.q_proj.weight", &[
            (0, 0, -0.09631348), (1, 5, -0.2984619), (31, 100, 0.09887695),
            (32, 7, -0.041809082), (63, 575, -0.06124878), (64, 3, 0.350708),
            (100, 200, 0.0021972656)]),
        ("model.layers.0.self_attn.k_proj.weight", &[
            (0, 0, -0.15527344), (1, 5, 0.42736816), (31, 100, -0.6421509),
            (32, 7, -0.40234375), (63, 575, 0.043701172), (64, 3, 0.98913574),
            (100, 200, -0.07080078)]),
        ("model.layers.29.self_attn.q_proj.weight", &[
            (0, 0, 0.2619629), (1, 5, 0.16958618), (31, 100, 0.07965088),
            (32, 7, 0.029052734), (63, 575, 0.31134033), (64, 3, 0.12823486),
            (100, 200, -0.03125)]),
        ("model.layers.0.self_attn.v_proj.weight", &[
            (0, 0, 0.10547638), (1, 5, -0.007247925), (31, 100, 0.000579834),
            (32, 7, -0.028007507), (63, 575, -0.021820068), (64, 3, -0.011512756),
            (100, 200, 0.03164673)]),
        // Q8_0
        ("model.embed_tokens.weight", &[
            (0, 0, -0.106544495), (1, 5, -0.00793457), (31, 100, 0.012269974),
            (32, 7, 0.021839142), (63, 575, 0.020923615), (64, 3, -0.11484909),
            (100, 200, 0.1263237)]),
        ("model.layers.0.mlp.down_proj.weight", &[
            (0, 0, -0.33081055), (1, 5, -0.038085938), (31, 100, -0.30273438),
            (32, 7, 0.0026855469), (63, 575, -0.049987793), (64, 3, -0.055999756),
            (100, 200, -0.053390503)]),
    ];
    for (name, points) in cases {
        let t = &smollm2().tensors[*name];
        for &(r, c, want) in *points {
            let got = t.data[r * t.shape[1] + c];
            assert_eq!(got, want, "{name}[{r}, {c}]: gguf-py says {want}");
        }
    }
}

/// After un-permutation, rows `i` and `i + head_dim / 2` of a head are the two halves of one
/// RoPE frequency pair, and in a trained model their norms are close. On this model the mean
/// log-norm gap is 0.15 with the right layout, 0.26 if the permutation were applied the
/// wrong way round, and 0.43 if it were not undone (measured with numpy).
#[test]
fn smollm2_qk_unpermuted_and_plausible() {
    let ckpt = smollm2();
    let hd = ckpt.config.head_dim;
    let mut gaps = Vec::new();
    for l in 0..ckpt.config.num_layers {
        for proj in ["q_proj", "k_proj"] {
            let t = &ckpt.tensors[&format!("model.layers.{l}.self_attn.{proj}.weight")];
            assert!(t.data.iter().all(|x| x.is_finite()), "layer {l} {proj}");
            let mean_abs = t.data.iter().map(|x| x.abs()).sum::<f32>() / t.data.len() as f32;
            let max_abs = t.data.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!(
                (0.01..1.0).contains(&mean_abs),
                "layer {l} {proj}: {mean_abs}"
            );
            assert!(max_abs < 20.0, "layer {l} {proj}: {max_abs}");

            let cols = t.shape[1];
            let log_norm = |row: usize| {
                let r = &t.data[row * cols..(row + 1) * cols];
                (r.iter().map(|x| (x * x) as f64).sum::<f64>()).sqrt().ln()
            };
            let mut gap = 0.0;
            let heads = t.shape[0] / hd;
            for h in 0..heads {
                for i in 0..hd / 2 {
                    gap += (log_norm(h * hd + i) - log_norm(h * hd + i + hd / 2)).abs();
                }
            }
            gaps.push(gap / (heads * hd / 2) as f64);
        }
    }
    let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
    assert!(
        mean < 0.2,
        "rotate-half pairs differ by {mean:.3} in log-norm"
    );
}

// ---------------------------------------------------------------------------------------
// The tokenizer of the real model
// ---------------------------------------------------------------------------------------

#[test]
fn smollm2_tokenizer_round_trips() {
    let tok = &smollm2().tokenizer;
    assert_eq!(tok.vocab_size(), 49152);
    for s in [
        "The quick brown fox jumps over the lazy dog.",
        "Hello, world! How are you today?",
        "In 1984, prices rose 12.5% — naïve café owners shrugged.",
        "  leading spaces,\ttabs and\nnew lines  ",
        "fn main() { println!(\"{}\", 42); }",
    ] {
        let ids = tok.encode(s).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), s);
    }
}

/// Ids established independently, over the vocabulary embedded in the GGUF, by Hugging Face
/// `tokenizers` (Python, built as Sequence[Digits(individual), ByteLevel]) and by a
/// pure-Python GPT-2 BPE; both agree.
#[test]
fn smollm2_known_encodings() {
    let tok = &smollm2().tokenizer;
    let cases: &[(&str, &[u32])] = &[
        ("The capital of France is", &[504, 3575, 282, 4649, 314]),
        ("Hello, world!", &[19556, 28, 905, 17]),
        (
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
            &[1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198],
        ),
        (
            "In 1984, prices rose 12.5%.",
            &[
                788, 216, 33, 41, 40, 36, 28, 5770, 8739, 216, 33, 34, 30, 37, 8006,
            ],
        ),
    ];
    for (text, ids) in cases {
        assert_eq!(tok.encode(text).unwrap(), *ids, "{text:?}");
    }
}

#[test]
fn smollm2_special_tokens_and_chat() {
    let tok = &smollm2().tokenizer;
    assert_eq!(tok.encode("<|im_start|>").unwrap(), [1]);
    assert_eq!(tok.token_id("<|im_start|>"), Some(1));
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
    assert!(tok.eos_token_ids().contains(&2));
    assert_eq!(tok.bos_token_id(), Some(1));

    let prompt = tok.chat_prompt(&[("system", "Be brief."), ("user", "Hi!")], true);
    assert_eq!(
        prompt,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    let ids = tok.encode(&prompt).unwrap();
    assert_eq!(ids[0], 1, "no BOS in front for SmolLM2");
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 3);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 2);
    assert_eq!(
        tok.decode(&ids).unwrap(),
        "system\nBe brief.\nuser\nHi!\nassistant\n"
    );
    assert!(
        !tok.chat_prompt(&[("user", "x")], false)
            .ends_with("assistant\n")
    );
}

// ---------------------------------------------------------------------------------------
// Dequantization of hand-built blocks
// ---------------------------------------------------------------------------------------

fn h(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

#[test]
fn dequant_q8_0() {
    // d = 0.5, q = 8 i - 128 (covers -128 and 120), then a second block with d = -2.
    let mut raw = h(0.5).to_vec();
    raw.extend((0..32).map(|i| (8 * i - 128) as i8 as u8));
    raw.extend(h(-2.0));
    raw.extend((0..32).map(|i| (i as i8 - 16) as u8));
    let got = dequantize("t", GGmlType::Q8_0, &raw, 64).unwrap();
    let mut want: Vec<f32> = (0..32).map(|i| (8 * i - 128) as f32 * 0.5).collect();
    want.extend((0..32).map(|i| (i - 16) as f32 * -2.0));
    assert_eq!(got, want);
}

#[test]
fn dequant_q4_0() {
    // Byte j holds element j in its low nibble and element j + 16 in its high nibble.
    let mut raw = h(0.25).to_vec();
    raw.extend((0..16u8).map(|j| ((15 - j) << 4) | j));
    let got = dequantize("t", GGmlType::Q4_0, &raw, 32).unwrap();
    let mut want: Vec<f32> = (0..16).map(|j| (j - 8) as f32 * 0.25).collect();
    want.extend((0..16).map(|j| (15 - j - 8) as f32 * 0.25));
    assert_eq!(got, want);
}

#[test]
fn dequant_q4_1() {
    // x = q d + m with d = 0.5, m = -1.
    let mut raw = h(0.5).to_vec();
    raw.extend(h(-1.0));
    raw.extend((0..16u8).map(|j| (((j * 7) % 16) << 4) | j));
    let got = dequantize("t", GGmlType::Q4_1, &raw, 32).unwrap();
    let mut want: Vec<f32> = (0..16).map(|j| j as f32 * 0.5 - 1.0).collect();
    want.extend((0..16).map(|j| ((j * 7) % 16) as f32 * 0.5 - 1.0));
    assert_eq!(got, want);
}

#[test]
fn dequant_q5_0_and_q5_1() {
    // The fifth bit of element i is bit i of qh; qh = 0xAAAA5555 sets it for even i < 16 and
    // odd i >= 16. Low nibbles as in Q4_0.
    let qh = 0xAAAA_5555u32.to_le_bytes();
    let qs: Vec<u8> = (0..16u8).map(|j| ((15 - j) << 4) | j).collect();
    let q = |i: usize| -> i32 {
        let low = if i < 16 {
            i as i32
        } else {
            15 - (i as i32 - 16)
        };
        let high = (0xAAAA_5555u32 >> i) & 1;
        low | ((high as i32) << 4)
    };
    let mut raw = h(0.5).to_vec();
    raw.extend(qh);
    raw.extend(&qs);
    let got = dequantize("t", GGmlType::Q5_0, &raw, 32).unwrap();
    let want: Vec<f32> = (0..32).map(|i| (q(i) - 16) as f32 * 0.5).collect();
    assert_eq!(got, want);

    let mut raw = h(0.25).to_vec();
    raw.extend(h(3.0));
    raw.extend(qh);
    raw.extend(&qs);
    let got = dequantize("t", GGmlType::Q5_1, &raw, 32).unwrap();
    let want: Vec<f32> = (0..32).map(|i| q(i) as f32 * 0.25 + 3.0).collect();
    assert_eq!(got, want);
}

#[test]
fn dequant_float_types() {
    let vals = [0.0f32, 1.5, -2.25, 65504.0, 1.0e-3];
    let f32_raw: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(dequantize("t", GGmlType::F32, &f32_raw, 5).unwrap(), vals);

    let f16_raw: Vec<u8> = vals.iter().flat_map(|&v| h(v)).collect();
    let want: Vec<f32> = vals.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
    assert_eq!(dequantize("t", GGmlType::F16, &f16_raw, 5).unwrap(), want);

    let bf_raw: Vec<u8> = vals
        .iter()
        .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
        .collect();
    let want: Vec<f32> = vals.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    assert_eq!(dequantize("t", GGmlType::BF16, &bf_raw, 5).unwrap(), want);
}

#[test]
fn dequant_rejects_unsupported_and_short_data() {
    let err = dequantize("blk.0.ffn_up.weight", GGmlType::Q4K, &[0; 144], 256).unwrap_err();
    assert!(
        matches!(&err, LoadError::UnsupportedQuant { tensor, quant }
            if tensor == "blk.0.ffn_up.weight" && quant == "Q4K"),
        "{err}"
    );
    let err = dequantize("t", GGmlType::Q4_1, &[0; 19], 32).unwrap_err();
    assert!(matches!(err, LoadError::ShapeMismatch { .. }), "{err}");
}

#[test]
fn unpermute_small() {
    // One head of 4 rows: HF rows r0 r1 r2 r3 are stored by llama.cpp as r0 r2 r1 r3.
    let gguf = [0.0, 2.0, 1.0, 3.0, 10.0, 12.0, 11.0, 13.0];
    assert_eq!(
        unpermute_qk(&gguf, 2, 8, 1),
        [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]
    );
}

// ---------------------------------------------------------------------------------------
// A tiny random Llama, written as GGUF and as a safetensors directory
// ---------------------------------------------------------------------------------------

/// A scratch directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
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
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        x as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// GPT-2's byte → printable character table.
fn byte_chars() -> Vec<char> {
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
fn tiny_vocab() -> (Vec<String>, Vec<String>, Vec<i32>) {
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

fn tiny_config(vocab_size: usize, tie: bool) -> LlamaConfig {
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
fn tiny_weights(config: &LlamaConfig, seed: u64) -> HashMap<String, HostTensor> {
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
fn permute_like_llama_cpp(w: &[f32], n_head: usize, rows: usize, cols: usize) -> Vec<f32> {
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
enum Meta {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

/// A GGUF v3 file, written by hand from the format description (not with the parser's
/// crate), with 32-byte alignment. Tensors: name, GGML type id, dims innermost first, bytes.
fn write_gguf(path: &Path, meta: &[(&str, Meta)], tensors: &[(String, u32, Vec<u64>, Vec<u8>)]) {
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
fn gguf_name(hf: &str) -> String {
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

fn tiny_meta(config: &LlamaConfig) -> Vec<(&'static str, Meta)> {
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
fn tiny_gguf_tensors(
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

#[test]
fn tiny_gguf_loads_exactly() {
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

#[test]
fn tiny_gguf_wrong_shape_is_shape_mismatch() {
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

#[test]
fn validate_reports_missing_and_misshapen_tensors() {
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

#[test]
fn unsupported_quant_is_reported_with_tensor_and_type() {
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

#[test]
fn missing_paths_are_not_found() {
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

#[test]
fn malformed_files_are_format_errors() {
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

/// A Hugging Face directory: config.json, tokenizer.json and the weights (BF16 norms, F32
/// otherwise), in one file or in two shards with an index.
fn write_hf_dir(
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

#[test]
fn tiny_safetensors_dir_loads_exactly() {
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

#[test]
fn tokenizer_from_gguf_vocab_directly() {
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
#[test]
fn tiny_gguf_llama3_rope_scaling() {
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
