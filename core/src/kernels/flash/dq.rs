//! The query-owned walk: one cube per `(batch · q_head, tile of TILE queries)`, one plane per 16
//! queries, walking the key tiles the queries see. Per key tile: `S = Q·Kᵀ` and `dP = dO·Vᵀ`
//! (Q and dO fragments held in registers for the whole walk), `dS = P ⊙ (dP − Δ)` on the
//! registers, `dQ += dS·K`. `dQ · scale` is written once at the end. Before the walk each plane
//! computes `Δ = rowsum(dO ⊙ O)` of its rows from register fragments and writes it for
//! [`super::dkdv`], which runs after this walk.

use cubecl::prelude::*;

use super::stages::{
    a_fragments, accumulate, head_base, keys_end, query_rows_gradients, rows_product,
    sees_key_tile, store_hidden, store_tile, write_rows, zero,
};
use super::{FlashArgs, PAD, Rows, TILE};

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
pub(super) fn flash_dq_kernel<P: Float, N2: Size>(
    q: &Tensor<Vector<P, N2>>,
    k: &Tensor<Vector<P, N2>>,
    v: &Tensor<Vector<P, N2>>,
    dout: &Tensor<Vector<P, N2>>,
    out: &Tensor<Vector<P, N2>>,
    lse: &Tensor<f32>,
    delta: &mut Tensor<f32>,
    dq: &mut Tensor<P>,
    pad: &Tensor<f32>,
    args: FlashArgs,
    q_rows: Rows,
    k_rows: Rows,
    v_rows: Rows,
    do_rows: Rows,
    o_rows: Rows,
    dq_rows: Rows,
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

    let mut qf = Array::<Vector<P, N2>>::new(comptime!(dim / 4));
    let mut dof = Array::<Vector<P, N2>>::new(comptime!(dim / 4));
    let q_base = head_base(&q_rows, bh, args.hq);
    let do_base = head_base(&do_rows, bh, args.hq);
    a_fragments::<P, N2>(q, q_base, q_rows.row, first, args.sq, lane, &mut qf, dim);
    a_fragments::<P, N2>(
        dout,
        do_base,
        do_rows.row,
        first,
        args.sq,
        lane,
        &mut dof,
        dim,
    );
    let k_base = head_base(&k_rows, bhk, args.hkv);
    let v_base = head_base(&v_rows, bhk, args.hkv);
    // Δ = rowsum(dO ⊙ O) of the plane's rows from the lane's fragments (rows `g`, `g + 8`:
    // fragments `j` even and odd), summed over the 4 lanes of a row; written for `dkdv`.
    let t = lane % 4;
    let mut of = Array::<Vector<P, N2>>::new(comptime!(dim / 4));
    let o_base = head_base(&o_rows, bh, args.hq);
    a_fragments::<P, N2>(out, o_base, o_rows.row, first, args.sq, lane, &mut of, dim);
    let mut row_lse = Array::<f32>::new(2usize);
    let mut row_delta = Array::<f32>::new(2usize);
    #[unroll]
    for v in 0..2usize {
        let mut d = f32::new(0.0);
        #[unroll]
        for kk in 0..comptime!(dim / 16) {
            #[unroll]
            for h in 0..2usize {
                let a = dof[kk * 4 + 2 * h + v];
                let b = of[kk * 4 + 2 * h + v];
                #[unroll]
                for e in 0..2usize {
                    d += f32::cast_from(a.extract(e)) * f32::cast_from(b.extract(e));
                }
            }
        }
        d += plane_shuffle_xor(d, 1u32);
        d += plane_shuffle_xor(d, 2u32);
        let r = row + 8 * v;
        let mut l = f32::new(0.0);
        if r < args.sq {
            l = lse[bh * args.sq + r];
            if t == 0 {
                delta[bh * args.sq + r] = d;
            }
        }
        row_lse[v] = l;
        row_delta[v] = d;
    }
    let mut acc = Array::<Vector<f32, N2>>::new(comptime!(dim / 4));
    zero::<N2>(&mut acc, dim);

    let mut k_sm =
        Shared::<[Vector<P, N2>]>::new_aligned_slice(comptime!(TILE * (dim / 2 + PAD)), 16usize);
    let mut v_sm =
        Shared::<[Vector<P, N2>]>::new_aligned_slice(comptime!(TILE * (dim / 2 + PAD)), 16usize);
    let mut s = Array::<Vector<f32, N2>>::new(comptime!(TILE / 4));
    let mut dp = Array::<Vector<f32, N2>>::new(comptime!(TILE / 4));
    let mut ds = Array::<Vector<P, N2>>::new(comptime!(TILE / 4));
    let mut hidden_sm = Shared::<[f32]>::new_slice(TILE);
    let pad_base = (bh / args.hq) * args.skv;

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
        rows_product::<P, N2>(&dof, &v_sm, &mut dp, lane, dim);
        if sees_key_tile(&args, kv0, first, causal, padded) {
            query_rows_gradients::<P, N2>(
                &s, &dp, &mut ds, &row_lse, &row_delta, &hidden_sm, &args, row, kv0, t, causal,
                false, padded,
            );
        } else {
            query_rows_gradients::<P, N2>(
                &s, &dp, &mut ds, &row_lse, &row_delta, &hidden_sm, &args, row, kv0, t, causal,
                true, padded,
            );
        }
        accumulate::<P, N2>(&ds, &k_sm, &mut acc, lane, dim);
        kv0 += TILE;
    }
    let mut factor = Array::<f32>::new(2usize);
    factor[0] = args.scale;
    factor[1] = args.scale;
    let dq_base = head_base(&dq_rows, bh, args.hq);
    write_rows::<P, N2>(
        &acc,
        dq,
        dq_base,
        dq_rows.row,
        first,
        args.sq,
        &factor,
        lane,
        dim,
    );
}
