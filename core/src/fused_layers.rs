//! [`FusedLayers`]: an attention implementation carrying the layer's [`LayerOps`], the bridge
//! between the two plug-ins (apart from both, so neither module imports the other).

use std::sync::Arc;

use burn::tensor::Tensor;

use crate::attention::{AttentionImpl, AttnOptions};
use crate::layer_ops::{FusedOps, LayerOps};

/// An attention implementation that also brings the layer's [`LayerOps`]: what a model uses
/// to run its small ops as kernels (`Llama::forward` takes them from
/// [`AttentionImpl::layer_ops`]).
#[derive(Debug, Clone)]
pub struct FusedLayers {
    pub attention: Arc<dyn AttentionImpl>,
    pub ops: Arc<dyn LayerOps>,
}

impl FusedLayers {
    /// `attention` with the [`FusedOps`].
    pub fn new(attention: Arc<dyn AttentionImpl>) -> Self {
        Self {
            attention,
            ops: Arc::new(FusedOps),
        }
    }
}

impl AttentionImpl for FusedLayers {
    fn name(&self) -> String {
        format!("{} + fused layer ops", self.attention.name())
    }

    fn attend(
        &self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        opts: &AttnOptions,
    ) -> Tensor<4> {
        self.attention.attend(layer, q, k, v, opts)
    }

    fn layer_ops(&self) -> Option<&dyn LayerOps> {
        Some(self.ops.as_ref())
    }
}
