//! Cube-wide reductions shared by the kernels: one value per unit in, the result in every unit.

use cubecl::prelude::*;

/// Merges two partial `(max, Σ exp(x − max))` pairs; `s = 0` marks an empty partial.
///
/// No infinity literal appears: CUDA's NVRTC has no `inf` identifier. Infinite inputs still
/// work: `-inf` entries add `exp(-inf) = 0`, and a row max of `±inf` gives `±inf + ln(s)`.
#[cube]
pub fn merge(m1: f32, s1: f32, m2: f32, s2: f32) -> (f32, f32) {
    let mut m = m1;
    let mut s = s1 + s2;
    if s1 == 0.0 {
        m = m2;
        s = s2;
    } else if s2 == 0.0 {
        s = s1;
    } else if m2 > m1 {
        m = m2;
        s = s1 * f32::exp(m1 - m2) + s2;
    } else if m1 > m2 {
        s = s1 + s2 * f32::exp(m2 - m1);
    } else if m1 != m2 {
        // One side is NaN: propagate it.
        m = m1 + m2;
    }
    (m, s)
}

/// Merges every unit's `(max, Σ exp(x − max))` partial; `units` is the cube size, a power of
/// two. Returns the merged pair in every unit.
#[cube]
pub fn cube_merge_lse(m: f32, s: f32, #[comptime] units: usize) -> (f32, f32) {
    let mut shared_m = Shared::<[f32]>::new_slice(units);
    let mut shared_s = Shared::<[f32]>::new_slice(units);
    let unit = UNIT_POS_X as usize;
    shared_m[unit] = m;
    shared_s[unit] = s;
    sync_cube();

    // Runtime, not comptime: the loop mutates it.
    let mut half = CUBE_DIM_X as usize / 2;
    while half > 0 {
        if unit < half {
            let (m2, s2) = merge(
                shared_m[unit],
                shared_s[unit],
                shared_m[unit + half],
                shared_s[unit + half],
            );
            shared_m[unit] = m2;
            shared_s[unit] = s2;
        }
        sync_cube();
        half /= 2;
    }
    (shared_m[0], shared_s[0])
}
