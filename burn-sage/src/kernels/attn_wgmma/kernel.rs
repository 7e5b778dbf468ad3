//! The Hopper kernel's body: the loads by TMA, the K scales a tile ahead, and the tile loop (see
//! the module docs of [`super`] for its structure).

use core::f64::consts::{LN_2, LOG2_E as LOG2E};
use cubecl::ir::{ElemType, FastMath};
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;
use cubecl::wgmma::{Accumulator, Fragment, MatrixDescriptor, WARPGROUP_M};

use super::super::AttnArgs;
use super::super::attn_mma::BKV;
use super::super::attn_mma::stages::{lane_rows, write_output};
use super::super::common::{keys_end, kv_head};
use super::super::pv_grid::RoundArgs;
use super::softmax::{output_pair, probabilities, rescale, scores};
use super::{STAGES, WG, qk_layout, v_layout};

/// Loads the K and `Vᵀ` tiles of keys from `kv0` (K's rows from `k_row`, `Vᵀ`'s from `v_row`)
/// into one stage by TMA, completing `bar` with their bytes.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_kv<P: Float>(
    k_map: &TensorMap<i8, Tiled>,
    v_map: &TensorMap<P, Tiled>,
    k_dst: &mut [i8],
    v_dst: &mut [P],
    bar: &Shared<Barrier>,
    k_row: usize,
    v_row: usize,
    kv0: usize,
    #[comptime] dim: usize,
) {
    bar.tma_load_2d(k_map, k_dst, k_row as i32, 0i32);
    bar.tma_load_2d(v_map, v_dst, v_row as i32, kv0 as i32);
    // K: 1 byte a value; `Vᵀ`: 2.
    bar.arrive_and_expect_tx(1u32, comptime![(3 * BKV * dim) as u32]);
}

/// The K scales and scaled `ΔS` of the keys from `kv0`, into the scale slot starting at `slot`
/// (zeros past the end), one key per unit of the first [`BKV`].
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_scales(
    ks: &Tensor<f32>,
    ds: &Tensor<f32>,
    ks_sm: &mut Shared<[f32]>,
    ds_sm: &mut Shared<[f32]>,
    slot: usize,
    args: &AttnArgs,
    bhk: usize,
    ds_row: usize,
    kv0: usize,
    tid: usize,
    #[comptime] has_ds: bool,
    #[comptime] poly: bool,
) {
    if tid < BKV {
        let key = kv0 + tid;
        let mut x = f32::new(0.0);
        let mut y = f32::new(0.0);
        if key < args.skv {
            let kg = (key / args.k_block) * args.k_inter + (key % args.k_block) % args.k_inter;
            x = ks[bhk * args.k_groups + kg];
            if has_ds {
                y = ds[ds_row + key] * args.scale;
                if poly {
                    y *= f32::new(LOG2E);
                }
            }
        }
        ks_sm[slot + tid] = x;
        ds_sm[slot + tid] = y;
    }
}

/// Issues `A += P̃·V` for one tile: each 16-key step's `P̃` pairs as an A fragment in registers,
/// `Vᵀ` from the stage. Nothing waits here: the next tile's wait on its `Q·Kᵀ` covers it.
#[cube]
fn issue_pv<P: Float, N2: Size>(
    p: &Array<Vector<P, N2>>,
    v_desc: &MatrixDescriptor<P>,
    pv: &mut Pending<Accumulator<f32>>,
) {
    #[unroll]
    for kk in 0..comptime!(BKV / 16) {
        let mut frag = Fragment::<P>::new();
        #[unroll]
        for j in 0..8usize {
            frag.set(j, p[(kk * 8 + j) / 2].extract(j % 2));
        }
        pv.execute_registers(&frag, &v_desc.at(0usize, kk * 16));
    }
}

#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
pub(super) fn attn_wgmma_kernel<F: Float, P: Float, N2: Size>(
    q_map: &TensorMap<i8, Tiled>,
    k_map: &TensorMap<i8, Tiled>,
    v_map: &TensorMap<P, Tiled>,
    qs: &Tensor<f32>,
    ks: &Tensor<f32>,
    ds: &Tensor<f32>,
    post: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    args: AttnArgs,
    g: RoundArgs,
    tau: f32,
    #[comptime] dim: usize,
    #[comptime] causal: bool,
    #[comptime] has_ds: bool,
    #[comptime] write_lse: bool,
    #[comptime] native: bool,
    #[comptime] wgs: usize,
    #[comptime] poly: bool,
    #[define(F, P)] _dtypes: [ElemType; 2],
) {
    let bq = comptime!(wgs * WARPGROUP_M);
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
    let tid = UNIT_POS as usize;
    let (lane, plane) = (tid % 32, tid / 32);
    let t = lane % 4;
    let wg = tid / WG;
    let offset = args.skv - args.sq;

    let (k_stage, v_stage) = comptime!((BKV * dim, dim * BKV));
    let mut q_smem =
        Shared::<[i8]>::new_aligned_slice(comptime!(wgs * WARPGROUP_M * dim), 1024usize);
    let mut k_smem = Shared::<[i8]>::new_aligned_slice(comptime!(STAGES * BKV * dim), 1024usize);
    let mut v_smem = Shared::<[P]>::new_aligned_slice(comptime!(STAGES * dim * BKV), 1024usize);
    // Two slots of scales: tile `j` reads slot `j mod 2`, written during tile `j − 1`.
    let mut ks_sm = Shared::<[f32]>::new_slice(comptime!(2 * BKV));
    let mut ds_sm = Shared::<[f32]>::new_slice(comptime!(2 * BKV));
    let q_bar = Barrier::shared_uninit();
    let mut full = Sequence::<Shared<Barrier>>::new();
    #[unroll]
    for _ in 0..STAGES {
        full.push(Barrier::shared_uninit());
    }
    if UNIT_POS == 0 {
        q_bar.init_manual(1u32);
        #[unroll]
        for s in 0..STAGES {
            full.index(s).init_manual(1u32);
        }
    }
    sync_async_proxy_shared();
    sync_cube();

    let kv_end = keys_end(&args, q0, bq, causal);
    let tiles = (kv_end + BKV - 1) / BKV;
    let k_row0 = bhk * args.skv;
    let v_row = bhk * dim;
    // All the cube's rows share one Q mean block (the launch checks that blocks are whole
    // query tiles), so ΔS is one row per key tile.
    let ds_row = (bh * args.mean_blocks + q0 / args.mean_block) * args.skv;
    if UNIT_POS == 0 {
        q_bar.tma_load_2d(q_map, &mut q_smem, (bh * args.sq + q0) as i32, 0i32);
        q_bar.arrive_and_expect_tx(1u32, comptime!((wgs * WARPGROUP_M * dim) as u32));
        if tiles > 0 {
            load_kv::<P>(
                k_map,
                v_map,
                &mut k_smem[0..k_stage],
                &mut v_smem[0..v_stage],
                full.index(0),
                k_row0,
                v_row,
                0usize,
                dim,
            );
        }
    }
    // Tile 0's scales; the loop's first cube sync publishes them.
    load_scales(
        ks, ds, &mut ks_sm, &mut ds_sm, 0usize, &args, bhk, ds_row, 0usize, tid, has_ds, poly,
    );

    // The lane's two rows: `lane / 4` and `lane / 4 + 8` of its plane's 16.
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
    // In base 2 where `poly` (see `softmax`): the Q scales (and `ΔS`, `τ`) carry `log₂e`.
    let mut tau = tau;
    if poly {
        #[unroll]
        for v in 0..2usize {
            qsc[v] *= f32::new(LOG2E);
        }
        tau *= f32::new(LOG2E);
    }
    let mut m = Array::<f32>::new(2usize);
    let mut l = Array::<f32>::new(2usize);
    let mut mx = Array::<f32>::new(2usize);
    #[unroll]
    for v in 0..2usize {
        m[v] = f32::new(-1.0e30);
        l[v] = f32::new(0.0);
    }
    // The output is `o + A` (see `softmax`).
    let mut o = Array::<Vector<f32, N2>>::new(comptime!(dim / 4));
    #[unroll]
    for i in 0..comptime!(dim / 4) {
        o[i] = Vector::<f32, N2>::new(f32::new(0.0));
    }
    // `A`, for the whole row tile. Each tile waits on it and restarts it through a handle to
    // the same registers (a `Pending` cannot be reassigned in a loop).
    let pv = Accumulator::<f32>::new(dim).start();
    let mut sf = Array::<f32>::new(comptime!(BKV / 2));
    let mut p = Array::<Vector<P, N2>>::new(comptime!(BKV / 4));

    q_bar.wait_parity(0u32);
    let q_desc = MatrixDescriptor::new(&q_smem, comptime!(qk_layout(wgs * WARPGROUP_M, dim)));
    let rounds = (tiles + STAGES - 1) / STAGES;
    for round in 0..rounds {
        #[unroll]
        for st in 0..STAGES {
            let tile = round * STAGES + st;
            if tile < tiles {
                let kv0 = tile * BKV;
                // Every unit is done with tile `tile − 1`'s scales and, having waited on that
                // tile's `Q·Kᵀ`, with tile `tile − 2`'s stage, which the next load takes.
                sync_cube();
                if tile + 1 < tiles {
                    if UNIT_POS == 0 {
                        let next = comptime!((st + 1) % STAGES);
                        load_kv::<P>(
                            k_map,
                            v_map,
                            &mut k_smem[next * k_stage..(next + 1) * k_stage],
                            &mut v_smem[next * v_stage..(next + 1) * v_stage],
                            full.index(next),
                            k_row0 + kv0 + BKV,
                            v_row,
                            kv0 + BKV,
                            dim,
                        );
                    }
                    load_scales(
                        ks,
                        ds,
                        &mut ks_sm,
                        &mut ds_sm,
                        ((tile + 1) % 2) * BKV,
                        &args,
                        bhk,
                        ds_row,
                        kv0 + BKV,
                        tid,
                        has_ds,
                        poly,
                    );
                }
                full.index(st).wait_parity(round as u32 & 1);

                let k_desc = MatrixDescriptor::new(
                    &k_smem[st * k_stage..(st + 1) * k_stage],
                    comptime!(qk_layout(BKV, dim)),
                );
                let mut s_acc = Accumulator::<i32>::new(BKV).start();
                #[unroll]
                for step in 0..comptime!(dim / 32) {
                    s_acc.execute(
                        &q_desc.at(wg * 64, step * 32),
                        &k_desc.at(0usize, step * 32),
                    );
                }
                // Waits for every MMA of the unit: this `Q·Kᵀ` and the last tile's `P̃·V`.
                let s_acc = s_acc.wait();

                // Only tiles that cross the end of the keys or the causal diagonal of the
                // cube's first row need per-key masks.
                let mut full_tile = kv0 + BKV <= args.skv;
                if causal {
                    full_tile = full_tile && kv0 + BKV <= q0 + offset + 1;
                }
                let slot = (tile % 2) * BKV;
                if full_tile {
                    scores(
                        &s_acc, &mut sf, &mut mx, &ks_sm, &ds_sm, slot, &args, &qsc, &rows, &own,
                        kv0, t, false, causal, has_ds,
                    );
                } else {
                    scores(
                        &s_acc, &mut sf, &mut mx, &ks_sm, &ds_sm, slot, &args, &qsc, &rows, &own,
                        kv0, t, true, causal, has_ds,
                    );
                }
                let acc = pv.downcast::<f32>().wait();
                rescale::<N2>(
                    &mx, &mut m, &mut l, &mut o, &acc, &qsc, tau, has_ds, dim, poly,
                );
                if full_tile {
                    probabilities::<P, N2>(
                        &sf, &mut p, &m, &mut l, &qsc, &args, &g, false, has_ds, native, poly,
                    );
                } else {
                    probabilities::<P, N2>(
                        &sf, &mut p, &m, &mut l, &qsc, &args, &g, true, has_ds, native, poly,
                    );
                }
                let mut next = acc.start();
                let v_desc = MatrixDescriptor::new(
                    &v_smem[st * v_stage..(st + 1) * v_stage],
                    comptime!(v_layout(dim)),
                );
                issue_pv::<P, N2>(&p, &v_desc, &mut next);
            }
        }
    }

    let acc = pv.downcast::<f32>().wait();
    #[unroll]
    for i in 0..comptime!(dim / 4) {
        o[i] += output_pair::<N2>(&acc, i);
    }
    if poly {
        // The log-sum-exp is written in base e.
        #[unroll]
        for v in 0..2usize {
            m[v] *= f32::new(LN_2);
        }
    }
    write_output::<F, N2>(
        &o, &mut l, &m, out, lse, post, &args, &rows, &own, bh, bhk, t, dim, write_lse,
    );
}
