//! CubeCL kernels, one file per stage, each generic over the runtime:
//!
//! - [`quantize`]: smoothing (subtracting the prepared means) and group quantization to
//!   integers, one scale per group.
//! - [`attn_unit`]: the portable attention kernel (any runtime, lavapipe included).
//! - [`attn_cmma`]: the attention kernel on the matrix units: `QKᵀ` as i8·i8→i32 cmma,
//!   `P̃·V` as f16/bf16 cmma with f32 accumulation, scores staged in shared memory.
//! - [`attn_mma`]: the same on register-resident tiles (manual `mma.sync`, FlashAttention-2
//!   structure), for head dims 64 and 128.
//!
//! [`sage_forward`] runs the whole pipeline on `CubeBackend`; [`choose`] picks the register
//! kernel where the runtime has manual i8 and f16/bf16 MMA and the head dim is 64 or 128, the
//! cmma kernel where it has i8 and f16/bf16 cmma and the head dim is 64, 128 or 256, and the
//! portable kernel otherwise; [`crate::SageOptions::kernel`] can ask for one.

pub mod attn_cmma;
pub mod attn_mma;
pub mod attn_unit;
mod common;
pub mod quantize;

use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::{
    BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement,
    kernel::matmul::MatmulStrategy, ops::numeric::empty_device_contiguous_dtype,
    tensor::CubeTensor,
};
use cubecl::ir::{ElemType, FloatKind, IntKind, StorageType, features::MmaConfig};
use cubecl::prelude::*;

use crate::{SagePlan, Unsupported, prep::prepare_with};

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

    pub fn launch_arg<R: Runtime>(self) -> AttnArgsLaunch<R> {
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
pub(crate) fn dummy<R: CubeRuntime>(like: &CubeTensor<R>) -> CubeTensor<R> {
    empty_device_contiguous_dtype::<R>(
        like.client.clone(),
        like.device.clone(),
        Shape::new([1]),
        DType::F32,
    )
}

/// What both matrix-unit launchers allocate and derive from the plan before their launch.
pub(crate) struct MatrixLaunch<R: CubeRuntime> {
    /// `[b, hq, sq, d]` in the plan's dtype.
    pub out: CubeTensor<R>,
    /// `[b, hq, sq]` f32 when the plan asks for the LSE, else a dummy.
    pub lse: CubeTensor<R>,
    pub write_lse: bool,
    /// ΔS, contiguous, or a dummy.
    pub ds: CubeTensor<R>,
    pub has_ds: bool,
    /// f16, or bf16 for bf16 inputs.
    pub pv_dtype: DType,
    pub g: attn_cmma::RoundArgs,
    pub fp8: bool,
    /// How far a row maximum may move before the accumulators are rescaled: P̃ may grow to
    /// `e^tau` in between; FP8's grid saturates at 448, so it rescales always.
    pub tau: f32,
}

impl<R: CubeRuntime> MatrixLaunch<R> {
    pub fn new(
        qi: &CubeTensor<R>,
        qs: &CubeTensor<R>,
        ds: Option<CubeTensor<R>>,
        plan: &SagePlan,
    ) -> Self {
        let (client, device) = (qi.client.clone(), qi.device.clone());
        let [b, hq, sq, d] = qi.meta.shape().dims::<4>();
        let out = empty_device_contiguous_dtype::<R>(
            client.clone(),
            device.clone(),
            Shape::new([b, hq, sq, d]),
            plan.dtype,
        );
        let write_lse = plan.opts.return_lse;
        let lse = if write_lse {
            empty_device_contiguous_dtype::<R>(client, device, Shape::new([b, hq, sq]), DType::F32)
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
            g: attn_cmma::RoundArgs::new(plan.pv_grid()),
            fp8,
            tau: if fp8 { 0.0 } else { 8.0 },
        }
    }

    /// `(out, lse when asked for)`.
    pub fn outputs(self) -> (CubeTensor<R>, Option<CubeTensor<R>>) {
        (self.out, self.write_lse.then_some(self.lse))
    }
}

/// The integer dtype the runtime stores quantized values in: i8, else i32.
pub fn int_storage<R: CubeRuntime>(client: &ComputeClient<R>) -> Result<DType, Unsupported> {
    let props = client.properties();
    for dtype in [DType::I8, DType::I32] {
        let st: StorageType = dtype.into();
        if props.supports_type(st) {
            return Ok(dtype);
        }
    }
    Err(Unsupported::Dtype(DType::I8))
}

/// Whether the runtime has the cmma shapes the matrix-unit kernel uses for inputs in `dtype`.
pub fn cmma_support<R: CubeRuntime>(
    client: &ComputeClient<R>,
    dtype: DType,
) -> Result<(), Unsupported> {
    let props = client.properties();
    let has = |a: ElemType, cd: ElemType| {
        props.features.matmul.cmma.contains(&MmaConfig {
            a_type: a.into(),
            b_type: a.into(),
            cd_type: cd.into(),
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
}

/// The kernel [`sage_forward`] would pick for `plan` on this client.
pub fn choose<R: CubeRuntime>(
    client: &ComputeClient<R>,
    plan: &SagePlan,
) -> Result<KernelChoice, Unsupported> {
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
        Some(KernelChoice::Unit) => unit(),
        None if mma_dim && attn_mma::support(client, plan.dtype).is_ok() => Ok(KernelChoice::Mma),
        None if cmma_dim && cmma_support(client, plan.dtype).is_ok() => Ok(KernelChoice::Cmma),
        None => unit(),
    }
}

type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// `a · b` in f32 by cubek's default GEMM, without autotuning (see
/// [`crate::prep::prepare_with`]); Burn's autotuned matmul where that GEMM cannot launch.
fn fixed_matmul<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    a: Tensor<Cube<R, F, I, BT>, 4>,
    b: Tensor<Cube<R, F, I, BT>, 4>,
) -> Tensor<Cube<R, F, I, BT>, 4> {
    let (l, r) = (
        a.clone().into_primitive().tensor(),
        b.clone().into_primitive().tensor(),
    );
    match burn_cubecl::kernel::matmul::matmul(l, r, None, MatmulStrategy::Cube, DType::F32) {
        Ok(out) => Tensor::from_primitive(TensorPrimitive::Float(out)),
        Err(err) => {
            log::debug!("burn-sage: fixed GEMM unavailable for ΔS ({err:?}); autotuned matmul");
            a.matmul(b)
        }
    }
}

/// The whole pipeline on `CubeBackend` with a chosen kernel: shared tensor-op stages, the
/// quantization kernels, the attention kernel. Returns `(out, lse)`.
pub fn sage_forward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    plan: &SagePlan,
    choice: KernelChoice,
) -> Result<(CubeTensor<R>, Option<CubeTensor<R>>), Unsupported> {
    let client = q.client.clone();
    let int_dtype = match choice {
        KernelChoice::Cmma | KernelChoice::Mma => DType::I8,
        KernelChoice::Unit => int_storage(&client)?,
    };
    let t = |x: CubeTensor<R>| {
        Tensor::<Cube<R, F, I, BT>, 4>::from_primitive(TensorPrimitive::Float(x))
    };
    let prim = |x: Tensor<Cube<R, F, I, BT>, 4>| x.into_primitive().tensor();
    let (qt, kt, vt) = (t(q.clone()), t(k.clone()), t(v));
    let prep = prepare_with(&qt, &kt, &vt, plan, fixed_matmul::<R, F, I, BT>);
    let qk = plan.opts.qk;
    let (qi, qs) = quantize::quantize(
        q,
        prim(prep.q_mean.clone()),
        plan.q_mean_block(),
        qk.q_layout(),
        qk.qmax(),
        int_dtype,
    );
    let (ki, ks) = quantize::quantize(
        k,
        prim(prep.k_mean.clone()),
        plan.kv_len,
        qk.k_layout(),
        qk.qmax(),
        int_dtype,
    );
    let args = AttnArgs::new(plan, prep.q_mean.dims()[2]);
    let ds = prep.delta_s.map(prim);
    let (v, post) = (prim(prep.v), prim(prep.post));
    Ok(match choice {
        KernelChoice::Unit => attn_unit::launch(
            qi,
            ki,
            qs,
            ks,
            ds,
            v,
            post,
            args,
            plan.dtype,
            plan.head_dim,
            plan.opts.causal,
            plan.opts.return_lse,
        ),
        KernelChoice::Cmma => attn_cmma::launch(qi, ki, qs, ks, ds, v, post, args, plan),
        KernelChoice::Mma => attn_mma::launch(qi, ki, qs, ks, ds, v, post, args, plan),
    })
}
