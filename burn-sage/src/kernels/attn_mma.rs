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
//!   padded to whole tiles with zeros, rounded to the PV grid once by [`v_transposed`]), so its
//!   B-operand words are contiguous pairs of keys.
//! - Rescaling the output rows when a maximum moves by more than `tau` is a multiply of the
//!   lane's own accumulator registers.
//!
//! The next tile's K, V and K scales are loaded into registers while the current one is
//! computed. Causal problems schedule their longest query tiles first. The launch is
//! unchecked: every index is in bounds by construction (Q rows past the end read nothing,
//! keys past the end read zeros, `Vᵀ` is padded).

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::cmma::MmaDefinition;
use cubecl::ir::{ElemType, FastMath, FloatKind, IntKind, features::MmaConfig};
use cubecl::prelude::*;

use super::attn_cmma::{RoundArgs, round_bits};
use super::common::grid;
use super::{AttnArgs, MatrixLaunch};
use crate::{SagePlan, Unsupported};

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

/// `Vᵀ` per KV head, `[b·h_kv, d, skv_pad]` in the PV dtype: keys past `skv` are zero, values
/// rounded to the PV grid when `round`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn v_transposed_kernel<V: Float, P: Float>(
    v: &Tensor<V>,
    out: &mut Tensor<P>,
    g: RoundArgs,
    skv: usize,
    skv_pad: usize,
    #[comptime] dim: usize,
    #[comptime] round: bool,
    #[define(V, P)] _dtypes: [ElemType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        let key = i % skv_pad;
        let d = (i / skv_pad) % dim;
        let bhk = i / (skv_pad * dim);
        let mut x = f32::new(0.0);
        if key < skv {
            x = f32::cast_from(v[(bhk * skv + key) * dim + d]);
            if round {
                x = round_bits(x, &g);
            }
        }
        out[i] = P::cast_from(x);
    }
}

/// Loads the K vectors (16 i8), `Vᵀ` vectors (8 values), K scales and scaled `ΔS` of the
/// tile at `kv0` that unit `tid` stores (zeros for keys past the end; `Vᵀ` is padded).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_tile<P: Float, N8: Size, N16: Size>(
    ki: &Tensor<Vector<i8, N16>>,
    ks: &Tensor<f32>,
    ds: &Tensor<f32>,
    vt: &Tensor<Vector<P, N8>>,
    args: &AttnArgs,
    kr: &mut Array<Vector<i8, N16>>,
    vr: &mut Array<Vector<P, N8>>,
    sc: &mut f32,
    dsv: &mut f32,
    bhk: usize,
    ds_row: usize,
    kv0: usize,
    skv_pad: usize,
    tid: usize,
    #[comptime] dim: usize,
    #[comptime] threads: usize,
    #[comptime] has_ds: bool,
) {
    let k_vecs = comptime!(dim / 16);
    #[unroll]
    for i in 0..comptime!(BKV * dim / 16 / threads) {
        let e = tid + i * threads;
        let key = kv0 + e / k_vecs;
        let mut x = Vector::<i8, N16>::new(i8::new(0));
        if key < args.skv {
            x = ki[(bhk * args.skv + key) * k_vecs + e % k_vecs];
        }
        kr[i] = x;
    }
    #[unroll]
    for i in 0..comptime!(dim * BKV / 8 / threads) {
        let e = tid + i * threads;
        let d = e / comptime!(BKV / 8);
        vr[i] = vt[((bhk * dim + d) * skv_pad + kv0) / 8 + e % comptime!(BKV / 8)];
    }
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
        *sc = x;
        *dsv = y;
    }
}

/// The lane's scores of one tile, dequantized (index `n·4 + v·2 + e`: 8-key block `n`, row
/// `v` of the lane's two, key `2·(lane mod 4) + e` of the block), masked when `masked`; returns
/// nothing, writes `sf` and the lane's row maxima `mx`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn scores<N2: Size>(
    s: &Array<Vector<i32, N2>>,
    sf: &mut Array<f32>,
    mx: &mut Array<f32>,
    ks_sm: &Shared<[f32]>,
    ds_sm: &Shared<[f32]>,
    args: &AttnArgs,
    qsc: &Array<f32>,
    rows: &Array<usize>,
    own: &Array<bool>,
    kv0: usize,
    t: usize,
    #[comptime] masked: bool,
    #[comptime] causal: bool,
    #[comptime] has_ds: bool,
) {
    let offset = args.skv - args.sq;
    #[unroll]
    for v in 0..2usize {
        mx[v] = f32::new(-1.0e30);
    }
    #[unroll]
    for n in 0..comptime!(BKV / 8) {
        #[unroll]
        for v in 0..2usize {
            let cv = s[n * 2 + v];
            #[unroll]
            for e in 0..2usize {
                let col = n * 8 + 2 * t + e;
                let key = kv0 + col;
                let mut x = f32::cast_from(cv.extract(e)) * qsc[v] * ks_sm[col];
                if has_ds {
                    x += ds_sm[col];
                }
                if masked {
                    let mut valid = own[v] && key < args.skv;
                    if causal {
                        valid = valid && key <= rows[v] + offset;
                    }
                    x = select(valid, x, f32::new(-1.0e30));
                }
                sf[n * 4 + v * 2 + e] = x;
                mx[v] = f32::max(mx[v], x);
            }
        }
    }
}

/// `P̃ = exp(s − m)·p_scale` rounded to the PV grid, as A-operand pairs; adds the unrounded
/// `exp(s − m)` to the lane's row sums.
#[cube]
#[allow(clippy::too_many_arguments)]
fn probabilities<P: Float, N2: Size>(
    sf: &Array<f32>,
    p: &mut Array<Vector<P, N2>>,
    m: &Array<f32>,
    l: &mut Array<f32>,
    args: &AttnArgs,
    g: &RoundArgs,
    #[comptime] masked: bool,
    #[comptime] native: bool,
) {
    #[unroll]
    for n in 0..comptime!(BKV / 8) {
        #[unroll]
        for v in 0..2usize {
            let mut pv = Vector::<P, N2>::empty();
            #[unroll]
            for e in 0..2usize {
                let x = sf[n * 4 + v * 2 + e];
                let mut pe = f32::exp(x - m[v]);
                if masked {
                    // Masked scores sit at -1e30: exp(0) when the whole row is masked so far.
                    pe = select(x > f32::new(-1.0e29), pe, f32::new(0.0));
                }
                l[v] += pe;
                if native {
                    pv.insert(e, P::cast_from(pe * args.p_scale));
                } else {
                    pv.insert(e, P::cast_from(round_bits(pe * args.p_scale, g)));
                }
            }
            p[n * 2 + v] = pv;
        }
    }
}

#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
// `a = a * b` on indexed shared memory and register arrays, as written for CubeCL 0.10.
#[allow(
    clippy::too_many_arguments,
    clippy::manual_div_ceil,
    clippy::assign_op_pattern,
    unused_assignments
)]
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
    // Shared-memory rows padded by 16 bytes: the 8 rows one fragment load touches start in 8
    // distinct groups of 4 banks.
    let krow = comptime!(dim / 4 + 4);
    let vrow = comptime!(BKV / 2 + 4);
    let ksteps = comptime!(dim / 32);
    let q_tiles = (args.sq + bq - 1) / bq;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    // Spare cubes of a two-dimensional grid (see `grid`) have no tile.
    if cube >= (args.rows / args.sq) * q_tiles {
        terminate!();
    }
    let bh = cube / q_tiles;
    // Longest tiles first: with a causal mask the last query tiles see the most keys.
    let q0 = (q_tiles - 1 - cube % q_tiles) * bq;
    let bhk = (bh / args.hq) * (args.hq / args.group) + (bh % args.hq) / args.group;
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let tid = plane * 32 + lane;
    let gid = lane / 4;
    let t = lane % 4;
    let offset = args.skv - args.sq;

    let mut k_sm =
        Shared::<[Vector<i8, N4>]>::new_aligned_slice(comptime!(BKV * (dim / 4 + 4)), 16usize);
    let mut v_sm =
        Shared::<[Vector<P, N2>]>::new_aligned_slice(comptime!(dim * (BKV / 2 + 4)), 16usize);
    let mut ks_sm = Shared::<[f32]>::new_slice(bkv);
    let mut ds_sm = Shared::<[f32]>::new_slice(bkv);

    let def_qk = MmaDefinition::<i8, i8, i32>::new(16usize, 8usize, 32usize);
    let def_pv = MmaDefinition::<P, P, f32>::new(16usize, 8usize, 16usize);

    // The lane's two rows: `gid` and `gid + 8` of the plane's 16.
    let mut rows = Array::<usize>::new(2usize);
    let mut own = Array::<bool>::new(2usize);
    let mut qsc = Array::<f32>::new(2usize);
    let mut m = Array::<f32>::new(2usize);
    let mut l = Array::<f32>::new(2usize);
    let mut mx = Array::<f32>::new(2usize);
    #[unroll]
    for v in 0..2usize {
        let row = q0 + plane * 16 + gid + 8 * v;
        rows[v] = row;
        own[v] = row < args.sq;
        let mut sc = f32::new(0.0);
        if row < args.sq {
            let qg = (row / args.q_block) * args.q_inter + (row % args.q_block) % args.q_inter;
            sc = qs[bh * args.q_groups + qg] * args.scale;
        }
        qsc[v] = sc;
        m[v] = f32::new(-1.0e30);
        l[v] = f32::new(0.0);
    }

    // Q A-fragments: word `j` of k-step `kk` holds 4 channels of row `gid + 8·(j mod 2)`.
    let wq = comptime!(dim / 4);
    let mut qf = Array::<Vector<i8, N4>>::new(comptime!(dim / 8));
    #[unroll]
    for kk in 0..ksteps {
        #[unroll]
        for j in 0..4usize {
            let row = rows[j % 2];
            let mut x = Vector::<i8, N4>::new(i8::new(0));
            if row < args.sq {
                x = qi[(bh * args.sq + row) * wq + kk * 8 + t + 4 * (j / 2)];
            }
            qf[kk * 4 + j] = x;
        }
    }
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

    let mut last = q0 + bq;
    if last > args.sq {
        last = args.sq;
    }
    let mut kv_end = args.skv;
    if causal {
        kv_end = last + offset;
    }

    let mut s = Array::<Vector<i32, N2>>::new(comptime!(BKV / 4));
    let mut sf = Array::<f32>::new(comptime!(BKV / 2));
    let mut p = Array::<Vector<P, N2>>::new(comptime!(BKV / 4));
    let mut a8 = Array::<Vector<i8, N4>>::new(4usize);
    let mut b8 = Array::<Vector<i8, N4>>::new(2usize);
    let mut c32 = Array::<Vector<i32, N2>>::new(2usize);
    let mut ah = Array::<Vector<P, N2>>::new(4usize);
    let mut bh16 = Array::<Vector<P, N2>>::new(2usize);
    let mut cf = Array::<Vector<f32, N2>>::new(2usize);

    let mut kv0 = 0usize;
    while kv0 < kv_end {
        sync_cube();
        {
            let k16 = k_sm
                .slice_mut(0usize, comptime!(BKV * (dim / 4 + 4)))
                .with_vector_size_mut::<N16>();
            #[unroll]
            for i in 0..comptime!(BKV * dim / 16 / threads) {
                let e = tid + i * threads;
                let key = e / comptime!(dim / 16);
                k16[key * comptime!(dim / 16 + 1) + e % comptime!(dim / 16)] = kr[i];
            }
            let v8 = v_sm
                .slice_mut(0usize, comptime!(dim * (BKV / 2 + 4)))
                .with_vector_size_mut::<N8>();
            #[unroll]
            for i in 0..comptime!(dim * BKV / 8 / threads) {
                let e = tid + i * threads;
                let d = e / comptime!(BKV / 8);
                v8[d * comptime!((BKV / 2 + 4) / 4) + e % comptime!(BKV / 8)] = vr[i];
            }
        }
        if tid < bkv {
            ks_sm[tid] = sc;
            if has_ds {
                ds_sm[tid] = dsv;
            }
        }
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

        // S = Q·Kᵀ, 8 keys at a time.
        #[unroll]
        for n in 0..comptime!(BKV / 8) {
            c32[0] = Vector::<i32, N2>::new(i32::new(0));
            c32[1] = Vector::<i32, N2>::new(i32::new(0));
            let kbase = (n * 8 + gid) * krow + t;
            #[unroll]
            for kk in 0..ksteps {
                #[unroll]
                for j in 0..4usize {
                    a8[j] = qf[kk * 4 + j];
                }
                b8[0] = k_sm[kbase + kk * 8];
                b8[1] = k_sm[kbase + kk * 8 + 4];
                let r = def_qk.execute(&a8, &b8, &c32);
                c32[0] = r[0];
                c32[1] = r[1];
            }
            s[n * 2] = c32[0];
            s[n * 2 + 1] = c32[1];
        }

        // Online softmax; only tiles that cross the end of the keys or the causal diagonal of
        // the cube's first row need per-key masks.
        let mut full = kv0 + bkv <= args.skv;
        if causal {
            full = full && kv0 + bkv <= q0 + offset + 1;
        }
        if full {
            scores::<N2>(
                &s, &mut sf, &mut mx, &ks_sm, &ds_sm, &args, &qsc, &rows, &own, kv0, t, false,
                causal, has_ds,
            );
        } else {
            scores::<N2>(
                &s, &mut sf, &mut mx, &ks_sm, &ds_sm, &args, &qsc, &rows, &own, kv0, t, true,
                causal, has_ds,
            );
        }
        let mut alpha = Array::<f32>::new(2usize);
        let mut need = false;
        #[unroll]
        for v in 0..2usize {
            let mut tm = mx[v];
            tm = f32::max(tm, plane_shuffle_xor(tm, 1u32));
            tm = f32::max(tm, plane_shuffle_xor(tm, 2u32));
            let m_new = f32::max(m[v], tm);
            let mut a = f32::new(1.0);
            if m_new > m[v] + tau {
                a = f32::exp(m[v] - m_new);
                m[v] = m_new;
                need = true;
            }
            alpha[v] = a;
            l[v] *= a;
        }
        if need {
            #[unroll]
            for dn in 0..comptime!(dim / 8) {
                #[unroll]
                for v in 0..2usize {
                    o[dn * 2 + v] = o[dn * 2 + v] * Vector::<f32, N2>::new(alpha[v]);
                }
            }
        }
        if full {
            probabilities::<P, N2>(&sf, &mut p, &m, &mut l, &args, &g, false, native);
        } else {
            probabilities::<P, N2>(&sf, &mut p, &m, &mut l, &args, &g, true, native);
        }

        // O += P̃·V: the score pairs of 8-key blocks 2kk and 2kk+1 are the A operand of the
        // 16-key step kk.
        #[unroll]
        for dn in 0..comptime!(dim / 8) {
            cf[0] = o[dn * 2];
            cf[1] = o[dn * 2 + 1];
            let vbase = (dn * 8 + gid) * vrow + t;
            #[unroll]
            for kk in 0..comptime!(BKV / 16) {
                ah[0] = p[kk * 4];
                ah[1] = p[kk * 4 + 1];
                ah[2] = p[kk * 4 + 2];
                ah[3] = p[kk * 4 + 3];
                bh16[0] = v_sm[vbase + kk * 8];
                bh16[1] = v_sm[vbase + kk * 8 + 4];
                let r = def_pv.execute(&ah, &bh16, &cf);
                cf[0] = r[0];
                cf[1] = r[1];
            }
            o[dn * 2] = cf[0];
            o[dn * 2 + 1] = cf[1];
        }
        kv0 += bkv;
    }

    // Epilogue: the row sums over the quad, then each lane writes its pairs.
    #[unroll]
    for v in 0..2usize {
        let mut lt = l[v];
        lt += plane_shuffle_xor(lt, 1u32);
        lt += plane_shuffle_xor(lt, 2u32);
        l[v] = lt;
        if write_lse && t == 0 && own[v] {
            lse[bh * args.sq + rows[v]] = m[v] + f32::ln(lt);
        }
    }
    #[unroll]
    for dn in 0..comptime!(dim / 8) {
        #[unroll]
        for v in 0..2usize {
            if own[v] {
                let ov = o[dn * 2 + v];
                let inv = f32::new(1.0) / l[v];
                #[unroll]
                for e in 0..2usize {
                    let c = dn * 8 + 2 * t + e;
                    out[(bh * args.sq + rows[v]) * dim + c] =
                        F::cast_from(ov.extract(e) * post[bhk * dim + c] * inv);
                }
            }
        }
    }
}

/// `Vᵀ` in the PV dtype, padded to whole tiles (see [`v_transposed_kernel`]).
fn v_transposed(
    v: CubeTensor,
    dtype: DType,
    g: RoundArgs,
    round: bool,
    skv_pad: usize,
) -> CubeTensor {
    let v = into_contiguous(v);
    let client = v.client.clone();
    let [b, h, skv, d] = v.meta.shape().dims::<4>();
    let out = empty_device_contiguous_dtype(
        client.clone(),
        v.device.clone(),
        Shape::new([b * h, d, skv_pad]),
        dtype,
    );
    let n = b * h * d * skv_pad;
    let dtypes = [dtype_to_storage_type(v.dtype), dtype_to_storage_type(dtype)];
    // SAFETY: every index the kernel forms is below its tensor's length (guarded by `out.len()`
    // for the output; `key < skv`, `d < dim`, `bhk < b·h` for the input).
    unsafe {
        v_transposed_kernel::launch_unchecked(
            &client,
            grid(&client, n.div_ceil(256)),
            CubeDim::new_1d(256),
            v.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            g.launch_arg(),
            skv,
            skv_pad,
            d,
            round,
            dtypes,
        );
    }
    out
}

/// Launches the register-tile kernel (head dims 64 and 128). Quantized Q/K must be i8.
#[allow(clippy::too_many_arguments)]
pub fn launch(
    qi: CubeTensor,
    ki: CubeTensor,
    qs: CubeTensor,
    ks: CubeTensor,
    ds: Option<CubeTensor>,
    v: CubeTensor,
    post: CubeTensor,
    args: AttnArgs,
    plan: &SagePlan,
) -> (CubeTensor, Option<CubeTensor>) {
    let client = qi.client.clone();
    let [b, hq, sq, d] = qi.meta.shape().dims::<4>();
    let skv = plan.kv_len;
    let ml = MatrixLaunch::new(&qi, &qs, ds, plan);
    let skv_pad = skv.div_ceil(BKV) * BKV;
    let vt = v_transposed(
        v,
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
            into_contiguous(qi).into_tensor_arg(),
            into_contiguous(ki).into_tensor_arg(),
            qs.into_tensor_arg(),
            ks.into_tensor_arg(),
            ml.ds.clone().into_tensor_arg(),
            vt.into_tensor_arg(),
            into_contiguous(post).into_tensor_arg(),
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
