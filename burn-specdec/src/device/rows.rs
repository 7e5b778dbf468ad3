//! What the block-verification kernel's decision rules share ([`super::kernel`] for SpecInfer
//! and SpecTr, [`super::importance`] for sequential importance sampling): the geometry of a
//! verified position ([`Pos`]), probability-row access, residual steps, SpecTr's `rho`, and the
//! final residual sample. Split from `kernel.rs` so the two rule modules import it instead of
//! each other.

use cubecl::prelude::*;

use super::cube::{broadcast, cube_sum, has_mass, sample_row};

/// Rounds of the reserve fixed point and its stopping tolerance, as on the host.
pub(super) const RESERVE_ITERATIONS: u32 = crate::RESERVE_ITERATIONS as u32;

pub(super) const RESERVE_TOLERANCE: f32 = 1e-13;

/// Relative width of an f32 acceptance plateau between reserve rounds (4 ulps).
pub(super) const PLATEAU_ULPS: f32 = 4.0 * f32::EPSILON;

/// Bisection steps of SpecTr's `rho`, as on the host (f32 stops after ~25).
const BISECTION_STEPS: u32 = 200;

/// Geometry of one verified position, identical in every unit except `lo..hi`.
#[derive(CubeType, Clone, Copy)]
pub struct Pos {
    /// Vocabulary size.
    pub(super) v: usize,
    /// The unit's columns.
    pub(super) lo: usize,
    pub(super) hi: usize,
    /// Offset of the target row and its sum.
    pub(super) tbase: usize,
    pub(super) sp: f32,
    /// Offset of the sequence's scratch rows.
    pub(super) srow: usize,
    /// Offset of the position's uniforms.
    pub(super) ubase: usize,
    /// Number of surviving drafts.
    pub(super) m: usize,
}

#[cube]
impl Pos {
    /// Normalised target probability of `y`.
    pub(super) fn p(&self, target: &Tensor<f32>, y: usize) -> f32 {
        target[self.tbase + y] / self.sp
    }

    pub(super) fn owns(&self, y: usize) -> bool {
        y >= self.lo && y < self.hi
    }

    /// Offset of scratch row `r`.
    pub(super) fn row(&self, r: usize) -> usize {
        self.srow + r * self.v
    }
}

/// Normalised probability of `y` under survivor `i`'s draft row.
#[cube]
pub(super) fn q_at(
    draft: &Tensor<f32>,
    qb: &Array<usize>,
    qn: &Array<f32>,
    i: usize,
    y: usize,
) -> f32 {
    draft[qb[i] + y] / qn[i]
}

/// Sum of a row; a negative entry poisons the sum so that it fails [`has_mass`].
#[cube]
pub(super) fn row_sum(
    row: &Tensor<f32>,
    base: usize,
    lo: usize,
    hi: usize,
    red: &mut Shared<[f32]>,
) -> f32 {
    let mut part = f32::new(0.0);
    let mut negative = false;
    let mut y = lo;
    while y < hi {
        let x = row[base + y];
        if x < 0.0 {
            negative = true;
        }
        part += x;
        y += 1;
    }
    if negative {
        part = -f32::MAX;
    }
    cube_sum(red, part)
}

/// Writes the normalised target row into scratch row 0.
#[cube]
pub(super) fn copy_target(target: &Tensor<f32>, scratch: &mut Tensor<f32>, pos: &Pos) {
    let w = pos.row(0);
    let mut y = pos.lo;
    while y < pos.hi {
        scratch[w + y] = pos.p(target, y);
        y += 1;
    }
}

/// Replaces scratch row `w` by `norm(max(row - q_i, 0))` unless that has no mass (then the row
/// is kept, as the host's `normalised_or`).
#[allow(clippy::too_many_arguments)]
#[cube]
pub(super) fn residual_step(
    draft: &Tensor<f32>,
    scratch: &mut Tensor<f32>,
    pos: &Pos,
    qb: &Array<usize>,
    qn: &Array<f32>,
    i: usize,
    w: usize,
    red: &mut Shared<[f32]>,
) {
    let mut part = f32::new(0.0);
    let mut y = pos.lo;
    while y < pos.hi {
        part += max(scratch[w + y] - q_at(draft, qb, qn, i, y), f32::new(0.0));
        y += 1;
    }
    let total = cube_sum(red, part);
    if has_mass(total) {
        let mut y = pos.lo;
        while y < pos.hi {
            scratch[w + y] = max(scratch[w + y] - q_at(draft, qb, qn, i, y), f32::new(0.0)) / total;
            y += 1;
        }
    }
}

/// `scratch[row + x]` from its owner, in every unit (0 for an invalid token `x == V`).
#[cube]
pub(super) fn owned_value(
    scratch: &Tensor<f32>,
    pos: &Pos,
    row: usize,
    x: usize,
    scal: &mut Shared<[f32]>,
) -> f32 {
    let mut out = f32::new(0.0);
    if x < pos.v {
        let owner = pos.owns(x);
        let mut mine = f32::new(0.0);
        if owner {
            mine = scratch[row + x];
        }
        out = broadcast(scal, mine, owner);
    }
    out
}

/// SpecTr's `(c(rho), P_{K+1}(rho))` over the survivors; `reaches[i]` gets survivor `i`'s
/// `P_i(rho)`.
#[allow(clippy::too_many_arguments)]
#[cube]
pub(super) fn spectr_reach(
    target: &Tensor<f32>,
    draft: &Tensor<f32>,
    pos: &Pos,
    qb: &Array<usize>,
    qn: &Array<f32>,
    rho: f32,
    reaches: &mut Array<f32>,
    red: &mut Shared<[f32]>,
) -> (f32, f32) {
    let mut c = f32::new(0.0);
    let mut reach = f32::new(1.0);
    for i in 0..pos.m {
        reaches[i] = reach;
        c += reach;
        let mut part = f32::new(0.0);
        let mut y = pos.lo;
        while y < pos.hi {
            part += min(q_at(draft, qb, qn, i, y), pos.p(target, y) / rho);
            y += 1;
        }
        let beta = cube_sum(red, part);
        reach *= max(1.0 - beta, f32::new(0.0));
    }
    (c, reach)
}

/// SpecTr's `rho`: the host's bisection on `g(rho) = rho - c(rho)` over `[1, m]`, in f32.
#[cube]
pub(super) fn spectr_rho(
    target: &Tensor<f32>,
    draft: &Tensor<f32>,
    pos: &Pos,
    qb: &Array<usize>,
    qn: &Array<f32>,
    red: &mut Shared<[f32]>,
    #[comptime] k_max: usize,
) -> f32 {
    let mut reaches = Array::<f32>::new(k_max);
    let (c1, _r) = spectr_reach(target, draft, pos, qb, qn, f32::new(1.0), &mut reaches, red);
    let mut rho = f32::new(1.0);
    if 1.0 - c1 < 0.0 {
        let mut lo = f32::new(1.0);
        let mut hi = f32::cast_from(pos.m);
        let mut step = 0u32;
        while step < BISECTION_STEPS {
            let mid = 0.5 * (lo + hi);
            if mid <= lo || mid >= hi {
                step = BISECTION_STEPS;
            } else {
                let (c, _r) = spectr_reach(target, draft, pos, qb, qn, mid, &mut reaches, red);
                if mid - c >= 0.0 {
                    hi = mid;
                } else {
                    lo = mid;
                }
                step += 1;
            }
        }
        rho = hi;
    }
    rho
}

/// The final token from the residual the caller wrote into scratch row 0 (`part`: the unit's
/// share of its sum), or from the target where the residual has no mass, with `u[m + 1]`.
#[allow(clippy::too_many_arguments)]
#[cube]
pub(super) fn sample_residual(
    target: &Tensor<f32>,
    uniforms: &Tensor<f32>,
    scratch: &mut Tensor<f32>,
    pos: &Pos,
    part: f32,
    red: &mut Shared<[f32]>,
    idx: &mut Shared<[u32]>,
    scal: &mut Shared<[f32]>,
) -> u32 {
    let total = cube_sum(red, part);
    if !has_mass(total) {
        copy_target(target, scratch, pos);
    }
    let u = uniforms[pos.ubase + pos.m + 1];
    sample_row(&*scratch, pos.row(0), pos.lo, pos.hi, u, red, idx, scal)
}
