//! Cube-wide reductions for the kernels of every crate: one value per unit in, the result in
//! every unit, through a shared-memory tree of `units` slots (the cube size, a power of two).

use cubecl::prelude::*;

/// Sums every unit's `value`; returns the sum in every unit.
#[cube]
pub fn cube_sum(value: f32, #[comptime] units: usize) -> f32 {
    cube_reduce(value, units, false)
}

/// The largest of every unit's `value` (`f32::max`); returns it in every unit.
#[cube]
pub fn cube_max(value: f32, #[comptime] units: usize) -> f32 {
    cube_reduce(value, units, true)
}

/// The tree of [`cube_sum`] (`take_max` false) and [`cube_max`] (`take_max` true).
#[cube]
fn cube_reduce(value: f32, #[comptime] units: usize, #[comptime] take_max: bool) -> f32 {
    let mut shared = Shared::<[f32]>::new_slice(units);
    let unit = UNIT_POS_X as usize;
    shared[unit] = value;
    sync_cube();
    // Runtime, not comptime: the loop mutates it.
    let mut half = CUBE_DIM_X as usize / 2;
    while half > 0 {
        if unit < half {
            if take_max {
                shared[unit] = f32::max(shared[unit], shared[unit + half]);
            } else {
                shared[unit] += shared[unit + half];
            }
        }
        sync_cube();
        half /= 2;
    }
    shared[0]
}
