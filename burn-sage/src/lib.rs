//! # burn-sage: SageAttention2 for Burn
//!
//! Quantized attention after SageAttention2 (Zhang et al., 2024): Q and K are smoothed
//! (K minus its mean over tokens; optionally Q minus its block mean, with the
//! `ΔS = mean(Q)·Kᵀ` correction added back in full precision) and quantized to INT8 or INT4
//! with one scale per group of rows; `QKᵀ` is an integer product dequantized with the folded
//! scales; the softmax is computed online in f32; `P̃·V` runs in FP16 (f32 accumulation) or in
//! FP8 E4M3 with a per-channel V scale.
//!
//! - [`sage_attention`]: the op, with typed errors for bad input. On a CubeCL device it runs
//!   the CubeCL kernels ([`kernels`], through the backend extension [`SageKernels`], fused or
//!   not); everywhere else (Burn's `Flex` CPU backend, an autodiff device, a configuration no
//!   kernel takes: see [`sage_kernel`]) the tensor-op reference ([`reference`](mod@reference)), which applies
//!   exactly the same quantization.
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
//! use burn::tensor::{Device, Distribution, Tensor};
//! use burn_sage::{SageOptions, sage_attention};
//!
//! let device = Device::flex();
//! let q = Tensor::<4>::random([1, 4, 17, 64], Distribution::Normal(0.0, 1.0), &device);
//! let k = Tensor::<4>::random([1, 2, 17, 64], Distribution::Normal(0.0, 1.0), &device);
//! let v = Tensor::<4>::random([1, 2, 17, 64], Distribution::Normal(0.0, 1.0), &device);
//! let out = sage_attention(q, k, v, &SageOptions { causal: true, ..Default::default() }).unwrap();
//! assert_eq!(out.out.dims(), [1, 4, 17, 64]);
//! ```

pub mod adaptive;
mod attention_impl;
mod cube;
mod error;
pub mod kernels;
mod options;
pub mod prep;
pub mod reference;

pub use attention_impl::SageAttention;
pub use cube::{SageKernels, matmul_shape};
pub use error::{SageError, Unsupported};
pub use options::{Grid, GroupLayout, PvPrecision, Q_SMOOTH_BLOCK, QkQuant, SageOptions, SagePlan};

use burn::backend::Dispatch;
use burn::tensor::{DType, Device, Tensor};
use burn_kernels_core::route::{Grad, cube_device, route};

use kernels::KernelChoice;

/// The kernel [`sage_attention`] runs for `plan` on `device`, or why it runs the tensor-op
/// reference there instead: the device is no CubeCL device of a runtime this build enables,
/// it has autodiff (the kernels have no backward), or the runtime or the configuration
/// rules every kernel out (see [`kernels::choose`]).
pub fn sage_kernel(device: &Device, plan: &SagePlan) -> Result<KernelChoice, Unsupported> {
    let Some(cube) = cube_device(device) else {
        return Err(Unsupported::NoKernels);
    };
    if device.is_autodiff() {
        return Err(Unsupported::Autodiff);
    }
    kernels::choose(&cube.client(), plan)
}

/// The kernel [`KernelChoice::Tuned`] runs for `plan`'s shape key on `device`: `None` until a
/// launch of that key was timed (in this process, or read back from CubeCL's autotune cache by
/// one), and where `device` runs no kernel. For reports: the op itself needs no call to this.
pub fn tuned_kernel(device: &Device, plan: &SagePlan) -> Option<KernelChoice> {
    kernels::tune::tuned_kernel(&cube_device(device)?, plan)
}

/// The quantization stage alone (for tests and inspection): `x − mean` quantized per group.
/// Its kernel runs on CubeCL devices; elsewhere the tensor-op reference.
///
/// # Shapes
/// - `x`: `[b, h, s, d]`; `mean`: `[b, h, nm, d]` f32 (block `m` of `mean_block` rows uses
///   row `m`)
/// - returns `(ints [b, h, s, d] as f32 values, scales [b, h, layout.groups(s)] f32)`
pub fn quantize_stage(
    x: Tensor<4>,
    mean: Tensor<4>,
    mean_block: usize,
    layout: GroupLayout,
    qmax: f32,
) -> (Tensor<4>, Tensor<3>) {
    let device = x.device();
    let unsupported = if mean.dtype() != DType::F32 {
        Some(format!(
            "the mean is {:?}, the kernel reads f32",
            mean.dtype()
        ))
    } else {
        cube_device(&device)
            .and_then(|cube| kernels::int_storage(&cube.client()).err())
            .map(|e| e.to_string())
    };
    if !route("sage_quantize", &device, Grad::ForwardOnly, unsupported) {
        return reference::quantize(x, mean, mean_block, layout, qmax);
    }
    let (ints, scales) = Dispatch::sage_quantize(
        x.into_dispatch(),
        mean.into_dispatch(),
        mean_block,
        layout,
        qmax,
    );
    (Tensor::from_dispatch(ints), Tensor::from_dispatch(scales))
}

/// Output of [`sage_attention`].
#[derive(Debug, Clone)]
pub struct SageOutput {
    /// `[batch, q_heads, q_len, head_dim]`, in the input dtype.
    pub out: Tensor<4>,
    /// `[batch, q_heads, q_len]` f32 log-sum-exp of the scaled scores, when asked for.
    pub lse: Option<Tensor<3>>,
}

/// Sage attention of `q` over `k`, `v`: the kernel [`sage_kernel`] names where there is
/// one, else the tensor-op reference (logged once per reason on a CubeCL device).
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
pub fn sage_attention<const R: usize>(
    q: Tensor<R>,
    k: Tensor<R>,
    v: Tensor<R>,
    opts: &SageOptions,
) -> Result<SageOutput, SageError> {
    let plan = plan(
        &q.dims(),
        &k.dims(),
        &v.dims(),
        [q.dtype(), k.dtype(), v.dtype()],
        opts,
    )?;
    let q = q.reshape([plan.batch, plan.q_heads, plan.q_len, plan.head_dim]);
    let kv = [plan.batch, plan.kv_heads, plan.kv_len, plan.head_dim];
    let (k, v) = (k.reshape(kv), v.reshape(kv));
    let device = q.device();
    let choice = sage_kernel(&device, &plan);
    let unsupported = choice.as_ref().err().map(ToString::to_string);
    if !route("sage_attention", &device, Grad::ForwardOnly, unsupported) {
        let (out, lse) = reference::sage_attention(q, k, v, &plan);
        return Ok(SageOutput { out, lse });
    }
    let kernel = choice.expect("route takes the kernel only when one fits");
    Ok(run_kernels(q, k, v, plan, kernel))
}

/// The kernel path: the shared tensor-op stages (ΔS by a GEMM that is not autotuned, see
/// [`prep::prepare_with`]), then the quantization and attention kernels in one extension call.
fn run_kernels(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    plan: SagePlan,
    kernel: KernelChoice,
) -> SageOutput {
    let fixed_matmul = |a: Tensor<4>, b: Tensor<4>| {
        Tensor::from_dispatch(Dispatch::sage_fixed_matmul(
            a.into_dispatch(),
            b.into_dispatch(),
        ))
    };
    let prep = prep::prepare_with(&q, &k, &v, &plan, fixed_matmul);
    // Without Q smoothing the kernels read no ΔS; the extension takes a tensor all the same.
    let delta_s = prep
        .delta_s
        .unwrap_or_else(|| Tensor::<4>::zeros([1, 1, 1, 1], &q.device()).cast(DType::F32));
    let d = Tensor::<4>::into_dispatch;
    let (q, k, v) = (d(q), d(k), d(prep.v));
    let (q_mean, k_mean, delta_s, post) =
        (d(prep.q_mean), d(prep.k_mean), d(delta_s), d(prep.post));
    if plan.opts.return_lse {
        let (out, lse) =
            Dispatch::sage_attention_lse(q, k, q_mean, k_mean, delta_s, v, post, plan, kernel);
        SageOutput {
            out: Tensor::from_dispatch(out),
            lse: Some(Tensor::from_dispatch(lse)),
        }
    } else {
        let out = Dispatch::sage_attention(q, k, q_mean, k_mean, delta_s, v, post, plan, kernel);
        SageOutput {
            out: Tensor::from_dispatch(out),
            lse: None,
        }
    }
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
