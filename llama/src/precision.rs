//! Mixed-precision training for a Burn [`Module`]: Burn has no autocast, so this is the small
//! piece that does its job for the model's parameters.
//!
//! A step in [`Precision::Bf16`] computes with a *compute view* of the model: every float
//! parameter is the master parameter (f32, the one the optimizer updates and keeps its moments
//! for) cast to bf16 inside the autodiff graph. The forward and backward then run in bf16 —
//! matrix products, attention, activations and their gradients — and autodiff's cast backward
//! returns each parameter's gradient to its f32 master, so [`GradientsParams::from_grads`] on
//! the master model reads f32 gradients and AdamW updates f32 weights. burn-cce accumulates its
//! log-sum-exp and loss in f32 whatever its inputs, Burn's fused attention keeps its log-sum-exp
//! in f32; the plain loss (Burn's ops) takes the log-softmax in the compute dtype and sums the
//! per-token losses in f32.
//!
//! Constant tensors of a module (RoPE's tables) are not parameters and keep their dtype.
//!
//! ```ignore
//! let view = Precision::Bf16.compute_view(&model);          // bf16, tracked back to `model`
//! let loss = next_token_loss(&view, tokens, &attention, kind, -100)?;
//! let grads = GradientsParams::from_grads(loss.backward(), &model); // f32 gradients
//! model = optim.step(lr, model, grads);
//! ```
//!
//! [`GradientsParams::from_grads`]: burn::optim::GradientsParams::from_grads

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{DType, Tensor};

use crate::model::Llama;

/// The compute precision of a training step (`finetune --precision`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// bf16 forward and backward, f32 master weights, optimizer state and loss accumulation.
    Bf16,
}

impl Precision {
    /// The dtype the step's forward and backward compute in.
    pub fn compute_dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }

    /// The model a step computes with: a clone of `model` where its parameters are already in
    /// the compute dtype, else every float parameter cast to it (same parameter ids; on an
    /// autodiff device the casts are recorded, so gradients reach `model`'s parameters in their
    /// own dtype).
    pub fn compute_view(self, model: &Llama) -> Llama {
        let dtype = self.compute_dtype();
        if model.embed.val().dtype() == dtype {
            return model.clone();
        }
        model.clone().map(&mut CastParams(dtype))
    }
}

/// Casts every float parameter of a module to its dtype, keeping the parameter ids.
#[derive(Debug, Clone, Copy)]
pub struct CastParams(pub DType);

impl ModuleMapper for CastParams {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let dtype = self.0;
        param.map(|tensor| match tensor.dtype() == dtype {
            true => tensor,
            false => tensor.cast(dtype),
        })
    }
}
