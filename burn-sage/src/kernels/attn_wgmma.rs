//! The attention kernel on Hopper's warpgroup MMA (`wgmma`), its tiles loaded by the tensor
//! memory accelerator (TMA): the first step of issue 32's plan (`notes/hopper-plan.md`).
//!
//! One cube per `(batch·q_head, tile of 64 queries per warpgroup)`, [`warpgroups`] (1 or 2)
//! warpgroups of 128 units, each owning 64 query rows; tiles of [`BKV`] = 64 keys in a ring of [`STAGES`] stages:
//!
//! - Q (i8, `[128, d]`) is loaded once by TMA; K (i8, `[64, d]`) and `Vᵀ` (the PV dtype,
//!   `[d, 64]`, keys contiguous, padded and rounded to the PV grid by `v_transposed`) by TMA into
//!   the stage, one tile ahead of the one computed, each stage guarded by a barrier the TMA
//!   bytes complete. Unit 0 issues the loads.
//! - `S = Q·Kᵀ`: `wgmma m64n64k32` i8·i8→i32, both operands in shared memory (K-major,
//!   swizzled). The accumulator's layout is the `mma.sync` one per 16 rows, so the online
//!   softmax of [`super::attn_mma`] (`stages::online_softmax`: the folded scales, `ΔS`, the
//!   masks, the lazy rescale by `tau`, `P̃` rounded to the PV grid) runs unchanged on it.
//! - `O += P̃·V`: `wgmma m64n{d}k16` f16/bf16→f32 with `P̃` in registers (the S accumulator of
//!   two 8-key blocks is the A fragment of one 16-key step) and `Vᵀ` from shared memory. A
//!   warpgroup accumulator cannot be rescaled in place, so each tile's product goes into a
//!   fresh accumulator that is added to the f32 output rows (the two-level accumulation
//!   SageAttention2 uses for FP8 P·V).
//!
//! What this first kernel leaves out (the plan's later steps): a producer warp and a deeper
//! ring, the softmax of one tile overlapped with the next tile's `Q·Kᵀ`, FP8 `P̃·V` on the
//! tensor cores, register reallocation between warpgroups. It is asked for by name
//! ([`crate::SageOptions::kernel`]); [`super::choose`] does not pick it until it measures
//! faster than [`super::attn_mma`].

use burn::tensor::DType;
use burn_cubecl::{kernel::into_contiguous, tensor::CubeTensor};
use cubecl::features::{Tma, WgmmaElems};
use cubecl::ir::{ElemType, FastMath, FloatKind, IntKind, types::MatrixShape};
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;
use cubecl::wgmma::{
    Accumulator, Fragment, Major, MatrixDescriptor, Swizzle, WARPGROUP_M, WgmmaTileLayout,
};
use cubecl::zspace::{Shape, Strides};

use super::attn_mma::BKV;
use super::attn_mma::stages::{lane_rows, online_softmax, write_output};
use super::common::{grid, keys_end, kv_head};
use super::pv_grid::{RoundArgs, v_transposed};
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
/// Stages of the K/`Vᵀ` ring.
pub const STAGES: usize = 2;
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

/// The K scales and scaled `ΔS` of the keys from `kv0`, into shared memory (zeros past the
/// end), one key per unit of the first [`BKV`].
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_scales(
    ks: &Tensor<f32>,
    ds: &Tensor<f32>,
    ks_sm: &mut Shared<[f32]>,
    ds_sm: &mut Shared<[f32]>,
    args: &AttnArgs,
    bhk: usize,
    ds_row: usize,
    kv0: usize,
    tid: usize,
    #[comptime] has_ds: bool,
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
            }
        }
        ks_sm[tid] = x;
        ds_sm[tid] = y;
    }
}

/// The S accumulator as the pairs [`online_softmax`] reads: index `n·2 + v` holds row `v` of
/// the lane's two, keys `2·(lane mod 4)` and `+1` of 8-key block `n`.
#[cube]
fn score_pairs<N2: Size>(acc: &Accumulator<i32>, s: &mut Array<Vector<i32, N2>>) {
    #[unroll]
    for i in 0..comptime!(BKV / 4) {
        let mut x = Vector::<i32, N2>::empty();
        x.insert(0usize, acc.get(2 * i));
        x.insert(1usize, acc.get(2 * i + 1));
        s[i] = x;
    }
}

/// `O += P̃·V` for one tile: each 16-key step's `P̃` pairs as an A fragment in registers, `Vᵀ`
/// from the stage; the product (a fresh accumulator) added to the lane's f32 output pairs.
#[cube]
fn accumulate_pv<P: Float, N2: Size>(
    p: &Array<Vector<P, N2>>,
    v_desc: &MatrixDescriptor<P>,
    o: &mut Array<Vector<f32, N2>>,
    #[comptime] dim: usize,
) {
    let mut acc = Accumulator::<f32>::new(dim).start();
    #[unroll]
    for kk in 0..comptime!(BKV / 16) {
        let mut frag = Fragment::<P>::new();
        #[unroll]
        for j in 0..8usize {
            frag.set(j, p[(kk * 8 + j) / 2].extract(j % 2));
        }
        acc.execute_registers(&frag, &v_desc.at(0usize, kk * 16));
    }
    let acc = acc.wait();
    #[unroll]
    for i in 0..comptime!(dim / 4) {
        let mut x = Vector::<f32, N2>::empty();
        x.insert(0usize, acc.get(2 * i));
        x.insert(1usize, acc.get(2 * i + 1));
        o[i] += x;
    }
}

#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
fn attn_wgmma_kernel<F: Float, P: Float, N2: Size>(
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
    let mut ks_sm = Shared::<[f32]>::new_slice(BKV);
    let mut ds_sm = Shared::<[f32]>::new_slice(BKV);
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
    #[unroll]
    for v in 0..2usize {
        m[v] = f32::new(-1.0e30);
        l[v] = f32::new(0.0);
    }
    let mut o = Array::<Vector<f32, N2>>::new(comptime!(dim / 4));
    #[unroll]
    for i in 0..comptime!(dim / 4) {
        o[i] = Vector::<f32, N2>::new(f32::new(0.0));
    }
    let mut s = Array::<Vector<i32, N2>>::new(comptime!(BKV / 4));
    let mut sf = Array::<f32>::new(comptime!(BKV / 2));
    let mut p = Array::<Vector<P, N2>>::new(comptime!(BKV / 4));
    // All the cube's rows share one Q mean block (the launch checks that blocks are whole
    // query tiles), so ΔS is one row per key tile.
    let ds_row = (bh * args.mean_blocks + q0 / args.mean_block) * args.skv;

    q_bar.wait_parity(0u32);
    let q_desc = MatrixDescriptor::new(&q_smem, comptime!(qk_layout(wgs * WARPGROUP_M, dim)));
    let rounds = (tiles + STAGES - 1) / STAGES;
    for round in 0..rounds {
        #[unroll]
        for st in 0..STAGES {
            let tile = round * STAGES + st;
            if tile < tiles {
                let kv0 = tile * BKV;
                // Every unit is done with the previous tile: its stage and the scales.
                sync_cube();
                if UNIT_POS == 0 && tile + 1 < tiles {
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
                    ks, ds, &mut ks_sm, &mut ds_sm, &args, bhk, ds_row, kv0, tid, has_ds,
                );
                sync_cube();
                full.index(st).wait_parity(round as u32 & 1);

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
                let acc = acc.wait();
                score_pairs::<N2>(&acc, &mut s);

                // Only tiles that cross the end of the keys or the causal diagonal of the
                // cube's first row need per-key masks.
                let mut full_tile = kv0 + BKV <= args.skv;
                if causal {
                    full_tile = full_tile && kv0 + BKV <= q0 + offset + 1;
                }
                online_softmax::<P, N2>(
                    &s, &mut sf, &mut mx, &mut p, &mut m, &mut l, &mut o, &ks_sm, &ds_sm, &args,
                    &g, &qsc, &rows, &own, kv0, t, tau, full_tile, causal, has_ds, native, dim,
                );
                let v_desc = MatrixDescriptor::new(
                    &v_smem[st * v_stage..(st + 1) * v_stage],
                    comptime!(v_layout(dim)),
                );
                accumulate_pv::<P, N2>(&p, &v_desc, &mut o, dim);
            }
        }
    }

    write_output::<F, N2>(
        &o, &mut l, &m, out, lse, post, &args, &rows, &own, bh, bhk, t, dim, write_lse,
    );
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
    // As in `attn_mma`: where the PV grid is the PV dtype itself, the conversion rounds `P̃`.
    let native = !ml.fp8;
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
        attn_wgmma_kernel::launch_unchecked(
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
            dtypes,
        );
    }
    ml.outputs()
}
