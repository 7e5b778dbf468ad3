//! The real SmolLM2-135M checkpoint (fetched by `./scripts/setup.sh`): its config, tensors and
//! values, and its tokenizer.

use burn_llama::config::LlamaConfig;
use burn_llama::loader::{Checkpoint, default_model_path, load, validate};
use std::sync::OnceLock;

pub(super) fn smollm2() -> &'static Checkpoint {
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

pub(super) fn smollm2_config_matches_preset() {
    // Every field of the preset comes from the file (metadata, tokenizer ids, no `output`).
    assert_eq!(smollm2().config, LlamaConfig::smollm2_135m());
}

pub(super) fn smollm2_has_every_tensor_with_hf_shapes() {
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
pub(super) type Points = &'static [(usize, usize, f32)];

/// Values at a few (row, column) positions of Hugging Face-layout tensors, computed
/// independently with llama.cpp's `gguf` Python package (`gguf.quants.dequantize`) and
/// numpy (`w.reshape(n_head, head_dim / 2, 2, in).swapaxes(1, 2)` for Q and K).
pub(super) fn smollm2_values_match_gguf_py_reference() {
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
pub(super) fn smollm2_qk_unpermuted_and_plausible() {
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

pub(super) fn smollm2_tokenizer_round_trips() {
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
pub(super) fn smollm2_known_encodings() {
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

pub(super) fn smollm2_special_tokens_and_chat() {
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
