//! The fused backward: one launch per gradient. A cube owns `TILE` rows of one operand — tokens
//! for dE, vocabulary entries for dC — and walks every row of the other in tiles of `TILE`:
//! `S = X·Yᵀ` on the matrix units, the logit gradient `G` of the tile into shared memory, and
//! `acc += G·Y` into f32 accumulators that stay in registers for the whole walk. The owned rows'
//! gradient is written once, in the operands' dtype; nothing else is written. The next walked
//! tile is copied by bulk copies into a second buffer while the cube computes on the current
//! one.
//!
//! Planes (8 a cube): for `S`, two planes a 32 × 32 block, each over half the depth, and each
//! keeps 16 of its rows for `G` (`stages::scores`); for `G·Y`, rows `32(p mod 2) ..` and
//! channels `(p / 2)·dim/4 ..`, so every plane holds `dim / 4` f32 accumulators a lane (144 at
//! `dim = 576`). With the gradient filter a tile whose every `|softmax − onehot|` is below the
//! threshold skips `G·Y`.

use cubecl::prelude::*;

use super::copies::{copy_rows, copy_to_buffer, tile_barrier, wait_tile};
use super::stages::{
    accumulate, gradients, score_block, scores, store_rows, token_grad, write_rows,
};
use super::{FusedArgs, PAD, THREADS, TILE};

#[cube(launch_unchecked)]
// `vocab_owned` is known when the kernel is compiled, `tid < TILE` only when it runs: kept apart.
// Kernel code has no `is_multiple_of`.
#[allow(
    clippy::too_many_arguments,
    clippy::collapsible_if,
    clippy::manual_is_multiple_of
)]
pub(super) fn cce_grad_kernel<P: Float, I: Int, N2: Size, N8: Size>(
    x: &Tensor<Vector<P, N8>>,
    y: &Tensor<Vector<P, N8>>,
    lse: &Tensor<f32>,
    dout: &Tensor<f32>,
    targets: &Tensor<I>,
    out: &mut Tensor<Vector<P, N2>>,
    args: FusedArgs,
    #[comptime] dim: usize,
    #[comptime] vocab_owned: bool,
    #[comptime] has_softcap: bool,
    #[comptime] filtered: bool,
    #[define(P, I)] _dtypes: [ElemType; 2],
) {
    // Owned rows: vocabulary entries (dC) or tokens (dE); walked rows: the other.
    let mut owned = args.tokens;
    let mut walked = args.vocab;
    if vocab_owned {
        owned = args.vocab;
        walked = args.tokens;
    }
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if cube * TILE >= owned {
        terminate!();
    }
    let o0 = cube * TILE;
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let tid = plane * 32 + lane;
    let (sr0, sc0) = score_block(plane);
    let (ar0, aq0) = (32 * (plane % 2), (plane / 2) * comptime!(dim / 4));

    // The owned tile (swizzled), two walked tiles (padded: one read while bulk copies fill the
    // other), the gradient tile (through which the planes also trade partial logits) and the
    // walked tokens' data: 232 240 bytes at `dim = 576` (`super::shared_bytes`).
    let words = comptime!(TILE * (dim / 2 + PAD));
    let mut x_sm = Shared::<[Vector<P, N2>]>::new_aligned_slice(comptime!(TILE * dim / 2), 16usize);
    let mut y_sm = Shared::<[Vector<P, N2>]>::new_aligned_slice(comptime!(2 * words), 16usize);
    let mut g_sm =
        Shared::<[Vector<P, N2>]>::new_aligned_slice(comptime!(TILE * TILE / 2), 16usize);
    let mut tok_lse = Shared::<[f32]>::new_slice(TILE);
    let mut tok_dout = Shared::<[f32]>::new_slice(TILE);
    let mut tok_target = Shared::<[u32]>::new_slice(TILE);
    // Each plane's "some entry of the tile passes the filter".
    let mut wanted = Shared::<[u32]>::new_slice(comptime!(THREADS / 32));
    let bar0 = tile_barrier();
    let bar1 = tile_barrier();
    copy_rows::<P, N2, N8>(y, 0usize, walked, &mut y_sm, 0usize, &bar0, tid, dim);
    store_rows::<P, N2, N8>(x, o0, owned, &mut x_sm, tid, dim);

    // Where the rows are tokens, their data, once (written before the first tile's sync).
    if !vocab_owned {
        if tid < TILE {
            token_grad::<I>(
                lse,
                dout,
                targets,
                o0 + tid,
                &args,
                &mut tok_lse,
                &mut tok_dout,
                &mut tok_target,
                tid,
            );
        }
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
    while w0 < walked {
        let at = select(k % 2 == 0, 0usize, words);
        wait_tile(&bar0, &bar1, k);
        // Every plane is done with the last tile (and the owned tile is stored): the next tile
        // goes where the last one was, while the cube computes on this one.
        sync_cube();
        if w0 + TILE < walked {
            let next = words - at;
            let (first, other) = (w0 + TILE, (k + 1) % 2);
            copy_to_buffer::<P, N2, N8>(
                y, first, walked, &mut y_sm, next, other, &bar0, &bar1, tid, dim,
            );
        }
        // The walked tokens' data, read by `gradients` after the syncs of `scores`.
        if vocab_owned {
            if tid < TILE {
                token_grad::<I>(
                    lse,
                    dout,
                    targets,
                    w0 + tid,
                    &args,
                    &mut tok_lse,
                    &mut tok_dout,
                    &mut tok_target,
                    tid,
                );
            }
        }
        scores::<P, N2>(&x_sm, &y_sm, at, &mut g_sm, &mut s, plane, lane, dim);
        let big = gradients::<P, N2>(
            &s,
            &mut g_sm,
            &tok_lse,
            &tok_dout,
            &tok_target,
            &args,
            o0,
            w0,
            sr0,
            sc0,
            lane,
            vocab_owned,
            has_softcap,
            filtered,
        );
        if filtered {
            let any = plane_any(big);
            if lane == 0 {
                wanted[plane] = u32::cast_from(any);
            }
        }
        sync_cube();
        // The paper's gradient filter, per tile: a tile whose every entry is below the
        // threshold adds nothing (the same decision in every plane: a uniform branch).
        let mut keep = true;
        if filtered {
            let mut some = 0u32;
            #[unroll]
            for p in 0..comptime!(THREADS / 32) {
                some |= wanted[p];
            }
            keep = some != 0;
        }
        if keep {
            accumulate::<P, N2>(&g_sm, &y_sm, at, ar0, aq0, &mut acc, lane, dim);
        }
        w0 += TILE;
        k += 1;
    }
    write_rows::<P, N2>(&acc, out, o0 + ar0, owned, aq0, lane, dim);
}
