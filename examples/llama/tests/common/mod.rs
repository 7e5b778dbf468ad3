//! Shared by the tests that use the real SmolLM2-135M-Instruct weights.

use std::sync::OnceLock;

use burn_llama::loader::{Checkpoint, default_model_path, load};

/// The checkpoint at the default model path, loaded once per test binary.
pub fn checkpoint() -> &'static Checkpoint {
    static CKPT: OnceLock<Checkpoint> = OnceLock::new();
    CKPT.get_or_init(|| {
        load(&default_model_path()).unwrap_or_else(|e| {
            panic!("{e}\n(the SmolLM2 weights come from `./scripts/setup.sh`, or `cargo xtask fetch-model`)")
        })
    })
}
