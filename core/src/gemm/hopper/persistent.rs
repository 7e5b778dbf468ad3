//! The compensated adding GEMM as a persistent kernel ([`CompensatedStore::Persistent`]): one
//! cube per SM walks its share of the tiles, and the next tile's main loop starts while this
//! tile's pair is stored.
//!
//! Why: at burn-cce's dE carry (Gemma-2 shape, K = a vocabulary chunk of ~1700) a tile's main
//! loop is ~27 stages, and [`CompensatedStore::Prefetched`] (one cube a tile, 176 KB of shared
//! memory: one cube an SM) spends each tile's start filling the ring and its end storing the
//! pair while the tensor cores wait: 0.212 ms a chunk against 0.133 for `G`'s product of the
//! same FLOPs (H100, 2026-12-07). Here the ring runs on from tile to tile (its stages' parities
//! carried, [`mainloop::stage_flips`]), so the producer fills it with the next tile's stages
//! while the consumers update the pair; a third unit, the pair's, stores each tile's pair by
//! TMA and then loads the next tile's into the same shared memory, during the next main loop.
//!
//! Measured (H100, 2026-12-07, one machine, `bench/results/2026-12-07/nvidia-h100-s64.md`): the
//! adding product 200.6 µs a chunk (`ncu`; `G`'s product of the same FLOPs 133.1); burn-cce's
//! exact loss + gradient at the Gemma-2 shape 83.30 ms against 84.50 with the prefetched
//! kernel, Burn plain 84.67 and 84.46 in the same runs. `ncu` has it at 35% of the SM's compute
//! and 45% of L2's throughput, one cube an SM (168 registers a unit): the 128-column main loop
//! with one MMA group in flight, not the tile's start and end, holds the rest.
//!
//! Roles (384 units): unit 0 loads `A` and `B` stages; unit 32 loads and stores the pair;
//! warpgroups 1 and 2 run the MMAs and update the pair. Barriers: the ring's, `loaded` (the
//! pair's TMA bytes arrived, once a tile) and `updated` (both consumers wrote it, once a tile).

use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::ElemType;
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::prefetched::{PairLaunch, load_pair, pair_launch, pair_tile, store_pair, update_pair};
use super::{BK, BM, CompensatedStore, HopperTile, Plan, STAGES, WG, epilogue, mainloop};

/// Row and column of tile `t` of `tiles_m × tiles_n`, in the order the grid of the
/// one-tile kernels walks them (down M first where `tile.m_fast`).
#[cube]
fn tile_at(t: u32, tiles_m: u32, tiles_n: u32, #[comptime] tile: HopperTile) -> (u32, u32) {
    let (tile_m, tile_n) = if comptime![tile.m_fast] {
        (t % tiles_m, t / tiles_m)
    } else {
        (t / tiles_n, t % tiles_n)
    };
    (tile_m * BM as u32, tile_n * tile.bn as u32)
}

/// `sum, fix += A · B` over tiles `CUBE_POS_X, CUBE_POS_X + CUBE_COUNT_X, …` of the
/// `tiles_m × tiles_n` (K never split), as [`super::prefetched`]'s kernel does for one tile.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
pub(super) fn compensated_persistent_kernel<E: Float>(
    a: &TensorMap<E, Tiled>,
    b: &TensorMap<E, Tiled>,
    sum: &mut TensorMap<E, Tiled>,
    fix: &mut TensorMap<i8, Tiled>,
    k_tiles: u32,
    tiles_m: u32,
    tiles_n: u32,
    #[comptime] tile: HopperTile,
    #[define(E)] _dtype: ElemType,
) {
    let bn = comptime![tile.bn];
    let mut a_smem = Shared::<[E]>::new_aligned_slice(comptime![STAGES * BM * BK], 1024usize);
    let mut b_smem = Shared::<[E]>::new_aligned_slice(comptime![STAGES * bn * BK], 1024usize);
    let (mut sum_smem, mut fix_smem) = pair_tile::<E>(bn);
    let full = mainloop::ring_barriers();
    let empty = mainloop::ring_barriers();
    let loaded = Barrier::shared_uninit();
    let updated = Barrier::shared_uninit();
    if UNIT_POS == 0 {
        mainloop::init_ring(&full, &empty);
        loaded.init_manual(1u32);
        updated.init_manual(2 * WG);
    }
    sync_async_proxy_shared();
    sync_cube();

    let tiles = tiles_m * tiles_n;
    let (first, step) = (CUBE_POS_X, CUBE_COUNT_X);
    // This cube's tiles: first, first + step, ...
    let mine = select(tiles > first, (tiles - first + step - 1) / step, 0u32);
    // How a tile's main loop turns the ring's parities.
    let flips = mainloop::stage_flips(k_tiles);
    let wg = UNIT_POS / WG;
    if wg == 0 {
        if UNIT_POS == 0 {
            let mut phases = 0u32;
            for i in 0..mine {
                let (row0, col0) = tile_at(first + i * step, tiles_m, tiles_n, tile);
                mainloop::produce::<E>(
                    a,
                    b,
                    &mut a_smem,
                    &mut b_smem,
                    &full,
                    &empty,
                    0u32,
                    k_tiles,
                    row0,
                    col0,
                    phases,
                    tile,
                );
                phases ^= flips;
            }
        } else if UNIT_POS == 32 {
            // Tile i's pair is loaded once tile i − 1's is stored (the same shared memory).
            for i in 0..mine + 1 {
                if i > 0 {
                    let (row0, col0) = tile_at(first + (i - 1) * step, tiles_m, tiles_n, tile);
                    updated.wait_parity((i - 1) & 1);
                    store_pair::<E>(&sum_smem, &fix_smem, sum, fix, row0, col0, bn);
                }
                if i < mine {
                    let (row0, col0) = tile_at(first + i * step, tiles_m, tiles_n, tile);
                    load_pair::<E>(
                        &*sum,
                        &*fix,
                        &mut sum_smem,
                        &mut fix_smem,
                        &loaded,
                        row0,
                        col0,
                        bn,
                    );
                }
            }
        }
    } else {
        let c = (wg - 1) as usize;
        let mut phases = 0u32;
        for i in 0..mine {
            let acc = mainloop::consume::<E>(
                &a_smem, &b_smem, &full, &empty, c, k_tiles, phases, tile, true,
            );
            phases ^= flips;
            loaded.wait_parity(i & 1);
            update_pair::<E>(&acc, UNIT_POS % WG, c, &mut sum_smem, &mut fix_smem, bn);
            updated.arrive();
        }
    }
}

/// Launches [`compensated_persistent_kernel`] for `plan` (checked by
/// [`super::prefetched::refused`]: the same pair maps and tile) on one cube per SM (fewer where
/// the tiles are fewer), through [`epilogue::verified`].
pub(super) fn launch(
    lhs: &CubeTensor,
    rhs: &CubeTensor,
    plan: &Plan,
    sum: &CubeTensor,
    fix: &CubeTensor,
) -> Result<(), String> {
    let PairLaunch {
        tile,
        maps: [a_map, b_map, sum_map, fix_map],
        k_tiles,
        ..
    } = pair_launch(lhs, rhs, plan, [sum, fix], CompensatedStore::Persistent);
    let client = lhs.client.clone();
    let (tiles_m, tiles_n) = (plan.m.div_ceil(BM) as u32, plan.n.div_ceil(tile.bn) as u32);
    // One cube an SM (an H100's 132 where the runtime does not say).
    let sms = client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .unwrap_or(132);
    let cubes = (tiles_m * tiles_n).min(sms.max(1));
    epilogue::verified((tile, lhs.dtype), sum.clone(), || {
        // SAFETY: TMA reads and writes only inside the maps (loads fill zeros past their ends,
        // stores clip there); every cube's tiles are distinct.
        unsafe {
            compensated_persistent_kernel::launch_unchecked(
                &client,
                CubeCount::Static(cubes, 1, 1),
                CubeDim::new_1d(3 * WG),
                a_map,
                b_map,
                sum_map,
                fix_map,
                k_tiles,
                tiles_m,
                tiles_n,
                tile,
                burn::backend::cubecl::dtype_to_storage_type(lhs.dtype),
            );
        }
    })
    .map(|_| ())
}
