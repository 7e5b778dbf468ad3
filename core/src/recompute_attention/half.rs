//! [`HalfAttention`]: the forward and backward of the recomputing attention for f16/bf16
//! operands, as a backend extension over core's flash kernels (with Burn's fused attention where
//! they decline), and the helpers the op and the extension share.

#[cfg(feature = "cube")]
use burn::backend::ops::ModuleOps;
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Backend, TensorMetadata, backend_extension};
use burn::tensor::{DType, Shape};

#[cfg(feature = "cube")]
use super::options;
#[cfg(feature = "cube")]
use crate::route::count_launch;

/// [`crate::kernels::flash::flash_forward`] of the operands (counted as [`FLASH_FORWARD`] when it
/// ran), or `None` where it declined.
#[cfg(feature = "cube")]
pub(super) fn flash_forward(
    q: &burn_cubecl::tensor::CubeTensor,
    k: &burn_cubecl::tensor::CubeTensor,
    v: &burn_cubecl::tensor::CubeTensor,
    key_padding: Option<&burn_cubecl::tensor::CubeTensor>,
    causal: bool,
    scale: f64,
) -> Option<(
    burn_cubecl::tensor::CubeTensor,
    burn_cubecl::tensor::CubeTensor,
)> {
    let out = crate::kernels::flash::flash_forward(
        q.clone(),
        k.clone(),
        v.clone(),
        key_padding.cloned(),
        causal,
        scale,
    );
    if out.is_some() {
        count_launch(FLASH_FORWARD);
    }
    out
}

/// The `[batch, q_heads, sq, dv]` shape of attention's output.
pub(super) fn out_shape(q: &burn::tensor::Shape, v: &burn::tensor::Shape) -> burn::tensor::Shape {
    let [b, h, s, _] = q.dims::<4>();
    burn::tensor::Shape::new([b, h, s, v.dims::<4>()[3]])
}

/// `scale`, or `1/√head_dim` of `q`.
pub(super) fn resolve_scale<B: Backend>(scale: Option<f64>, q: &FloatTensor<B>) -> f64 {
    scale_or_default(scale, q.shape().dims::<4>()[3])
}

/// `scale`, or `1/√head_dim`.
pub(super) fn scale_or_default(scale: Option<f64>, head_dim: usize) -> f64 {
    scale.unwrap_or(1.0 / (head_dim as f64).sqrt())
}

/// The op's name for [`crate::route::launches`]: counted once per backward pass that ran the
/// flash kernels ([`crate::kernels::flash`]).
pub const FLASH_BACKWARD: &str = "flash-attention-backward";

/// The op's name for [`crate::route::launches`]: counted once per forward that ran the flash
/// kernel ([`crate::kernels::flash`]).
pub const FLASH_FORWARD: &str = "flash-attention-forward";

/// Attention for f16/bf16 operands, forward and backward, as a backend extension: on
/// `CubeBackend` (and `Fusion` of it) the FlashAttention-2 style kernels of
/// [`crate::kernels::flash`] where they take the problem (CUDA's 16-bit MMA, head dim 64, a
/// causal mask only with no more queries than keys), else Burn's fused forward and backward
/// (`attention_with_logsumexp`, `attention_backward`: cubek's kernels), with a debug log line
/// saying why. The `_padded` ops take a key-padding mask, which only the flash kernels do:
/// [`recompute_attention`](super::recompute_attention) routes a masked problem here only where they take it.
#[backend_extension(
    Cube: cfg(feature = "cube"),
    Fusion: cfg(all(feature = "cube", feature = "fusion")),
)]
pub trait HalfAttention: Backend {
    /// The output and each query's log-sum-exp of the scaled scores (natural log); `causal`
    /// bottom-right.
    ///
    /// # Shapes
    /// - `q`: `[batch, q_heads, sq, d]`; `k`, `v`: `[batch, kv_heads, skv, d]`
    /// - returns the output, `[batch, q_heads, sq, d]` in `q`'s dtype, and the log-sum-exp,
    ///   `[batch, q_heads, sq]` f32
    #[fusion(meta = |q, _k, v, _causal, _scale| forward_specs(q, v))]
    fn half_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// [`HalfAttention::half_attention_forward`] with a key-padding mask (`true` = hidden); a
    /// query that sees no key gets a zero output.
    ///
    /// # Shapes
    /// As the unmasked op; `key_padding`: `[batch, skv]`.
    #[fusion(meta = |q, _k, v, _key_padding, _causal, _scale| forward_specs(q, v))]
    fn half_attention_forward_padded(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `(dQ, dK, dV)` from the inputs, the output `out`, the forward's log-sum-exp `lse` of
    /// the scaled scores and the output's gradient `dout`; `causal` bottom-right.
    ///
    /// # Shapes
    /// - `q`, `out`, `dout`: `[batch, q_heads, sq, d]`; `k`, `v`: `[batch, kv_heads, skv, d]`;
    ///   `lse`: `[batch, q_heads, sq]` f32
    /// - returns the gradients in `q`'s, `k`'s and `v`'s shapes and dtype
    #[fusion(meta = |q, k, v, _out, _lse, _dout, _causal, _scale| (q.clone(), k.clone(), v.clone()))]
    #[allow(clippy::too_many_arguments)]
    fn half_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// [`HalfAttention::half_attention_backward`] with the forward's key-padding mask.
    ///
    /// # Shapes
    /// As the unmasked op; `key_padding`: `[batch, skv]`.
    #[fusion(meta = |q, k, v, _out, _lse, _dout, _key_padding, _causal, _scale| {
        (q.clone(), k.clone(), v.clone())
    })]
    #[allow(clippy::too_many_arguments)]
    fn half_attention_backward_padded(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// The output's and the log-sum-exp's specs of [`HalfAttention::half_attention_forward`].
fn forward_specs(
    q: &burn::backend::fusion::custom::TensorSpec,
    v: &burn::backend::fusion::custom::TensorSpec,
) -> (
    burn::backend::fusion::custom::TensorSpec,
    burn::backend::fusion::custom::TensorSpec,
) {
    let spec = burn::backend::fusion::custom::TensorSpec::new;
    let [b, h, s, _] = q.shape.dims::<4>();
    (
        spec(out_shape(&q.shape, &v.shape), q.dtype),
        spec(Shape::new([b, h, s]), DType::F32),
    )
}

#[cfg(feature = "cube")]
type CubePair = (
    burn_cubecl::tensor::CubeTensor,
    burn_cubecl::tensor::CubeTensor,
);

#[cfg(feature = "cube")]
type CubeTriple = (
    burn_cubecl::tensor::CubeTensor,
    burn_cubecl::tensor::CubeTensor,
    burn_cubecl::tensor::CubeTensor,
);

/// [`HalfAttention::half_attention_forward`] on `CubeBackend`, with or without the mask.
#[cfg(feature = "cube")]
fn cube_half_forward(
    q: burn_cubecl::tensor::CubeTensor,
    k: burn_cubecl::tensor::CubeTensor,
    v: burn_cubecl::tensor::CubeTensor,
    key_padding: Option<burn_cubecl::tensor::CubeTensor>,
    causal: bool,
    scale: f64,
) -> CubePair {
    if let Some(out) = flash_forward(&q, &k, &v, key_padding.as_ref(), causal, scale) {
        return out;
    }
    assert!(
        key_padding.is_none(),
        "recompute attention: the flash forward declined a key-padding mask it was routed"
    );
    burn_cubecl::CubeBackend::attention_with_logsumexp(q, k, v, options(causal, Some(scale)))
}

/// [`HalfAttention::half_attention_backward`] on `CubeBackend`, with or without the mask.
#[cfg(feature = "cube")]
#[allow(clippy::too_many_arguments)]
fn cube_half_backward(
    q: burn_cubecl::tensor::CubeTensor,
    k: burn_cubecl::tensor::CubeTensor,
    v: burn_cubecl::tensor::CubeTensor,
    out: burn_cubecl::tensor::CubeTensor,
    lse: burn_cubecl::tensor::CubeTensor,
    dout: burn_cubecl::tensor::CubeTensor,
    key_padding: Option<burn_cubecl::tensor::CubeTensor>,
    causal: bool,
    scale: f64,
) -> CubeTriple {
    let masked = key_padding.is_some();
    let flash = crate::kernels::flash::flash_backward(
        q.clone(),
        k.clone(),
        v.clone(),
        out.clone(),
        lse.clone(),
        dout.clone(),
        key_padding,
        causal,
        scale,
    );
    if let Some(grads) = flash {
        count_launch(FLASH_BACKWARD);
        return grads;
    }
    assert!(
        !masked,
        "recompute attention: the flash backward declined a key-padding mask it was routed"
    );
    let g = burn_cubecl::CubeBackend::attention_backward(
        q,
        k,
        v,
        out,
        lse,
        dout,
        options(causal, Some(scale)),
    );
    (g.query_grad, g.key_grad, g.value_grad)
}

#[cfg(feature = "cube")]
impl HalfAttention for burn_cubecl::CubeBackend {
    fn half_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> CubePair {
        cube_half_forward(q, k, v, None, causal, scale)
    }

    fn half_attention_forward_padded(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> CubePair {
        cube_half_forward(q, k, v, Some(key_padding), causal, scale)
    }

    fn half_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> CubeTriple {
        cube_half_backward(q, k, v, out, lse, dout, None, causal, scale)
    }

    fn half_attention_backward_padded(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> CubeTriple {
        cube_half_backward(q, k, v, out, lse, dout, Some(key_padding), causal, scale)
    }
}
