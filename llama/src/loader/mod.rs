//! Weight loading: a GGUF file (dequantized to f32 on load) or a Hugging Face safetensors
//! directory, into host tensors with Hugging Face names and layouts, plus the model's
//! [`LlamaConfig`] and [`Tokenizer`].
//!
//! ```no_run
//! let ckpt = burn_llama::loader::load(&burn_llama::loader::default_model_path())?;
//! println!("{} tensors, {} layers", ckpt.tensors.len(), ckpt.config.num_layers);
//! # Ok::<(), burn_llama::loader::LoadError>(())
//! ```

pub mod gguf;
pub mod host;
pub mod safetensors;

pub use crate::error::LoadError;

use crate::config::LlamaConfig;
use crate::tokenizer::Tokenizer;
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

/// A dense f32 tensor in host memory, row-major, with Hugging Face shapes: linear weights
/// `[out_features, in_features]`, embeddings `[vocab, hidden]`, norms `[hidden]`.
#[derive(Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl HostTensor {
    /// Number of elements the shape describes.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Shape and a few values: the data is too long to print.
impl fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let head = &self.data[..self.data.len().min(4)];
        write!(f, "HostTensor {{ shape: {:?}, data: {head:?}", self.shape)?;
        if self.data.len() > head.len() {
            write!(f, "... ({} values)", self.data.len())?;
        }
        f.write_str(" }")
    }
}

/// Everything needed to build and run a model.
pub struct Checkpoint {
    pub config: LlamaConfig,
    /// Weights by Hugging Face name (`model.layers.0.self_attn.q_proj.weight`, ...).
    pub tensors: HashMap<String, HostTensor>,
    pub tokenizer: Tokenizer,
}

/// The configuration and tensor count: the weights are too long to print.
impl fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checkpoint")
            .field("config", &self.config)
            .field("tensors", &self.tensors.len())
            .field("tokenizer", &self.tokenizer)
            .finish()
    }
}

/// Loads a checkpoint: a `.gguf` file, or a Hugging Face directory (`config.json`,
/// `model.safetensors` or sharded `model.safetensors.index.json`, `tokenizer.json`).
/// A path to a `.safetensors` file or `config.json` loads its directory.
pub fn load(path: &Path) -> Result<Checkpoint, LoadError> {
    let meta = std::fs::metadata(path).map_err(|e| LoadError::io(path, e))?;
    if meta.is_dir() {
        return load_safetensors_dir(path);
    }
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if name.ends_with(".safetensors") || name.ends_with(".json") {
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
        return load_safetensors_dir(dir.unwrap_or(Path::new(".")));
    }
    load_gguf(path)
}

/// Loads a GGUF file (llama architecture), dequantizing every tensor to f32.
pub fn load_gguf(path: &Path) -> Result<Checkpoint, LoadError> {
    gguf::load(path)
}

/// Loads a Hugging Face checkpoint directory.
pub fn load_safetensors_dir(dir: &Path) -> Result<Checkpoint, LoadError> {
    safetensors::load_dir(dir)
}

/// The tensors a model with `config` needs and their shapes, by Hugging Face name.
pub fn expected_shapes(config: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let h = config.hidden_size;
    let q = config.num_heads * config.head_dim;
    let kv = config.num_kv_heads * config.head_dim;
    let ff = config.intermediate_size;
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![config.vocab_size, h],
    )];
    for i in 0..config.num_layers {
        let p = format!("model.layers.{i}");
        out.extend([
            (format!("{p}.input_layernorm.weight"), vec![h]),
            (format!("{p}.self_attn.q_proj.weight"), vec![q, h]),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
            (format!("{p}.self_attn.o_proj.weight"), vec![h, q]),
            (format!("{p}.post_attention_layernorm.weight"), vec![h]),
            (format!("{p}.mlp.gate_proj.weight"), vec![ff, h]),
            (format!("{p}.mlp.up_proj.weight"), vec![ff, h]),
            (format!("{p}.mlp.down_proj.weight"), vec![h, ff]),
        ]);
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !config.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![config.vocab_size, h]));
    }
    out
}

/// Checks that every tensor the model needs is present with the expected shape (and that its
/// data has as many elements as its shape says). Extra tensors are allowed.
pub fn validate(
    config: &LlamaConfig,
    tensors: &HashMap<String, HostTensor>,
) -> Result<(), LoadError> {
    for (name, expected) in expected_shapes(config) {
        let t = tensors
            .get(&name)
            .ok_or_else(|| LoadError::MissingTensor { name: name.clone() })?;
        if t.shape != expected {
            return Err(LoadError::ShapeMismatch {
                tensor: name,
                expected,
                found: t.shape.clone(),
            });
        }
        if t.data.len() != t.numel() {
            return Err(LoadError::ShapeMismatch {
                tensor: name,
                expected,
                found: vec![t.data.len()],
            });
        }
    }
    Ok(())
}

/// Where the default model lives: `$BURN_KERNELS_MODEL` if set, else
/// `$HOME/.cache/burn-kernels/models/SmolLM2-135M-Instruct.Q4_1.gguf`
/// (`cargo xtask fetch-model` puts it there).
pub fn default_model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("BURN_KERNELS_MODEL").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache/burn-kernels/models/SmolLM2-135M-Instruct.Q4_1.gguf")
}
