//! Attention for training: a fused forward, which saves only the output and one log-sum-exp
//! per query, and a backward that recomputes the probabilities from them one layer at a time.
//!
//! - f32 operands: Burn's own composed backward (`attention_backward_default`: `QKᵀ` again,
//!   `exp(s − lse)`, four TF32 matmuls), whose `seq²` tensors live only while one layer's
//!   gradient is computed. Why: Burn 0.23.0-pre.1's fused attention backward (cubek's) has no
//!   tensor-core routine for f32 operands; the one routine that takes f32 walks one query or key
//!   per thread, which made an f32 training step with Burn's attention 3.1× slower than one with
//!   the decomposed attention (H200, 2026-11-28, SmolLM2-135M, batch 8 × 1024), and the
//!   decomposed attention keeps every layer's `batch · heads · seq²` scores until the backward.
//! - f16/bf16 operands: [`HalfAttention`], the FlashAttention-2 style kernels of
//!   [`crate::kernels::flash`] for the forward and the backward where they take the problem
//!   (CUDA, head dim 64), else Burn's fused forward and backward (cubek's). The backward kernels
//!   made a bf16 SmolLM2 step at batch 8 × 1024 1.44× faster than with Burn's fused attention
//!   (H200, 2026-11-29: 181.7 against 261.1 ms; cubek's backward took 104 of the 219 ms of the
//!   step's GPU time). The forward kernel replaces cubek's forward (0.54 ms a layer at
//!   8 × 2048) and, without autodiff (a validation pass), Burn's attention op, whose autotune
//!   also benchmarks a decomposed candidate that runs Burn's matmul autotune in bf16.
//!
//! f32 operands take Burn's fused forward (`attention_with_logsumexp`) with autodiff and Burn's
//! `attention` op without.

use burn::backend::TensorMetadata;
use burn::backend::autodiff::{
    Autodiff, NodeId,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::ops::AttentionModuleOptions;
use burn::backend::ops::attention::attention_backward_default;
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::ops::CausalAlignment;
use burn::tensor::{Bool, DType, Shape, Tensor};

mod half;

pub use half::{FLASH_BACKWARD, FLASH_FORWARD, HalfAttention};
#[cfg(feature = "cube")]
use half::{flash_forward, out_shape};
use half::{resolve_scale, scale_or_default};

use crate::attention::{AttentionImpl, AttnOptions, BurnAttention, burn_scale};
use crate::route::{Grad, count_launch, route};

/// The op's name for [`crate::route::launches`]: counted once per backward pass that
/// recomputes (so a test can tell it from Burn's fused backward).
pub const RECOMPUTE_BACKWARD: &str = "recompute-attention-backward";

/// Attention with Burn's fused forward and, on an autodiff device, a backward that recomputes
/// the probabilities with tensor ops (see the module docs) on a CubeCL device of this build.
/// Elsewhere Burn's `attention` op runs (the decomposed attention on other backends).
///
/// # Shapes
/// - `q`: `[batch, q_heads, sq, head_dim]`
/// - `k`, `v`: `[batch, kv_heads, skv, head_dim]`, `q_heads` a multiple of `kv_heads` (GQA,
///   read in place)
/// - `key_padding`: `[batch, skv]`, `true` for keys no query may see
/// - returns `[batch, q_heads, sq, head_dim]`
///
/// `causal` masks bottom-right (query `i` sees keys `j ≤ i + skv − sq`); `scale` `None` is
/// `1/√head_dim`. A key-padding mask takes the flash kernels where they take the problem
/// (16-bit operands on CUDA, head dim 64); elsewhere Burn's `attention` op with the mask (on an
/// autodiff device its decomposed backward, which saves the scores), with a log line.
///
/// # Errors
/// [`AttentionShapeError`] when the shapes do not fit together (batch, head dimension, key and
/// value lengths, query heads not a multiple of the key heads, a mask not `[batch, skv]`).
pub fn recompute_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    key_padding: Option<Tensor<2, Bool>>,
    causal: bool,
    scale: Option<f64>,
) -> Result<Tensor<4>, AttentionShapeError> {
    check_shapes(
        q.dims(),
        k.dims(),
        v.dims(),
        key_padding.as_ref().map(|m| m.dims()),
    )?;
    let why = key_padding
        .as_ref()
        .and_then(|_| padded_unsupported(&q, &k, &v, causal));
    if !route(
        "recompute-attention",
        &q.device(),
        Grad::Differentiable,
        why,
    ) {
        let opts = AttnOptions {
            causal,
            scale: scale_or_default(scale, q.dims()[3]) as f32,
            key_padding,
        };
        return Ok(BurnAttention.attend(0, q, k, v, &opts));
    }
    let [q, k, v] = [q, k, v].map(Tensor::into_dispatch);
    Ok(Tensor::from_dispatch(match key_padding {
        None => Dispatch::recompute_attention(q, k, v, causal, scale),
        Some(m) => Dispatch::recompute_attention_padded(q, k, v, m.into_dispatch(), causal, scale),
    }))
}

/// Why the flash kernels cannot take a problem with a key-padding mask (the op's other
/// backends and fallbacks have no masked fused attention), or `None`.
fn padded_unsupported(q: &Tensor<4>, k: &Tensor<4>, v: &Tensor<4>, causal: bool) -> Option<String> {
    #[cfg(feature = "cube")]
    {
        let Some(device) = crate::route::cube_device(&q.device()) else {
            return Some("not a CubeCL device".to_string());
        };
        let [qs, ks, vs] = [q, k, v].map(|t| burn::tensor::Shape::from(t.dims()));
        if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
            return Some("operands of different dtypes".to_string());
        }
        crate::kernels::flash::unsupported(&device.client(), q.dtype(), [&qs, &ks, &vs], causal)
            .map(|why| format!("a key-padding mask with {why}"))
    }
    #[cfg(not(feature = "cube"))]
    {
        let _ = (q, k, v, causal);
        Some("no CubeCL runtime in this build".to_string())
    }
}

/// Q, K and V shapes that do not fit together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "attention shapes do not fit: q {q:?}, k {k:?}, v {v:?}, key padding {key_padding:?} (expected q [b, hq, sq, d], k [b, hkv, skv, d], v [b, hkv, skv, dv], hq a multiple of hkv ≥ 1, key padding [b, skv])"
)]
pub struct AttentionShapeError {
    pub q: [usize; 4],
    pub k: [usize; 4],
    pub v: [usize; 4],
    pub key_padding: Option<[usize; 2]>,
}

fn check_shapes(
    q: [usize; 4],
    k: [usize; 4],
    v: [usize; 4],
    key_padding: Option<[usize; 2]>,
) -> Result<(), AttentionShapeError> {
    let fits =
        k[..3] == v[..3] && q[0] == k[0] && q[3] == k[3] && k[1] > 0 && q[1].is_multiple_of(k[1]);
    let mask_fits = key_padding.is_none_or(|m| m == [k[0], k[2]]);
    (fits && mask_fits)
        .then_some(())
        .ok_or(AttentionShapeError {
            q,
            k,
            v,
            key_padding,
        })
}

fn options(causal: bool, scale: Option<f64>) -> AttentionModuleOptions {
    AttentionModuleOptions {
        scale,
        softcap: None,
        is_causal: causal,
        causal_alignment: CausalAlignment::BottomRight,
    }
}

/// [`recompute_attention`] as a Burn backend extension. Without autodiff it is the forward alone
/// (the flash forward kernel for 16-bit operands where it takes them, Burn's `attention` op
/// elsewhere);
/// `Autodiff<B>` runs that forward with the log-sum-exp (`B::attention_with_logsumexp` for f32)
/// and a backward that recomputes the probabilities: Burn's `attention_backward_default` for
/// f32 operands, [`HalfAttention::half_attention_backward`] for 16-bit ones. The `_padded` op
/// takes a key-padding mask (Burn's lazy fusion takes no optional tensor, hence two ops).
#[backend_extension(
    Cube: cfg(feature = "cube"),
    Fusion: cfg(all(feature = "cube", feature = "fusion")),
    Autodiff,
)]
pub trait RecomputeAttentionOps: Backend {
    /// Attention without a mask or bias.
    ///
    /// # Shapes
    /// As [`recompute_attention`].
    #[fusion(meta = |q, _k, v, _causal, _scale| {
        burn::backend::fusion::custom::TensorSpec::new(out_shape(&q.shape, &v.shape), q.dtype)
    })]
    fn recompute_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: Option<f64>,
    ) -> FloatTensor<Self> {
        burn_attention::<Self>(q, k, v, None, causal, scale)
    }

    /// Attention with a key-padding mask (`true` = hidden), no bias.
    ///
    /// # Shapes
    /// As [`recompute_attention`]; `key_padding`: `[batch, skv]`.
    #[fusion(meta = |q, _k, v, _key_padding, _causal, _scale| {
        burn::backend::fusion::custom::TensorSpec::new(out_shape(&q.shape, &v.shape), q.dtype)
    })]
    fn recompute_attention_padded(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        causal: bool,
        scale: Option<f64>,
    ) -> FloatTensor<Self> {
        burn_attention::<Self>(q, k, v, Some(key_padding), causal, scale)
    }
}

/// Burn's `attention` op, the key-padding mask (`[batch, skv]`) expanded to the scores' shape.
fn burn_attention<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    key_padding: Option<BoolTensor<B>>,
    causal: bool,
    scale: Option<f64>,
) -> FloatTensor<B> {
    let [b, hq, sq, _] = q.shape().dims::<4>();
    let skv = k.shape().dims::<4>()[2];
    let mask = key_padding.map(|m| {
        let m = B::bool_reshape(m, Shape::new([b, 1, 1, skv]));
        B::bool_expand(m, Shape::new([b, hq, sq, skv]))
    });
    B::attention(q, k, v, mask, None, options(causal, scale))
}

/// The forward without autodiff on `CubeBackend`: the flash kernel for 16-bit operands where it
/// takes them, else Burn's `attention` op.
#[cfg(feature = "cube")]
fn cube_forward(
    q: burn_cubecl::tensor::CubeTensor,
    k: burn_cubecl::tensor::CubeTensor,
    v: burn_cubecl::tensor::CubeTensor,
    key_padding: Option<burn_cubecl::tensor::CubeTensor>,
    causal: bool,
    scale: Option<f64>,
) -> burn_cubecl::tensor::CubeTensor {
    type Cb = burn_cubecl::CubeBackend;
    if q.dtype() != DType::F32 {
        let s = resolve_scale::<Cb>(scale, &q);
        if let Some((out, _)) = flash_forward(&q, &k, &v, key_padding.as_ref(), causal, s) {
            return out;
        }
    }
    burn_attention::<Cb>(q, k, v, key_padding, causal, scale)
}

#[cfg(feature = "cube")]
impl RecomputeAttentionOps for burn_cubecl::CubeBackend {
    fn recompute_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: Option<f64>,
    ) -> FloatTensor<Self> {
        cube_forward(q, k, v, None, causal, scale)
    }

    fn recompute_attention_padded(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        causal: bool,
        scale: Option<f64>,
    ) -> FloatTensor<Self> {
        cube_forward(q, k, v, Some(key_padding), causal, scale)
    }
}

impl<B: RecomputeAttentionOps + HalfAttention, C: CheckpointStrategy> RecomputeAttentionOps
    for Autodiff<B, C>
{
    fn recompute_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: Option<f64>,
    ) -> FloatTensor<Self> {
        autodiff_forward::<B, C>(q, k, v, None, causal, scale)
    }

    fn recompute_attention_padded(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        causal: bool,
        scale: Option<f64>,
    ) -> FloatTensor<Self> {
        autodiff_forward::<B, C>(q, k, v, Some(key_padding), causal, scale)
    }
}

/// The recomputing attention on `Autodiff<B, C>`: the forward with the log-sum-exp where a
/// parent is tracked ([`RecomputeBackward`] keeps what its backward needs), the plain forward
/// where none is.
fn autodiff_forward<B: RecomputeAttentionOps + HalfAttention, C: CheckpointStrategy>(
    q: FloatTensor<Autodiff<B, C>>,
    k: FloatTensor<Autodiff<B, C>>,
    v: FloatTensor<Autodiff<B, C>>,
    key_padding: Option<BoolTensor<B>>,
    causal: bool,
    scale: Option<f64>,
) -> FloatTensor<Autodiff<B, C>> {
    let options = options(causal, scale);
    match RecomputeBackward
        .prepare::<C>([q.node(), k.node(), v.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let q_state = prep.checkpoint(&q);
            let k_state = prep.checkpoint(&k);
            let v_state = prep.checkpoint(&v);
            let [q, k, v] = [q, k, v].map(|t| t.into_parts().0);
            let (out, lse) = if q.dtype() == DType::F32 {
                // `recompute_attention` routes a masked f32 problem to Burn's op.
                assert!(
                    key_padding.is_none(),
                    "recompute attention: a key-padding mask with f32 operands"
                );
                B::attention_with_logsumexp(q, k, v, options)
            } else {
                let scale = resolve_scale::<B>(scale, &q);
                match key_padding.clone() {
                    None => B::half_attention_forward(q, k, v, causal, scale),
                    Some(m) => B::half_attention_forward_padded(q, k, v, m, causal, scale),
                }
            };
            let state = (
                q_state,
                k_state,
                v_state,
                out.clone(),
                lse,
                key_padding,
                options,
            );
            prep.finish(state, out)
        }
        OpsKind::UnTracked(prep) => {
            let [q, k, v] = [q, k, v].map(|t| t.into_parts().0);
            prep.finish(match key_padding {
                None => B::recompute_attention(q, k, v, causal, scale),
                Some(m) => B::recompute_attention_padded(q, k, v, m, causal, scale),
            })
        }
    }
}

/// Parents `[q, k, v]` (checkpointed); the state keeps the output and the log-sum-exp.
#[derive(Debug)]
struct RecomputeBackward;

impl<B: HalfAttention> Backward<B, 3> for RecomputeBackward {
    /// Q, K and V's checkpoints, the output, the log-sum-exp, the key-padding mask and the
    /// options.
    type State = (
        NodeId,
        NodeId,
        NodeId,
        FloatTensor<B>,
        FloatTensor<B>,
        Option<BoolTensor<B>>,
        AttentionModuleOptions,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [q_node, k_node, v_node] = ops.parents;
        let out_grad = grads.consume::<B>(&ops.node);
        let (q, k, v, out, lse, key_padding, options) = ops.state;
        let q: FloatTensor<B> = checkpointer.retrieve_node_output(q);
        let k = checkpointer.retrieve_node_output(k);
        let v = checkpointer.retrieve_node_output(v);
        let grads_qkv = if q.dtype() == DType::F32 {
            let g = attention_backward_default::<B>(q, k, v, out, lse, out_grad, options);
            [g.query_grad, g.key_grad, g.value_grad]
        } else {
            let scale = resolve_scale::<B>(options.scale, &q);
            let causal = options.is_causal;
            let (dq, dk, dv) = match key_padding {
                None => B::half_attention_backward(q, k, v, out, lse, out_grad, causal, scale),
                Some(m) => {
                    B::half_attention_backward_padded(q, k, v, out, lse, out_grad, m, causal, scale)
                }
            };
            [dq, dk, dv]
        };
        count_launch(RECOMPUTE_BACKWARD);
        for (node, g) in [q_node, k_node, v_node].into_iter().zip(grads_qkv) {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

/// [`recompute_attention`] as an [`AttentionImpl`] (training's `recompute` attention), key
/// padding included.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecomputeAttention;

impl AttentionImpl for RecomputeAttention {
    fn name(&self) -> String {
        "recompute".into()
    }

    /// [`crate::TrainOps`]: RMSNorm, the SwiGLU gate and RoPE as differentiable kernels (CUDA,
    /// f16/bf16), the tensor ops elsewhere.
    fn layer_ops(&self) -> Option<&dyn crate::layer_ops::LayerOps> {
        Some(&crate::train_ops::TrainOps)
    }

    fn attend(
        &self,
        _layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        opts: &AttnOptions,
    ) -> Tensor<4> {
        let scale = burn_scale(opts.scale, q.dims()[3]);
        // `AttentionImpl` callers pass the model's own Q/K/V, whose shapes fit (as for the
        // other implementations, a mismatch is a bug of the caller).
        recompute_attention(q, k, v, opts.key_padding.clone(), opts.causal, scale)
            .unwrap_or_else(|e| panic!("recompute attention: {e}"))
    }
}
