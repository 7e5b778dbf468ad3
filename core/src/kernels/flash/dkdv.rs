//! The key-owned walk: one cube per `(batch · kv_head, tile of TILE keys)`, one plane per 16
//! keys, walking every query head of the key head's group and the query tiles that see the
//! keys. Per query tile: `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ` (K and V fragments held in registers),
//! `Pᵀ` and `dSᵀ = Pᵀ ⊙ (dPᵀ − Δ)` on the registers, `dV += Pᵀ·dO` and `dK += dSᵀ·Q`. The
//! group's query heads sum in the registers, so grouped-query attention needs no reduction
//! afterwards.

use cubecl::prelude::*;

use super::stages::{
    a_fragments, accumulate, head_base, key_rows_gradients, rows_product, store_tile, write_rows,
    zero,
};
use super::{FlashArgs, PAD, Rows, TILE};

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
pub(super) fn flash_dkdv_kernel<P: Float, N2: Size>(
    q: &Tensor<Vector<P, N2>>,
    k: &Tensor<Vector<P, N2>>,
    v: &Tensor<Vector<P, N2>>,
    dout: &Tensor<Vector<P, N2>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<P>,
    dv: &mut Tensor<P>,
    pad: &Tensor<f32>,
    args: FlashArgs,
    q_rows: Rows,
    k_rows: Rows,
    v_rows: Rows,
    do_rows: Rows,
    dkv_rows: Rows,
    #[comptime] dim: usize,
    #[comptime] causal: bool,
    #[comptime] padded: bool,
    #[define(P)] _dtype: ElemType,
) {
    let k_tiles = (args.skv + TILE - 1) / TILE;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let group = args.hq / args.hkv;
    if cube >= (args.heads / group) * k_tiles {
        terminate!();
    }
    let bhk = cube / k_tiles;
    // With a causal mask the first key tiles are seen by the most queries: they go first.
    let k0 = (cube % k_tiles) * TILE;
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let tid = plane * 32 + lane;
    let first = k0 + plane * 16;
    let row = first + lane / 4;
    let t = lane % 4;

    let mut kf = Array::<Vector<P, N2>>::new(comptime!(dim / 4));
    let mut vf = Array::<Vector<P, N2>>::new(comptime!(dim / 4));
    let k_base = head_base(&k_rows, bhk, args.hkv);
    let v_base = head_base(&v_rows, bhk, args.hkv);
    a_fragments::<P, N2>(k, k_base, k_rows.row, first, args.skv, lane, &mut kf, dim);
    a_fragments::<P, N2>(v, v_base, v_rows.row, first, args.skv, lane, &mut vf, dim);
    let mut dk_acc = Array::<Vector<f32, N2>>::new(comptime!(dim / 4));
    let mut dv_acc = Array::<Vector<f32, N2>>::new(comptime!(dim / 4));
    zero::<N2>(&mut dk_acc, dim);
    zero::<N2>(&mut dv_acc, dim);

    let rows = comptime!(TILE * (dim / 2 + PAD));
    let mut q_sm = Shared::<[Vector<P, N2>]>::new_aligned_slice(rows, 16usize);
    let mut do_sm = Shared::<[Vector<P, N2>]>::new_aligned_slice(rows, 16usize);
    let mut lse_sm = Shared::<[f32]>::new_slice(TILE);
    let mut delta_sm = Shared::<[f32]>::new_slice(TILE);
    let mut st = Array::<Vector<f32, N2>>::new(comptime!(TILE / 4));
    let mut dpt = Array::<Vector<f32, N2>>::new(comptime!(TILE / 4));
    let mut p = Array::<Vector<P, N2>>::new(comptime!(TILE / 4));
    let mut ds = Array::<Vector<P, N2>>::new(comptime!(TILE / 4));

    // The first query tile that sees any of the keys.
    let mut q_start = 0usize;
    if causal && k0 > args.offset {
        q_start = (k0 - args.offset) / TILE * TILE;
    }
    let b = bhk / args.hkv;
    let hk = bhk % args.hkv;
    // Whether a key-padding mask hides the lane's keys `row`, `row + 8` (past the end: hidden).
    let mut key_hidden = Array::<f32>::new(2usize);
    #[unroll]
    for v in 0..2usize {
        let key = row + 8 * v;
        let mut h = f32::new(0.0);
        if padded {
            h = f32::new(1.0);
            if key < args.skv {
                h = pad[b * args.skv + key];
            }
        }
        key_hidden[v] = h;
    }
    for gi in 0..group {
        let bh = b * args.hq + hk * group + gi;
        let mut q0 = q_start;
        while q0 < args.sq {
            sync_cube();
            let base = bh * args.sq + q0;
            let valid = args.sq - q0;
            let q_at = head_base(&q_rows, bh, args.hq) + q0 * q_rows.row;
            let do_at = head_base(&do_rows, bh, args.hq) + q0 * do_rows.row;
            store_tile::<P, N2>(q, q_at, q_rows.row, valid, &mut q_sm, tid, dim);
            store_tile::<P, N2>(dout, do_at, do_rows.row, valid, &mut do_sm, tid, dim);
            if tid < TILE {
                let mut l = f32::new(0.0);
                let mut d = f32::new(0.0);
                if tid < valid {
                    l = lse[base + tid];
                    d = delta[base + tid];
                }
                lse_sm[tid] = l;
                delta_sm[tid] = d;
            }
            sync_cube();
            rows_product::<P, N2>(&kf, &q_sm, &mut st, lane, dim);
            rows_product::<P, N2>(&vf, &do_sm, &mut dpt, lane, dim);
            // Every query of the tile exists and sees every key of the plane: no mask.
            let mut full = q0 + TILE <= args.sq;
            if causal {
                full = full && first + 16 <= q0 + args.offset + 1;
            }
            if padded {
                full = false;
            }
            if full {
                key_rows_gradients::<P, N2>(
                    &st,
                    &dpt,
                    &mut p,
                    &mut ds,
                    &lse_sm,
                    &delta_sm,
                    &key_hidden,
                    &args,
                    row,
                    q0,
                    t,
                    causal,
                    false,
                    padded,
                );
            } else {
                key_rows_gradients::<P, N2>(
                    &st,
                    &dpt,
                    &mut p,
                    &mut ds,
                    &lse_sm,
                    &delta_sm,
                    &key_hidden,
                    &args,
                    row,
                    q0,
                    t,
                    causal,
                    true,
                    padded,
                );
            }
            accumulate::<P, N2>(&p, &do_sm, &mut dv_acc, lane, dim);
            accumulate::<P, N2>(&ds, &q_sm, &mut dk_acc, lane, dim);
            q0 += TILE;
        }
    }
    let base = head_base(&dkv_rows, bhk, args.hkv);
    let mut factor = Array::<f32>::new(2usize);
    factor[0] = args.scale;
    factor[1] = args.scale;
    write_rows::<P, N2>(
        &dk_acc,
        dk,
        base,
        dkv_rows.row,
        first,
        args.skv,
        &factor,
        lane,
        dim,
    );
    factor[0] = f32::new(1.0);
    factor[1] = f32::new(1.0);
    write_rows::<P, N2>(
        &dv_acc,
        dv,
        base,
        dkv_rows.row,
        first,
        args.skv,
        &factor,
        lane,
        dim,
    );
}
