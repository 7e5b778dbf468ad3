//! The attention interface and its two plain implementations.

use burn::tensor::module::attention;
use burn::tensor::ops::{AttentionModuleOptions, CausalAlignment};
use burn::tensor::{Bool, DType, Device, Int, Tensor, activation};

/// What every attention call gets besides Q, K and V.
#[derive(Debug, Clone)]
pub struct AttnOptions {
    /// Causal masking aligned bottom-right: query `i` of `sq` sees keys `j ≤ i + (skv − sq)`,
    /// so decoding with `sq < skv` works.
    pub causal: bool,
    /// Softmax scale, usually `1/√head_dim`.
    pub scale: f32,
    /// `[batch, skv]`, `true` for keys no query may see (left padding of batched prompts).
    pub key_padding: Option<Tensor<2, Bool>>,
}

/// An attention implementation.
///
/// # Shapes
/// - `q`: `[batch, q_heads, sq, head_dim]`
/// - `k`, `v`: `[batch, kv_heads, skv, head_dim]`, `q_heads` a multiple of `kv_heads` (GQA)
/// - returns `[batch, q_heads, sq, head_dim]`
///
/// `layer` lets an implementation hold one choice per layer (e.g. INT4 or INT8 for Sage).
/// Query rows whose keys are all masked (padding positions) return finite, meaningless values.
pub trait AttentionImpl: Send + Sync + std::fmt::Debug {
    /// A short name for logs and benchmark tables.
    fn name(&self) -> String;
    fn attend(
        &self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        opts: &AttnOptions,
    ) -> Tensor<4>;

    /// The kernels for the rest of the layer that go with this implementation
    /// ([`crate::FusedLayers`]); `None`: the model's tensor ops.
    fn layer_ops(&self) -> Option<&dyn crate::layer_ops::LayerOps> {
        None
    }
}

/// The built-in implementations, by name (for CLIs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKind {
    Reference,
    BurnFused,
}

impl AttentionKind {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "reference" => Some(Self::Reference),
            "burn" | "burn-fused" => Some(Self::BurnFused),
            _ => None,
        }
    }

    pub fn build(self) -> Box<dyn AttentionImpl> {
        match self {
            Self::Reference => Box::new(ReferenceAttention),
            Self::BurnFused => Box::new(BurnAttention),
        }
    }
}

/// Repeats each KV head `group` times so that K/V have as many heads as Q.
pub fn repeat_kv(x: Tensor<4>, group: usize) -> Tensor<4> {
    if group == 1 {
        return x;
    }
    let [b, h, s, d] = x.dims();
    x.unsqueeze_dim::<5>(2)
        .expand([b, h, group, s, d])
        .reshape([b, h * group, s, d])
}

/// The bottom-right causal mask `[sq, skv]` (`true` = hidden: key `j` after query `i`'s
/// position `i + skv − sq`), built by device kernels only: no host upload, which a wgpu capture
/// window cannot record (a captured verification step has `sq > 1`). Only the last `sq` keys
/// can be hidden; their triangle comes from the positions `1..=sq` as a cumulative sum of ones.
fn causal_mask(sq: usize, skv: usize, device: &Device) -> Tensor<2, Bool> {
    let position = Tensor::<1, Int>::ones([sq], device).cumsum(0);
    let triangle = position
        .clone()
        .reshape([1, sq])
        .greater(position.reshape([sq, 1]));
    match skv - sq {
        0 => triangle,
        offset => Tensor::cat(
            vec![
                Tensor::<2, Int>::zeros([sq, offset], device).bool(),
                triangle,
            ],
            1,
        ),
    }
}

/// `[batch, 1, sq, skv]` mask (`true` = hidden) combining the bottom-right causal mask and the
/// key padding; `None` when nothing is masked.
pub fn build_mask(
    batch: usize,
    sq: usize,
    skv: usize,
    opts: &AttnOptions,
    device: &Device,
) -> Option<Tensor<4, Bool>> {
    let causal = (opts.causal && sq > 1).then(|| {
        causal_mask(sq, skv, device)
            .reshape([1, 1, sq, skv])
            .expand([batch, 1, sq, skv])
    });
    let padding = opts
        .key_padding
        .clone()
        .map(|p| p.reshape([batch, 1, 1, skv]).expand([batch, 1, sq, skv]));
    match (causal, padding) {
        (Some(c), Some(p)) => Some(c.bool_or(p)),
        (c, p) => c.or(p),
    }
}

/// Plain tensor ops in f32: scores, masks, softmax, weighted sum. The oracle for every other
/// implementation.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceAttention;

impl AttentionImpl for ReferenceAttention {
    fn name(&self) -> String {
        "reference".into()
    }

    fn attend(
        &self,
        _layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        opts: &AttnOptions,
    ) -> Tensor<4> {
        let dtype = q.dtype();
        let [b, hq, sq, _] = q.dims();
        let [_, hkv, skv, _] = k.dims();
        let group = hq / hkv;
        let k = repeat_kv(k.cast(DType::F32), group);
        let v = repeat_kv(v.cast(DType::F32), group);
        let scores = q.cast(DType::F32).matmul(k.swap_dims(2, 3)) * opts.scale;
        let scores = match build_mask(b, sq, skv, opts, &scores.device()) {
            // A large finite value rather than -inf keeps fully masked rows finite.
            Some(mask) => scores.mask_fill(mask.expand([b, hq, sq, skv]), -1.0e30),
            None => scores,
        };
        activation::softmax(scores, 3).matmul(v).cast(dtype)
    }
}

/// Burn's `attention` op (the fused flash kernel on `CubeBackend` where Burn picks it), which
/// reads grouped K/V heads (GQA) in place.
#[derive(Debug, Clone, Copy, Default)]
pub struct BurnAttention;

impl AttentionImpl for BurnAttention {
    fn name(&self) -> String {
        "burn-fused".into()
    }

    fn attend(
        &self,
        _layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        opts: &AttnOptions,
    ) -> Tensor<4> {
        let [b, hq, sq, head_dim] = q.dims();
        let skv = k.dims()[2];
        let options = AttentionModuleOptions {
            scale: burn_scale(opts.scale, head_dim),
            softcap: None,
            is_causal: false,
            causal_alignment: CausalAlignment::BottomRight,
        };
        // Burn's causal flag, aligned bottom-right as here, lets its kernel skip tiles; key
        // padding needs the explicit mask.
        if opts.causal && opts.key_padding.is_none() {
            let options = AttentionModuleOptions {
                is_causal: true,
                ..options
            };
            return attention(q, k, v, None, None, options);
        }
        let mask = build_mask(b, sq, skv, opts, &q.device()).map(|m| m.expand([b, hq, sq, skv]));
        attention(q, k, v, mask, None, options)
    }
}

/// The scale to pass Burn's attention op: `None` for the default `1/√head_dim` (a custom scale
/// makes Burn take its unfused fallback), else `scale`.
pub(crate) fn burn_scale(scale: f32, head_dim: usize) -> Option<f64> {
    let default_scale = (scale - (head_dim as f32).sqrt().recip()).abs() <= 1e-6 * scale;
    (!default_scale).then_some(scale as f64)
}
