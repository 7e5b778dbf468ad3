//! The Hopper kernel's body: the loads by TMA, the K scales a tile ahead, and the tile loop (see
//! the module docs of [`super`] for its structure).

use cubecl::ir::{ElemType, FastMath};
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;
use cubecl::wgmma::{Accumulator, Fragment, MatrixDescriptor, WARPGROUP_M};

use super::super::AttnArgs;
use super::super::attn_mma::BKV;
use super::super::attn_mma::stages::{lane_rows, write_output};
use super::super::common::{keys_end, kv_head};
use super::super::pv_grid::RoundArgs;
use super::softmax::{maxima, output_pair, probabilities, rescale_output, scores};
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

/// Reads the K scale and scaled `ΔS` of key `kv0 + tid` (zeros past the end) into `x` and `y`,
/// for the first [`BKV`] units: a tile ahead of [`store_scales`], so the load's latency
/// passes while a tile is computed.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fetch_scales(
    ks: &Tensor<f32>,
    ds: &Tensor<f32>,
    x: &mut f32,
    y: &mut f32,
    args: &AttnArgs,
    bhk: usize,
    ds_row: usize,
    kv0: usize,
    tid: usize,
    #[comptime] has_ds: bool,
) {
    *x = f32::new(0.0);
    *y = f32::new(0.0);
    let key = kv0 + tid;
    if tid < BKV && key < args.skv {
        let kg = (key / args.k_block) * args.k_inter + (key % args.k_block) % args.k_inter;
        *x = ks[bhk * args.k_groups + kg];
        if has_ds {
            *y = ds[ds_row + key] * args.scale;
        }
    }
}

/// Stores what [`fetch_scales`] read into the scale slot starting at `slot`.
#[cube]
fn store_scales(
    ks_sm: &mut Shared<[f32]>,
    ds_sm: &mut Shared<[f32]>,
    x: f32,
    y: f32,
    slot: usize,
    tid: usize,
) {
    if tid < BKV {
        ks_sm[slot + tid] = x;
        ds_sm[slot + tid] = y;
    }
}

/// Issues the loads of tile `tile` into its stage (`tile mod STAGES`) by TMA (unit 0).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_tile<P: Float>(
    k_map: &TensorMap<i8, Tiled>,
    v_map: &TensorMap<P, Tiled>,
    k_smem: &mut Shared<[i8]>,
    v_smem: &mut Shared<[P]>,
    full: &Sequence<Shared<Barrier>>,
    tile: usize,
    k_row0: usize,
    v_row: usize,
    #[comptime] dim: usize,
) {
    let (k_stage, v_stage) = comptime!((BKV * dim, dim * BKV));
    let st = tile % STAGES;
    #[unroll]
    for s in 0..STAGES {
        if st == s {
            load_kv::<P>(
                k_map,
                v_map,
                &mut k_smem[s * k_stage..(s + 1) * k_stage],
                &mut v_smem[s * v_stage..(s + 1) * v_stage],
                full.index(s),
                k_row0 + tile * BKV,
                v_row,
                tile * BKV,
                dim,
            );
        }
    }
}

/// Waits until tile `tile`'s stage holds it.
#[cube]
fn wait_tile(full: &Sequence<Shared<Barrier>>, tile: usize) {
    let st = tile % STAGES;
    let parity = ((tile / STAGES) & 1) as u32;
    #[unroll]
    for s in 0..STAGES {
        if st == s {
            full.index(s).wait_parity(parity);
        }
    }
}

/// Issues `S = Q·Kᵀ` of tile `tile` for warpgroup `wg` into a fresh accumulator.
#[cube]
fn issue_qk(
    q_desc: &MatrixDescriptor<i8>,
    k_smem: &Shared<[i8]>,
    tile: usize,
    wg: usize,
    #[comptime] dim: usize,
) -> Pending<Accumulator<i32>> {
    let k_stage = comptime!(BKV * dim);
    let st = tile % STAGES;
    let k_desc = MatrixDescriptor::new(
        &k_smem[st * k_stage..(st + 1) * k_stage],
        comptime!(qk_layout(BKV, dim)),
    );
    let mut acc = Accumulator::<i32>::new(BKV).start();
    #[unroll]
    for step in 0..comptime!(dim / 32) {
        acc.execute(
            &q_desc.at(wg * 64, step * 32),
            &k_desc.at(0usize, step * 32),
        );
    }
    acc
}

/// `1.5·2²³`: a float whose ulp is 1, so adding an integer `x` with `|x| < 2²²` (every i8·i8
/// dot product of up to 256 channels) to its bits adds `x` to its value.
const MAGIC: f32 = 12_582_912.0;
/// The bits of [`MAGIC`].
const MAGIC_BITS: i32 = 0x4B40_0000;

/// Copies a waited S accumulator into the registers the next tile's scores read, as f32 (exact:
/// the dot products are below 2²⁴). With `magic` each conversion is an integer add and a float
/// subtract on the full-rate pipes (see [`MAGIC`]) instead of one conversion instruction, which
/// Hopper issues at a quarter of their rate.
#[cube]
fn keep_scores(acc: &Accumulator<i32>, s: &mut Array<f32>, #[comptime] magic: bool) {
    #[unroll]
    for i in 0..comptime!(BKV / 2) {
        if magic {
            s[i] = f32::reinterpret(acc.get(i) + MAGIC_BITS) - MAGIC;
        } else {
            s[i] = f32::cast_from(acc.get(i));
        }
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
    #[comptime] magic: bool,
    #[define(F, P)] _dtypes: [ElemType; 2],
) {
    let bq = comptime!(wgs * WARPGROUP_M);
    let units = comptime!(wgs * WG);
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

    let v_stage = comptime!(dim * BKV);
    let mut q_smem =
        Shared::<[i8]>::new_aligned_slice(comptime!(wgs * WARPGROUP_M * dim), 1024usize);
    let mut k_smem = Shared::<[i8]>::new_aligned_slice(comptime!(STAGES * BKV * dim), 1024usize);
    let mut v_smem = Shared::<[P]>::new_aligned_slice(comptime!(STAGES * dim * BKV), 1024usize);
    // Two slots of scales: tile `j` reads slot `j mod 2`, stored during tile `j − 1`.
    let mut ks_sm = Shared::<[f32]>::new_slice(comptime!(2 * BKV));
    let mut ds_sm = Shared::<[f32]>::new_slice(comptime!(2 * BKV));
    // The output's `o` (see `softmax`): each unit's pairs in its own slots.
    let mut o_sm = Shared::<[Vector<f32, N2>]>::new_slice(comptime!(units * dim / 4));
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
    // Tiles are loaded two ahead of the one whose scores are computed (its successor's `Q·Kᵀ`
    // is issued during it).
    if UNIT_POS == 0 {
        q_bar.tma_load_2d(q_map, &mut q_smem, (bh * args.sq + q0) as i32, 0i32);
        q_bar.arrive_and_expect_tx(1u32, comptime!((wgs * WARPGROUP_M * dim) as u32));
        #[unroll]
        for tile in 0..2usize {
            if tile < tiles {
                load_tile::<P>(
                    k_map,
                    v_map,
                    &mut k_smem,
                    &mut v_smem,
                    &full,
                    tile,
                    k_row0,
                    v_row,
                    dim,
                );
            }
        }
    }
    // Tile 0's scales into slot 0 (the loop's first cube sync publishes them), tile 1's read.
    let mut ksr = f32::new(0.0);
    let mut dsr = f32::new(0.0);
    fetch_scales(
        ks, ds, &mut ksr, &mut dsr, &args, bhk, ds_row, 0usize, tid, has_ds,
    );
    store_scales(&mut ks_sm, &mut ds_sm, ksr, dsr, 0usize, tid);
    fetch_scales(
        ks, ds, &mut ksr, &mut dsr, &args, bhk, ds_row, BKV, tid, has_ds,
    );
    #[unroll]
    for i in 0..comptime!(dim / 4) {
        o_sm[i * units + tid] = Vector::<f32, N2>::new(f32::new(0.0));
    }

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
    let mut m = Array::<f32>::new(2usize);
    let mut l = Array::<f32>::new(2usize);
    let mut mx = Array::<f32>::new(2usize);
    let mut alpha = Array::<f32>::new(2usize);
    #[unroll]
    for v in 0..2usize {
        m[v] = f32::new(-1.0e30);
        l[v] = f32::new(0.0);
    }
    // `A`, for the whole row tile. Each tile waits on it and restarts it through a handle to
    // the same registers (a `Pending` cannot be reassigned in a loop).
    let pv = Accumulator::<f32>::new(dim).start();
    let mut s = Array::<f32>::new(comptime!(BKV / 2));
    let mut sf = Array::<f32>::new(comptime!(BKV / 2));
    let mut p = Array::<Vector<P, N2>>::new(comptime!(BKV / 4));

    q_bar.wait_parity(0u32);
    let q_desc = MatrixDescriptor::new(&q_smem, comptime!(qk_layout(wgs * WARPGROUP_M, dim)));
    if tiles > 0 {
        wait_tile(&full, 0usize);
        let first = issue_qk(&q_desc, &k_smem, 0usize, wg, dim).wait();
        keep_scores(&first, &mut s, magic);
    }
    for tile in 0..tiles {
        let kv0 = tile * BKV;
        // Every unit is done with the scale slot stored next and, having waited on tile
        // `tile − 1`'s MMAs, with tile `tile − 2`'s stage, which the next load takes.
        sync_cube();
        if UNIT_POS == 0 && tile + 2 < tiles {
            load_tile::<P>(
                k_map,
                v_map,
                &mut k_smem,
                &mut v_smem,
                &full,
                tile + 2,
                k_row0,
                v_row,
                dim,
            );
        }
        if tile + 1 < tiles {
            store_scales(
                &mut ks_sm,
                &mut ds_sm,
                ksr,
                dsr,
                ((tile + 1) % 2) * BKV,
                tid,
            );
            fetch_scales(
                ks,
                ds,
                &mut ksr,
                &mut dsr,
                &args,
                bhk,
                ds_row,
                kv0 + 2 * BKV,
                tid,
                has_ds,
            );
        }

        // Only tiles that cross the end of the keys or the causal diagonal of the cube's
        // first row need per-key masks.
        let mut full_tile = kv0 + BKV <= args.skv;
        if causal {
            full_tile = full_tile && kv0 + BKV <= q0 + offset + 1;
        }
        let slot = (tile % 2) * BKV;
        if full_tile {
            scores(
                &s, &mut sf, &mut mx, &ks_sm, &ds_sm, slot, &args, &qsc, &rows, &own, kv0, t,
                false, causal, has_ds,
            );
        } else {
            scores(
                &s, &mut sf, &mut mx, &ks_sm, &ds_sm, slot, &args, &qsc, &rows, &own, kv0, t, true,
                causal, has_ds,
            );
        }
        let need = maxima(&mx, &mut m, &mut l, &mut alpha, &qsc, tau, has_ds);

        // The next tile's `Q·Kᵀ` runs while this tile's exponentials are computed. After the
        // last tile it reads a stage no load writes, and is discarded.
        if tile + 1 < tiles {
            wait_tile(&full, tile + 1);
        }
        let next_s = issue_qk(&q_desc, &k_smem, tile + 1, wg, dim);
        if full_tile {
            probabilities::<P, N2>(
                &sf, &mut p, &m, &mut l, &qsc, &args, &g, false, has_ds, native,
            );
        } else {
            probabilities::<P, N2>(
                &sf, &mut p, &m, &mut l, &qsc, &args, &g, true, has_ds, native,
            );
        }
        // Waits for every MMA of the unit: the next `Q·Kᵀ` and the last tile's `P̃·V`.
        let next_s = next_s.wait();
        keep_scores(&next_s, &mut s, magic);
        let acc = pv.downcast::<f32>().wait();
        if need {
            rescale_output::<N2>(&mut o_sm, &acc, &alpha, tid, units, dim);
        }
        let mut next = acc.start();
        let st = tile % STAGES;
        let v_desc = MatrixDescriptor::new(
            &v_smem[st * v_stage..(st + 1) * v_stage],
            comptime!(v_layout(dim)),
        );
        issue_pv::<P, N2>(&p, &v_desc, &mut next);
    }

    let acc = pv.downcast::<f32>().wait();
    let mut o = Array::<Vector<f32, N2>>::new(comptime!(dim / 4));
    #[unroll]
    for i in 0..comptime!(dim / 4) {
        o[i] = o_sm[i * units + tid] + output_pair::<N2>(&acc, i);
    }
    write_output::<F, N2>(
        &o, &mut l, &m, out, lse, post, &args, &rows, &own, bh, bhk, t, dim, write_lse,
    );
}
