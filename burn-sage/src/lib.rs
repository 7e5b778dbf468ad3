//! # burn-sage: SageAttention2 for Burn
//!
//! Quantized attention after SageAttention2 (Zhang et al., 2024): Q and K are smoothed
//! (K minus its mean over tokens; optionally Q minus its block mean, with the
//! `ΔS = mean(Q)·Kᵀ` correction added back in full precision) and quantized to INT8 or INT4
//! with one scale per group of rows; `QKᵀ` is an integer product dequantized with the folded
//! scales; the softmax is computed online in f32; `P̃·V` runs in FP16 (f32 accumulation) or in
//! FP8 E4M3 with a per-channel V scale.
//!
//! - [`sage_attention`]: the op, with typed errors for bad input.
//! - [`SageBackend`]: `CubeBackend` runs the CubeCL kernels ([`kernels`]); `NdArray` runs the
//!   tensor-op reference ([`reference`]), which applies exactly the same quantization.
//! - [`SageAttention`]: the op as the Llama model's attention implementation, with one
//!   quantization choice per layer; [`adaptive`] picks INT4 or INT8 per layer from a
//!   calibration batch.
//!
//! # Shapes
//! - `q`: `[batch, q_heads, q_len, head_dim]`
//! - `k`, `v`: `[batch, kv_heads, kv_len, head_dim]`, `kv_heads` dividing `q_heads` (GQA, read
//!   in place: no repeated K/V is materialized by the kernels)
//! - output `[batch, q_heads, q_len, head_dim]` in the input dtype; log-sum-exp
//!   `[batch, q_heads, q_len]` in f32 when asked for
//!
//! ```
//! use burn::backend::NdArray;
//! use burn::tensor::{Distribution, Tensor};
//! use burn_sage::{SageOptions, sage_attention};
//!
//! let device = Default::default();
//! let q = Tensor::<NdArray, 4>::random([1, 4, 17, 64], Distribution::Normal(0.0, 1.0), &device);
//! let k = Tensor::<NdArray, 4>::random([1, 2, 17, 64], Distribution::Normal(0.0, 1.0), &device);
//! let v = Tensor::<NdArray, 4>::random([1, 2, 17, 64], Distribution::Normal(0.0, 1.0), &device);
//! let out = sage_attention(q, k, v, &SageOptions { causal: true, ..Default::default() }).unwrap();
//! assert_eq!(out.out.dims(), [1, 4, 17, 64]);
//! ```

pub mod adaptive;
mod attention_impl;
mod cpu;
mod error;
mod forward;
pub mod kernels;
mod options;
pub mod prep;
pub mod reference;

pub use attention_impl::SageAttention;
pub use error::{SageError, Unsupported};
pub use options::{Grid, GroupLayout, PvPrecision, Q_SMOOTH_BLOCK, QkQuant, SageOptions, SagePlan};

use burn::tensor::{DType, Tensor, TensorPrimitive, backend::Backend, ops::FloatTensor};

/// Backends that run Sage attention.
///
/// `CubeBackend` runs the CubeCL kernels; the CPU backend (`NdArray`) uses the default method,
/// the tensor-op reference. Another backend can opt in with an empty `impl`.
pub trait SageBackend: Backend {
    /// Sage attention on validated input (see [`sage_attention`] for shapes).
    fn sage_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        plan: &SagePlan,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let t = |x| Tensor::<Self, 4>::from_primitive(TensorPrimitive::Float(x));
        let (out, lse) = reference::sage_attention(t(q), t(k), t(v), plan);
        (
            out.into_primitive().tensor(),
            lse.map(|l| l.into_primitive().tensor()),
        )
    }

    /// The kernel [`SageBackend::sage_forward`] runs for `plan` on `device`; `None` is the
    /// tensor-op reference.
    fn sage_kernel(_device: &Self::Device, _plan: &SagePlan) -> Option<kernels::KernelChoice> {
        None
    }

    /// The quantization stage (see [`quantize_stage`]); integers returned as f32 values.
    fn sage_quantize(
        x: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        mean_block: usize,
        layout: GroupLayout,
        qmax: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let t = |x| Tensor::<Self, 4>::from_primitive(TensorPrimitive::Float(x));
        let (ints, scales) = reference::quantize(t(x), t(mean), mean_block, layout, qmax);
        (
            ints.into_primitive().tensor(),
            scales.into_primitive().tensor(),
        )
    }
}

/// The quantization stage alone (for tests and inspection): `x − mean` quantized per group.
///
/// # Shapes
/// - `x`: `[b, h, s, d]`; `mean`: `[b, h, nm, d]` f32 (block `m` of `mean_block` rows uses
///   row `m`)
/// - returns `(ints [b, h, s, d] as f32 values, scales [b, h, layout.groups(s)] f32)`
pub fn quantize_stage<B: SageBackend>(
    x: Tensor<B, 4>,
    mean: Tensor<B, 4>,
    mean_block: usize,
    layout: GroupLayout,
    qmax: f32,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let (ints, scales) = B::sage_quantize(
        x.into_primitive().tensor(),
        mean.into_primitive().tensor(),
        mean_block,
        layout,
        qmax,
    );
    (
        Tensor::from_primitive(TensorPrimitive::Float(ints)),
        Tensor::from_primitive(TensorPrimitive::Float(scales)),
    )
}

/// Output of [`sage_attention`].
#[derive(Debug, Clone)]
pub struct SageOutput<B: Backend> {
    /// `[batch, q_heads, q_len, head_dim]`, in the input dtype.
    pub out: Tensor<B, 4>,
    /// `[batch, q_heads, q_len]` f32 log-sum-exp of the scaled scores, when asked for.
    pub lse: Option<Tensor<B, 3>>,
}

/// Sage attention of `q` over `k`, `v`.
///
/// # Shapes
/// - `q`: `[batch, q_heads, q_len, head_dim]`, `k`, `v`: `[batch, kv_heads, kv_len, head_dim]`
///   (the rank is generic only so that a wrong rank is a typed error)
/// - returns `out [batch, q_heads, q_len, head_dim]` and, with `return_lse`,
///   `lse [batch, q_heads, q_len]`
///
/// # Errors
/// Wrong rank, mismatched batch / head dim / KV shapes, KV heads not dividing Q heads, mixed or
/// non-float dtypes, empty inputs, causal with `q_len > kv_len`, a bad scale.
pub fn sage_attention<B: SageBackend, const R: usize>(
    q: Tensor<B, R>,
    k: Tensor<B, R>,
    v: Tensor<B, R>,
    opts: &SageOptions,
) -> Result<SageOutput<B>, SageError> {
    let plan = plan(
        &q.dims(),
        &k.dims(),
        &v.dims(),
        [q.dtype(), k.dtype(), v.dtype()],
        opts,
    )?;
    let q4 = q.reshape([plan.batch, plan.q_heads, plan.q_len, plan.head_dim]);
    let kv = [plan.batch, plan.kv_heads, plan.kv_len, plan.head_dim];
    let (k4, v4) = (k.reshape(kv), v.reshape(kv));
    let (out, lse) = B::sage_forward(
        q4.into_primitive().tensor(),
        k4.into_primitive().tensor(),
        v4.into_primitive().tensor(),
        &plan,
    );
    Ok(SageOutput {
        out: Tensor::from_primitive(TensorPrimitive::Float(out)),
        lse: lse.map(|l| Tensor::from_primitive(TensorPrimitive::Float(l))),
    })
}

/// Validates the shapes, dtypes and options into a [`SagePlan`].
pub fn plan(
    q: &[usize],
    k: &[usize],
    v: &[usize],
    dtypes: [DType; 3],
    opts: &SageOptions,
) -> Result<SagePlan, SageError> {
    for (name, s) in [("q", q), ("k", k), ("v", v)] {
        if s.len() != 4 {
            return Err(SageError::Rank {
                name,
                rank: s.len(),
            });
        }
    }
    let d4 = |s: &[usize]| [s[0], s[1], s[2], s[3]];
    let (q, k, v) = (d4(q), d4(k), d4(v));
    let [qd, kd, vd] = dtypes;
    let float = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
    if !(float(qd) && qd == kd && kd == vd) {
        return Err(SageError::DtypeMismatch {
            q: qd,
            k: kd,
            v: vd,
        });
    }
    if q[0] != k[0] || k[0] != v[0] {
        return Err(SageError::BatchMismatch {
            q: q[0],
            k: k[0],
            v: v[0],
        });
    }
    if q[3] != k[3] || k[3] != v[3] {
        return Err(SageError::HeadDimMismatch {
            q: q[3],
            k: k[3],
            v: v[3],
        });
    }
    if k[1] != v[1] || k[2] != v[2] {
        return Err(SageError::KvShapeMismatch { k, v });
    }
    if q.contains(&0) || k.contains(&0) {
        return Err(SageError::Empty { q, k });
    }
    if q[1] % k[1] != 0 {
        return Err(SageError::KvHeadsNotDividing {
            q_heads: q[1],
            kv_heads: k[1],
        });
    }
    if opts.causal && q[2] > k[2] {
        return Err(SageError::CausalQueryLongerThanKeys {
            q_len: q[2],
            kv_len: k[2],
        });
    }
    let scale = opts.scale.unwrap_or(1.0 / (q[3] as f32).sqrt());
    if !(scale.is_finite() && scale > 0.0) {
        return Err(SageError::InvalidScale(scale));
    }
    Ok(SagePlan {
        opts: *opts,
        batch: q[0],
        q_heads: q[1],
        kv_heads: k[1],
        q_len: q[2],
        kv_len: k[2],
        head_dim: q[3],
        dtype: qd,
        scale,
    })
}

/// Accuracy of an attention output against a reference, as the paper reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Accuracy {
    pub cos_sim: f64,
    /// `Σ|a − e| / Σ|e|`.
    pub rel_l1: f64,
    pub rmse: f64,
}

impl Accuracy {
    /// Metrics of `actual` against `expected` (same length).
    pub fn of(actual: &[f32], expected: &[f32]) -> Self {
        let (mut dot, mut na, mut ne, mut l1, mut l1e, mut sq) = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
        for (&a, &e) in actual.iter().zip(expected) {
            let (a, e) = (a as f64, e as f64);
            dot += a * e;
            na += a * a;
            ne += e * e;
            l1 += (a - e).abs();
            l1e += e.abs();
            sq += (a - e) * (a - e);
        }
        let n = expected.len().max(1) as f64;
        Self {
            cos_sim: dot / (na.sqrt() * ne.sqrt()).max(f64::MIN_POSITIVE),
            rel_l1: l1 / l1e.max(f64::MIN_POSITIVE),
            rmse: (sq / n).sqrt(),
        }
    }

    /// The paper's per-layer score for choosing INT4: `cos_sim · (1 − rel_l1)`.
    pub fn score(&self) -> f64 {
        self.cos_sim * (1.0 - self.rel_l1)
    }
}

impl std::fmt::Display for Accuracy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cos_sim {:.5}  rel_l1 {:.4}  rmse {:.4}",
            self.cos_sim, self.rel_l1, self.rmse
        )
    }
}
