//! The stages of [`super::attn_mma_kernel`], in the order the kernel runs them: the lane's
//! rows and Q fragments, loading the next K/`Vᵀ` tile into registers and storing the current
//! one to shared memory, `Q·Kᵀ` with `mma.sync`, the scores and row maxima, rescaling, the
//! probabilities, `P̃·V`, and the output. Fragment layouts are the PTX ones (see the kernel's
//! module docs): lane `l` holds rows `l/4` and `l/4 + 8` and, per 8-key block, keys
//! `2·(l mod 4)` and `+1`.

use cubecl::cmma::MmaDefinition;
use cubecl::prelude::*;

use super::super::AttnArgs;
use super::super::pv_grid::{RoundArgs, round_bits};
use super::BKV;

/// The lane's two query rows (`row` and `row + 8`), whether each exists, and each one's Q
/// scale times the softmax scale (0 past the end).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn lane_rows(
    qs: &Tensor<f32>,
    args: &AttnArgs,
    bh: usize,
    row: usize,
    rows: &mut Array<usize>,
    own: &mut Array<bool>,
    qsc: &mut Array<f32>,
) {
    #[unroll]
    for v in 0..2usize {
        let r = row + 8 * v;
        rows[v] = r;
        own[v] = r < args.sq;
        let mut sc = f32::new(0.0);
        if r < args.sq {
            let qg = (r / args.q_block) * args.q_inter + (r % args.q_block) % args.q_inter;
            sc = qs[bh * args.q_groups + qg] * args.scale;
        }
        qsc[v] = sc;
    }
}

/// Q A-fragments read from global memory: word `j` of k-step `kk` holds 4 channels of row
/// `rows[j mod 2]` (zeros past the end).
#[cube]
pub(super) fn q_fragments<N4: Size>(
    qi: &Tensor<Vector<i8, N4>>,
    args: &AttnArgs,
    bh: usize,
    rows: &Array<usize>,
    t: usize,
    qf: &mut Array<Vector<i8, N4>>,
    #[comptime] dim: usize,
) {
    let wq = comptime!(dim / 4);
    #[unroll]
    for kk in 0..comptime!(dim / 32) {
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
}

/// Loads the K vectors (16 i8), `Vᵀ` vectors (8 values), K scales and scaled `ΔS` of the
/// tile at `kv0` that unit `tid` stores (zeros for keys past the end; `Vᵀ` is padded).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_tile<P: Float, N8: Size, N16: Size>(
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

/// Stores the registers [`load_tile`] filled to shared memory: K rows padded to `d/16 + 1`
/// vectors, `Vᵀ` rows padded to `BKV/2 + 4` pairs, the K scales and `ΔS`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn store_tile<P: Float, N2: Size, N4: Size, N8: Size, N16: Size>(
    k_sm: &mut Shared<[Vector<i8, N4>]>,
    v_sm: &mut Shared<[Vector<P, N2>]>,
    ks_sm: &mut Shared<[f32]>,
    ds_sm: &mut Shared<[f32]>,
    kr: &Array<Vector<i8, N16>>,
    vr: &Array<Vector<P, N8>>,
    sc: f32,
    dsv: f32,
    tid: usize,
    #[comptime] dim: usize,
    #[comptime] threads: usize,
    #[comptime] has_ds: bool,
) {
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
    if tid < BKV {
        ks_sm[tid] = sc;
        if has_ds {
            ds_sm[tid] = dsv;
        }
    }
}

/// `S = Q·Kᵀ` for the lane's fragments, 8 keys at a time: `mma.m16n8k32` i8·i8→i32; K words
/// from the padded shared tile (row stride `d/4 + 4` words).
#[cube]
pub(super) fn qk_tile<N2: Size, N4: Size>(
    qf: &Array<Vector<i8, N4>>,
    k_sm: &Shared<[Vector<i8, N4>]>,
    s: &mut Array<Vector<i32, N2>>,
    lane: usize,
    #[comptime] dim: usize,
) {
    let def_qk = MmaDefinition::<i8, i8, i32>::new(16usize, 8usize, 32usize);
    let krow = comptime!(dim / 4 + 4);
    let gid = lane / 4;
    let t = lane % 4;
    let mut a8 = Array::<Vector<i8, N4>>::new(4usize);
    let mut b8 = Array::<Vector<i8, N4>>::new(2usize);
    let mut c32 = Array::<Vector<i32, N2>>::new(2usize);
    #[unroll]
    for n in 0..comptime!(BKV / 8) {
        c32[0] = Vector::<i32, N2>::new(i32::new(0));
        c32[1] = Vector::<i32, N2>::new(i32::new(0));
        let kbase = (n * 8 + gid) * krow + t;
        #[unroll]
        for kk in 0..comptime!(dim / 32) {
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

/// The online softmax's running maxima: each row's tile maximum over the 4 lanes of its quad;
/// where it exceeds the running maximum by more than `tau`, the maximum moves and the row's sum
/// and accumulators are scaled by `exp(m_old − m_new)` (the lane's own registers).
#[cube]
// `a = a * b` on indexed register arrays, as written for CubeCL 0.10.
#[allow(clippy::assign_op_pattern)]
fn update_maxima<N2: Size>(
    mx: &Array<f32>,
    m: &mut Array<f32>,
    l: &mut Array<f32>,
    o: &mut Array<Vector<f32, N2>>,
    tau: f32,
    #[comptime] dim: usize,
) {
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
}

/// `O += P̃·V` with `mma.m16n8k16` f16/bf16→f32: the score pairs of 8-key blocks `2kk` and
/// `2kk + 1` are the A operand of the 16-key step `kk`; `Vᵀ` words from the padded shared tile.
#[cube]
pub(super) fn accumulate_pv<P: Float, N2: Size>(
    p: &Array<Vector<P, N2>>,
    v_sm: &Shared<[Vector<P, N2>]>,
    o: &mut Array<Vector<f32, N2>>,
    lane: usize,
    #[comptime] dim: usize,
) {
    let def_pv = MmaDefinition::<P, P, f32>::new(16usize, 8usize, 16usize);
    let vrow = comptime!(BKV / 2 + 4);
    let gid = lane / 4;
    let t = lane % 4;
    let mut ah = Array::<Vector<P, N2>>::new(4usize);
    let mut bh16 = Array::<Vector<P, N2>>::new(2usize);
    let mut cf = Array::<Vector<f32, N2>>::new(2usize);
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
}

/// The epilogue: the row sums over the quad (and the LSE where asked), then each lane writes
/// its pairs of its rows, divided by the row sum, times V's smoothing `post`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_output<F: Float, N2: Size>(
    o: &Array<Vector<f32, N2>>,
    l: &mut Array<f32>,
    m: &Array<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    post: &Tensor<f32>,
    args: &AttnArgs,
    rows: &Array<usize>,
    own: &Array<bool>,
    bh: usize,
    bhk: usize,
    t: usize,
    #[comptime] dim: usize,
    #[comptime] write_lse: bool,
) {
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

/// One tile's online softmax on the lane's registers: the scores (masked only where the tile is
/// not `full`: it crosses the end of the keys or the causal diagonal), the running maxima
/// (rescaling where they move), and `P̃` as the A operand of `P̃·V`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn online_softmax<P: Float, N2: Size>(
    s: &Array<Vector<i32, N2>>,
    sf: &mut Array<f32>,
    mx: &mut Array<f32>,
    p: &mut Array<Vector<P, N2>>,
    m: &mut Array<f32>,
    l: &mut Array<f32>,
    o: &mut Array<Vector<f32, N2>>,
    ks_sm: &Shared<[f32]>,
    ds_sm: &Shared<[f32]>,
    args: &AttnArgs,
    g: &RoundArgs,
    qsc: &Array<f32>,
    rows: &Array<usize>,
    own: &Array<bool>,
    kv0: usize,
    t: usize,
    tau: f32,
    full: bool,
    #[comptime] causal: bool,
    #[comptime] has_ds: bool,
    #[comptime] native: bool,
    #[comptime] dim: usize,
) {
    if full {
        scores::<N2>(
            s, sf, mx, ks_sm, ds_sm, args, qsc, rows, own, kv0, t, false, causal, has_ds,
        );
    } else {
        scores::<N2>(
            s, sf, mx, ks_sm, ds_sm, args, qsc, rows, own, kv0, t, true, causal, has_ds,
        );
    }
    update_maxima::<N2>(&*mx, m, l, o, tau, dim);
    if full {
        probabilities::<P, N2>(&*sf, p, &*m, l, args, g, false, native);
    } else {
        probabilities::<P, N2>(&*sf, p, &*m, l, args, g, true, native);
    }
}
