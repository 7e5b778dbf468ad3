//! Asynchronous tile loads for the fused kernels (`cp.async`, sm80 and later): a cube issues the
//! copies of a later tile into a free shared buffer and goes on computing; the copies land while
//! it does. Copies are grouped per tile (`cp.async.commit_group`) and waited for by count
//! (`cp.async.wait_group`), the way double-buffered GEMM main loops wait for the older of two
//! tiles in flight.

use cubecl::prelude::barrier::copy_async;
use cubecl::prelude::*;

use super::stages::chunk_at;
use super::{THREADS, TILE};

/// Starts copying rows `first .. first + TILE` of `src` (`[len, dim]`, contiguous, 8 values =
/// 16 bytes a copy) to the tile at word `at` of `sm`, swizzled as `stages::store_rows` stores
/// it. Rows at or past `len` repeat row `len − 1` (real values, which the caller masks), so
/// no copy reads past the tensor. Nothing is waited for: see [`commit_copies`] and
/// [`wait_all_but_newest`].
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn copy_rows_async<P: Float, N2: Size, N8: Size>(
    src: &Tensor<Vector<P, N8>>,
    first: usize,
    len: usize,
    sm: &mut Shared<[Vector<P, N2>]>,
    at: usize,
    tid: usize,
    #[comptime] dim: usize,
) {
    let vecs = comptime!(dim / 8);
    let wide = sm
        .slice_mut(at, at + comptime!(TILE * dim / 2))
        .with_vector_size_mut::<N8>();
    #[unroll]
    for i in 0..comptime!(TILE * dim / 8 / THREADS) {
        let b = tid + i * THREADS;
        let r = b / vecs;
        let c = b % vecs;
        let row = select(first + r < len, first + r, len - 1);
        let s = row * vecs + c;
        let d = chunk_at(r, c, dim) / 4;
        copy_async(&src[s..s + 1], &mut wide[d..d + 1], comptime!(8u32));
    }
}

/// Closes the group of this unit's copies started since the last call (an empty group where
/// none were, so every unit counts the same groups).
#[cube]
pub fn commit_copies() {
    gpu_asm!("cp.async.commit_group;");
}

/// Waits until every group of this unit's copies has landed. Other units' copies are visible
/// after a following `sync_cube`.
#[cube]
pub fn wait_all() {
    gpu_asm!("cp.async.wait_group 0;");
}

/// Waits until every group of this unit's copies but the newest has landed. Other units'
/// copies are visible after a following `sync_cube`.
#[cube]
pub fn wait_all_but_newest() {
    gpu_asm!("cp.async.wait_group 1;");
}
