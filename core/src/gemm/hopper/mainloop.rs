//! The Hopper GEMM's main loop, shared by its kernels: the producer's TMA loads of `A` and `B`
//! into the ring of [`STAGES`] stages and the consumers' warpgroup MMAs over them.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;
use cubecl::wgmma::{Accumulator, Major, MatrixDescriptor};

use super::{BK, BM, ELEM_BYTES, HopperTile, PANEL, STAGES, WG};

/// The barriers of the ring's stages: "full" (TMA bytes arrived) and "empty" (both consumers
/// done with it), not yet initialized ([`init_ring`]).
#[cube]
pub(super) fn ring_barriers() -> Sequence<Shared<Barrier>> {
    let mut bars = Sequence::<Shared<Barrier>>::new();
    #[unroll]
    for _ in 0..STAGES {
        bars.push(Barrier::shared_uninit());
    }
    bars
}

/// Initializes the ring's barriers (unit 0 only; the caller then fences and syncs the cube).
#[cube]
pub(super) fn init_ring(full: &Sequence<Shared<Barrier>>, empty: &Sequence<Shared<Barrier>>) {
    #[unroll]
    for s in 0..STAGES {
        full.index(s).init_manual(1u32);
        empty.index(s).init_manual(2 * WG);
    }
}

/// The cube's tile of `C`, `(tile_m, tile_n, row0, col0)`: its index along M and N and its first
/// row and column. Consecutive cubes walk down M where `tile.m_fast`, else along N.
#[cube]
pub(super) fn tile_origin(#[comptime] tile: HopperTile) -> (u32, u32, u32, u32) {
    let (tile_m, tile_n) = if comptime![tile.m_fast] {
        (CUBE_POS_X, CUBE_POS_Y)
    } else {
        (CUBE_POS_Y, CUBE_POS_X)
    };
    (tile_m, tile_n, tile_m * BM as u32, tile_n * tile.bn as u32)
}

/// Loads one stage of an operand tile (`rows` along M or N, `BK` along K) starting at
/// `(row0, k0)` into `dst` by TMA, signalling `bar`: one box for a K-major tile, one per
/// 64-row panel for an MN-major one.
#[cube]
fn load_stage<E: Float>(
    map: &TensorMap<E, Tiled>,
    dst: &mut [E],
    bar: &Shared<Barrier>,
    row0: u32,
    k0: u32,
    #[comptime] major: Major,
    #[comptime] rows: usize,
) {
    if comptime![major == Major::K] {
        // The map is `[rows, K]`: y = row, x = k.
        bar.tma_load_2d(map, dst, row0 as i32, k0 as i32);
    } else {
        // The map is `[K, rows]`: y = k, x = row; one box per panel of 64 rows.
        #[unroll]
        for p in 0..comptime![rows / 64] {
            let start = p * PANEL;
            bar.tma_load_2d(
                map,
                &mut dst[start..start + PANEL],
                k0 as i32,
                (row0 + p as u32 * 64) as i32,
            );
        }
    }
}

/// The ring's parity flips of one main loop of `count` stages from stage 0: bit `s` set where
/// stage `s` is used an odd number of times. A cube that runs several tiles' main loops through
/// one ring XORs them into the `phases` each next loop starts from.
#[cube]
#[allow(clippy::manual_div_ceil)]
pub(super) fn stage_flips(count: u32) -> u32 {
    let mut flips = 0u32;
    #[unroll]
    for s in 0..STAGES {
        let s = s as u32;
        let uses = select(
            count > s,
            (count - s + STAGES as u32 - 1) / STAGES as u32,
            0u32,
        );
        flips |= (uses & 1) << s;
    }
    flips
}

/// The producer (one unit): loads K tiles `first..first + count` of the cube's tile (rows from
/// `row0` of `A`, columns from `col0` of `B`) into the ring, each stage once both consumers
/// released it. `phases` (XORed [`stage_flips`]): the stages' parities where the ring ran earlier
/// tiles (0 for a fresh ring).
#[cube]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
pub(super) fn produce<E: Float>(
    a: &TensorMap<E, Tiled>,
    b: &TensorMap<E, Tiled>,
    a_smem: &mut Shared<[E]>,
    b_smem: &mut Shared<[E]>,
    full: &Sequence<Shared<Barrier>>,
    empty: &Sequence<Shared<Barrier>>,
    first: u32,
    count: u32,
    row0: u32,
    col0: u32,
    phases: u32,
    #[comptime] tile: HopperTile,
) {
    let a_stage = comptime![BM * BK];
    let b_stage = comptime![tile.bn * BK];
    let bytes = comptime![((BM + tile.bn) * BK * ELEM_BYTES) as u32];
    let rounds = (count + STAGES as u32 - 1) / STAGES as u32;
    for round in 0..rounds {
        #[unroll]
        for s in 0..STAGES {
            let t = round * STAGES as u32 + s as u32;
            if t < count {
                empty
                    .index(s)
                    .wait_parity(((round + (phases >> s as u32)) & 1) ^ 1);
                let k0 = (first + t) * BK as u32;
                let bar = full.index(s);
                let a_dst = &mut a_smem[s * a_stage..(s + 1) * a_stage];
                load_stage::<E>(a, a_dst, bar, row0, k0, tile.a_major, BM);
                let b_dst = &mut b_smem[s * b_stage..(s + 1) * b_stage];
                load_stage::<E>(b, b_dst, bar, col0, k0, tile.b_major, tile.bn);
                bar.arrive_and_expect_tx(1u32, bytes);
            }
        }
    }
}

/// Consumer `c`'s MMAs of stage `s` (K tile `t`, in round `round`) once its bytes arrived.
#[cube]
#[allow(clippy::too_many_arguments)]
fn issue_stage<E: Float>(
    acc: &mut Pending<Accumulator<f32>>,
    a_smem: &Shared<[E]>,
    b_smem: &Shared<[E]>,
    full: &Sequence<Shared<Barrier>>,
    c: usize,
    round: u32,
    phases: u32,
    #[comptime] s: usize,
    #[comptime] tile: HopperTile,
) {
    let a_stage = comptime![BM * BK];
    let b_stage = comptime![tile.bn * BK];
    full.index(s)
        .wait_parity((round + (phases >> s as u32)) & 1);
    let a_desc = MatrixDescriptor::new(
        &a_smem[s * a_stage..(s + 1) * a_stage],
        comptime![tile.a_layout()],
    );
    let b_desc = MatrixDescriptor::new(
        &b_smem[s * b_stage..(s + 1) * b_stage],
        comptime![tile.b_layout()],
    );
    #[unroll]
    for step in 0..comptime![BK / 16] {
        acc.execute(&a_desc.at(c * 64, step * 16), &b_desc.at(0usize, step * 16));
    }
}

/// One stage of a consumer's main loop: stage `s`'s MMAs issued and committed, then the wait
/// for the previous stage's group `released`, whose stage is released where
/// `release_previous`. Returns this stage's group.
#[cube]
#[allow(clippy::too_many_arguments)]
fn run_stage<E: Float>(
    acc: &mut Pending<Accumulator<f32>>,
    released: Pending<()>,
    a_smem: &Shared<[E]>,
    b_smem: &Shared<[E]>,
    full: &Sequence<Shared<Barrier>>,
    empty: &Sequence<Shared<Barrier>>,
    c: usize,
    round: u32,
    phases: u32,
    release_previous: bool,
    #[comptime] s: usize,
    #[comptime] tile: HopperTile,
) -> Pending<()> {
    issue_stage::<E>(acc, a_smem, b_smem, full, c, round, phases, s, tile);
    let read = acc.commit();
    released.wait();
    if release_previous {
        empty.index(comptime![(s + STAGES - 1) % STAGES]).arrive();
    }
    read
}

/// Consumer `c` (0 or 1, a warpgroup): the MMAs of its 64 rows of the tile over the `count`
/// stages the producer loads; the tile's sums once all completed. `phases` as the producer's;
/// with `release_last` the last stage is released too (where the ring goes on to another
/// tile). [`consume_rounds`] where `tile.overlap`, else [`consume_stages`].
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn consume<E: Float>(
    a_smem: &Shared<[E]>,
    b_smem: &Shared<[E]>,
    full: &Sequence<Shared<Barrier>>,
    empty: &Sequence<Shared<Barrier>>,
    c: usize,
    count: u32,
    phases: u32,
    #[comptime] tile: HopperTile,
    #[comptime] release_last: bool,
) -> Accumulator<f32> {
    if comptime![tile.overlap] {
        consume_rounds::<E>(
            a_smem,
            b_smem,
            full,
            empty,
            c,
            count,
            phases,
            tile,
            release_last,
        )
    } else {
        consume_stages::<E>(
            a_smem,
            b_smem,
            full,
            empty,
            c,
            count,
            phases,
            tile,
            release_last,
        )
    }
}

/// [`consume`] as it ran before session 65, each stage under its own `if t < count`: CubeCL
/// resolves three of the four stages' waits to `wgmma.wait_group 0` (every group), so the
/// tensor cores drain at those stages (read in the PTX and `ptxas`'s machine code).
#[cube]
#[allow(clippy::manual_div_ceil, clippy::too_many_arguments)]
fn consume_stages<E: Float>(
    a_smem: &Shared<[E]>,
    b_smem: &Shared<[E]>,
    full: &Sequence<Shared<Barrier>>,
    empty: &Sequence<Shared<Barrier>>,
    c: usize,
    count: u32,
    phases: u32,
    #[comptime] tile: HopperTile,
    #[comptime] release_last: bool,
) -> Accumulator<f32> {
    let rounds = (count + STAGES as u32 - 1) / STAGES as u32;
    let bn = comptime![tile.bn];
    let mut acc = Accumulator::<f32>::new(bn).start();
    let mut released = acc.commit();
    for round in 0..rounds {
        #[unroll]
        for s in 0..STAGES {
            let t = round * STAGES as u32 + s as u32;
            if t < count {
                released = run_stage::<E>(
                    &mut acc,
                    released,
                    a_smem,
                    b_smem,
                    full,
                    empty,
                    c,
                    round,
                    phases,
                    t > 0,
                    s,
                    tile,
                );
            }
        }
    }
    released.wait();
    release_last_stage(empty, count, release_last);
    acc.wait()
}

/// Releases the stage of the last of `count` K tiles where `release_last`.
#[cube]
fn release_last_stage(
    empty: &Sequence<Shared<Barrier>>,
    count: u32,
    #[comptime] release_last: bool,
) {
    if comptime![release_last] {
        let last = (count + STAGES as u32 - 1) % STAGES as u32;
        #[unroll]
        for s in 0..STAGES {
            if count > 0 && last == s as u32 {
                empty.index(s).arrive();
            }
        }
    }
}

/// [`consume`] with one group in flight at every stage (a stage is released once the next
/// one's MMAs are issued and its own completed).
///
/// The whole rounds of [`STAGES`] stages run without a condition on the stage and the last
/// partial round's stages are nested, so every wait keeps one group in flight: CubeCL resolves
/// a wait on a group's token to the fewest groups committed after it on any path, and each
/// stage under its own `if t < count` made those waits wait for every group
/// (`wgmma.wait_group 0`), draining the tensor cores at three stages of four (seen in the PTX
/// and `ptxas`'s machine code, 2026-12-07: `examples/hopper_ptx.rs`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn consume_rounds<E: Float>(
    a_smem: &Shared<[E]>,
    b_smem: &Shared<[E]>,
    full: &Sequence<Shared<Barrier>>,
    empty: &Sequence<Shared<Barrier>>,
    c: usize,
    count: u32,
    phases: u32,
    #[comptime] tile: HopperTile,
    #[comptime] release_last: bool,
) -> Accumulator<f32> {
    let whole = count / STAGES as u32;
    let bn = comptime![tile.bn];
    let mut acc = Accumulator::<f32>::new(bn).start();
    let mut released = acc.commit();
    for round in 0..whole {
        #[unroll]
        for s in 0..STAGES {
            released = run_stage::<E>(
                &mut acc,
                released,
                a_smem,
                b_smem,
                full,
                empty,
                c,
                round,
                phases,
                comptime![s > 0] || round > 0,
                s,
                tile,
            );
        }
    }
    // The last partial round (at most 3 stages: `STAGES` is 4, asserted below), nested so that every stage's wait follows the
    // previous stage's commit on every path.
    let rest = count - whole * STAGES as u32;
    let first = whole > 0;
    if rest > 0 {
        released = run_stage::<E>(
            &mut acc, released, a_smem, b_smem, full, empty, c, whole, phases, first, 0usize, tile,
        );
        if rest > 1 {
            released = run_stage::<E>(
                &mut acc, released, a_smem, b_smem, full, empty, c, whole, phases, true, 1usize,
                tile,
            );
            if rest > 2 {
                released = run_stage::<E>(
                    &mut acc, released, a_smem, b_smem, full, empty, c, whole, phases, true,
                    2usize, tile,
                );
            }
        }
    }
    released.wait();
    release_last_stage(empty, count, release_last);
    acc.wait()
}

// `consume_rounds` writes out the last partial round's (at most three) stages.
const _: () = assert!(STAGES == 4);
