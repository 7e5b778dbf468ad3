//! CubeCL kernels of [`crate::LayerKernels`], one file per op, for every CubeCL runtime.

pub mod flash;
mod gemv;
pub mod gemv_t;
pub mod linear;
pub mod qkv_store;
pub mod reduce;
pub mod rms_norm;
pub mod rope;
pub mod silu_mul;
pub mod store_kv;

use cubecl::prelude::*;

/// Units of the element-wise launches.
pub(crate) const UNITS: u32 = 256;

/// A grid with one cube per row; rows beyond one grid dimension spill into the second
/// (Vulkan drivers allow 65 535 cubes per dimension).
pub(crate) fn row_grid(client: &Client, rows: usize) -> CubeCount {
    let max_x = client.properties().hardware.max_cube_count.0.min(65_535) as usize;
    let cubes_x = rows.clamp(1, max_x);
    CubeCount::Static(cubes_x as u32, rows.div_ceil(cubes_x) as u32, 1)
}
