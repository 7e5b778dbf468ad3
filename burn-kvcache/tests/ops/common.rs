//! Sizes, tensor constructors and seeded values the op tests share.

use burn_kernels_testing::{Dist, random_values};

/// Rows (2 heads × seq 1, 17, 257) and head dims (64 and an odd one).
pub(super) const ROWS: &[usize] = &[2, 34, 514];
pub(super) const DIMS: &[usize] = &[64, 33];

pub(super) use crate::{cpu, tensor};

/// Row pairs whose angles spread over [0, ~0.5π]: `b = a + σᵢ·noise`, `σᵢ` from 0 to 1.5.
pub(super) fn pair_values(n: usize, d: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let a = random_values(n * d, Dist::STANDARD, seed);
    let noise = random_values(n * d, Dist::STANDARD, seed + 1);
    let b = a
        .iter()
        .zip(&noise)
        .enumerate()
        .map(|(i, (x, e))| x + e * ((i / d) % 16) as f32 * 0.1)
        .collect();
    (a, b)
}

pub(super) fn rows_of(v: &[f32], d: usize, skip: &[bool]) -> Vec<f32> {
    v.chunks(d)
        .zip(skip)
        .filter(|(_, s)| !**s)
        .flat_map(|(r, _)| r.iter().copied())
        .collect()
}
