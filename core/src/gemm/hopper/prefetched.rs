//! The compensated adding GEMM with its pair loaded during the main loop
//! ([`CompensatedStore::Prefetched`]).
//!
//! Why: with the pair read in the epilogue, the adding product took 0.253 ms a chunk of
//! burn-cce's dE carry against 0.131 for `G`'s product with the same main loop (H100,
//! 2026-12-07, Gemma-2 shape): each tile's epilogue waited on its loads. Here the producer issues
//! the TMA loads of the tile's 16-bit sum and i8 corrections before its first stage of `A` and
//! `B`, so they arrive while the MMAs run. The consumers update the pair in shared memory where
//! the MMA left each value (both tiles swizzled 128 bytes, so a warp's accesses hit 32 distinct
//! banks), and one unit stores both tiles back by TMA. The ring, the pair and the barriers take
//! 176 KB of shared memory at `bn` = [`PREFETCH_BN`].
//!
//! Measured (H100, 2026-12-07, same machine): 0.212 ms a chunk; burn-cce's exact loss +
//! gradient at the Gemma-2 shape 82.50 ms against 87.49 with the wide store and Burn plain's
//! 81.37 (`bench/results/2026-12-07/nvidia-h100-s63.md`).

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::{ElemType, IntKind};
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;
use cubecl::wgmma::{Accumulator, Major, Swizzle, WARPGROUP_M, WgmmaTileLayout};
use cubecl::zspace::{Shape, Strides};

use super::add::{compensated_value, correction};
use super::plan::elem;
use super::{BK, BM, CompensatedStore, Epilogue, HopperTile, Plan, STAGES, WG, epilogue, mainloop};

/// Columns of the prefetched kernel's tile: the ring (4 stages of `128 × 64` and `bn × 64`)
/// and the pair (3 bytes a value) fit 227 KB of shared memory at 128, not at 192 or 256.
pub const PREFETCH_BN: usize = 128;
/// Columns of one swizzled panel of the 16-bit sum (128 bytes).
const SUM_PANEL: usize = 64;

/// The layout of the pair's tile `[BM, bn]` in shared memory, for either element size (given
/// where an offset is taken): panels of 128 bytes of a row, swizzled 128 bytes (as a TMA box
/// one panel wide writes it).
const fn pair_layout(bn: usize) -> WgmmaTileLayout {
    WgmmaTileLayout {
        major: Major::K,
        swizzle: Swizzle::B128,
        rows: BM,
        k: bn,
    }
}

/// A vector of two values of the pair (a sum or its corrections).
type Two<T> = Vector<T, Const<2>>;
/// The pair's tile in shared memory: the sum and the corrections ([`pair_tile`]).
type PairSmem<E> = (Shared<[Two<E>]>, Shared<[Two<i8>]>);

/// The pair's tile in shared memory (`BM × bn`, 3 bytes a value, as [`pair_layout`] lays it
/// out): the 16-bit sum and the i8 corrections, in vectors of two.
#[cube]
pub(super) fn pair_tile<E: Float>(#[comptime] bn: usize) -> PairSmem<E> {
    (
        Shared::<[Two<E>]>::new_aligned_slice(comptime![BM * bn / 2], 1024usize),
        Shared::<[Two<i8>]>::new_aligned_slice(comptime![BM * bn / 2], 1024usize),
    )
}

/// Issues the TMA loads of the pair's tile at `(row0, col0)` into shared memory (one unit),
/// expected on `bar`: the sum in panels of 64 columns, the corrections in panels of 128.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_pair<E: Float>(
    sum: &TensorMap<E, Tiled>,
    fix: &TensorMap<i8, Tiled>,
    sum_smem: &mut Shared<[Two<E>]>,
    fix_smem: &mut Shared<[Two<i8>]>,
    bar: &Shared<Barrier>,
    row0: u32,
    col0: u32,
    #[comptime] bn: usize,
) {
    let sum_panel = comptime![BM * SUM_PANEL / 2];
    let fix_panel = comptime![BM * 128 / 2];
    #[unroll]
    for p in 0..comptime![bn / SUM_PANEL] {
        let at = p * sum_panel;
        let x = col0 + comptime![p * SUM_PANEL] as u32;
        bar.tma_load_2d(
            sum,
            &mut sum_smem[at..at + sum_panel],
            row0 as i32,
            x as i32,
        );
    }
    #[unroll]
    for p in 0..comptime![bn / 128] {
        let at = p * fix_panel;
        let x = col0 + comptime![p * 128] as u32;
        bar.tma_load_2d(
            fix,
            &mut fix_smem[at..at + fix_panel],
            row0 as i32,
            x as i32,
        );
    }
    bar.arrive_and_expect_tx(1u32, comptime![(BM * bn * 3) as u32]);
}

/// Consumer `c`'s update of its 64 rows of the pair's tile with its sums `acc` (`unit` of its
/// warpgroup), where the MMA left each value; the writes are fenced for the TMA stores.
#[cube]
pub(super) fn update_pair<E: Float>(
    acc: &Accumulator<f32>,
    unit: u32,
    c: usize,
    sum_smem: &mut Shared<[Two<E>]>,
    fix_smem: &mut Shared<[Two<i8>]>,
    #[comptime] bn: usize,
) {
    let layout = comptime![pair_layout(bn)];
    #[unroll]
    for j in 0..comptime![WARPGROUP_M * bn / (2 * WG as usize)] {
        let (r, col) = acc.position_of_nth(unit, 2 * j as u32);
        let row = c * 64 + r as usize;
        let s_at = layout.offset(row, col as usize, 2usize) / 2;
        let f_at = layout.offset(row, col as usize, 1usize) / 2;
        let old = sum_smem[s_at];
        let qs = fix_smem[f_at];
        let mut hi_v = Two::<E>::empty();
        let mut q_v = Two::<i8>::empty();
        #[unroll]
        for h in 0..2usize {
            let total = compensated_value::<E>(acc.get(2 * j + h), old.extract(h), qs.extract(h));
            let hi = E::cast_from(total);
            hi_v.insert(h, hi);
            q_v.insert(h, correction::<E>(total, hi));
        }
        sum_smem[s_at] = hi_v;
        fix_smem[f_at] = q_v;
    }
    // The units' writes, before the TMA stores read them.
    sync_async_proxy_shared();
}

/// Stores the pair's tile at `(row0, col0)` by TMA (one unit) and waits until the stores read
/// it (their writes to global memory land by the kernel's end).
#[cube]
pub(super) fn store_pair<E: Float>(
    sum_smem: &Shared<[Two<E>]>,
    fix_smem: &Shared<[Two<i8>]>,
    sum: &mut TensorMap<E, Tiled>,
    fix: &mut TensorMap<i8, Tiled>,
    row0: u32,
    col0: u32,
    #[comptime] bn: usize,
) {
    let sum_panel = comptime![BM * SUM_PANEL / 2];
    let fix_panel = comptime![BM * 128 / 2];
    #[unroll]
    for p in 0..comptime![bn / SUM_PANEL] {
        let at = p * sum_panel;
        let x = col0 + comptime![p * SUM_PANEL] as u32;
        tma_store_2d(&sum_smem[at..at + sum_panel], sum, row0 as i32, x as i32).wait();
    }
    #[unroll]
    for p in 0..comptime![bn / 128] {
        let at = p * fix_panel;
        let x = col0 + comptime![p * 128] as u32;
        tma_store_2d(&fix_smem[at..at + fix_panel], fix, row0 as i32, x as i32).wait();
    }
}

/// `sum, fix += A · B` for the cube's `BM × bn` tile (K never split), the pair loaded by TMA
/// during the main loop and stored back by TMA; rows past `m` and columns past `n` are neither
/// read (TMA fills zeros) nor written (TMA clips).
#[cube(launch_unchecked)]
fn compensated_prefetched_kernel<E: Float>(
    a: &TensorMap<E, Tiled>,
    b: &TensorMap<E, Tiled>,
    sum: &mut TensorMap<E, Tiled>,
    fix: &mut TensorMap<i8, Tiled>,
    k_tiles: u32,
    #[comptime] tile: HopperTile,
    #[define(E)] _dtype: ElemType,
) {
    let mut a_smem = Shared::<[E]>::new_aligned_slice(comptime![STAGES * BM * BK], 1024usize);
    let mut b_smem = Shared::<[E]>::new_aligned_slice(comptime![STAGES * tile.bn * BK], 1024usize);
    let (mut sum_smem, mut fix_smem) = pair_tile::<E>(tile.bn);
    let full = mainloop::ring_barriers();
    let empty = mainloop::ring_barriers();
    let loaded = Barrier::shared_uninit();
    if UNIT_POS == 0 {
        mainloop::init_ring(&full, &empty);
        loaded.init_manual(1u32);
    }
    sync_async_proxy_shared();
    sync_cube();

    let (_, _, row0, col0) = mainloop::tile_origin(tile);
    let wg = UNIT_POS / WG;
    if wg == 0 {
        if UNIT_POS == 0 {
            // The pair first: it is needed last, and its loads overlap the whole main loop.
            load_pair::<E>(
                &*sum,
                &*fix,
                &mut sum_smem,
                &mut fix_smem,
                &loaded,
                row0,
                col0,
                tile.bn,
            );
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
                0u32,
                tile,
            );
        }
    } else {
        let c = (wg - 1) as usize;
        let acc = mainloop::consume::<E>(
            &a_smem, &b_smem, &full, &empty, c, k_tiles, 0u32, tile, false,
        );
        loaded.wait_parity(0u32);
        update_pair::<E>(
            &acc,
            UNIT_POS % WG,
            c,
            &mut sum_smem,
            &mut fix_smem,
            tile.bn,
        );
    }
    sync_cube();
    if UNIT_POS == 0 {
        store_pair::<E>(&sum_smem, &fix_smem, sum, fix, row0, col0, tile.bn);
    }
}

/// A tensor map over the contiguous `[m, n]` tensor `t` of `elem` (`bytes` each), in boxes of
/// `BM` rows and 128 bytes of a row, swizzled 128 bytes.
fn pair_map(t: &CubeTensor, elem: ElemType, bytes: usize) -> TensorMapArg<Tiled> {
    let [rows, cols] = t.meta.shape().dims::<2>();
    let mut binding = t.clone().binding();
    binding.shape = Shape::new([rows, cols]);
    binding.strides = Strides::new(&[cols, 1]);
    TensorMapArg::new(
        TiledArgs {
            tile_size: Shape::new([BM, 128 / bytes]),
        },
        binding.into_tensor_arg(),
        elem,
    )
    .with_swizzle(pair_layout(PREFETCH_BN).tensor_map_swizzle())
}

/// Why [`CompensatedStore::Prefetched`] cannot take the pair (`sum`, `fix`) of `plan`'s product
/// of `lhs`'s dtype; `None` where it can: the sum in the operands' dtype, and rows TMA can
/// address (16-byte multiples: `n` a multiple of 16 for the corrections) from 16-byte aligned
/// starts.
pub(super) fn refused(
    plan: &Plan,
    lhs: &CubeTensor,
    sum: &CubeTensor,
    fix: &CubeTensor,
) -> Option<String> {
    let offset = |t: &CubeTensor| t.handle.offset_start.unwrap_or(0);
    if sum.dtype != lhs.dtype {
        Some(format!("a {:?} sum of {:?} products", sum.dtype, lhs.dtype))
    } else if !plan.n.is_multiple_of(16) {
        Some(format!(
            "rows of {} corrections (TMA: multiples of 16 bytes)",
            plan.n
        ))
    } else if !offset(sum).is_multiple_of(16) || !offset(fix).is_multiple_of(16) {
        Some("a pair starting at an address TMA cannot read".into())
    } else {
        None
    }
}

/// What a pair kernel's launch takes: its tile, the maps of `A`, `B`, the sum and the
/// corrections, the grid of one cube a tile, and K's stages.
pub(super) struct PairLaunch {
    pub(super) tile: HopperTile,
    pub(super) maps: [TensorMapArg<Tiled>; 4],
    pub(super) count: CubeCount,
    pub(super) k_tiles: u32,
}

/// [`PairLaunch`] of `store`'s kernel (`Prefetched` or `Persistent`) for `plan` (checked by
/// [`refused`]).
pub(super) fn pair_launch(
    lhs: &CubeTensor,
    rhs: &CubeTensor,
    plan: &Plan,
    [sum, fix]: [&CubeTensor; 2],
    store: CompensatedStore,
) -> PairLaunch {
    let tile = key_tile(plan, store);
    let ([a_map, b_map], count) = super::operand_maps_and_grid(lhs, rhs, plan, &tile, 1);
    let sum_map = pair_map(sum, elem(sum.dtype).expect("checked"), 2);
    let fix_map = pair_map(fix, ElemType::Int(IntKind::I8), 1);
    PairLaunch {
        tile,
        maps: [a_map, b_map, sum_map, fix_map],
        count,
        k_tiles: plan.k.div_ceil(BK) as u32,
    }
}

/// Launches [`compensated_prefetched_kernel`] for `plan` (checked by [`refused`]) through
/// [`epilogue::verified`].
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
        count,
        k_tiles,
    } = pair_launch(lhs, rhs, plan, [sum, fix], CompensatedStore::Prefetched);
    let client = lhs.client.clone();
    epilogue::verified((tile, lhs.dtype), sum.clone(), || {
        // SAFETY: TMA reads and writes only inside the maps (loads fill zeros past their ends,
        // stores clip there).
        unsafe {
            compensated_prefetched_kernel::launch_unchecked(
                &client,
                count,
                CubeDim::new_1d(3 * WG),
                a_map,
                b_map,
                sum_map,
                fix_map,
                k_tiles,
                tile,
                burn::backend::cubecl::dtype_to_storage_type(lhs.dtype),
            );
        }
    })
    .map(|_| ())
}

/// The tile of `store`'s kernel (`Prefetched` or `Persistent`) for `plan`, also the key its first
/// launch is verified under.
pub(super) fn key_tile(plan: &Plan, store: CompensatedStore) -> HopperTile {
    HopperTile {
        bn: PREFETCH_BN,
        epilogue: Epilogue::AddCompensated { store },
        ..plan.tile
    }
}

/// Whether `store`'s kernel failed at its first launch for `plan`'s tile and `dtype` in this
/// process.
pub(super) fn failed_before(plan: &Plan, store: CompensatedStore, dtype: DType) -> bool {
    epilogue::failed_before(&(key_tile(plan, store), dtype))
}
