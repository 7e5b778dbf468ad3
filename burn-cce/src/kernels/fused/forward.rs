//! The fused forward: each token's log-sum-exp of `E·Cᵀ` (soft-capped) without writing a logit.
//! A cube owns `TILE` tokens and one segment of the vocabulary, walks the segment in tiles of
//! `TILE` entries (`S = E·Cᵀ` on the matrix units, each plane keeping a 16 × 32 block, see
//! `stages::scores`) and folds each tile into running per-row maxima and sums on the
//! registers; the segments' partial `(max, sum)` are merged by [`cce_lse_merge_kernel`].
//!
//! The tokens' fragments stay in registers for the whole walk (`stages::held_fragments`), so
//! shared memory holds only vocabulary tiles: two, the next one copied by bulk copies while the
//! cube computes on the current one (`copies`).

use cubecl::prelude::*;

use super::copies::{copy_rows, copy_to_buffer, tile_barrier, wait_tile};
use super::stages::{capped, held_fragments, score_block, scores_held, store_rows};
use super::{FusedArgs, PAD, TILE, XCHG};

/// A finite "minus infinity" for masked logits: its exponential is 0 and no infinity reaches
/// the arithmetic.
const NEG: f64 = -1.0e30;

#[cube(launch_unchecked)]
// Kernel code has no `div_ceil` nor `is_multiple_of`.
#[allow(
    clippy::too_many_arguments,
    clippy::manual_div_ceil,
    clippy::manual_is_multiple_of
)]
pub(super) fn cce_lse_kernel<P: Float, N2: Size, N8: Size>(
    e: &Tensor<Vector<P, N8>>,
    c: &Tensor<Vector<P, N8>>,
    part_max: &mut Tensor<f32>,
    part_sum: &mut Tensor<f32>,
    args: FusedArgs,
    segment: usize,
    #[comptime] dim: usize,
    #[comptime] has_softcap: bool,
    #[define(P)] _dtype: ElemType,
) {
    let tiles = (args.tokens + TILE - 1) / TILE;
    let segments = (args.vocab + segment - 1) / segment;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if cube >= tiles * segments {
        terminate!();
    }
    let o0 = (cube % tiles) * TILE;
    let seg = cube / tiles;
    let v_begin = seg * segment;
    let mut v_end = v_begin + segment;
    if v_end > args.vocab {
        v_end = args.vocab;
    }
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let tid = plane * 32 + lane;
    let t = lane % 4;
    let (sr0, sc0) = score_block(plane);

    // Two vocabulary tiles: one being read while the next lands.
    let words = comptime!(TILE * (dim / 2 + PAD));
    let mut y_sm = Shared::<[Vector<P, N2>]>::new_aligned_slice(comptime!(2 * words), 16usize);
    let mut xchg_sm = Shared::<[Vector<f32, N2>]>::new_aligned_slice(XCHG, 16usize);
    let bar0 = tile_barrier();
    let bar1 = tile_barrier();
    // The token block passes through the first tile into registers, where it stays.
    store_rows::<P, N2, N8>(e, o0, args.tokens, &mut y_sm, tid, dim);
    sync_cube();
    let a = held_fragments::<P, N2>(&y_sm, plane, lane, dim);
    sync_cube();
    // Ordered before the copies that overwrite what the units stored and read.
    sync_async_proxy_shared();
    copy_rows::<P, N2, N8>(c, v_begin, v_end, &mut y_sm, 0usize, &bar0, tid, dim);
    if v_begin + TILE < v_end {
        copy_rows::<P, N2, N8>(c, v_begin + TILE, v_end, &mut y_sm, words, &bar1, tid, dim);
    }

    let mut m = Array::<f32>::new(2usize);
    let mut l = Array::<f32>::new(2usize);
    #[unroll]
    for v in 0..2usize {
        m[v] = f32::new(NEG);
        l[v] = f32::new(0.0);
    }
    let mut s = Array::<Vector<f32, N2>>::new(8usize);
    let mut w0 = v_begin;
    // Tile k of the walk is in buffer k mod 2, the fill (k / 2) of its barrier.
    let mut k = 0u32;
    while w0 < v_end {
        let at = select(k % 2 == 0, 0usize, words);
        wait_tile(&bar0, &bar1, k);
        // Every plane has read its partner's sums of the last tile before they are replaced.
        sync_cube();
        scores_held::<P, N2>(&a, &y_sm, at, &mut xchg_sm, &mut s, plane, lane, dim);
        // No plane reads this tile any more (`scores_held` synced after its last read): the
        // tile after next lands here while the cube goes on.
        if w0 + 2 * TILE < v_end {
            let (first, same) = (w0 + 2 * TILE, k % 2);
            copy_to_buffer::<P, N2, N8>(
                c, first, v_end, &mut y_sm, at, same, &bar0, &bar1, tid, dim,
            );
        }
        #[unroll]
        for v in 0..2usize {
            // The tile's logits of the lane's row `v`, masked past the segment, and their max.
            let mut xs = Array::<f32>::new(8usize);
            let mut mx = m[v];
            #[unroll]
            for n in 0..4usize {
                let sv = s[2 * n + v];
                #[unroll]
                for k in 0..2usize {
                    let col = sc0 + 8 * n + 2 * t + k;
                    let mut slope = f32::new(1.0);
                    let x = capped(sv.extract(k), args.softcap, &mut slope, has_softcap);
                    let x = select(w0 + col < v_end, x, f32::new(NEG));
                    xs[2 * n + k] = x;
                    mx = f32::max(mx, x);
                }
            }
            let mut sum = l[v] * f32::exp(m[v] - mx);
            #[unroll]
            for i in 0..8usize {
                sum += select(xs[i] > f32::new(NEG), f32::exp(xs[i] - mx), f32::new(0.0));
            }
            m[v] = mx;
            l[v] = sum;
        }
        w0 += TILE;
        k += 1;
    }

    // Merge the 4 lanes of a row, then the two planes that share its rows.
    let mut red_max = Shared::<[f32]>::new_slice(comptime!(2 * TILE));
    let mut red_sum = Shared::<[f32]>::new_slice(comptime!(2 * TILE));
    #[unroll]
    for v in 0..2usize {
        let mut mx = m[v];
        let mut sum = l[v];
        merge_lanes(&mut mx, &mut sum, 1u32);
        merge_lanes(&mut mx, &mut sum, 2u32);
        if t == 0 {
            let at = (plane % 2) * TILE + sr0 + lane / 4 + 8 * v;
            red_max[at] = mx;
            red_sum[at] = sum;
        }
    }
    sync_cube();
    if tid < TILE && o0 + tid < args.tokens {
        let (m0, m1) = (red_max[tid], red_max[TILE + tid]);
        let mn = f32::max(m0, m1);
        let sum = red_sum[tid] * f32::exp(m0 - mn) + red_sum[TILE + tid] * f32::exp(m1 - mn);
        part_max[seg * args.tokens + o0 + tid] = mn;
        part_sum[seg * args.tokens + o0 + tid] = sum;
    }
}

/// Merges a running `(max, sum)` with the one of lane `lane ^ mask`.
#[cube]
fn merge_lanes(mx: &mut f32, sum: &mut f32, mask: u32) {
    let m = *mx;
    let s = *sum;
    let mo = plane_shuffle_xor(m, mask);
    let so = plane_shuffle_xor(s, mask);
    let mn = f32::max(m, mo);
    *sum = s * f32::exp(m - mn) + so * f32::exp(mo - mn);
    *mx = mn;
}

/// `lse[i] = M + ln Σ_s sum[s, i]·exp(max[s, i] − M)` over the `segments` partials of token
/// `i`, `M` their largest maximum.
#[cube(launch)]
pub(super) fn cce_lse_merge_kernel(
    part_max: &Tensor<f32>,
    part_sum: &Tensor<f32>,
    lse: &mut Tensor<f32>,
    tokens: usize,
    segments: usize,
) {
    let i = ABSOLUTE_POS;
    if i >= tokens {
        terminate!();
    }
    let mut mx = f32::new(NEG);
    for s in 0..segments {
        mx = f32::max(mx, part_max[s * tokens + i]);
    }
    let mut sum = f32::new(0.0);
    for s in 0..segments {
        sum += part_sum[s * tokens + i] * f32::exp(part_max[s * tokens + i] - mx);
    }
    lse[i] = mx + f32::ln(sum);
}
