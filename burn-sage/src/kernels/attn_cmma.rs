//! The attention kernel on the matrix units (CUDA tensor cores through CubeCL's cmma).
//!
//! One cube per `(batch·q_head, tile of 16·PLANES queries)`, one plane (warp) per 16 query
//! rows. The plane's Q fragments (i8) and its output accumulators (f32) stay in registers for
//! the whole KV loop. For each tile of [`BKV`] keys:
//! 1. the cube loads the K tile (i8) and the V tile (already rounded to the PV grid, f16/bf16)
//!    into shared memory with 16-byte vector loads;
//! 2. each plane computes its `16 × BKV` block of `Q·Kᵀ` with i8·i8→i32 cmma into its own
//!    shared-memory rows;
//! 3. all 32 lanes of the plane run the online softmax, two lanes per row (one per half of the
//!    tile, combined with a shuffle), dequantizing with the folded scales (plus `ΔS`), and
//!    write `P̃ = exp(s − m)·p_scale` rounded to the PV grid;
//! 4. the plane accumulates `P̃·V` with f16/bf16 cmma into its register accumulators.
//!
//! The running maximum `m` used for `P̃` only moves when the tile's maximum exceeds it by
//! more than `tau` (0 for FP8 PV, whose grid saturates at 448; 8 for f16/bf16, where
//! `P̃ ≤ e⁸` loses nothing): rescaling the register accumulators goes through shared memory,
//! so skipping it is what keeps the loop on the matrix units. Rows that need it are rescaled
//! by `exp(m_old − m_new)` exactly as in the online softmax.
//!
//! Shared-memory reads by rows are skewed by lane (`(i + lane) mod 32`) so that 32 lanes
//! reading 32 rows hit 32 banks. Q and K tiles are stored chunk-major (`[d/16][rows][16]`)
//! so every cmma load starts on a 256-byte boundary, as the WMMA loads require. FP8 E4M3
//! values are exactly representable in f16, so the FP8 mode runs on the f16 units with E4M3
//! numerics (CubeCL 0.10's CUDA cmma has no e4m3 shape); its f32 accumulator is exact, so the
//! two-level accumulation the hardware FP8 path needs is not required here.
//!
//! The kernel body reads as those stages; each is a `#[cube]` function in `stages`
//! (inlined when the kernel is expanded, so the generated code is one kernel).

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::DType;
use burn_cubecl::{kernel::into_contiguous, tensor::CubeTensor};
use cubecl::prelude::*;

use super::common::{grid, keys_end, kv_head};
use super::pv_grid::{RoundArgs, round_v};
use super::{AttnArgs, MatrixLaunch, QuantizedInputs};
use crate::SagePlan;

mod stages;
use stages::*;

/// Keys per tile.
pub const BKV: usize = 64;
/// Planes (warps) per cube; each owns 16 query rows.
pub const PLANES: usize = 4;
/// i8 elements per vector load of K.
const K_VEC: usize = 16;
/// f16/bf16 elements per vector load of V.
const V_VEC: usize = 8;

#[cube(launch)]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
fn attn_cmma_kernel<F: Float, P: Float, NK: Size, NV: Size>(
    qi: &Tensor<i8>,
    ki: &Tensor<Vector<i8, NK>>,
    qs: &Tensor<f32>,
    ks: &Tensor<f32>,
    ds: &Tensor<f32>,
    v: &Tensor<Vector<P, NV>>,
    post: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    args: AttnArgs,
    g: RoundArgs,
    tau: f32,
    #[comptime] dim: usize,
    #[comptime] planes: usize,
    #[comptime] causal: bool,
    #[comptime] has_ds: bool,
    #[comptime] write_lse: bool,
    #[define(F, P)] _dtypes: [ElemType; 2],
) {
    let bq = planes * 16;
    let bkv = comptime!(BKV);
    let q_tiles = (args.sq + bq - 1) / bq;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    // Spare cubes of a two-dimensional grid (see `grid`) have no tile.
    if cube >= (args.rows / args.sq) * q_tiles {
        terminate!();
    }
    let bh = cube / q_tiles;
    let q0 = (cube % q_tiles) * bq;
    let bhk = kv_head(&args, bh);
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let tid = plane * 32 + lane;
    let offset = args.skv - args.sq;

    let mut k_sm = Shared::<[Vector<i8, NK>]>::new_aligned_slice(bkv * dim / K_VEC, 128usize);
    let mut v_sm = Shared::<[Vector<P, NV>]>::new_aligned_slice(bkv * dim / V_VEC, 128usize);
    let mut s_sm = Shared::<[i32]>::new_aligned_slice(bq * bkv, 128usize);
    let mut p_sm = Shared::<[P]>::new_aligned_slice(bq * bkv, 128usize);
    let mut o_sm = Shared::<[f32]>::new_aligned_slice(planes * 256, 128usize);
    let mut ks_sm = Shared::<[f32]>::new_slice(bkv);

    let qf = q_fragments(qi, &args, bh, q0, tid, plane, dim, planes);
    let mut of = zero_accumulators(dim);
    // Lanes r and r + 16 of each plane share query row `row.row`, one half of each tile each.
    let row = row_state(qs, &args, bh, q0, plane, lane);
    let mut m = f32::new(-1.0e30);
    let mut l = f32::new(0.0);
    let kv_end = keys_end(&args, q0, bq, causal);
    let s_plane = plane * 16 * bkv;

    // The next tile's K, V and K scales are loaded into registers while the current tile is
    // computed (the global-load latency hides behind the matrix work), then stored to shared
    // memory at the top of the next iteration.
    let mut kr = Array::<Vector<i8, NK>>::new(comptime!(BKV * (dim / K_VEC) / (planes * 32)));
    let mut vr = Array::<Vector<P, NV>>::new(comptime!(BKV * (dim / V_VEC) / (planes * 32)));
    let mut sc = f32::new(0.0);
    load_tile::<P, NK, NV>(
        ki, ks, v, &args, &mut kr, &mut vr, &mut sc, bhk, 0usize, tid, dim, planes,
    );

    let mut kv0 = 0usize;
    while kv0 < kv_end {
        sync_cube();
        store_tile::<P, NK, NV>(
            &mut k_sm, &mut v_sm, &mut ks_sm, &kr, &vr, sc, tid, dim, planes,
        );
        sync_cube();
        if kv0 + bkv < kv_end {
            load_tile::<P, NK, NV>(
                ki,
                ks,
                v,
                &args,
                &mut kr,
                &mut vr,
                &mut sc,
                bhk,
                kv0 + bkv,
                tid,
                dim,
                planes,
            );
        }
        scores_tile::<NK>(&qf, &k_sm, &mut s_sm, s_plane, dim);
        sync_plane();

        // Online softmax; only tiles that cross the end of the keys or the causal diagonal of
        // the cube's first row need per-key masks.
        let mut full = kv0 + bkv <= args.skv;
        if causal {
            full = full && kv0 + bkv <= q0 + offset + 1;
        }
        let st = online_softmax::<P>(
            &s_sm, &mut p_sm, &ks_sm, ds, &args, &g, tau, m, &row, kv0, lane, full, causal, has_ds,
        );
        m = st.m;
        l = l * st.alpha + st.sum;
        if plane_any(st.need) {
            rescale_accumulators(&mut of, &mut o_sm, st.alpha, plane * 256, lane, dim);
        }
        sync_plane();
        accumulate_pv::<P, NV>(&mut of, &p_sm, &v_sm, s_plane, dim);
        kv0 += bkv;
    }

    if write_lse && row.owner && lane < 16 {
        lse[bh * args.sq + row.row] = m + f32::ln(l);
    }
    write_output::<F>(
        &of,
        &mut o_sm,
        out,
        post,
        &args,
        l,
        bh,
        bhk,
        q0 + plane * 16,
        plane * 256,
        lane,
        dim,
    );
}

/// Launches the matrix-unit kernel. Quantized Q/K must be i8.
pub(crate) fn launch(
    x: QuantizedInputs,
    args: AttnArgs,
    plan: &SagePlan,
) -> (CubeTensor, Option<CubeTensor>) {
    let client = x.qi.client.clone();
    let [b, hq, sq, d] = x.qi.meta.shape().dims::<4>();
    let ml = MatrixLaunch::new(&x.qi, &x.qs, x.ds, plan);
    // V in FP16 mode is already in the PV format unless the input is f32.
    let v = if !ml.fp8 && x.v.dtype == ml.pv_dtype {
        into_contiguous(x.v)
    } else {
        round_v(x.v, ml.pv_dtype, ml.g, ml.fp8 || plan.dtype == DType::F32)
    };
    let dtypes = [
        dtype_to_storage_type(plan.dtype),
        dtype_to_storage_type(ml.pv_dtype),
    ];
    let cubes = b * hq * sq.div_ceil(PLANES * 16);
    attn_cmma_kernel::launch(
        &client,
        grid(&client, cubes),
        CubeDim::new_2d(32, PLANES as u32),
        K_VEC,
        V_VEC,
        into_contiguous(x.qi).into_tensor_arg(),
        into_contiguous(x.ki).into_tensor_arg(),
        x.qs.into_tensor_arg(),
        x.ks.into_tensor_arg(),
        ml.ds.clone().into_tensor_arg(),
        v.into_tensor_arg(),
        into_contiguous(x.post).into_tensor_arg(),
        ml.out.clone().into_tensor_arg(),
        ml.lse.clone().into_tensor_arg(),
        args.launch_arg(),
        ml.g.launch_arg(),
        ml.tau,
        d,
        PLANES,
        plan.opts.causal,
        ml.has_ds,
        ml.write_lse,
        dtypes,
    );
    ml.outputs()
}
