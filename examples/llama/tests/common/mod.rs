//! Shared by the tests that use the real SmolLM2-135M-Instruct weights.

use std::sync::OnceLock;

use burn::tensor::Device;

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

/// The committed paragraph's tokens.
pub fn paragraph_tokens() -> Vec<u32> {
    let text = include_str!("../../data/paragraph.txt");
    checkpoint().tokenizer.encode(text).unwrap()
}

/// Tokens of the paragraph a model-sized test runs on `device`: all of them, or on wgpu its
/// first [`WGPU_TOKENS`] (see [`burn_kernels_testing::is_wgpu`]: in CI that is lavapipe, where
/// a forward pass of the 135M-parameter model over the whole paragraph takes minutes).
pub fn paragraph_tokens_on(device: &Device) -> Vec<u32> {
    let mut ids = paragraph_tokens();
    if burn_kernels_testing::is_wgpu(device) {
        ids.truncate(WGPU_TOKENS);
    }
    ids
}

/// See [`paragraph_tokens_on`].
pub const WGPU_TOKENS: usize = 96;
