//! GGUF metadata: typed access, and the tokenizer and model configuration read from it.

use super::super::LoadError;
use crate::config::{Llama3RopeScaling, LlamaConfig};
use crate::tokenizer::Tokenizer;
use ggus::{
    GGuf, GGufMetaDataValueType as Ty, GGufMetaError, GGufMetaMap, GGufMetaMapExt, GGufReader,
};
use std::path::Path;

/// Typed access to GGUF metadata with errors that name the key and file.
pub(super) struct Meta<'a> {
    pub(super) path: &'a Path,
    pub(super) gguf: &'a GGuf<'a>,
}

impl Meta<'_> {
    pub(super) fn err(&self, key: &str, e: GGufMetaError) -> LoadError {
        match e {
            GGufMetaError::NotExist => LoadError::MissingMetadata {
                key: key.to_string(),
            },
            other => LoadError::format(self.path, format!("metadata `{key}`: {other:?}")),
        }
    }

    pub(super) fn opt<T>(
        &self,
        key: &str,
        r: Result<T, GGufMetaError>,
    ) -> Result<Option<T>, LoadError> {
        match r {
            Ok(v) => Ok(Some(v)),
            Err(GGufMetaError::NotExist) => Ok(None),
            Err(e) => Err(self.err(key, e)),
        }
    }

    pub(super) fn str(&self, key: &str) -> Result<&str, LoadError> {
        self.gguf.get_str(key).map_err(|e| self.err(key, e))
    }

    pub(super) fn opt_str(&self, key: &str) -> Result<Option<&str>, LoadError> {
        self.opt(key, self.gguf.get_str(key))
    }

    pub(super) fn usize(&self, key: &str) -> Result<usize, LoadError> {
        self.gguf.get_usize(key).map_err(|e| self.err(key, e))
    }

    pub(super) fn opt_usize(&self, key: &str) -> Result<Option<usize>, LoadError> {
        self.opt(key, self.gguf.get_usize(key))
    }

    pub(super) fn opt_u32(&self, key: &str) -> Result<Option<u32>, LoadError> {
        self.opt_usize(key)?
            .map(|v| {
                u32::try_from(v).map_err(|_| {
                    LoadError::format(self.path, format!("metadata `{key}` = {v} is too large"))
                })
            })
            .transpose()
    }

    pub(super) fn opt_bool(&self, key: &str) -> Result<Option<bool>, LoadError> {
        self.opt(key, self.gguf.get_bool(key))
    }

    /// An f32 or f64 value.
    pub(super) fn opt_f32(&self, key: &str) -> Result<Option<f32>, LoadError> {
        let Some((ty, val)) = self.gguf.get(key) else {
            return Ok(None);
        };
        let mut r = GGufReader::new(val);
        let v = match ty {
            Ty::F32 => r.read::<f32>().ok(),
            Ty::F64 => r.read::<f64>().ok().map(|v| v as f32),
            _ => None,
        };
        v.map(Some).ok_or_else(|| {
            LoadError::format(self.path, format!("metadata `{key}`: expected a float"))
        })
    }

    pub(super) fn f32(&self, key: &str) -> Result<f32, LoadError> {
        self.opt_f32(key)?
            .ok_or_else(|| LoadError::MissingMetadata {
                key: key.to_string(),
            })
    }

    pub(super) fn opt_strings(&self, key: &str) -> Result<Option<Vec<String>>, LoadError> {
        let Some(arr) = self.opt(key, self.gguf.get_str_arr(key))? else {
            return Ok(None);
        };
        arr.map(|s| s.map(str::to_string))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
            .map_err(|e| LoadError::format(self.path, format!("metadata `{key}`: {e:?}")))
    }

    pub(super) fn opt_i32s(&self, key: &str) -> Result<Option<Vec<i32>>, LoadError> {
        let Some(arr) = self.opt(key, self.gguf.get_i32_arr(key))? else {
            return Ok(None);
        };
        arr.collect::<Result<Vec<_>, _>>()
            .map(Some)
            .map_err(|e| LoadError::format(self.path, format!("metadata `{key}`: {e:?}")))
    }
}

pub(super) fn tokenizer_from_meta(meta: &Meta<'_>) -> Result<Tokenizer, LoadError> {
    let model = meta.str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(LoadError::Tokenizer {
            msg: format!(
                "{}: tokenizer model `{model}` is not supported (only byte-level BPE, `gpt2`)",
                meta.path.display()
            ),
        });
    }
    let missing = |key: &str| LoadError::MissingMetadata {
        key: key.to_string(),
    };
    let tokens = meta
        .opt_strings("tokenizer.ggml.tokens")?
        .ok_or_else(|| missing("tokenizer.ggml.tokens"))?;
    let merges = meta
        .opt_strings("tokenizer.ggml.merges")?
        .ok_or_else(|| missing("tokenizer.ggml.merges"))?;
    let types = meta.opt_i32s("tokenizer.ggml.token_type")?;
    let pre = meta.opt_str("tokenizer.ggml.pre")?;
    let bos = meta.opt_u32("tokenizer.ggml.bos_token_id")?;
    let eos = eos_ids(meta)?;
    let mut tok = Tokenizer::from_gguf_vocab(tokens, merges, types, pre, bos, eos)?;
    if let Some(add) = meta.opt_bool("tokenizer.ggml.add_bos_token")? {
        tok.set_add_bos(add)?;
    }
    Ok(tok)
}

/// `eos_token_id`, then the end-of-turn and end-of-message ids when the file has them.
fn eos_ids(meta: &Meta<'_>) -> Result<Vec<u32>, LoadError> {
    let mut ids = Vec::new();
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        if let Some(id) = meta.opt_u32(key)?
            && !ids.contains(&id)
        {
            ids.push(id);
        }
    }
    Ok(ids)
}

pub(super) fn config_from_meta(
    meta: &Meta<'_>,
    tokenizer_vocab: usize,
    has_output: bool,
    rope_freqs: Option<&[f32]>,
) -> Result<LlamaConfig, LoadError> {
    let hidden_size = meta.usize("llama.embedding_length")?;
    let num_heads = meta.usize("llama.attention.head_count")?;
    if num_heads == 0 {
        return Err(LoadError::format(
            meta.path,
            "llama.attention.head_count is 0",
        ));
    }
    let num_kv_heads = meta
        .opt_usize("llama.attention.head_count_kv")?
        .unwrap_or(num_heads);
    let head_dim = meta
        .opt_usize("llama.attention.key_length")?
        .unwrap_or(hidden_size / num_heads);
    let rope_theta = meta.opt_f32("llama.rope.freq_base")?.unwrap_or(10_000.0);
    let rope_scaling = match rope_freqs {
        Some(f) => Some(llama3_scaling(meta, f, rope_theta, head_dim)?),
        None => None,
    };
    let eos_token_ids = eos_ids(meta)?;
    Ok(LlamaConfig {
        vocab_size: meta
            .opt_usize("llama.vocab_size")?
            .unwrap_or(tokenizer_vocab),
        hidden_size,
        intermediate_size: meta.usize("llama.feed_forward_length")?,
        num_layers: meta.usize("llama.block_count")?,
        num_heads,
        num_kv_heads,
        head_dim,
        rope_theta,
        rope_scaling,
        rms_norm_eps: meta.f32("llama.attention.layer_norm_rms_epsilon")?,
        tie_word_embeddings: !has_output,
        max_seq_len: meta.usize("llama.context_length")?,
        bos_token_id: meta.opt_u32("tokenizer.ggml.bos_token_id")?,
        eos_token_ids,
    })
}

/// Recovers Llama-3 RoPE scaling from `rope_freqs.weight`, where llama.cpp stores the
/// per-frequency divisors instead of the parameters. The factor is the largest divisor (or
/// `llama.rope.scaling.factor`); the frequency band is assumed to be Llama 3.1's (low/high
/// frequency factors 1 and 4, original context 8192 unless the file says) and checked
/// against the stored divisors.
fn llama3_scaling(
    meta: &Meta<'_>,
    freqs: &[f32],
    theta: f32,
    head_dim: usize,
) -> Result<Llama3RopeScaling, LoadError> {
    let factor = match meta.opt_f32("llama.rope.scaling.factor")? {
        Some(f) => f,
        None => freqs.iter().copied().fold(1.0, f32::max),
    };
    let scaling = Llama3RopeScaling {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: meta
            .opt_usize("llama.rope.scaling.original_context_length")?
            .unwrap_or(8192),
    };
    let expected = llama3_divisors(&scaling, theta, head_dim);
    let close = expected.len() == freqs.len()
        && expected
            .iter()
            .zip(freqs)
            .all(|(a, b)| (a - b).abs() <= 1e-3 * a.abs().max(1.0));
    if !close {
        return Err(LoadError::format(
            meta.path,
            format!("rope_freqs.weight does not match Llama-3 RoPE scaling {scaling:?}"),
        ));
    }
    Ok(scaling)
}

/// What llama.cpp's converter writes to `rope_freqs.weight` for these parameters.
fn llama3_divisors(s: &Llama3RopeScaling, theta: f32, head_dim: usize) -> Vec<f32> {
    let old = s.original_max_position_embeddings as f64;
    let low_wavelen = old / s.low_freq_factor as f64;
    let high_wavelen = old / s.high_freq_factor as f64;
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / (theta as f64).powf(2.0 * i as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let f = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                s.factor as f64
            } else {
                let smooth = (old / wavelen - s.low_freq_factor as f64)
                    / (s.high_freq_factor - s.low_freq_factor) as f64;
                1.0 / ((1.0 - smooth) / s.factor as f64 + smooth)
            };
            f as f32
        })
        .collect()
}
