//! The fused forward for training: each token's log-sum-exp, its target logit and its row of dE
//! for a unit loss gradient, in one walk over the vocabulary (the backward then only scales
//! dE by `dout` and computes dC, see [`super::backward_dc`]).
//!
//! A cube owns `TILE` tokens and walks every vocabulary tile as the dE walk of
//! [`super::backward()`] does, with the softmax taken online (FlashAttention's forward, the
//! classifier rows in the place of the values): per row a reference maximum `m` and a sum
//! `Z = Σ exp(x − m)`, the tile's unnormalized gradient `exp(x − m)·cap'(x)` through the
//! gradient tile into `acc += G·C`. The references are renewed lazily (FlashAttention-4): only
//! where a tile holds a logit above its row's reference by more than [`TAU`] do the planes
//! trade the rows' maxima (two more syncs) and rescale `Z` and the accumulators by
//! `exp(m_old − m_new)`; every other tile costs the dE walk's syncs and nothing more. At the
//! end, for token `i` with target `t`: `dE_i = acc_i / Z_i − cap'(x_t)·C_t`
//! (`∂ lossᵢ / ∂Eᵢ`), `lse_i = m_i + ln Z_i`, and the target logit `x_t` from one dot product.
//!
//! Plane roles as in [`super::backward()`]: plane `p` keeps the logits block
//! `stages::score_block(p)` (16 rows × 32 columns; the other 32 columns of its rows are plane
//! `p ^ 1`'s, the two trade their row maxima through shared memory) and accumulates rows
//! `32(p mod 2) ..`, channels `(p / 2)·dim/4 ..`.

use cubecl::prelude::*;

use super::copies::{copy_rows, copy_to_buffer, tile_barrier, wait_tile};
use super::stages::{accumulate, capped, chunk_at, score_block, scores, store_rows};
use super::{FusedArgs, PAD, TILE};

/// A finite "minus infinity" for masked logits: its exponential is 0 and no infinity reaches
/// the arithmetic.
const NEG: f64 = -1.0e30;
/// How far a logit may pass its row's reference maximum before the references are renewed
/// (FlashAttention-4's lazy rescaling): `exp(x − m) ≤ e⁸ ≈ 2981`, which the 16-bit gradient
/// tile and the f32 sums hold exactly as well as values up to 1.
const TAU: f64 = 8.0;

#[cube(launch_unchecked)]
// Kernel code has no `is_multiple_of`.
#[allow(clippy::too_many_arguments, clippy::manual_is_multiple_of)]
pub(super) fn cce_lse_grad_kernel<P: Float, I: Int, N2: Size, N8: Size>(
    e: &Tensor<Vector<P, N8>>,
    c: &Tensor<Vector<P, N8>>,
    c_pairs: &Tensor<Vector<P, N2>>,
    targets: &Tensor<I>,
    lse: &mut Tensor<f32>,
    target_logit: &mut Tensor<f32>,
    de: &mut Tensor<Vector<P, N2>>,
    args: FusedArgs,
    #[comptime] dim: usize,
    #[comptime] has_softcap: bool,
    #[define(P, I)] _dtypes: [ElemType; 2],
) {
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if cube * TILE >= args.tokens {
        terminate!();
    }
    let o0 = cube * TILE;
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let tid = plane * 32 + lane;
    let (g, t) = (lane / 4, lane % 4);
    let (sr0, sc0) = score_block(plane);
    let (ar0, aq0) = (32 * (plane % 2), (plane / 2) * comptime!(dim / 4));

    // The token tile (swizzled), two vocabulary tiles (padded), the gradient tile, and the
    // rows' maxima of the tile's two column halves and their rescaling factors.
    let words = comptime!(TILE * (dim / 2 + PAD));
    let mut x_sm = Shared::<[Vector<P, N2>]>::new_aligned_slice(comptime!(TILE * dim / 2), 16usize);
    let mut y_sm = Shared::<[Vector<P, N2>]>::new_aligned_slice(comptime!(2 * words), 16usize);
    let mut g_sm =
        Shared::<[Vector<P, N2>]>::new_aligned_slice(comptime!(TILE * TILE / 2), 16usize);
    let mut half_max = Shared::<[f32]>::new_slice(comptime!(2 * TILE));
    let mut alpha = Shared::<[f32]>::new_slice(TILE);
    let bar0 = tile_barrier();
    let bar1 = tile_barrier();
    copy_rows::<P, N2, N8>(c, 0usize, args.vocab, &mut y_sm, 0usize, &bar0, tid, dim);
    store_rows::<P, N2, N8>(e, o0, args.tokens, &mut x_sm, tid, dim);

    // The lane's rows `sr0 + g + 8v` of the score block: the reference maximum `m` (the same in
    // the two planes of a row) and the lane's part of the sum (reduced at the end).
    let mut m = Array::<f32>::new(2usize);
    let mut z = Array::<f32>::new(2usize);
    #[unroll]
    for v in 0..2usize {
        m[v] = f32::new(NEG);
        z[v] = f32::new(0.0);
    }
    // Whether some plane saw a logit above its row's reference by more than `TAU`, for tiles of
    // even and odd `k`.
    let mut grow = Shared::<[u32]>::new_slice(2usize);
    if tid == 0 {
        grow[0] = 0;
        grow[1] = 0;
    }
    let mut acc = Array::<Vector<f32, N2>>::new(comptime!(dim / 8));
    #[unroll]
    for i in 0..comptime!(dim / 8) {
        acc[i] = Vector::<f32, N2>::new(f32::new(0.0));
    }
    let mut s = Array::<Vector<f32, N2>>::new(8usize);

    let mut w0 = 0usize;
    // Tile k of the walk is in buffer k mod 2, the fill (k / 2) of its barrier.
    let mut k = 0u32;
    while w0 < args.vocab {
        let at = select(k % 2 == 0, 0usize, words);
        wait_tile(&bar0, &bar1, k);
        // Every plane is done with the last tile: the next one goes where it was.
        sync_cube();
        if w0 + TILE < args.vocab {
            let next = words - at;
            let (first, other) = (w0 + TILE, (k + 1) % 2);
            copy_to_buffer::<P, N2, N8>(
                c, first, args.vocab, &mut y_sm, next, other, &bar0, &bar1, tid, dim,
            );
        }
        scores::<P, N2>(&x_sm, &y_sm, at, &mut g_sm, &mut s, plane, lane, dim);

        // The block's capped logits (masked past the vocabulary) and slopes; the gradient tile
        // against the rows' references, valid unless a logit passes its reference by `TAU`.
        let mut xs = Array::<f32>::new(16usize);
        let mut sl = Array::<f32>::new(16usize);
        let mut hm = Array::<f32>::new(2usize);
        let mut part = Array::<f32>::new(2usize);
        let mut over = false;
        #[unroll]
        for v in 0..2usize {
            let mut mx = f32::new(NEG);
            let mut sum = f32::new(0.0);
            #[unroll]
            for n in 0..4usize {
                let sv = s[2 * n + v];
                let mut out = Vector::<P, N2>::empty();
                #[unroll]
                for ee in 0..2usize {
                    let i = 8 * v + 2 * n + ee;
                    let col = w0 + sc0 + 8 * n + 2 * t + ee;
                    let mut slope = f32::new(1.0);
                    let x = capped(sv.extract(ee), args.softcap, &mut slope, has_softcap);
                    let x = select(col < args.vocab, x, f32::new(NEG));
                    xs[i] = x;
                    sl[i] = slope;
                    mx = f32::max(mx, x);
                    let p = f32::exp(x - m[v]);
                    sum += p;
                    out.insert(ee, P::cast_from(p * slope));
                }
                g_sm[chunk_at(sr0 + g + 8 * v, (sc0 + 8 * n) / 8, TILE) + t] = out;
            }
            hm[v] = mx;
            part[v] = sum;
            over = over || mx > m[v] + f32::new(TAU);
        }
        let any = plane_any(over);
        if lane == 0 && any {
            grow[(k % 2) as usize] = 1;
        }
        if tid == 0 {
            grow[((k + 1) % 2) as usize] = 0;
        }
        sync_cube();
        if grow[(k % 2) as usize] != 0 {
            // Some row's logits outgrew its reference (always on the first tile): the new
            // references, the sums and accumulators rescaled, the tile's gradient redone.
            new_references::<P, N2>(
                &xs,
                &sl,
                &hm,
                &mut m,
                &mut z,
                &mut half_max,
                &mut alpha,
                &mut g_sm,
                plane,
                lane,
            );
            rescale::<N2>(&alpha, &mut acc, ar0, g, dim);
        } else {
            #[unroll]
            for v in 0..2usize {
                z[v] += part[v];
            }
        }
        accumulate::<P, N2>(&g_sm, &y_sm, at, ar0, aq0, &mut acc, lane, dim);
        w0 += TILE;
        k += 1;
    }

    // The rows' sums (per column half) and maxima, through the gradient tile (as f32 bits) once
    // every plane is done with it; then per row `1 / Z`, the target logit's slope, the
    // log-sum-exp and the target logit.
    sync_cube();
    #[unroll]
    for v in 0..2usize {
        let mut zr = z[v];
        zr += plane_shuffle_xor(zr, 1u32);
        zr += plane_shuffle_xor(zr, 2u32);
        if t == 0 {
            let row = sr0 + g + 8 * v;
            g_sm[(plane % 2) * TILE + row] = Vector::<P, N2>::reinterpret(zr);
            if plane % 2 == 0 {
                g_sm[2 * TILE + row] = Vector::<P, N2>::reinterpret(m[v]);
            }
        }
    }
    sync_cube();
    if tid < TILE {
        let mut inv = f32::new(0.0);
        let mut slope = f32::new(0.0);
        if o0 + tid < args.tokens {
            let zr = f32::reinterpret(g_sm[tid]) + f32::reinterpret(g_sm[TILE + tid]);
            lse[o0 + tid] = f32::reinterpret(g_sm[2 * TILE + tid]) + f32::ln(zr);
            inv = f32::new(1.0) / zr;
            let target = usize::cast_from(targets[o0 + tid]);
            let raw = row_dot::<P, N2>(&x_sm, c_pairs, tid, target, dim);
            slope = f32::new(1.0);
            target_logit[o0 + tid] = capped(raw, args.softcap, &mut slope, has_softcap);
        }
        g_sm[3 * TILE + tid] = Vector::<P, N2>::reinterpret(inv);
        g_sm[4 * TILE + tid] = Vector::<P, N2>::reinterpret(slope);
    }
    sync_cube();
    write_unit_rows::<P, I, N2>(
        &acc, &g_sm, c_pairs, targets, de, o0, ar0, aq0, &args, lane, dim,
    );
}

/// The slow step of the online softmax, where some logit of the tile passed its row's
/// reference by more than `TAU`: the rows' maxima over the tile (`hm`: the lane's) through
/// `half_max`, the new references `m`, the rescaling factors into `alpha` (for the
/// accumulators, by the planes of column half 0), the sums `z` rescaled and the tile added,
/// and the tile's gradient `exp(x − m)·cap'(x)` rewritten into `g_sm`. Syncs the cube twice;
/// `alpha` is read after the second.
#[cube]
// Kernel code has no `is_multiple_of`.
#[allow(clippy::too_many_arguments, clippy::manual_is_multiple_of)]
fn new_references<P: Float, N2: Size>(
    xs: &Array<f32>,
    sl: &Array<f32>,
    hm: &Array<f32>,
    m: &mut Array<f32>,
    z: &mut Array<f32>,
    half_max: &mut Shared<[f32]>,
    alpha: &mut Shared<[f32]>,
    g_sm: &mut Shared<[Vector<P, N2>]>,
    plane: usize,
    lane: usize,
) {
    let (g, t) = (lane / 4, lane % 4);
    let (sr0, sc0) = score_block(plane);
    #[unroll]
    for v in 0..2usize {
        let mut mx = hm[v];
        mx = f32::max(mx, plane_shuffle_xor(mx, 1u32));
        mx = f32::max(mx, plane_shuffle_xor(mx, 2u32));
        if t == 0 {
            half_max[(plane % 2) * TILE + sr0 + g + 8 * v] = mx;
        }
    }
    sync_cube();
    #[unroll]
    for v in 0..2usize {
        let row = sr0 + g + 8 * v;
        let mn = f32::max(m[v], f32::max(half_max[row], half_max[TILE + row]));
        let a = f32::exp(m[v] - mn);
        let mut sum = z[v] * a;
        #[unroll]
        for n in 0..4usize {
            let mut out = Vector::<P, N2>::empty();
            #[unroll]
            for ee in 0..2usize {
                let i = 8 * v + 2 * n + ee;
                let p = f32::exp(xs[i] - mn);
                sum += p;
                out.insert(ee, P::cast_from(p * sl[i]));
            }
            g_sm[chunk_at(row, (sc0 + 8 * n) / 8, TILE) + t] = out;
        }
        z[v] = sum;
        m[v] = mn;
        if plane % 2 == 0 && t == 0 {
            alpha[row] = a;
        }
    }
    sync_cube();
}

/// `E[row] · C[target]` in f32 over `dim` channels: the token's row from the swizzled tile
/// `x_sm`, the classifier's from `c_pairs` (`[V, dim]` as pairs).
#[cube]
fn row_dot<P: Float, N2: Size>(
    x_sm: &Shared<[Vector<P, N2>]>,
    c_pairs: &Tensor<Vector<P, N2>>,
    row: usize,
    target: usize,
    #[comptime] dim: usize,
) -> f32 {
    let mut sum = f32::new(0.0);
    for chunk in 0..comptime!(dim / 8) {
        let at = chunk_at(row, chunk, dim);
        #[unroll]
        for w in 0..4usize {
            let xv = x_sm[at + w];
            let cv = c_pairs[(target * dim) / 2 + chunk * 4 + w];
            #[unroll]
            for ee in 0..2usize {
                sum += f32::cast_from(xv.extract(ee)) * f32::cast_from(cv.extract(ee));
            }
        }
    }
    sum
}

/// `acc *= alpha[row]` for the lane's rows `r0 + 16m + g + 8v` of [`accumulate`]'s layout,
/// skipped where every factor of the plane is 1 (the rows' maxima did not grow).
#[cube]
// The form the kernel was checked in (an indexed element of a register array).
#[allow(clippy::assign_op_pattern)]
fn rescale<N2: Size>(
    alpha: &Shared<[f32]>,
    acc: &mut Array<Vector<f32, N2>>,
    r0: usize,
    g: usize,
    #[comptime] dim: usize,
) {
    let blocks = comptime!(dim / 32);
    let mut f = Array::<f32>::new(4usize);
    let mut grow = false;
    #[unroll]
    for i in 0..4usize {
        f[i] = alpha[r0 + 16 * (i / 2) + g + 8 * (i % 2)];
        grow = grow || f[i] != f32::new(1.0);
    }
    if plane_any(grow) {
        #[unroll]
        for mb in 0..2usize {
            #[unroll]
            for n in 0..comptime!(dim / 32) {
                #[unroll]
                for v in 0..2usize {
                    let i = (mb * blocks + n) * 2 + v;
                    acc[i] = acc[i] * Vector::<f32, N2>::new(f[2 * mb + v]);
                }
            }
        }
    }
}

/// Writes `dE = acc / Z − cap'(x_t)·C_t` for the lane's rows and channels ([`accumulate`]'s
/// layout), rows below `args.tokens`; the rows' `1 / Z` and target slopes are in `stats`
/// (f32 bits, at `3·TILE + row` and `4·TILE + row`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_unit_rows<P: Float, I: Int, N2: Size>(
    acc: &Array<Vector<f32, N2>>,
    stats: &Shared<[Vector<P, N2>]>,
    c_pairs: &Tensor<Vector<P, N2>>,
    targets: &Tensor<I>,
    de: &mut Tensor<Vector<P, N2>>,
    o0: usize,
    r0: usize,
    q0: usize,
    args: &FusedArgs,
    lane: usize,
    #[comptime] dim: usize,
) {
    let (g, t) = (lane / 4, lane % 4);
    let blocks = comptime!(dim / 32);
    #[unroll]
    for mb in 0..2usize {
        #[unroll]
        for v in 0..2usize {
            let r = r0 + 16 * mb + g + 8 * v;
            let row = o0 + r;
            if row < args.tokens {
                let inv = f32::reinterpret(stats[3 * TILE + r]);
                let slope = f32::reinterpret(stats[4 * TILE + r]);
                let target = usize::cast_from(targets[row]);
                #[unroll]
                for n in 0..comptime!(dim / 32) {
                    let x = acc[(mb * blocks + n) * 2 + v];
                    let ct = c_pairs[(target * dim + q0 + 8 * n) / 2 + t];
                    let mut y = Vector::<P, N2>::empty();
                    #[unroll]
                    for ee in 0..2usize {
                        let ctv = f32::cast_from(ct.extract(ee));
                        y.insert(ee, P::cast_from(x.extract(ee) * inv - slope * ctv));
                    }
                    de[(row * dim + q0 + 8 * n) / 2 + t] = y;
                }
            }
        }
    }
}

/// `de[i, :] *= dout[i]` in f32, in place (`de`: `[n, dim]` contiguous, `count = n·dim`).
#[cube(launch)]
pub(super) fn scale_rows_kernel<P: Float>(
    de: &mut Tensor<P>,
    dout: &Tensor<f32>,
    count: usize,
    dim: usize,
    #[define(P)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= count {
        terminate!();
    }
    de[i] = P::cast_from(f32::cast_from(de[i]) * dout[i / dim]);
}
