//! Device functions shared by the kernels, and launch helpers.

use cubecl::prelude::*;

use super::AttnArgs;

/// `log₂ e` as an f32 constant (kernel literals are written as f64).
const LOG2_E: f64 = std::f32::consts::LOG2_E as f64;
/// The smallest positive normal f32, as a kernel literal.
pub(crate) const F32_MIN_POSITIVE: f64 = f32::MIN_POSITIVE as f64;

/// `sign(x)·floor(|x| + 0.5)`: round half away from zero, as the reference does.
#[cube]
pub fn round_away(x: f32) -> f32 {
    let r = f32::floor(f32::abs(x) + 0.5);
    if x < 0.0 { -r } else { r }
}

/// `x` rounded to a float format with `mantissa` bits, smallest normal exponent `min_exp` and
/// largest value `max` (ties away from zero, saturating): [`crate::Grid::round`] on the device.
#[cube]
pub fn round_grid(x: f32, mantissa: f32, min_exp: f32, max: f32) -> f32 {
    let a = f32::abs(x);
    let mut r = a;
    if a > 0.0 {
        let e = f32::max(f32::floor(f32::ln(a) * f32::new(LOG2_E)), min_exp);
        let step = f32::powf(f32::new(2.0), e - mantissa);
        r = f32::min(f32::floor(a / step + 0.5) * step, max);
    }
    if x < 0.0 { -r } else { r }
}

/// The K/V head that query head row `bh` (`batch·q_heads + head`) reads under grouped-query
/// attention.
#[cube]
pub fn kv_head(args: &AttnArgs, bh: usize) -> usize {
    (bh / args.hq) * (args.hq / args.group) + (bh % args.hq) / args.group
}

/// One past the last key that query rows `q0 .. q0 + rows` (those below `sq`) attend to: every
/// key, or with a causal mask (queries aligned to the end of the keys) the last row's diagonal.
#[cube]
pub fn keys_end(args: &AttnArgs, q0: usize, rows: usize, #[comptime] causal: bool) -> usize {
    let mut end = args.skv;
    if causal {
        let mut last = q0 + rows;
        if last > args.sq {
            last = args.sq;
        }
        end = last + (args.skv - args.sq);
    }
    end
}

/// A grid of at least `cubes` cubes; beyond one grid dimension they spill into the second,
/// split evenly so that fewer than `y` cubes are spare (a full first row would launch up to
/// twice the cubes, e.g. 131 070 for 65 536). Kernels still skip the spare ones.
pub fn grid(client: &Client, cubes: usize) -> CubeCount {
    let max_x = client.properties().hardware.max_cube_count.0.min(65_535) as usize;
    let cubes = cubes.max(1);
    let y = cubes.div_ceil(max_x);
    let x = cubes.div_ceil(y);
    CubeCount::Static(x as u32, y as u32, 1)
}
