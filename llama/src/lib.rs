//! # burn-llama: a Llama-architecture model for the burn-kernels examples
//!
//! Loads real weights (GGUF with F32/F16/Q8_0/Q4_0/Q4_1 dequantized on load, or an HF
//! safetensors directory), builds the tokenizer, and generates with a KV cache. Attention,
//! the KV cache and sampling are plug-in points from `burn-kernels-core`, which the paper
//! crates implement; [`attention`] names the attention implementations, the SageAttention2
//! variants of `burn-sage` among them.

pub mod attention;
pub mod checkpoint;
pub mod config;
pub mod data_parallel;
mod distill;
pub mod error;
pub mod eval;
pub mod finetune;
pub mod generate;
pub mod graph;
pub mod loader;
pub mod model;
pub mod names;
pub mod passkey;
pub mod precision;
pub mod ruler;
pub mod spec;
pub mod tokenizer;
pub mod train;

pub use config::{Llama3RopeScaling, LlamaConfig};
pub use model::Llama;
