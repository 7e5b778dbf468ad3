//! Layer checkpointing for training: a step keeps only each layer's input (the residual stream,
//! `hidden` values a token) instead of every activation its backward reads, and recomputes one
//! layer at a time during the backward.
//!
//! How: the forward runs once without autodiff, keeping the stream before each layer; the head
//! (final norm and loss) runs on autodiff from the last stream as a leaf, and its backward gives
//! the stream's gradient `g`; then, from the last layer down, the layer runs again on autodiff
//! from its input as a leaf, and the backward of `sum(output · g)` gives the parameters'
//! gradients and the input's, the next `g`; the embedding's gradient closes it. The parameters
//! are the same leaves in every backward (bf16: cast inside each one), so the gradients land on
//! the model's (f32 master) parameters, summed where a parameter appears twice (a tied
//! embedding). The price is a second forward of every layer, ~⅓ more compute.
//!
//! Memory: about `layers · hidden` values a token for the kept streams plus one layer's
//! activations, against all layers' (~`layers · (8 hidden + 3 intermediate)` values a token for
//! a SwiGLU Llama) without it.
//!
//! Measured (SmolLM2-135M shape, bf16, recompute attention, 8 × 2048 tokens, H200,
//! 2026-11-30): peak 14.8 → 7.1 GB with the plain loss and 10.2 → 2.46 GB with CCE, the step
//! 115 → 139 ms and 149 → 174 ms; with CCE a batch of 768 × 2048 tokens trains in 117 GB.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Gradients, Int, Tensor, TensorData};
use burn_cce::CceError;
use burn_kernels_core::route::count_launch;
use burn_kernels_core::{AttentionImpl, AttnOptions, TensorOps};

use crate::model::{ForwardError, Llama, classifier_of, embed_rows};
use crate::precision::{CastParams, Precision};
use crate::train::{LossKind, hidden_loss};

/// The name [`checkpointed_grads`] counts its calls under (`burn_kernels_core::route::launches`).
pub const CHECKPOINTED_STEP: &str = "layer-checkpointed-step";

/// Why a checkpointed step could not run.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The loss's typed errors (target ids outside the vocabulary, …).
    #[error(transparent)]
    Loss(#[from] CceError),
    /// A layer could not run.
    #[error(transparent)]
    Forward(#[from] ForwardError),
}

/// The gradients of `model`'s mean next-token loss on `tokens` (position `t` scored against
/// `tokens[t + 1]`, as [`crate::train::next_token_loss`]) scaled by `scale`, computed with
/// layer checkpointing, and the unscaled loss (without autodiff).
///
/// `model` holds the trained parameters (on an autodiff device); `precision` is the compute
/// precision, as [`Precision::compute_view`] applies it.
///
/// # Shapes
/// - `tokens`: `[batch, seq]`, `seq ≥ 2`; the loss: `[1]` (f32)
///
/// # Errors
/// [`CheckpointError`]: the loss's typed errors, a sequence longer than the model's context
/// ([`ForwardError::ContextTooLong`]), a layer that could not run.
pub fn checkpointed_grads(
    model: &Llama,
    precision: Precision,
    tokens: Tensor<2, Int>,
    attention: &dyn AttentionImpl,
    kind: LossKind,
    ignore_index: i64,
    scale: f32,
) -> Result<(Tensor<1>, GradientsParams), CheckpointError> {
    count_launch(CHECKPOINTED_STEP);
    let dtype = precision.compute_dtype();
    let [b, s] = tokens.dims();
    // As `Llama::try_forward`: the layers run without a cache, so this is the one check.
    if s > model.max_positions() {
        return Err(ForwardError::ContextTooLong {
            needed: s,
            max: model.max_positions(),
        }
        .into());
    }
    let opts = AttnOptions {
        causal: true,
        scale: model.attention_scale(),
        key_padding: None,
    };
    let positions = |device: burn::tensor::Device| {
        let data: Vec<i64> = (0..b).flat_map(|_| 0..s as i64).collect();
        Tensor::<2, Int>::from_data(TensorData::new(data, [b, s]), &device)
    };

    // The forward without autodiff: the stream before each layer, and after the last.
    let plain = precision.compute_view(&model.valid());
    let mut x = plain.embed_tokens(tokens.clone().inner());
    let plain_positions = positions(x.device());
    let mut inputs = Vec::with_capacity(model.layers.len());
    for (layer, block) in plain.layers.iter().enumerate() {
        let next =
            plain.block_forward(block, layer, x.clone(), &plain_positions, &opts, attention)?;
        inputs.push(x);
        x = next;
    }
    drop(plain);

    // The head: final norm and loss, from the last stream as a leaf.
    let mut grads = GradientsParams::new();
    let h = x.autodiff().require_grad();
    let norm = view(&model.norm, dtype);
    let hidden = attention
        .layer_ops()
        .unwrap_or(&TensorOps)
        .rms_norm(&norm, h.clone());
    // Only the classifier's parameter is cast (the embedding when tied).
    let classifier = match &model.lm_head {
        Some(w) => classifier_of(&model.embed, Some(&view(w, dtype))),
        None => classifier_of(&view(&model.embed, dtype), None),
    };
    let loss = hidden_loss(hidden, classifier, tokens.clone(), kind, ignore_index)?;
    let mut g_all = (loss.clone() * scale).backward();
    let mut g = h
        .grad_remove(&mut g_all)
        .expect("the stream is a leaf of the loss");
    absorb(&mut grads, &mut g_all, &model.norm);
    match &model.lm_head {
        Some(w) => absorb(&mut grads, &mut g_all, w),
        None => absorb(&mut grads, &mut g_all, &model.embed),
    }
    drop(g_all);

    // The layers, last first: recomputed from their input, backward of `sum(output · g)`.
    let ad_positions = positions(h.device());
    for (layer, block) in model.layers.iter().enumerate().rev() {
        let x = inputs
            .pop()
            .expect("one input per layer")
            .autodiff()
            .require_grad();
        let out = model.block_forward(
            &view(block, dtype),
            layer,
            x.clone(),
            &ad_positions,
            &opts,
            attention,
        )?;
        let mut g_all = (out * g).sum().backward();
        g = x
            .grad_remove(&mut g_all)
            .expect("the layer input is a leaf");
        absorb(&mut grads, &mut g_all, block);
    }

    // The embedding: backward of `sum(embed[tokens] · g)`.
    let x0 = embed_rows(view(&model.embed, dtype).val(), tokens);
    let mut g_all = (x0 * g).sum().backward();
    absorb(&mut grads, &mut g_all, &model.embed);
    Ok((loss.inner(), grads))
}

/// `module` with its parameters in `dtype` (cast inside the graph, same parameter ids).
fn view<M: Module>(module: &M, dtype: DType) -> M {
    module.clone().map(&mut CastParams(dtype))
}

/// Moves `module`'s parameter gradients from `from` into `into`, adding to any already there.
fn absorb<M: Module>(into: &mut GradientsParams, from: &mut Gradients, module: &M) {
    let part = GradientsParams::from_module(from, module);
    module.visit(&mut Absorb { into, part });
}

struct Absorb<'a> {
    into: &'a mut GradientsParams,
    part: GradientsParams,
}

impl ModuleVisitor for Absorb<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(new) = self.part.remove::<D>(param.id) {
            let sum = match self.into.remove::<D>(param.id) {
                Some(old) => old + new,
                None => new,
            };
            self.into.register(param.id, sum);
        }
    }
}
