//! CubeCL kernels, one file per stage, for every CubeCL runtime:
//!
//! - [`quantize`]: smoothing (subtracting the prepared means) and group quantization to
//!   integers, one scale per group.
//! - [`attn_unit`]: the portable attention kernel (any runtime, lavapipe included).
//! - [`attn_cmma`]: the attention kernel on the matrix units: `QKᵀ` as i8·i8→i32 cmma,
//!   `P̃·V` as f16/bf16 cmma with f32 accumulation, scores staged in shared memory.
//! - [`attn_mma`]: the same on register-resident tiles (manual `mma.sync`, FlashAttention-2
//!   structure), for head dims 64 and 128.
//! - [`attn_wgmma`]: the same on Hopper's warpgroup MMA with TMA loads (sm_90a, head dims 64
//!   and 128).
//! - [`tune`]: the choice among them by measurement (CubeCL's autotune).
//!
//! [`sage_forward`] runs the kernels of the pipeline on `CubeBackend`. [`choose`] picks, among
//! the kernels that take a plan on this runtime ([`tune::candidates`]: the Hopper kernel where
//! the runtime has warpgroup MMA and TMA, the register kernel where it has manual i8 and
//! f16/bf16 MMA, both for head dims 64 and 128, the cmma kernel where it has i8 and f16/bf16
//! cmma, for head dims 64, 128 and 256), the fastest by measurement ([`KernelChoice::Tuned`])
//! where there are several, the one where there is one, and the portable kernel where there are
//! none; [`crate::SageOptions::kernel`] can ask for one.

pub mod attn_cmma;
pub mod attn_mma;
pub mod attn_unit;
pub mod attn_wgmma;
mod common;
pub mod fast_exp;
mod pv_grid;
pub mod quantize;
pub mod tune;

pub use pv_grid::v_transposed_map;

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, Shape};
use burn_cubecl::{
    CubeBackend, kernel::matmul::MatmulStrategy, ops::numeric::empty_device_contiguous_dtype,
    tensor::CubeTensor,
};
use cubecl::ir::{
    ElemType, FloatKind, IntKind,
    features::{MmaConfig, TypeUsage},
};
use cubecl::prelude::*;

use crate::{GroupLayout, SagePlan, Unsupported};

/// The scalars every attention kernel takes.
#[derive(CubeLaunch, CubeType, Clone, Copy, Debug)]
pub struct AttnArgs {
    /// `batch · q_heads · q_len`
    pub rows: usize,
    pub hq: usize,
    pub group: usize,
    pub sq: usize,
    pub skv: usize,
    pub q_block: usize,
    pub q_inter: usize,
    pub q_groups: usize,
    pub k_block: usize,
    pub k_inter: usize,
    pub k_groups: usize,
    pub mean_block: usize,
    pub mean_blocks: usize,
    pub scale: f32,
    pub p_scale: f32,
    pub mantissa: f32,
    pub min_exp: f32,
    pub grid_max: f32,
}

impl AttnArgs {
    pub fn new(plan: &SagePlan, mean_blocks: usize) -> Self {
        let (ql, kl) = (plan.opts.qk.q_layout(), plan.opts.qk.k_layout());
        let grid = plan.pv_grid();
        Self {
            rows: plan.batch * plan.q_heads * plan.q_len,
            hq: plan.q_heads,
            group: plan.group(),
            sq: plan.q_len,
            skv: plan.kv_len,
            q_block: ql.block,
            q_inter: ql.interleave,
            q_groups: ql.groups(plan.q_len),
            k_block: kl.block,
            k_inter: kl.interleave,
            k_groups: kl.groups(plan.kv_len),
            mean_block: plan.q_mean_block(),
            mean_blocks,
            scale: plan.scale,
            p_scale: plan.p_scale(),
            mantissa: grid.mantissa as f32,
            min_exp: grid.min_exp as f32,
            grid_max: grid.max,
        }
    }

    pub fn launch_arg(self) -> AttnArgsLaunch {
        AttnArgsLaunch::new(
            self.rows,
            self.hq,
            self.group,
            self.sq,
            self.skv,
            self.q_block,
            self.q_inter,
            self.q_groups,
            self.k_block,
            self.k_inter,
            self.k_groups,
            self.mean_block,
            self.mean_blocks,
            self.scale,
            self.p_scale,
            self.mantissa,
            self.min_exp,
            self.grid_max,
        )
    }
}

/// A one-element f32 buffer for an optional input or output that is not used (binding one
/// tensor twice is not allowed on every runtime).
pub(crate) fn dummy(like: &CubeTensor) -> CubeTensor {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::new([1]),
        DType::F32,
    )
}

/// What every attention kernel reads: Q and K quantized with their group scales, ΔS when Q is
/// smoothed, V as the PV product reads it and V's smoothing `post`.
#[derive(Clone)]
pub(crate) struct QuantizedInputs {
    /// `[b, hq, sq, d]` integers.
    pub qi: CubeTensor,
    /// `[b, hkv, skv, d]` integers.
    pub ki: CubeTensor,
    /// Q's group scales, `[b, hq, q_groups]` f32.
    pub qs: CubeTensor,
    /// K's group scales, `[b, hkv, k_groups]` f32.
    pub ks: CubeTensor,
    /// `[b, hq, nm, skv]` f32 when Q is smoothed.
    pub ds: Option<CubeTensor>,
    /// `[b, hkv, skv, d]`.
    pub v: CubeTensor,
    /// `[b, hkv, 1, d]` f32.
    pub post: CubeTensor,
}

/// What every attention launcher allocates and derives from the plan before its launch.
pub(crate) struct MatrixLaunch {
    /// `[b, hq, sq, d]` in the plan's dtype.
    pub out: CubeTensor,
    /// `[b, hq, sq]` f32 when the plan asks for the LSE, else a dummy.
    pub lse: CubeTensor,
    pub write_lse: bool,
    /// ΔS, contiguous, or a dummy.
    pub ds: CubeTensor,
    pub has_ds: bool,
    /// f16, or bf16 for bf16 inputs.
    pub pv_dtype: DType,
    pub g: pv_grid::RoundArgs,
    pub fp8: bool,
    /// How far a row maximum may move before the accumulators are rescaled: P̃ may grow to
    /// `e^tau` in between; FP8's grid saturates at 448, so it rescales always.
    pub tau: f32,
}

impl MatrixLaunch {
    pub fn new(qi: &CubeTensor, qs: &CubeTensor, ds: Option<CubeTensor>, plan: &SagePlan) -> Self {
        let (client, device) = (qi.client.clone(), qi.device.clone());
        let [b, hq, sq, d] = qi.meta.shape().dims::<4>();
        let out = empty_device_contiguous_dtype(
            client.clone(),
            device.clone(),
            Shape::new([b, hq, sq, d]),
            plan.dtype,
        );
        let write_lse = plan.opts.return_lse;
        let lse = if write_lse {
            empty_device_contiguous_dtype(client, device, lse_shape(qi.meta.shape()), DType::F32)
        } else {
            dummy(qs)
        };
        let has_ds = ds.is_some();
        let ds = ds
            .map(burn_cubecl::kernel::into_contiguous)
            .unwrap_or_else(|| dummy(qs));
        let pv_dtype = if plan.dtype == DType::BF16 {
            DType::BF16
        } else {
            DType::F16
        };
        let fp8 = plan.opts.pv == crate::PvPrecision::Fp8E4m3;
        Self {
            out,
            lse,
            write_lse,
            ds,
            has_ds,
            pv_dtype,
            g: pv_grid::RoundArgs::new(plan.pv_grid()),
            fp8,
            tau: if fp8 { 0.0 } else { 8.0 },
        }
    }

    /// `(out, lse when asked for)`.
    pub fn outputs(self) -> (CubeTensor, Option<CubeTensor>) {
        (self.out, self.write_lse.then_some(self.lse))
    }
}

/// The integer dtype the runtime stores quantized values in: i8, else i32.
pub fn int_storage(client: &Client) -> Result<DType, Unsupported> {
    let props = client.properties();
    for dtype in [DType::I8, DType::I32] {
        if props
            .type_usage(dtype_to_storage_type(dtype))
            .contains(TypeUsage::Buffer)
        {
            return Ok(dtype);
        }
    }
    Err(Unsupported::Dtype(DType::I8))
}

/// Whether the runtime has the cmma shapes the matrix-unit kernel uses for inputs in `dtype`.
pub fn cmma_support(client: &Client, dtype: DType) -> Result<(), Unsupported> {
    let props = client.properties();
    let has = |a: ElemType, cd: ElemType| {
        props.features.matmul.cmma.contains(&MmaConfig {
            a_type: a,
            b_type: a,
            cd_type: cd,
            m: 16,
            n: 16,
            k: 16,
        })
    };
    let i8 = ElemType::Int(IntKind::I8);
    if !has(i8, ElemType::Int(IntKind::I32)) {
        return Err(Unsupported::MatrixUnits("i8·i8→i32"));
    }
    let pv = match dtype {
        DType::BF16 => ElemType::Float(FloatKind::BF16),
        _ => ElemType::Float(FloatKind::F16),
    };
    if !has(pv, ElemType::Float(FloatKind::F32)) {
        return Err(Unsupported::MatrixUnits("f16/bf16·→f32"));
    }
    Ok(())
}

/// Loop iterations lavapipe lets one invocation run: llvmpipe's shader compiler (gallivm) gives
/// every shader one counter shared by all its loops (`LP_MAX_TGSI_LOOP_ITERATIONS`) and ends
/// every loop once it has counted this many iterations, silently: the invocation goes on with
/// its loops cut short, so results are wrong or never written.
pub const LOOP_BUDGET: usize = 65_535;

/// Longest KV length the portable kernel is used for: its one loop runs once per key (the
/// per-channel loops are unrolled), so it stays within [`LOOP_BUDGET`] up to here; longer
/// problems run the reference instead.
pub const UNIT_MAX_KV: usize = 65_000;

/// Which attention kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelChoice {
    /// The portable one-unit-per-row kernel.
    Unit,
    /// The matrix-unit kernel with scores staged in shared memory (WMMA-style cmma).
    Cmma,
    /// The matrix-unit kernel with register-resident tiles (manual MMA).
    Mma,
    /// The Hopper kernel: warpgroup MMA, tiles loaded by TMA (sm_90a).
    Wgmma,
    /// The fastest of [`tune::candidates`], timed at the first launch of each shape key
    /// ([`tune::SageTuneKey`]) by CubeCL's autotune: what [`choose`] picks where more than one
    /// kernel takes the plan.
    Tuned,
}

impl std::fmt::Display for KernelChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KernelChoice::Unit => "unit",
            KernelChoice::Cmma => "cmma",
            KernelChoice::Mma => "mma",
            KernelChoice::Wgmma => "wgmma",
            KernelChoice::Tuned => "tuned",
        })
    }
}

/// The kernel [`sage_forward`] would pick for `plan` on this client.
pub fn choose(client: &Client, plan: &SagePlan) -> Result<KernelChoice, Unsupported> {
    if plan.head_dim > 256 {
        return Err(Unsupported::HeadDim(plan.head_dim));
    }
    int_storage(client)?;
    let mma_dim = matches!(plan.head_dim, 64 | 128);
    let cmma_dim = matches!(plan.head_dim, 64 | 128 | 256);
    let unit = || {
        if plan.kv_len > UNIT_MAX_KV {
            Err(Unsupported::UnitKernelLength(plan.kv_len))
        } else {
            Ok(KernelChoice::Unit)
        }
    };
    let dim = |ok: bool, c: KernelChoice| {
        if ok {
            Ok(c)
        } else {
            Err(Unsupported::KernelHeadDim(c, plan.head_dim))
        }
    };
    match plan.opts.kernel {
        Some(KernelChoice::Mma) => {
            attn_mma::support(client, plan.dtype).and_then(|()| dim(mma_dim, KernelChoice::Mma))
        }
        Some(KernelChoice::Cmma) => {
            cmma_support(client, plan.dtype).and_then(|()| dim(cmma_dim, KernelChoice::Cmma))
        }
        Some(KernelChoice::Wgmma) => attn_wgmma::support(client, plan.dtype, plan.head_dim)
            .and_then(|()| dim(mma_dim, KernelChoice::Wgmma)),
        Some(KernelChoice::Unit) => unit(),
        Some(KernelChoice::Tuned) => match tune::candidates(client, plan).is_empty() {
            true => unit(),
            false => Ok(KernelChoice::Tuned),
        },
        None => match tune::candidates(client, plan).as_slice() {
            [] => unit(),
            [one] => Ok(*one),
            _ => Ok(KernelChoice::Tuned),
        },
    }
}

/// `a · b` in f32 by cubek's default GEMM, without autotuning (see
/// [`crate::prep::prepare_with`]); Burn's autotuned matmul where that GEMM cannot launch.
pub fn fixed_matmul(a: CubeTensor, b: CubeTensor) -> CubeTensor {
    match burn_cubecl::kernel::matmul::matmul(
        a.clone(),
        b.clone(),
        None,
        MatmulStrategy::Cube,
        DType::F32,
    ) {
        Ok(out) => out,
        Err(err) => {
            log::debug!("burn-sage: fixed GEMM unavailable for ΔS ({err:?}); autotuned matmul");
            CubeBackend::float_matmul(a, b)
        }
    }
}

/// What the quantization and attention kernels consume: Q, K and the tensor-op stages'
/// outputs ([`crate::prep::Prepared`]) as `CubeBackend` primitives.
pub struct PreparedInputs {
    /// `[b, hq, sq, d]` in the plan's dtype.
    pub q: CubeTensor,
    /// `[b, hkv, skv, d]` in the plan's dtype.
    pub k: CubeTensor,
    /// `[b, hq, nm, d]` f32.
    pub q_mean: CubeTensor,
    /// `[b, hkv, 1, d]` f32.
    pub k_mean: CubeTensor,
    /// `[b, hq, nm, skv]` f32 when Q is smoothed.
    pub delta_s: Option<CubeTensor>,
    /// V as the PV product reads it.
    pub v: CubeTensor,
    /// `[b, hkv, 1, d]` f32.
    pub post: CubeTensor,
}

/// The kernels of the pipeline with a chosen kernel, after the shared tensor-op stages: the
/// quantization kernels, the attention kernel. Returns `(out, lse when the plan asks for it)`.
///
/// `choice` must be what [`choose`] returned for `plan` on this client.
pub fn sage_forward(
    inputs: PreparedInputs,
    plan: &SagePlan,
    choice: KernelChoice,
) -> (CubeTensor, Option<CubeTensor>) {
    let PreparedInputs {
        q,
        k,
        q_mean,
        k_mean,
        delta_s,
        v,
        post,
    } = inputs;
    // The tuner's candidates are all matrix-unit kernels, or the portable kernel alone.
    let unit = match choice {
        KernelChoice::Unit => true,
        KernelChoice::Tuned => tune::candidates(&q.client, plan) == [KernelChoice::Unit],
        _ => false,
    };
    let int_dtype = if unit {
        int_storage(&q.client).expect("the kernel choice checked the integer storage")
    } else {
        DType::I8
    };
    let mean_blocks = q_mean.meta.shape().dims::<4>()[2];
    let qk = plan.opts.qk;
    let (qi, qs) = quantize::quantize(
        q,
        q_mean,
        plan.q_mean_block(),
        qk.q_layout(),
        qk.qmax(),
        int_dtype,
    );
    let (ki, ks) = quantize::quantize(k, k_mean, plan.kv_len, qk.k_layout(), qk.qmax(), int_dtype);
    let args = AttnArgs::new(plan, mean_blocks);
    let x = QuantizedInputs {
        qi,
        ki,
        qs,
        ks,
        ds: delta_s,
        v,
        post,
    };
    tune::launch(choice, x, args, plan)
}

/// The shape of the log-sum-exp of attention with `q` of shape `[b, h, sq, d]`: `[b, h, sq]`.
pub fn lse_shape(q: &Shape) -> Shape {
    Shape::new([q[0], q[1], q[2]])
}

/// The shape of the group scales of `x` `[b, h, s, d]` quantized with `layout`:
/// `[b, h, layout.groups(s)]`.
pub fn scales_shape(x: &Shape, layout: &GroupLayout) -> Shape {
    Shape::new([x[0], x[1], layout.groups(x[2])])
}
