//! Hugging Face checkpoint directories: `config.json`, `tokenizer.json`, and weights in
//! `model.safetensors` or in shards listed by `model.safetensors.index.json`.

use super::{Checkpoint, HostTensor, LoadError, validate};
use crate::config::{Llama3RopeScaling, LlamaConfig};
use crate::tokenizer::Tokenizer;
use ::safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

pub(crate) fn load_dir(dir: &Path) -> Result<Checkpoint, LoadError> {
    if !dir.is_dir() {
        return Err(LoadError::NotFound {
            path: dir.to_path_buf(),
        });
    }
    let config = config_from_json(&dir.join("config.json"))?;
    let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"))?
        .with_bos_token_id(config.bos_token_id)
        .with_eos_token_ids(&config.eos_token_ids);
    let mut tensors = HashMap::new();
    for file in weight_files(dir)? {
        read_safetensors(&file, &mut tensors)?;
    }
    validate(&config, &tensors)?;
    Ok(Checkpoint {
        config,
        tensors,
        tokenizer,
    })
}

/// `model.safetensors`, or the shards `model.safetensors.index.json` names.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Ok(vec![dir.join("model.safetensors")]);
    }
    let json = read_json(&index)?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| LoadError::format(&index, "no `weight_map` object"))?;
    let files: BTreeSet<&str> = map
        .values()
        .map(|v| {
            v.as_str()
                .ok_or_else(|| LoadError::format(&index, "`weight_map` values must be strings"))
        })
        .collect::<Result<_, _>>()?;
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}

/// Adds every tensor of one safetensors file to `out`, converted to f32.
fn read_safetensors(path: &Path, out: &mut HashMap<String, HostTensor>) -> Result<(), LoadError> {
    let bytes = std::fs::read(path).map_err(|e| LoadError::io(path, e))?;
    let st =
        SafeTensors::deserialize(&bytes).map_err(|e| LoadError::format(path, e.to_string()))?;
    for (name, view) in st.iter() {
        let raw = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => raw
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => raw
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => raw
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(LoadError::UnsupportedQuant {
                    tensor: name.to_string(),
                    quant: format!("{other:?}"),
                });
            }
        };
        out.insert(
            name.to_string(),
            HostTensor {
                shape: view.shape().to_vec(),
                data,
            },
        );
    }
    Ok(())
}

fn read_json(path: &Path) -> Result<Value, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| LoadError::format(path, e.to_string()))
}

/// Reads the Llama fields of a Hugging Face `config.json`.
pub fn config_from_json(path: &Path) -> Result<LlamaConfig, LoadError> {
    let json = read_json(path)?;
    let missing = |key: &str| LoadError::MissingMetadata {
        key: key.to_string(),
    };
    let wrong = |key: &str, what: &str| LoadError::format(path, format!("`{key}` is not {what}"));
    let opt_usize = |key: &str| -> Result<Option<usize>, LoadError> {
        match json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| wrong(key, "a non-negative integer")),
        }
    };
    let usize_ = |key: &str| opt_usize(key)?.ok_or_else(|| missing(key));
    let opt_f32 = |v: Option<&Value>, key: &str| -> Result<Option<f32>, LoadError> {
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|f| Some(f as f32))
                .ok_or_else(|| wrong(key, "a number")),
        }
    };
    let ids = |key: &str| -> Result<Vec<u32>, LoadError> {
        let as_id = |v: &Value| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| wrong(key, "a token id or a list of token ids"))
        };
        match json.get(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(a)) => a.iter().map(as_id).collect(),
            Some(v) => Ok(vec![as_id(v)?]),
        }
    };

    let hidden_size = usize_("hidden_size")?;
    let num_heads = usize_("num_attention_heads")?;
    if num_heads == 0 {
        return Err(wrong("num_attention_heads", "positive"));
    }
    let rope_scaling = match json.get("rope_scaling") {
        None | Some(Value::Null) => None,
        Some(s) => {
            let kind = s
                .get("rope_type")
                .or_else(|| s.get("type"))
                .and_then(Value::as_str);
            if kind != Some("llama3") {
                return Err(LoadError::format(
                    path,
                    format!("rope_scaling type {kind:?} is not supported (only \"llama3\")"),
                ));
            }
            let field = |k: &str| {
                opt_f32(s.get(k), &format!("rope_scaling.{k}"))?
                    .ok_or_else(|| missing(&format!("rope_scaling.{k}")))
            };
            let orig = "original_max_position_embeddings";
            Some(Llama3RopeScaling {
                factor: field("factor")?,
                low_freq_factor: field("low_freq_factor")?,
                high_freq_factor: field("high_freq_factor")?,
                original_max_position_embeddings: s
                    .get(orig)
                    .and_then(Value::as_u64)
                    .ok_or_else(|| missing(&format!("rope_scaling.{orig}")))?
                    as usize,
            })
        }
    };
    let bos = ids("bos_token_id")?;
    Ok(LlamaConfig {
        vocab_size: usize_("vocab_size")?,
        hidden_size,
        intermediate_size: usize_("intermediate_size")?,
        num_layers: usize_("num_hidden_layers")?,
        num_heads,
        num_kv_heads: opt_usize("num_key_value_heads")?.unwrap_or(num_heads),
        head_dim: opt_usize("head_dim")?.unwrap_or(hidden_size / num_heads),
        rope_theta: opt_f32(json.get("rope_theta"), "rope_theta")?.unwrap_or(10_000.0),
        rope_scaling,
        rms_norm_eps: opt_f32(json.get("rms_norm_eps"), "rms_norm_eps")?.unwrap_or(1e-6),
        tie_word_embeddings: json
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        max_seq_len: opt_usize("max_position_embeddings")?.unwrap_or(2048),
        bos_token_id: bos.first().copied(),
        eos_token_ids: ids("eos_token_id")?,
    })
}
