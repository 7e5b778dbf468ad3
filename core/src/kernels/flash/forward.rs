//! The forward walk: one cube per `(batch · q_head, tile of TILE queries)`, one plane per 16
//! queries, walking the key tiles the queries see. Per key tile: `S = Q·Kᵀ` (Q fragments held
//! in registers for the whole walk), the online softmax on the registers (running row maxima,
//! the accumulator rescaled when a maximum grows), `O += P·V`. At the end `O / Σ` is written,
//! and each query's log-sum-exp of the scaled scores, which the backward walks recompute the
//! probabilities from.

use cubecl::prelude::*;

use super::stages::{
    a_fragments, accumulate, head_base, keys_end, online_softmax, rows_product, sees_key_tile,
    softmax_start, store_hidden, store_tile, write_rows, zero,
};
use super::{FlashArgs, PAD, Rows, TILE};

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
pub(super) fn flash_forward_kernel<P: Float, N2: Size>(
    q: &Tensor<Vector<P, N2>>,
    k: &Tensor<Vector<P, N2>>,
    v: &Tensor<Vector<P, N2>>,
    out: &mut Tensor<P>,
    lse: &mut Tensor<f32>,
    pad: &Tensor<f32>,
    args: FlashArgs,
    q_rows: Rows,
    k_rows: Rows,
    v_rows: Rows,
    out_rows: Rows,
    #[comptime] dim: usize,
    #[comptime] causal: bool,
    #[comptime] padded: bool,
    #[define(P)] _dtype: ElemType,
) {
    let q_tiles = (args.sq + TILE - 1) / TILE;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if cube >= args.heads * q_tiles {
        terminate!();
    }
    let bh = cube / q_tiles;
    // Longest walks first: with a causal mask the last query tiles see the most keys.
    let q0 = (q_tiles - 1 - cube % q_tiles) * TILE;
    let bhk = (bh / args.hq) * args.hkv + (bh % args.hq) / (args.hq / args.hkv);
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let tid = plane * 32 + lane;
    let first = q0 + plane * 16;
    let row = first + lane / 4;
    let t = lane % 4;

    let mut qf = Array::<Vector<P, N2>>::new(comptime!(dim / 4));
    let q_base = head_base(&q_rows, bh, args.hq);
    a_fragments::<P, N2>(q, q_base, q_rows.row, first, args.sq, lane, &mut qf, dim);
    let k_base = head_base(&k_rows, bhk, args.hkv);
    let v_base = head_base(&v_rows, bhk, args.hkv);

    let mut acc = Array::<Vector<f32, N2>>::new(comptime!(dim / 4));
    zero::<N2>(&mut acc, dim);
    let mut m = Array::<f32>::new(2usize);
    let mut l = Array::<f32>::new(2usize);
    softmax_start(&mut m, &mut l);

    let mut k_sm =
        Shared::<[Vector<P, N2>]>::new_aligned_slice(comptime!(TILE * (dim / 2 + PAD)), 16usize);
    let mut v_sm =
        Shared::<[Vector<P, N2>]>::new_aligned_slice(comptime!(TILE * (dim / 2 + PAD)), 16usize);
    let mut hidden_sm = Shared::<[f32]>::new_slice(TILE);
    let pad_base = (bh / args.hq) * args.skv;
    let mut s = Array::<Vector<f32, N2>>::new(comptime!(TILE / 4));
    let mut p = Array::<Vector<P, N2>>::new(comptime!(TILE / 4));

    let kv_end = keys_end(&args, q0, causal);
    let mut kv0 = 0usize;
    while kv0 < kv_end {
        sync_cube();
        let valid = args.skv - kv0;
        let k_at = k_base + kv0 * k_rows.row;
        let v_at = v_base + kv0 * v_rows.row;
        store_tile::<P, N2>(k, k_at, k_rows.row, valid, &mut k_sm, tid, dim);
        store_tile::<P, N2>(v, v_at, v_rows.row, valid, &mut v_sm, tid, dim);
        store_hidden(pad, pad_base, kv0, &args, &mut hidden_sm, tid, padded);
        sync_cube();
        rows_product::<P, N2>(&qf, &k_sm, &mut s, lane, dim);
        if sees_key_tile(&args, kv0, first, causal, padded) {
            online_softmax::<P, N2>(
                &mut s, &mut p, &mut m, &mut l, &mut acc, &hidden_sm, &args, row, kv0, t, dim,
                causal, false, padded,
            );
        } else {
            online_softmax::<P, N2>(
                &mut s, &mut p, &mut m, &mut l, &mut acc, &hidden_sm, &args, row, kv0, t, dim,
                causal, true, padded,
            );
        }
        accumulate::<P, N2>(&p, &v_sm, &mut acc, lane, dim);
        kv0 += TILE;
    }

    let mut inv = Array::<f32>::new(2usize);
    #[unroll]
    for r in 0..2usize {
        let mut sum = l[r] + plane_shuffle_xor(l[r], 1u32);
        sum += plane_shuffle_xor(sum, 2u32);
        inv[r] = select(sum > f32::new(0.0), f32::new(1.0) / sum, f32::new(0.0));
        let query = row + 8 * r;
        // A query that sees no key (all hidden by a key-padding mask) gets a large finite
        // log-sum-exp: its output is zero and the backward's probabilities of it are zero.
        if t == 0 && query < args.sq {
            lse[bh * args.sq + query] =
                select(sum > f32::new(0.0), m[r] + f32::ln(sum), f32::new(1.0e30));
        }
    }
    let out_base = head_base(&out_rows, bh, args.hq);
    write_rows::<P, N2>(
        &acc,
        out,
        out_base,
        out_rows.row,
        first,
        args.sq,
        &inv,
        lane,
        dim,
    );
}
