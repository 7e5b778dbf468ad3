//! The attention kernel on the matrix units with register-resident tiles (CUDA `mma.sync`
//! through CubeCL's manual MMA): the FlashAttention-2 structure with Sage's quantization.
//!
//! One cube per `(batch·q_head, tile of 16·PLANES queries)`, one plane (warp) per 16 query
//! rows; tiles of [`BKV`] keys. Unlike [`super::attn_cmma`], whose WMMA fragments are opaque
//! and send every score tile through shared memory, the fragment layouts here are the PTX
//! ones (`MmaDefinition::position_of_nth` describes them), so a lane knows which scores it
//! holds and the tile never leaves registers:
//!
//! - `S = Q·Kᵀ`: `mma.m16n8k32` i8·i8→i32. Lane `l` holds rows `l/4` and `l/4 + 8` and, in
//!   each 8-key block, keys `2·(l mod 4)` and `+1`. Q fragments are read once from global
//!   memory; K fragments are 32-bit words of a padded shared-memory tile (row stride
//!   `d/4 + 4` words, so the 8 rows of one fragment load hit 8 distinct bank groups).
//! - The online softmax works on those registers: dequantize with the folded scales (plus
//!   `ΔS`), row maxima over the 4 lanes of a quad with two shuffles, `exp`, row sums kept per
//!   lane and reduced once at the end, `P̃` rounded to the PV grid.
//! - `O += P̃·V`: `mma.m16n8k16` f16/bf16→f32. The accumulator layout of two adjacent 8-key
//!   blocks of `S` is exactly the A-operand layout of one 16-key step, so `P̃` goes from the
//!   softmax straight into the next product. V is read transposed (`Vᵀ`, keys contiguous,
//!   padded to whole tiles with zeros, rounded to the PV grid once by `v_transposed`), so its
//!   B-operand words are contiguous pairs of keys.
//! - Rescaling the output rows when a maximum moves by more than `tau` is a multiply of the
//!   lane's own accumulator registers.
//!
//! The next tile's K, V and K scales are loaded into registers while the current one is
//! computed. Causal problems schedule their longest query tiles first. The launch is
//! unchecked: every index is in bounds by construction (Q rows past the end read nothing,
//! keys past the end read zeros, `Vᵀ` is padded).
//!
//! The kernel body reads as those stages; each is a `#[cube]` function in `stages`
//! (inlined when the kernel is expanded, so the generated code is one kernel).

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::DType;
use burn_cubecl::{kernel::into_contiguous, tensor::CubeTensor};
use cubecl::ir::{ElemType, FastMath, FloatKind, IntKind, features::MmaConfig};
use cubecl::prelude::*;

use super::common::{grid, keys_end, kv_head};
use super::pv_grid::{RoundArgs, v_transposed};
use super::{AttnArgs, MatrixLaunch, QuantizedInputs};
use crate::{SagePlan, Unsupported};

pub(crate) mod stages;
use stages::*;

/// Keys per tile.
pub const BKV: usize = 64;
/// Planes (warps) per cube; each owns 16 query rows. Measured on an H100 (N = 8192, D = 128,
/// 2026-11-25): 8 planes 24.6 ms, 4 planes 29.9 ms (a K/V tile feeds twice the rows); loading
/// the next tile into registers during the current one saves 4% at 8 planes (25.7 ms without).
/// At 237 registers a thread one cube of 8 planes fits an SM.
pub const PLANES: usize = 8;

/// Whether the runtime has the manual MMA shapes this kernel uses for inputs in `dtype`.
pub fn support(client: &Client, dtype: DType) -> Result<(), Unsupported> {
    let props = client.properties();
    let has = |a: ElemType, cd: ElemType, k: u32| {
        props.features.matmul.mma.contains(&MmaConfig {
            a_type: a,
            b_type: a,
            cd_type: cd,
            m: 16,
            n: 8,
            k,
        })
    };
    if !has(ElemType::Int(IntKind::I8), ElemType::Int(IntKind::I32), 32) {
        return Err(Unsupported::ManualMma("i8·i8→i32 16×8×32"));
    }
    let pv = match dtype {
        DType::BF16 => ElemType::Float(FloatKind::BF16),
        _ => ElemType::Float(FloatKind::F16),
    };
    if !has(pv, ElemType::Float(FloatKind::F32), 16) {
        return Err(Unsupported::ManualMma("f16/bf16→f32 16×8×16"));
    }
    Ok(())
}

#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
fn attn_mma_kernel<F: Float, P: Float, N2: Size, N4: Size, N8: Size, N16: Size>(
    qi: &Tensor<Vector<i8, N4>>,
    ki: &Tensor<Vector<i8, N16>>,
    qs: &Tensor<f32>,
    ks: &Tensor<f32>,
    ds: &Tensor<f32>,
    vt: &Tensor<Vector<P, N8>>,
    post: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    args: AttnArgs,
    g: RoundArgs,
    tau: f32,
    skv_pad: usize,
    #[comptime] dim: usize,
    #[comptime] causal: bool,
    #[comptime] has_ds: bool,
    #[comptime] write_lse: bool,
    #[comptime] native: bool,
    #[comptime] planes: usize,
    #[define(F, P)] _dtypes: [ElemType; 2],
) {
    let bq = comptime!(planes * 16);
    let threads = comptime!(planes * 32);
    let bkv = comptime!(BKV);
    let q_tiles = (args.sq + bq - 1) / bq;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    // Spare cubes of a two-dimensional grid (see `grid`) have no tile.
    if cube >= (args.rows / args.sq) * q_tiles {
        terminate!();
    }
    let bh = cube / q_tiles;
    // Longest tiles first: with a causal mask the last query tiles see the most keys.
    let q0 = (q_tiles - 1 - cube % q_tiles) * bq;
    let bhk = kv_head(&args, bh);
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let tid = plane * 32 + lane;
    let t = lane % 4;
    let offset = args.skv - args.sq;

    // Shared-memory rows padded by 16 bytes: the 8 rows one fragment load touches start in 8
    // distinct groups of 4 banks.
    let mut k_sm =
        Shared::<[Vector<i8, N4>]>::new_aligned_slice(comptime!(BKV * (dim / 4 + 4)), 16usize);
    let mut v_sm =
        Shared::<[Vector<P, N2>]>::new_aligned_slice(comptime!(dim * (BKV / 2 + 4)), 16usize);
    let mut ks_sm = Shared::<[f32]>::new_slice(bkv);
    let mut ds_sm = Shared::<[f32]>::new_slice(bkv);

    // The lane's two rows: `lane / 4` and `lane / 4 + 8` of the plane's 16.
    let mut rows = Array::<usize>::new(2usize);
    let mut own = Array::<bool>::new(2usize);
    let mut qsc = Array::<f32>::new(2usize);
    lane_rows(
        qs,
        &args,
        bh,
        q0 + plane * 16 + lane / 4,
        &mut rows,
        &mut own,
        &mut qsc,
    );
    let mut m = Array::<f32>::new(2usize);
    let mut l = Array::<f32>::new(2usize);
    let mut mx = Array::<f32>::new(2usize);
    #[unroll]
    for v in 0..2usize {
        m[v] = f32::new(-1.0e30);
        l[v] = f32::new(0.0);
    }
    let mut qf = Array::<Vector<i8, N4>>::new(comptime!(dim / 8));
    q_fragments::<N4>(qi, &args, bh, &rows, t, &mut qf, dim);
    let mut o = Array::<Vector<f32, N2>>::new(comptime!(dim / 4));
    #[unroll]
    for i in 0..comptime!(dim / 4) {
        o[i] = Vector::<f32, N2>::new(f32::new(0.0));
    }

    let mut kr = Array::<Vector<i8, N16>>::new(comptime!(BKV * dim / 16 / threads));
    let mut vr = Array::<Vector<P, N8>>::new(comptime!(dim * BKV / 8 / threads));
    let mut sc = f32::new(0.0);
    let mut dsv = f32::new(0.0);
    // All the cube's rows share one Q mean block (the launch checks that blocks are whole
    // query tiles), so ΔS is one row per key tile.
    let ds_row = (bh * args.mean_blocks + q0 / args.mean_block) * args.skv;
    load_tile::<P, N8, N16>(
        ki, ks, ds, vt, &args, &mut kr, &mut vr, &mut sc, &mut dsv, bhk, ds_row, 0usize, skv_pad,
        tid, dim, threads, has_ds,
    );

    let kv_end = keys_end(&args, q0, bq, causal);

    let mut s = Array::<Vector<i32, N2>>::new(comptime!(BKV / 4));
    let mut sf = Array::<f32>::new(comptime!(BKV / 2));
    let mut p = Array::<Vector<P, N2>>::new(comptime!(BKV / 4));

    let mut kv0 = 0usize;
    while kv0 < kv_end {
        sync_cube();
        store_tile::<P, N2, N4, N8, N16>(
            &mut k_sm, &mut v_sm, &mut ks_sm, &mut ds_sm, &kr, &vr, sc, dsv, tid, dim, threads,
            has_ds,
        );
        sync_cube();
        if kv0 + bkv < kv_end {
            load_tile::<P, N8, N16>(
                ki,
                ks,
                ds,
                vt,
                &args,
                &mut kr,
                &mut vr,
                &mut sc,
                &mut dsv,
                bhk,
                ds_row,
                kv0 + bkv,
                skv_pad,
                tid,
                dim,
                threads,
                has_ds,
            );
        }
        qk_tile::<N2, N4>(&qf, &k_sm, &mut s, lane, dim);

        // Online softmax; only tiles that cross the end of the keys or the causal diagonal of
        // the cube's first row need per-key masks.
        let mut full = kv0 + bkv <= args.skv;
        if causal {
            full = full && kv0 + bkv <= q0 + offset + 1;
        }
        online_softmax::<P, N2>(
            &s, &mut sf, &mut mx, &mut p, &mut m, &mut l, &mut o, &ks_sm, &ds_sm, &args, &g, &qsc,
            &rows, &own, kv0, t, tau, full, causal, has_ds, native, dim,
        );
        accumulate_pv::<P, N2>(&p, &v_sm, &mut o, lane, dim);
        kv0 += bkv;
    }

    write_output::<F, N2>(
        &o, &mut l, &m, out, lse, post, &args, &rows, &own, bh, bhk, t, dim, write_lse,
    );
}

/// Launches the register-tile kernel (head dims 64 and 128). Quantized Q/K must be i8.
pub(crate) fn launch(
    x: QuantizedInputs,
    args: AttnArgs,
    plan: &SagePlan,
) -> (CubeTensor, Option<CubeTensor>) {
    let client = x.qi.client.clone();
    let [b, hq, sq, d] = x.qi.meta.shape().dims::<4>();
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
    // Where the PV grid is the PV dtype itself, P̃ is rounded by the conversion (nearest, ties
    // to even: it differs from the reference's ties-away rounding by one unit in the last place,
    // at exact ties only).
    let native = !ml.fp8;
    let dtypes = [
        dtype_to_storage_type(plan.dtype),
        dtype_to_storage_type(ml.pv_dtype),
    ];
    let planes = PLANES;
    let cubes = b * hq * sq.div_ceil(planes * 16);
    // The kernel reads ΔS for one Q mean block per cube.
    let mean_block = plan.q_mean_block();
    assert!(
        mean_block.is_multiple_of(planes * 16) || mean_block >= sq,
        "Q mean blocks of {mean_block} rows are not whole query tiles"
    );
    // SAFETY: Q rows are read only below `sq`, K keys only below `skv`, `Vᵀ` up to its padded
    // length, scales and ΔS at indices the plan's group layouts bound, shared memory within its
    // declared sizes, outputs only for rows below `sq`.
    unsafe {
        attn_mma_kernel::launch_unchecked(
            &client,
            grid(&client, cubes),
            CubeDim::new_2d(32, planes as u32),
            2,
            4,
            8,
            16,
            into_contiguous(x.qi).into_tensor_arg(),
            into_contiguous(x.ki).into_tensor_arg(),
            x.qs.into_tensor_arg(),
            x.ks.into_tensor_arg(),
            ml.ds.clone().into_tensor_arg(),
            vt.into_tensor_arg(),
            into_contiguous(x.post).into_tensor_arg(),
            ml.out.clone().into_tensor_arg(),
            ml.lse.clone().into_tensor_arg(),
            args.launch_arg(),
            ml.g.launch_arg(),
            ml.tau,
            skv_pad,
            d,
            plan.opts.causal,
            ml.has_ds,
            ml.write_lse,
            native,
            planes,
            dtypes,
        );
    }
    ml.outputs()
}
