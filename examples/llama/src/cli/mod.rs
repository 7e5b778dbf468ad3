//! The `llama` and `finetune` command lines. Their code lives in the library, and the binaries
//! (`src/bin/`) only call [`llama::main`] and [`finetune::main`], so that the backends they
//! dispatch to are compiled once, not once per binary (minutes of a two-core CI build).

pub mod finetune;
pub mod llama;
