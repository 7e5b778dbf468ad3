//! Where draft tokens come from: draft models (and self-speculative truncations of the
//! target) and prompt lookup.

use burn_kernels_core::SamplingConfig;
use burn_specdec::PromptLookup;

use crate::model::Llama;

use super::*;

/// Where a draft's tokens come from.
#[derive(Debug)]
pub enum DraftSource<'a> {
    /// A model that shares the target's tokenizer (drafts may share one), sampled with the
    /// draft's settings.
    Model(&'a Llama),
    /// Prompt lookup over the sequence so far ([`PromptLookup`]): no model and no forward
    /// passes; its distribution is one-hot at the drafted token.
    Lookup(PromptLookup),
}

impl Clone for DraftSource<'_> {
    fn clone(&self) -> Self {
        *self
    }
}

impl Copy for DraftSource<'_> {}

/// One draft: its source and the sampling settings a model draft's tokens are drawn with
/// (temperature, top-k, top-p; the seed is unused, see [`SpecOptions::seed`]).
#[derive(Debug)]
pub struct Draft<'a> {
    pub source: DraftSource<'a>,
    pub sampling: SamplingConfig,
}

impl Clone for Draft<'_> {
    fn clone(&self) -> Self {
        *self
    }
}

impl Copy for Draft<'_> {}

impl<'a> Draft<'a> {
    /// A draft model sampled with `sampling`.
    pub fn model(model: &'a Llama, sampling: SamplingConfig) -> Self {
        Self {
            source: DraftSource::Model(model),
            sampling,
        }
    }

    /// A prompt-lookup draft (see [`PromptLookup`]).
    pub fn lookup(lookup: PromptLookup) -> Self {
        Self {
            source: DraftSource::Lookup(lookup),
            sampling: SamplingConfig::default(),
        }
    }

    /// The model, for a model draft.
    pub fn model_ref(&self) -> Option<&'a Llama> {
        match self.source {
            DraftSource::Model(m) => Some(m),
            DraftSource::Lookup(_) => None,
        }
    }
}

/// The first `layers` blocks of `target` with its final norm and LM head: a self-speculative
/// draft (shares the target's weights, no extra memory beyond handles).
///
/// # Errors
/// [`SpecError::DraftLayers`] unless `1 <= layers <= target layers`.
pub fn truncated_draft(target: &Llama, layers: usize) -> Result<Llama, SpecError> {
    let available = target.layers.len();
    if layers == 0 || layers > available {
        return Err(SpecError::DraftLayers {
            requested: layers,
            available,
        });
    }
    let mut config = target.config.clone();
    config.num_layers = layers;
    Ok(Llama {
        embed: target.embed.clone(),
        layers: target.layers[..layers].to_vec(),
        norm: target.norm.clone(),
        lm_head: target.lm_head.clone(),
        config,
        rope: target.rope.clone(),
    })
}
