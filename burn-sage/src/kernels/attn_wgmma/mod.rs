//! The attention kernel on Hopper's warpgroup MMA (`wgmma`), its tiles loaded by the tensor
//! memory accelerator (TMA): issue 32's plan (`notes/hopper-plan.md`), steps 1 and 2.
//!
//! One cube per `(batch·q_head, tile of 64 queries per warpgroup)`, [`warpgroups`] (1 or 2)
//! warpgroups of 128 units, each owning 64 query rows; tiles of [`BKV`] = 64 keys in a ring of
//! [`STAGES`] stages ([`kernel`] is the body, [`softmax`] the arithmetic on the registers):
//!
//! - Q (i8, `[128, d]`) is loaded once by TMA; K (i8, `[64, d]`) and `Vᵀ` (the PV dtype,
//!   `[d, 64]`, keys contiguous, padded and rounded to the PV grid by `v_transposed`) by TMA into
//!   the stage, one tile ahead of the one computed, each stage guarded by a barrier the TMA
//!   bytes complete. Unit 0 issues the loads. The K scales and `ΔS` of the next tile go to the
//!   other of two shared slots, so one cube sync a tile orders everything.
//! - `S = Q·Kᵀ`: `wgmma m64n64k32` i8·i8→i32, both operands in shared memory (K-major,
//!   swizzled). The accumulator's layout is the `mma.sync` one per 16 rows, so the online
//!   softmax reads it as `attn_mma`'s does (the folded scales, `ΔS`, the masks, the lazy
//!   rescale by `tau`, `P̃` rounded to the PV grid), with fewer instructions a score.
//! - `A += P̃·V`: `wgmma m64n{d}k16` f16/bf16→f32 with `P̃` in registers (the S accumulator of
//!   two 8-key blocks is the A fragment of one 16-key step) and `Vᵀ` from shared memory, into
//!   one accumulator for the whole row tile. It is not waited on: it runs while the next
//!   tile's sync, loads and `Q·Kᵀ` are issued. A warpgroup accumulator cannot be rescaled in
//!   place, so a row whose maximum moves rescales the f32 registers `o` beside it instead
//!   (the output is `o + A`, see [`softmax`]).
//!
//! What this kernel leaves out (the plan's later steps): a producer warp and barriers per
//! stage instead of a cube sync per tile, FP8 `P̃·V` on the tensor cores, register
//! reallocation between warpgroups. (A version that issued the next tile's `Q·Kᵀ` under this
//! tile's exponentials, branch `wgmma-v3`, ran 10% more instructions and was no faster.) It is
//! one of the kernels [`super::tune`] times, and can be asked for by name
//! ([`crate::SageOptions::kernel`]).

mod kernel;
#[cfg(feature = "ptx-dump")]
pub mod offline;
mod softmax;

use burn::tensor::DType;
use burn_cubecl::{kernel::into_contiguous, tensor::CubeTensor};
use cubecl::features::{Tma, WgmmaElems};
use cubecl::ir::{ElemType, FloatKind, IntKind, types::MatrixShape};
use cubecl::prelude::*;
use cubecl::wgmma::{Major, Swizzle, WARPGROUP_M, WgmmaTileLayout};
use cubecl::zspace::{Shape, Strides};

use super::attn_mma::BKV;
use super::common::grid;
use super::pv_grid::v_transposed;
use super::{AttnArgs, MatrixLaunch, QuantizedInputs};
use crate::{SagePlan, Unsupported};

/// Warpgroups (of 64 query rows each) per cube: `BURN_SAGE_WGMMA_WARPGROUPS` (1 or 2) where set,
/// else 2 (a K/`Vᵀ` tile feeds 128 rows). One warpgroup per cube lets two cubes share an SM, so
/// one's softmax can overlap the other's MMAs: measured side by side to choose the default.
/// Read once per process (not on every launch).
pub fn warpgroups() -> usize {
    static WARPGROUPS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *WARPGROUPS.get_or_init(
        || match std::env::var("BURN_SAGE_WGMMA_WARPGROUPS").as_deref() {
            Ok("1") => 1,
            _ => 2,
        },
    )
}
/// Whether the softmax takes its exponentials in base 2 by a polynomial on the FMA pipe
/// ([`super::fast_exp::exp2_poly`]): `BURN_SAGE_WGMMA_EXP=poly`. Otherwise `f32::exp`
/// (libdevice's `expf`), the default until the degree-4 polynomial has passed
/// `wgmma_kernel_matches_reference` on a GPU (degree 3 was 1.3–1.7% faster on an H100 at
/// N = 16K but put the log-sum-exp 7·10⁻⁵ off). Read once per process.
pub fn poly_exp() -> bool {
    static POLY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *POLY.get_or_init(|| std::env::var("BURN_SAGE_WGMMA_EXP").as_deref() == Ok("poly"))
}
/// Stages of the K/`Vᵀ` ring: three, so that the load of tile `j + 1`, issued at the start of
/// tile `j`, takes the stage of tile `j − 2`, whose `P̃·V` every unit has waited on (it runs on
/// while tile `j − 1`'s scores are computed).
pub const STAGES: usize = 3;
/// Units of a warpgroup.
const WG: usize = 128;

/// The shared-memory layout of an i8 tile of `rows` rows of `dim` channels (K-major, one
/// swizzle panel as wide as a row: 128 bytes for d = 128, 64 for d = 64).
fn qk_layout(rows: usize, dim: usize) -> WgmmaTileLayout {
    WgmmaTileLayout {
        major: Major::K,
        swizzle: if dim >= 128 {
            Swizzle::B128
        } else {
            Swizzle::B64
        },
        rows,
        k: dim,
    }
}

/// The layout of a `Vᵀ` tile: `dim` rows of [`BKV`] keys of a 16-bit dtype (128 bytes).
fn v_layout(dim: usize) -> WgmmaTileLayout {
    WgmmaTileLayout {
        major: Major::K,
        swizzle: Swizzle::B128,
        rows: dim,
        k: BKV,
    }
}

/// The PV product's element for inputs of `dtype`: bf16 for bf16, f16 otherwise.
fn pv_elem(dtype: DType) -> ElemType {
    match dtype {
        DType::BF16 => ElemType::Float(FloatKind::BF16),
        _ => ElemType::Float(FloatKind::F16),
    }
}

/// Whether the runtime has what this kernel uses for inputs in `dtype` and head dim `dim`: TMA
/// and the warpgroup MMAs i8·i8→i32 (n = 64) and f16/bf16→f32 (n = `dim`) — Hopper (sm_90a).
pub fn support(client: &Client, dtype: DType, dim: usize) -> Result<(), Unsupported> {
    let features = &client.properties().features;
    if !features.tma.contains(Tma::Base) {
        return Err(Unsupported::MatrixUnits("tensor memory accelerator (TMA)"));
    }
    let has = |a: ElemType, cd: ElemType, n: usize, k: usize| {
        let elems = WgmmaElems { a, b: a, cd };
        let shape = MatrixShape {
            m: WARPGROUP_M,
            n,
            k,
        };
        features
            .matmul
            .wgmma
            .iter()
            .any(|c| c.matches(elems, shape))
    };
    if !has(
        ElemType::Int(IntKind::I8),
        ElemType::Int(IntKind::I32),
        BKV,
        32,
    ) {
        return Err(Unsupported::MatrixUnits("warpgroup MMA i8·i8→i32"));
    }
    if !has(pv_elem(dtype), ElemType::Float(FloatKind::F32), dim, 16) {
        return Err(Unsupported::MatrixUnits("warpgroup MMA f16/bf16→f32"));
    }
    Ok(())
}

/// A TMA map of contiguous `t` read as `[rows, cols]`, in boxes of `[box_rows, box_cols]`
/// laid out as `layout` says.
fn tma_map(
    t: &CubeTensor,
    [rows, cols]: [usize; 2],
    [box_rows, box_cols]: [usize; 2],
    elem: ElemType,
    layout: WgmmaTileLayout,
) -> TensorMapArg<Tiled> {
    let mut binding = t.clone().binding();
    binding.shape = Shape::new([rows, cols]);
    binding.strides = Strides::new(&[cols, 1]);
    TensorMapArg::new(
        TiledArgs {
            tile_size: Shape::new([box_rows, box_cols]),
        },
        binding.into_tensor_arg(),
        elem,
    )
    .with_swizzle(layout.tensor_map_swizzle())
}

/// Launches the warpgroup-MMA kernel (head dims 64 and 128; [`support`] checked). Quantized
/// Q/K must be i8.
pub(crate) fn launch(
    x: QuantizedInputs,
    args: AttnArgs,
    plan: &SagePlan,
) -> (CubeTensor, Option<CubeTensor>) {
    let client = x.qi.client.clone();
    let [b, hq, sq, d] = x.qi.meta.shape().dims::<4>();
    let hkv = x.ki.meta.shape().dims::<4>()[1];
    let skv = plan.kv_len;
    let ml = MatrixLaunch::new(&x.qi, &x.qs, x.ds, plan);
    let skv_pad = skv.div_ceil(BKV) * BKV;
    let vt = v_transposed(
        x.v,
        ml.pv_dtype,
        ml.g,
        ml.fp8 || plan.dtype == DType::F32,
        skv_pad,
    );
    // As in `attn_mma`: where the PV grid is the PV dtype itself, the conversion rounds `P̃`
    // (and `p_scale` is 1, which the kernel then leaves out).
    let native = !ml.fp8;
    debug_assert!(!native || args.p_scale == 1.0);
    let i8 = ElemType::Int(IntKind::I8);
    let (qi, ki) = (into_contiguous(x.qi), into_contiguous(x.ki));
    let wgs = warpgroups();
    let bq = wgs * WARPGROUP_M;
    let q_map = tma_map(&qi, [b * hq * sq, d], [bq, d], i8, qk_layout(bq, d));
    let k_map = tma_map(&ki, [b * hkv * skv, d], [BKV, d], i8, qk_layout(BKV, d));
    let v_map = tma_map(
        &vt,
        [b * hkv * d, skv_pad],
        [d, BKV],
        pv_elem(plan.dtype),
        v_layout(d),
    );
    let dtypes = [
        burn::backend::cubecl::dtype_to_storage_type(plan.dtype),
        burn::backend::cubecl::dtype_to_storage_type(ml.pv_dtype),
    ];
    let cubes = b * hq * sq.div_ceil(bq);
    let mean_block = plan.q_mean_block();
    assert!(
        mean_block.is_multiple_of(bq) || mean_block >= sq,
        "Q mean blocks of {mean_block} rows are not whole query tiles"
    );
    // SAFETY: TMA reads only inside the maps (zeros past their ends; rows of a neighbouring head
    // are masked or never written); scales and ΔS are read at indices the plan's group layouts
    // bound, keys below `skv`; shared memory within its declared sizes; outputs only for rows
    // below `sq`.
    unsafe {
        kernel::attn_wgmma_kernel::launch_unchecked(
            &client,
            grid(&client, cubes),
            CubeDim::new_1d((wgs * WG) as u32),
            2,
            q_map,
            k_map,
            v_map,
            x.qs.into_tensor_arg(),
            x.ks.into_tensor_arg(),
            ml.ds.clone().into_tensor_arg(),
            into_contiguous(x.post).into_tensor_arg(),
            ml.out.clone().into_tensor_arg(),
            ml.lse.clone().into_tensor_arg(),
            args.launch_arg(),
            ml.g.launch_arg(),
            ml.tau,
            d,
            plan.opts.causal,
            ml.has_ds,
            ml.write_lse,
            native,
            wgs,
            poly_exp(),
            dtypes,
        );
    }
    ml.outputs()
}
