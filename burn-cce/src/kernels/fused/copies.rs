//! Asynchronous tile loads for the fused kernels: Hopper's bulk copies (`cp.async.bulk`, one
//! contiguous row each) complete on a shared-memory barrier (`mbarrier`) as the bytes land, while
//! the cube computes on the other tile. A tile has its own barrier; its `k`-th fill completes the
//! barrier's phase `k`, which the cube waits for by parity.
//!
//! Walked tiles are padded (`dim / 2 + PAD` words a row: a bulk copy writes a contiguous row, so
//! they cannot be swizzled like the tiles units store, `stages::chunk_at`).

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::{PAD, TILE};

/// Starts copying rows `first .. first + TILE` of `src` (`[len, dim]`, contiguous, 16-byte
/// aligned rows) to the padded tile at word `at` of `sm`: unit `r < TILE` copies row `r`, and
/// unit 0 arrives on `bar` expecting all the bytes, so the barrier's phase completes once they
/// have landed. Rows at or past `len` repeat row `len − 1` (real values, which the caller
/// masks), so no copy reads past the tensor.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn copy_rows<P: Float, N2: Size, N8: Size>(
    src: &Tensor<Vector<P, N8>>,
    first: usize,
    len: usize,
    sm: &mut Shared<[Vector<P, N2>]>,
    at: usize,
    bar: &Barrier,
    tid: usize,
    #[comptime] dim: usize,
) {
    let vecs = comptime!(dim / 8);
    let rv = comptime!(dim / 8 + PAD / 4);
    if tid < TILE {
        let row = select(first + tid < len, first + tid, len - 1);
        let wide = sm
            .slice_mut(at, at + comptime!(TILE * (dim / 2 + PAD)))
            .with_vector_size_mut::<N8>();
        bar.memcpy_async_tx(
            &src[row * vecs..row * vecs + vecs],
            &mut wide[tid * rv..tid * rv + vecs],
        );
    }
    if tid == 0 {
        bar.arrive_and_expect_tx(1u32, comptime!((TILE * dim * 2) as u32));
    }
}

/// [`copy_rows()`] into buffer `buffer` (0 or 1) of a walk's two, on that buffer's barrier
/// (`bar0` or `bar1`); the buffer starts at word `at` of `sm`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn copy_to_buffer<P: Float, N2: Size, N8: Size>(
    src: &Tensor<Vector<P, N8>>,
    first: usize,
    len: usize,
    sm: &mut Shared<[Vector<P, N2>]>,
    at: usize,
    buffer: u32,
    bar0: &Barrier,
    bar1: &Barrier,
    tid: usize,
    #[comptime] dim: usize,
) {
    if buffer == 0 {
        copy_rows::<P, N2, N8>(src, first, len, sm, at, bar0, tid, dim);
    } else {
        copy_rows::<P, N2, N8>(src, first, len, sm, at, bar1, tid, dim);
    }
}

/// Waits until tile `k` of a walk has landed: tile `k` is in buffer `k mod 2`, whose barrier
/// completes its phase `(k / 2) mod 2` then.
#[cube]
// Kernel code has no `is_multiple_of`.
#[allow(clippy::manual_is_multiple_of)]
pub fn wait_tile(bar0: &Barrier, bar1: &Barrier, k: u32) {
    if k % 2 == 0 {
        bar0.wait_parity((k / 2) % 2);
    } else {
        bar1.wait_parity((k / 2) % 2);
    }
}

/// The word at which 16-byte chunk `chunk` of row `row` of a padded walked tile starts.
#[cube]
pub fn padded_at(row: usize, chunk: usize, #[comptime] dim: usize) -> usize {
    row * comptime!(dim / 2 + PAD) + chunk * 4
}

/// A barrier for one tile's bulk copies: one arrival (unit 0's) a phase, made visible to the
/// copy engine before any copy uses it. Syncs the cube.
#[cube]
pub fn tile_barrier() -> Shared<Barrier> {
    let bar = Barrier::shared(1u32, UNIT_POS == 0);
    sync_async_proxy_shared();
    bar
}
