//! The layer ops of a training step as differentiable kernels: RMSNorm, the SwiGLU gate and the
//! RoPE of a layer's queries and keys, each one launch forward and one backward, where Burn's
//! tensor ops take several launches in f32 each way.
//!
//! Why: in a bf16 SmolLM2-135M step at batch 8 × 2048 on an H200 (`ncu`, 2026-11-29), the
//! tensor-op RMSNorm took ~0.13 ms a call forward (cast, square, mean, `rsqrt`, two products,
//! cast back) and ~0.2 ms backward, `silu(g) · u` ~0.4 ms forward (Burn's `sigmoid` is six
//! f32 launches below the fusion), and RoPE ten launches: ~1 ms a layer of a 5.3 ms layer.
//!
//! [`TrainOps`] is the [`LayerOps`] of the training attention ([`crate::RecomputeAttention`]):
//! on CUDA with 16-bit operands the ops below, elsewhere the [`TensorOps`]. The backward
//! kernels use 32-unit planes, so CUDA only.

use burn::backend::autodiff::{
    Autodiff, NodeId,
    checkpoint::{
        base::Checkpointer, retro_forward::RetroForward, state::BackwardStates,
        strategy::CheckpointStrategy,
    },
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch, TensorMetadata, backend_extension};
use burn::nn::RmsNorm;
use burn::tensor::{DType, FloatDType, Int, Tensor};
use std::marker::PhantomData;

use crate::layer_ops::{LayerOps, TensorOps};
use crate::rope::Rope;
use crate::route::{Grad, is_cuda, route};

/// The forward ops, differentiable: `Autodiff<B>` registers their backward
/// ([`TrainLayerGrads`] and, for RoPE, the same op with the sine negated).
#[backend_extension(
    Cube: cfg(feature = "cube"),
    Fusion: cfg(all(feature = "cube", feature = "fusion")),
    Autodiff,
)]
pub trait TrainLayerKernels: Backend {
    /// `x · γ / √(mean(x²) + ε)` over the last dimension, accumulated in f32.
    ///
    /// # Shapes
    /// - `x`: `[..., cols]`, `gamma`: `[cols]` in `x`'s dtype; returns `x`'s shape
    #[fusion(dtype = x, shape = x)]
    fn train_rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self>;

    /// `silu(gate) · up`.
    ///
    /// # Shapes
    /// - `gate`, `up`: the same shape and dtype; returns it
    #[fusion(dtype = gate, shape = gate)]
    fn train_silu_mul(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;

    /// Rotate-half RoPE of `x` at `positions`, from f32 tables.
    ///
    /// # Shapes
    /// - `x`: `[batch, heads, seq, head_dim]` (any strides), `positions`: `[batch, seq]`,
    ///   `cos`, `sin`: `[max_positions, head_dim / 2]` f32; returns `x`'s shape, contiguous
    #[fusion(dtype = x, shape = x)]
    fn train_rope(
        x: FloatTensor<Self>,
        positions: IntTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// The backward kernels of [`TrainLayerKernels`].
#[backend_extension(
    Cube: cfg(feature = "cube"),
    Fusion: cfg(all(feature = "cube", feature = "fusion")),
)]
pub trait TrainLayerGrads: Backend {
    /// `(dx, dγ)` of [`TrainLayerKernels::train_rms_norm`] from the output's gradient `dy`;
    /// `dγ` in f32.
    ///
    /// # Shapes
    /// - `x`, `dy`: `[..., cols]`, `gamma`: `[cols]`, one dtype; returns `x`'s shape and
    ///   `[cols]`
    #[fusion(meta = |x, gamma, _dy, _eps| {
        let spec = burn::backend::fusion::custom::TensorSpec::new;
        (spec(x.shape.clone(), x.dtype), spec(gamma.shape.clone(), DType::F32))
    })]
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `(d_gate, d_up)` of [`TrainLayerKernels::train_silu_mul`] from the output's gradient.
    ///
    /// # Shapes
    /// - `gate`, `up`, `dout`: the same shape and dtype; returns two of it
    #[fusion(meta = |gate, up, _dout| (gate.clone(), up.clone()))]
    fn silu_mul_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        dout: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

#[cfg(feature = "cube")]
mod cube_backend {
    use super::{TrainLayerGrads, TrainLayerKernels};
    use crate::kernels;
    use crate::route::count_launch;
    use burn::backend::tensor::{FloatTensor, IntTensor};
    use burn_cubecl::CubeBackend;

    impl TrainLayerKernels for CubeBackend {
        fn train_rms_norm(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            eps: f64,
        ) -> FloatTensor<Self> {
            count_launch("train_rms_norm");
            kernels::rms_norm::rms_norm(x, gamma, eps)
        }

        fn train_silu_mul(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
            count_launch("train_silu_mul");
            kernels::silu_mul::silu_mul(gate, up)
        }

        fn train_rope(
            x: FloatTensor<Self>,
            positions: IntTensor<Self>,
            cos: FloatTensor<Self>,
            sin: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            count_launch("train_rope");
            kernels::rope::rope(x, positions, cos, sin)
        }
    }

    impl TrainLayerGrads for CubeBackend {
        fn rms_norm_backward(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            dy: FloatTensor<Self>,
            eps: f64,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            count_launch("rms_norm_backward");
            kernels::rms_norm::rms_norm_backward(x, gamma, dy, eps)
        }

        fn silu_mul_backward(
            gate: FloatTensor<Self>,
            up: FloatTensor<Self>,
            dout: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            count_launch("silu_mul_backward");
            kernels::silu_mul::silu_mul_backward(gate, up, dout)
        }
    }
}

/// `t` in `dtype` (a gradient arriving in another dtype than its operand).
fn to_dtype<B: Backend>(t: FloatTensor<B>, dtype: DType) -> FloatTensor<B> {
    match t.dtype() == dtype {
        true => t,
        false => B::float_cast(t, FloatDType::from(dtype)),
    }
}

/// The checkpointer keeps `(x, γ)` (see [`crate::tracked`]); `eps` rides along.
#[derive(Debug)]
struct RmsNormBackward {
    eps: f64,
}

impl<B: TrainLayerGrads> Backward<B, 2> for RmsNormBackward {
    type State = (NodeId, NodeId);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, ck: &mut Checkpointer) {
        let [x_node, gamma_node] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (x, gamma) = ops.state;
        let x: FloatTensor<B> = ck.retrieve_node_output(x);
        let gamma: FloatTensor<B> = ck.retrieve_node_output(gamma);
        let (dtype, gamma_dtype) = (x.dtype(), gamma.dtype());
        let (dx, dgamma) = B::rms_norm_backward(x, gamma, to_dtype::<B>(dy, dtype), self.eps);
        if let Some(node) = x_node {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = gamma_node {
            grads.register::<B>(node.id, to_dtype::<B>(dgamma, gamma_dtype));
        }
    }
}

#[derive(Debug)]
struct SiluMulBackward;

impl<B: TrainLayerGrads> Backward<B, 2> for SiluMulBackward {
    type State = (NodeId, NodeId);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, ck: &mut Checkpointer) {
        let [gate_node, up_node] = ops.parents;
        let dout = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        let gate: FloatTensor<B> = ck.retrieve_node_output(gate);
        let up: FloatTensor<B> = ck.retrieve_node_output(up);
        let dtype = gate.dtype();
        let (dgate, dup) = B::silu_mul_backward(gate, up, to_dtype::<B>(dout, dtype));
        for (node, grad) in [gate_node, up_node].into_iter().zip([dgate, dup]) {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// RMSNorm's output again from its inputs, for gradient checkpointing.
#[derive(Debug)]
struct RetroRmsNorm<B> {
    x: NodeId,
    gamma: NodeId,
    eps: f64,
    _backend: PhantomData<fn() -> B>,
}

impl<B: TrainLayerKernels> RetroForward for RetroRmsNorm<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let x = states.get_state::<FloatTensor<B>>(&self.x);
        let gamma = states.get_state::<FloatTensor<B>>(&self.gamma);
        states.save(out_node, B::train_rms_norm(x, gamma, self.eps));
    }
}

/// `silu(gate) · up` again from its inputs, for gradient checkpointing.
#[derive(Debug)]
struct RetroSiluMul<B> {
    gate: NodeId,
    up: NodeId,
    _backend: PhantomData<fn() -> B>,
}

impl<B: TrainLayerKernels> RetroForward for RetroSiluMul<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let gate = states.get_state::<FloatTensor<B>>(&self.gate);
        let up = states.get_state::<FloatTensor<B>>(&self.up);
        states.save(out_node, B::train_silu_mul(gate, up));
    }
}

/// RoPE is a rotation of each channel pair, so its backward is the rotation by the opposite
/// angle: the same op with the sine negated. The state keeps the positions and tables.
#[derive(Debug)]
struct RopeBackward;

impl<B: TrainLayerKernels> Backward<B, 1> for RopeBackward {
    type State = (IntTensor<B>, FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (positions, cos, sin) = ops.state;
        if let Some(node) = node {
            let dx = B::train_rope(dy, positions, cos, B::float_neg(sin));
            grads.register::<B>(node.id, dx);
        }
    }
}

impl<B: TrainLayerKernels + TrainLayerGrads, C: CheckpointStrategy> TrainLayerKernels
    for Autodiff<B, C>
{
    fn train_rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        let forward = |x, gamma| B::train_rms_norm(x, gamma, eps);
        let retro = RetroRmsNorm::<B> {
            x: x.node().id(),
            gamma: gamma.node().id(),
            eps,
            _backend: PhantomData,
        };
        let op = RmsNormBackward { eps };
        crate::tracked::binary_recomputable::<B, C, _, _>(op, retro, x, gamma, forward)
    }

    fn train_silu_mul(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let retro = RetroSiluMul::<B> {
            gate: gate.node().id(),
            up: up.node().id(),
            _backend: PhantomData,
        };
        crate::tracked::binary_recomputable::<B, C, _, _>(
            SiluMulBackward,
            retro,
            gate,
            up,
            B::train_silu_mul,
        )
    }

    fn train_rope(
        x: FloatTensor<Self>,
        positions: IntTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let (x, x_node) = x.into_parts();
        let cos = cos.into_primitive();
        let sin = sin.into_primitive();
        match RopeBackward
            .prepare::<C>([x_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::train_rope(x, positions.clone(), cos.clone(), sin.clone());
                prep.finish((positions, cos, sin), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::train_rope(x, positions, cos, sin)),
        }
    }
}

/// The [`LayerOps`] of a training step: on CUDA with f16/bf16 operands RMSNorm, the SwiGLU gate
/// and RoPE run the differentiable kernels of [`TrainLayerKernels`] (through Burn's
/// `Dispatch`, with or without autodiff); elsewhere, and for every projection, the
/// [`TensorOps`].
#[derive(Debug, Clone, Copy, Default)]
pub struct TrainOps;

/// Why the kernels do not take operands of `dtype` on `device`, if they do not.
fn unsupported(device: &burn::tensor::Device, dtype: DType) -> Option<String> {
    if !matches!(dtype, DType::F16 | DType::BF16) {
        return Some(format!("{dtype:?} operands (f16/bf16 only)"));
    }
    (!is_cuda(device)).then(|| "not a CUDA device (the backward kernels use 32-unit planes)".into())
}

impl LayerOps for TrainOps {
    fn linear(&self, x: Tensor<3>, w: Tensor<2>) -> Tensor<3> {
        TensorOps.linear(x, w)
    }

    fn rms_norm(&self, norm: &RmsNorm, x: Tensor<3>) -> Tensor<3> {
        let why = unsupported(&x.device(), x.dtype());
        if !route("train_rms_norm", &x.device(), Grad::Differentiable, why) {
            return TensorOps.rms_norm(norm, x);
        }
        let gamma = norm.gamma.val().cast(x.dtype());
        Tensor::from_dispatch(Dispatch::train_rms_norm(
            x.into_dispatch(),
            gamma.into_dispatch(),
            norm.epsilon,
        ))
    }

    fn rope(&self, rope: &Rope, x: Tensor<4>, positions: Tensor<2, Int>) -> Tensor<4> {
        let why = unsupported(&x.device(), x.dtype());
        if !route("train_rope", &x.device(), Grad::Differentiable, why) {
            return TensorOps.rope(rope, x, positions);
        }
        // The kernel reads f32 tables (what `Rope::new` builds).
        let (cos, sin) = rope.tables();
        let (cos, sin) = (cos.clone().cast(DType::F32), sin.clone().cast(DType::F32));
        Tensor::from_dispatch(Dispatch::train_rope(
            x.into_dispatch(),
            positions.into_dispatch(),
            cos.into_dispatch(),
            sin.into_dispatch(),
        ))
    }

    fn silu_mul(&self, gate: Tensor<3>, up: Tensor<3>) -> Tensor<3> {
        let why = unsupported(&gate.device(), gate.dtype()).or_else(|| {
            (up.dtype() != gate.dtype() || up.dims() != gate.dims())
                .then(|| format!("gate {:?}, up {:?}", gate.dtype(), up.dtype()))
        });
        if !route("train_silu_mul", &gate.device(), Grad::Differentiable, why) {
            return TensorOps.silu_mul(gate, up);
        }
        Tensor::from_dispatch(Dispatch::train_silu_mul(
            gate.into_dispatch(),
            up.into_dispatch(),
        ))
    }
}
