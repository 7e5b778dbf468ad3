//! The ops of a transformer layer besides its attention (the projections, RMSNorm, RoPE, the
//! SwiGLU gate), as a plug-in: plain tensor ops (differentiable, any backend) or one CubeCL
//! kernel each (inference only).
//!
//! At decode time a layer's work is dozens of tiny kernels, so their launch cost, not the
//! device, sets the speed: Burn's `RmsNorm` is six launches, a tensor-op RoPE ten (two
//! gathers, six element-wise ops, a two-part concatenation), `silu(g)·u` seven. The kernels
//! here do each in one, and a projection of a few rows is a GEMV with a lighter launch than
//! Burn's matmul. They ride along with the attention implementation
//! ([`FusedLayers`]), which every forward pass already receives, so a model enables them for
//! inference without a new parameter and training keeps the tensor ops.

use std::sync::Arc;

use burn::nn::RmsNorm;
use burn::tensor::{Int, Tensor, activation, backend::Backend};

use crate::attention::{AttentionImpl, AttnOptions};
use crate::rope::Rope;

/// Rows (`batch · seq`) up to which [`FusedBackend::fused_linear`] runs its GEMV kernel; more
/// rows go to Burn's matmul.
pub const GEMV_MAX_ROWS: usize = 16;

/// The layer ops a model runs around its attention.
///
/// # Shapes
/// - `rms_norm`: `x` `[batch, seq, hidden]` and a norm of `hidden`; returns `x`'s shape
/// - `rope`: `x` `[batch, heads, seq, head_dim]` (any strides), `positions` `[batch, seq]`;
///   returns `x`'s shape
/// - `silu_mul`: `gate`, `up` `[batch, seq, inter]`; returns `silu(gate) · up`
/// - `linear`: `x` `[batch, seq, in]`, `w` `[in, out]`; returns `x · w`, `[batch, seq, out]`
pub trait LayerOps<B: Backend>: Send + Sync + std::fmt::Debug {
    fn linear(&self, x: Tensor<B, 3>, w: Tensor<B, 2>) -> Tensor<B, 3>;
    fn rms_norm(&self, norm: &RmsNorm<B>, x: Tensor<B, 3>) -> Tensor<B, 3>;
    fn rope(&self, rope: &Rope<B>, x: Tensor<B, 4>, positions: Tensor<B, 2, Int>) -> Tensor<B, 4>;
    fn silu_mul(&self, gate: Tensor<B, 3>, up: Tensor<B, 3>) -> Tensor<B, 3>;
}

/// Plain tensor ops: what Burn's autodiff differentiates, and the oracle of the kernels.
#[derive(Debug, Clone, Copy, Default)]
pub struct TensorOps;

impl<B: Backend> LayerOps<B> for TensorOps {
    fn linear(&self, x: Tensor<B, 3>, w: Tensor<B, 2>) -> Tensor<B, 3> {
        x.matmul(w.unsqueeze())
    }

    fn rms_norm(&self, norm: &RmsNorm<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
        norm.forward(x)
    }

    fn rope(&self, rope: &Rope<B>, x: Tensor<B, 4>, positions: Tensor<B, 2, Int>) -> Tensor<B, 4> {
        rope.apply(x, positions)
    }

    fn silu_mul(&self, gate: Tensor<B, 3>, up: Tensor<B, 3>) -> Tensor<B, 3> {
        activation::silu(gate) * up
    }
}

/// A backend with single-launch kernels for [`LayerOps`]; the defaults are [`TensorOps`]
/// (backends without kernels implement the trait with no methods).
pub trait FusedBackend: Backend {
    /// # Shapes
    /// See [`LayerOps`]. Kernels take over for at most [`GEMV_MAX_ROWS`] rows.
    fn fused_linear(x: Tensor<Self, 3>, w: Tensor<Self, 2>) -> Tensor<Self, 3> {
        TensorOps.linear(x, w)
    }

    /// # Shapes
    /// See [`LayerOps`].
    fn fused_rms_norm(norm: &RmsNorm<Self>, x: Tensor<Self, 3>) -> Tensor<Self, 3> {
        TensorOps.rms_norm(norm, x)
    }

    /// # Shapes
    /// See [`LayerOps`].
    fn fused_rope(
        rope: &Rope<Self>,
        x: Tensor<Self, 4>,
        positions: Tensor<Self, 2, Int>,
    ) -> Tensor<Self, 4> {
        TensorOps.rope(rope, x, positions)
    }

    /// # Shapes
    /// See [`LayerOps`].
    fn fused_silu_mul(gate: Tensor<Self, 3>, up: Tensor<Self, 3>) -> Tensor<Self, 3> {
        TensorOps.silu_mul(gate, up)
    }
}

impl<E, I, Q> FusedBackend for burn::backend::NdArray<E, I, Q>
where
    E: burn::backend::ndarray::FloatNdArrayElement,
    I: burn::backend::ndarray::IntNdArrayElement,
    Q: burn::backend::ndarray::QuantElement,
    burn::backend::ndarray::NdArrayTensor: From<burn::backend::ndarray::SharedArray<E>>,
    burn::backend::ndarray::NdArrayTensor: From<burn::backend::ndarray::SharedArray<I>>,
{
}

/// The backend's [`FusedBackend`] kernels (forward only: no autodiff).
#[derive(Debug, Clone, Copy, Default)]
pub struct FusedOps;

impl<B: FusedBackend> LayerOps<B> for FusedOps {
    fn linear(&self, x: Tensor<B, 3>, w: Tensor<B, 2>) -> Tensor<B, 3> {
        B::fused_linear(x, w)
    }

    fn rms_norm(&self, norm: &RmsNorm<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
        B::fused_rms_norm(norm, x)
    }

    fn rope(&self, rope: &Rope<B>, x: Tensor<B, 4>, positions: Tensor<B, 2, Int>) -> Tensor<B, 4> {
        B::fused_rope(rope, x, positions)
    }

    fn silu_mul(&self, gate: Tensor<B, 3>, up: Tensor<B, 3>) -> Tensor<B, 3> {
        B::fused_silu_mul(gate, up)
    }
}

/// An attention implementation that also brings the layer's [`LayerOps`]: what a model uses
/// to run its small ops as kernels (`Llama::forward` takes them from
/// [`AttentionImpl::layer_ops`]).
#[derive(Debug, Clone)]
pub struct FusedLayers<B: Backend> {
    pub attention: Arc<dyn AttentionImpl<B>>,
    pub ops: Arc<dyn LayerOps<B>>,
}

impl<B: FusedBackend> FusedLayers<B> {
    /// `attention` with the backend's [`FusedOps`].
    pub fn new(attention: Arc<dyn AttentionImpl<B>>) -> Self {
        Self {
            attention,
            ops: Arc::new(FusedOps),
        }
    }
}

impl<B: Backend> AttentionImpl<B> for FusedLayers<B> {
    fn name(&self) -> String {
        format!("{} + fused layer ops", self.attention.name())
    }

    fn attend(
        &self,
        layer: usize,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        opts: &AttnOptions<B>,
    ) -> Tensor<B, 4> {
        self.attention.attend(layer, q, k, v, opts)
    }

    fn layer_ops(&self) -> Option<&dyn LayerOps<B>> {
        Some(self.ops.as_ref())
    }
}
