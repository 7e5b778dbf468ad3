//! CubeCL kernels, one file per stage; each compiles for every CubeCL runtime.
//!
//! The linear cross-entropy kernels work on one chunk of logits at a time (`n × chunk`, f32,
//! produced by the matmul): [`lse_chunk`] folds a chunk into running per-token log-sum-exp
//! state, [`score`] finds the vocabulary entries whose gradient passes the filter, [`grad`]
//! forms `(softmax − onehot)·dout` for a chunk, [`accumulate`] adds f32 blocks of dE rows in
//! place, [`scatter`] adds a gathered chunk's dC rows at their vocabulary ids, and [`indexed_dot`] computes the target logits without any logits at all.
//!
//! Where the chunk GEMMs run on core's Hopper kernel, the forward's and the scoring pass's
//! reductions happen inside it instead (`crate::epilogue`); [`lse_chunk::merge_tiles`] folds its
//! per-tile sums.
//!
//! [`fused`] holds the one-kernel-per-pass alternative ([`crate::PassKernels::Fused`]), which
//! never writes a logit.
//!
//! Outputs are allocated with `empty_device_contiguous_dtype`: the kernels index them linearly,
//! and CubeCL's CUDA runtime may pitch (row-pad) a plain 2-D allocation.

pub mod accumulate;
pub mod fused;
pub mod grad;
pub mod indexed_dot;
pub mod lse;
pub mod lse_chunk;
mod reduce;
pub mod scatter;
pub mod score;

use cubecl::prelude::*;

/// Units for a one-cube-per-row reduction over `cols` values: a power of two (the tree merges
/// halve evenly), 32 to 256.
pub(crate) fn row_units(client: &Client, cols: usize) -> u32 {
    let max_units = client.properties().hardware.max_cube_dim.0.min(256);
    (cols as u32)
        .next_power_of_two()
        .clamp(32, max_units.max(32))
}

/// A grid with one cube per row; rows beyond one grid dimension spill into the second.
pub(crate) fn row_grid(client: &Client, rows: usize) -> CubeCount {
    let max_x = client.properties().hardware.max_cube_count.0.min(65_535) as usize;
    let cubes_x = rows.clamp(1, max_x);
    CubeCount::Static(cubes_x as u32, rows.div_ceil(cubes_x) as u32, 1)
}

/// One unit per value for `count` values: cubes of 256 units, as many as needed.
pub(crate) fn elementwise_grid(client: &Client, count: usize) -> (CubeCount, CubeDim) {
    let cube_dim = CubeDim::new_1d(256);
    let cube_count = cubecl::calculate_cube_count_elemwise(client, count, cube_dim);
    (cube_count, cube_dim)
}
