//! Sage attention as the Llama model's attention implementation.

use burn::tensor::Tensor;
use burn_kernels_core::attention::{AttentionImpl, AttnOptions, ReferenceAttention};

use crate::{QkQuant, SageOptions, sage_attention};

/// [`sage_attention`] behind [`AttentionImpl`], with one Q/K quantization per layer.
///
/// Calls with a key-padding mask (left-padded batches) run the plain reference attention with a
/// log line: the Sage kernels take no mask.
#[derive(Debug, Clone, PartialEq)]
pub struct SageAttention {
    /// Options for every layer; `causal` and `scale` come from each call.
    pub opts: SageOptions,
    /// The Q/K quantization of layer `i` (`opts.qk` for layers past the end).
    pub per_layer: Vec<QkQuant>,
}

impl SageAttention {
    pub fn new(opts: SageOptions) -> Self {
        Self {
            opts,
            per_layer: Vec::new(),
        }
    }

    /// One quantization per layer (from [`crate::adaptive::calibrate`]).
    pub fn with_layers(opts: SageOptions, per_layer: Vec<QkQuant>) -> Self {
        Self { opts, per_layer }
    }

    pub fn qk_for(&self, layer: usize) -> QkQuant {
        self.per_layer.get(layer).copied().unwrap_or(self.opts.qk)
    }
}

impl AttentionImpl for SageAttention {
    fn name(&self) -> String {
        let pv = match self.opts.pv {
            crate::PvPrecision::Fp16 => "fp16",
            crate::PvPrecision::Fp8E4m3 => "fp8",
        };
        let qk = if self.per_layer.is_empty() {
            self.opts.qk.name().to_string()
        } else {
            let int4 = self
                .per_layer
                .iter()
                .filter(|q| **q == QkQuant::Int4PerThread)
                .count();
            format!("adaptive({int4}/{} int4)", self.per_layer.len())
        };
        format!("sage-{qk}-{pv}")
    }

    fn attend(
        &self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        opts: &AttnOptions,
    ) -> Tensor<4> {
        if opts.key_padding.is_some() {
            log::debug!("burn-sage: key padding mask; layer {layer} runs the reference attention");
            return ReferenceAttention.attend(layer, q, k, v, opts);
        }
        let sage = SageOptions {
            causal: opts.causal,
            scale: Some(opts.scale),
            qk: self.qk_for(layer),
            return_lse: false,
            ..self.opts
        };
        match sage_attention(q.clone(), k.clone(), v.clone(), &sage) {
            Ok(out) => out.out,
            Err(e) => {
                log::warn!("burn-sage: {e}; layer {layer} runs the reference attention");
                ReferenceAttention.attend(layer, q, k, v, opts)
            }
        }
    }
}
