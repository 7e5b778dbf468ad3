//! The command lines and examples of `burn-llama`: thin tools over its public API (the model,
//! loader, generation, fine-tuning and evaluation live in the `burn-llama` library, `llama/`).
//!
//! - `llama generate|perplexity` ([`cli::llama`]) and `finetune` ([`cli::finetune`]): `src/bin/`
//! - tables and profiles: `examples/` (`kv_table`, `needle`, `sage_table`, `spec_table`,
//!   `decode_profile`), which load their model with [`smollm::load_smollm`]

pub mod cli;
pub mod smollm;
