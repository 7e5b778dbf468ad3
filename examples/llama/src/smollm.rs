//! The model the CPU tables of `examples/` run: the default SmolLM2 checkpoint in f32.

use burn::tensor::{DType, Device};
use burn_llama::loader::{Checkpoint, default_model_path, load};
use burn_llama::model::Llama;

/// The default checkpoint (its tokenizer included) and its model in f32 on `device`.
///
/// # Panics
/// Where the weights are missing or do not load, saying where they come from.
pub fn load_smollm(device: &Device) -> (Checkpoint, Llama) {
    let ckpt = load(&default_model_path()).unwrap_or_else(|e| {
        panic!("{e}\n(the SmolLM2 weights come from `cargo xtask fetch-model`)")
    });
    let model = Llama::from_checkpoint(&ckpt, device, DType::F32).expect("model");
    (ckpt, model)
}
