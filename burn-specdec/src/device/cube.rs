//! Cube-wide building blocks of the verification kernel: reductions, owner-to-cube broadcasts
//! and inverse-CDF sampling over a row split into one contiguous chunk per unit.
//!
//! Every unit owns the columns `lo..hi` of each `V`-sized row and is the only unit that writes
//! or reads them in scratch memory. Only values in shared memory cross units, so one
//! workgroup barrier (which on SPIR-V orders shared, not storage, memory) is enough everywhere.

use cubecl::prelude::*;

/// Largest finite `f32`: a total above it is an overflow.
const FINITE_MAX: f32 = f32::MAX;

/// Whether a row total can normalise a row (positive and finite; NaN fails both tests).
#[cube]
pub fn has_mass(total: f32) -> bool {
    total > 0.0 && total <= FINITE_MAX
}

/// `min(1, num / den)`, 0 for a zero denominator (as the host's `ratio_capped`).
#[cube]
pub fn ratio_capped(num: f32, den: f32) -> f32 {
    let mut out = f32::new(0.0);
    if den > 0.0 {
        out = min(num / den, f32::new(1.0));
    }
    out
}

/// Sum of every unit's `value`, returned in every unit. `buf` holds one slot per unit and the
/// cube size is a power of two. Ends with a barrier so that calls can follow each other.
#[cube]
pub fn cube_sum(buf: &mut Shared<[f32]>, value: f32) -> f32 {
    cube_reduce(buf, value, false)
}

/// Maximum of every unit's `value` (NaN-propagating), returned in every unit.
#[cube]
pub fn cube_max(buf: &mut Shared<[f32]>, value: f32) -> f32 {
    cube_reduce(buf, value, true)
}

/// The shared-memory tree of [`cube_sum`] (`take_max` false) and [`cube_max`] (`take_max` true).
#[cube]
fn cube_reduce(buf: &mut Shared<[f32]>, value: f32, #[comptime] take_max: bool) -> f32 {
    let unit = UNIT_POS_X as usize;
    buf[unit] = value;
    sync_cube();
    // Runtime, not comptime: the loop mutates it.
    let mut half = CUBE_DIM_X as usize / 2;
    while half > 0 {
        if unit < half {
            if take_max {
                let a = buf[unit];
                let b = buf[unit + half];
                // `a < b` is false for a NaN `b`, so keep NaNs explicitly.
                if a < b || b.is_nan() {
                    buf[unit] = b;
                }
            } else {
                buf[unit] += buf[unit + half];
            }
        }
        sync_cube();
        half /= 2;
    }
    let out = buf[0];
    sync_cube();
    out
}

/// Returns the `value` of the unit with `owner == true` (exactly one unit) in every unit.
#[cube]
pub fn broadcast(buf: &mut Shared<[f32]>, value: f32, owner: bool) -> f32 {
    if owner {
        buf[0] = value;
    }
    sync_cube();
    let out = buf[0];
    sync_cube();
    out
}

/// Compensated (Kahan) accumulation: returns the new `(sum, compensation)`.
///
/// Sampling needs prefix sums accurate to a few ulps of the total whatever `V` is, so that the
/// sampled index only differs from the host's (`f64`) when the uniform is within about 1e-6 of
/// a cumulative boundary.
#[cube]
pub fn kahan_add(sum: f32, comp: f32, x: f32) -> (f32, f32) {
    let y = x - comp;
    let t = sum + y;
    (t, (t - sum) - y)
}

/// Inverse-CDF sample from the non-negative weights `row[base + 0..v]` (not normalised):
/// the first `i` with `u * total < w[0] + .. + w[i]`, else the last positive index, else 0 (no
/// mass), as the host's `inverse_cdf(..).unwrap_or(0)`.
///
/// Two passes: each unit sums its chunk, unit 0 scans the chunk sums (compensated) and finds
/// the chunk holding the target, then the owner of that chunk walks it. `sums` has one slot
/// per unit, `idx` one per unit plus two.
#[allow(clippy::too_many_arguments)]
#[cube]
pub fn sample_row(
    row: &Tensor<f32>,
    base: usize,
    lo: usize,
    hi: usize,
    u: f32,
    sums: &mut Shared<[f32]>,
    idx: &mut Shared<[u32]>,
    scalars: &mut Shared<[f32]>,
) -> u32 {
    let unit = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let mut sum = f32::new(0.0);
    let mut comp = f32::new(0.0);
    // Last positive column + 1, 0 if none.
    let mut last = 0u32;
    let mut y = lo;
    while y < hi {
        let w = row[base + y];
        if w > 0.0 {
            let (s, c) = kahan_add(sum, comp, w);
            sum = s;
            comp = c;
            last = (y + 1) as u32;
        }
        y += 1;
    }
    sums[unit] = sum;
    idx[unit] = last;
    sync_cube();

    if unit == 0 {
        // Inclusive prefix sums of the chunk sums, in place.
        let mut acc = f32::new(0.0);
        let mut c = f32::new(0.0);
        let mut glast = 0u32;
        for t in 0..units {
            let (s, c2) = kahan_add(acc, c, sums[t]);
            acc = s;
            c = c2;
            sums[t] = acc;
            if idx[t] > 0 {
                glast = idx[t];
            }
        }
        let target = u * acc;
        // Default answer: the last positive index; `units` marks "no chunk" (rounding left the
        // target at or above the total).
        let mut answer = select(glast > 0, glast - 1, 0u32);
        let mut chosen = units as u32;
        if has_mass(acc) {
            let mut t = 0usize;
            while t < units {
                if target < sums[t] {
                    chosen = t as u32;
                    t = units;
                }
                t += 1;
            }
        } else {
            // No mass: the host gets `None` and falls back to token 0.
            answer = 0u32;
        }
        scalars[0] = target;
        idx[units] = chosen;
        idx[units + 1] = answer;
    }
    sync_cube();

    let chosen = idx[units] as usize;
    if chosen == unit {
        let target = scalars[0];
        let mut acc = f32::new(0.0);
        if unit > 0 {
            acc = sums[unit - 1];
        }
        let mut c = f32::new(0.0);
        let mut found = false;
        let mut y = lo;
        while y < hi && !found {
            let w = row[base + y];
            if w > 0.0 {
                let (s, c2) = kahan_add(acc, c, w);
                acc = s;
                c = c2;
                if target < acc {
                    idx[units + 1] = y as u32;
                    found = true;
                }
            }
            y += 1;
        }
        // Rounding can leave the walk short of the chunk's scanned total: take the chunk's last
        // positive entry, as the host takes the last positive one when it runs out.
        if !found && last > 0 {
            idx[units + 1] = last - 1;
        }
    }
    sync_cube();
    let out = idx[units + 1];
    sync_cube();
    out
}
