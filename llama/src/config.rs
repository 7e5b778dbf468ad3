//! Model hyper-parameters: from GGUF metadata, an HF `config.json`, or a preset.

use serde::{Deserialize, Serialize};

/// Llama-3 style RoPE frequency scaling (`rope_scaling.rope_type = "llama3"`).
pub use burn_kernels_core::rope::RopeScaling as Llama3RopeScaling;

/// The shape and constants of a Llama-architecture model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    pub max_seq_len: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl LlamaConfig {
    /// SmolLM2-135M(-Instruct).
    pub fn smollm2_135m() -> Self {
        LlamaConfig {
            vocab_size: 49152,
            hidden_size: 576,
            intermediate_size: 1536,
            num_layers: 30,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            rope_theta: 100_000.0,
            rope_scaling: None,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            max_seq_len: 8192,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
        }
    }

    /// Llama-3.2-1B.
    pub fn llama32_1b() -> Self {
        LlamaConfig {
            vocab_size: 128_256,
            hidden_size: 2048,
            intermediate_size: 8192,
            num_layers: 16,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 64,
            rope_theta: 500_000.0,
            rope_scaling: Some(Llama3RopeScaling {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }),
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            max_seq_len: 131_072,
            bos_token_id: Some(128_000),
            eos_token_ids: vec![128_001, 128_008, 128_009],
        }
    }

    /// Llama-3-8B.
    pub fn llama3_8b() -> Self {
        LlamaConfig {
            vocab_size: 128_256,
            hidden_size: 4096,
            intermediate_size: 14_336,
            num_layers: 32,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            rope_theta: 500_000.0,
            rope_scaling: None,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            max_seq_len: 8192,
            bos_token_id: Some(128_000),
            eos_token_ids: vec![128_001, 128_009],
        }
    }

    /// A preset by name: `smollm2-135m`, `llama-3.2-1b`, `llama-3-8b`.
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "smollm2-135m" => Some(Self::smollm2_135m()),
            "llama-3.2-1b" => Some(Self::llama32_1b()),
            "llama-3-8b" => Some(Self::llama3_8b()),
            _ => None,
        }
    }

    /// Query heads per KV head (grouped-query attention).
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}
