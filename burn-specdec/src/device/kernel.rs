//! The block-verification kernel: one cube per sequence walks the positions of its block and the
//! surviving drafts, as [`crate::verify_block`] does on the host.
//!
//! Per position, every unit computes the same scalar decisions (identical inputs: shared memory
//! and read-only global memory), so control flow stays uniform and the barriers inside the
//! reductions are reached by the whole cube. `V`-sized work is split into one contiguous chunk
//! of columns per unit; per-column state lives in a scratch buffer (`rows` rows of `V` per
//! sequence) that only the owning unit touches (see [`super::cube`]).
//!
//! Scratch rows of a sequence: row 0 is the work row (SpecInfer's residual chain, the final
//! residual, the bonus row). Importance sampling adds two candidate slots of `K` rows each
//! (`K - 1` selection rows and `q~` in the last row) and `K - 1` rows of reserve-rule estimates.

use cubecl::prelude::*;

use super::cube::{broadcast, cube_max, cube_sum, has_mass, ratio_capped, sample_row};

/// [`crate::Scheme::SingleDraft`] and [`crate::Scheme::SpecInfer`] (same plan).
pub const SCHEME_SPECINFER: u32 = 0;
/// [`crate::Scheme::SpecTr`].
pub const SCHEME_SPECTR: u32 = 1;
/// [`crate::Scheme::SequentialImportance`].
pub const SCHEME_IS: u32 = 2;

/// Status bit: a probability row used by the walk was not normalisable (zero or non-finite
/// sum, or a negative entry).
pub const STATUS_BAD_ROW: u32 = 1;
/// Status bit: a drafted token was outside the vocabulary or had zero draft probability.
pub const STATUS_BAD_TOKEN: u32 = 2;

/// Rounds of the reserve fixed point and its stopping tolerance, as on the host.
const RESERVE_ITERATIONS: u32 = crate::RESERVE_ITERATIONS as u32;
const RESERVE_TOLERANCE: f32 = 1e-13;
/// Relative width of an f32 acceptance plateau between reserve rounds (4 ulps).
const PLATEAU_ULPS: f32 = 4.0 * f32::EPSILON;
/// Bisection steps of SpecTr's `rho`, as on the host (f32 stops after ~25).
const BISECTION_STEPS: u32 = 200;

/// Geometry of one verified position, identical in every unit except `lo..hi`.
#[derive(CubeType, Clone, Copy)]
pub struct Pos {
    /// Vocabulary size.
    v: usize,
    /// The unit's columns.
    lo: usize,
    hi: usize,
    /// Offset of the target row and its sum.
    tbase: usize,
    sp: f32,
    /// Offset of the sequence's scratch rows.
    srow: usize,
    /// Offset of the position's uniforms.
    ubase: usize,
    /// Number of surviving drafts.
    m: usize,
}

#[cube]
impl Pos {
    /// Normalised target probability of `y`.
    fn p(&self, target: &Tensor<f32>, y: usize) -> f32 {
        target[self.tbase + y] / self.sp
    }

    fn owns(&self, y: usize) -> bool {
        y >= self.lo && y < self.hi
    }

    /// Offset of scratch row `r`.
    fn row(&self, r: usize) -> usize {
        self.srow + r * self.v
    }
}

/// Normalised probability of `y` under survivor `i`'s draft row.
#[cube]
fn q_at(draft: &Tensor<f32>, qb: &Array<usize>, qn: &Array<f32>, i: usize, y: usize) -> f32 {
    draft[qb[i] + y] / qn[i]
}

/// Sum of a row; a negative entry poisons the sum so that it fails [`has_mass`].
#[cube]
fn row_sum(row: &Tensor<f32>, base: usize, lo: usize, hi: usize, red: &mut Shared<[f32]>) -> f32 {
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
fn copy_target(target: &Tensor<f32>, scratch: &mut Tensor<f32>, pos: &Pos) {
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
fn residual_step(
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
fn owned_value(
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

/// SpecInfer / single-draft SD: draft `i` against the residual chain `p_i`, `u[i]` for its test,
/// `u[m + 1]` for the final residual. The chain is only advanced past rejected drafts.
#[allow(clippy::too_many_arguments)]
#[cube]
fn decide_specinfer(
    target: &Tensor<f32>,
    draft: &Tensor<f32>,
    uniforms: &Tensor<f32>,
    scratch: &mut Tensor<f32>,
    pos: &Pos,
    qb: &Array<usize>,
    qn: &Array<f32>,
    xs: &Array<u32>,
    red: &mut Shared<[f32]>,
    idx: &mut Shared<[u32]>,
    scal: &mut Shared<[f32]>,
) -> (bool, u32) {
    let w = pos.row(0);
    copy_target(target, scratch, pos);
    let mut accepted = false;
    let mut token = 0u32;
    let mut i = 0usize;
    while i < pos.m && !accepted {
        let x = xs[i] as usize;
        let pk = owned_value(&*scratch, pos, w, x, scal);
        let mut thr = f32::new(0.0);
        if x < pos.v {
            thr = ratio_capped(pk, q_at(draft, qb, qn, i, x));
        }
        if uniforms[pos.ubase + i] < thr {
            accepted = true;
            token = x as u32;
        } else {
            residual_step(draft, scratch, pos, qb, qn, i, w, red);
            i += 1;
        }
    }
    if !accepted {
        let u = uniforms[pos.ubase + pos.m + 1];
        token = sample_row(&*scratch, w, pos.lo, pos.hi, u, red, idx, scal);
    }
    (accepted, token)
}

/// SpecTr's `(c(rho), P_{K+1}(rho))` over the survivors.
#[allow(clippy::too_many_arguments)]
#[cube]
fn spectr_reach(
    target: &Tensor<f32>,
    draft: &Tensor<f32>,
    pos: &Pos,
    qb: &Array<usize>,
    qn: &Array<f32>,
    rho: f32,
    red: &mut Shared<[f32]>,
) -> (f32, f32) {
    let mut c = f32::new(0.0);
    let mut reach = f32::new(1.0);
    for i in 0..pos.m {
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
fn spectr_rho(
    target: &Tensor<f32>,
    draft: &Tensor<f32>,
    pos: &Pos,
    qb: &Array<usize>,
    qn: &Array<f32>,
    red: &mut Shared<[f32]>,
) -> f32 {
    let (c1, _r) = spectr_reach(target, draft, pos, qb, qn, f32::new(1.0), red);
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
                let (c, _r) = spectr_reach(target, draft, pos, qb, qn, mid, red);
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

/// SpecTr: draft `i` accepted with `min(1, p / (rho q_i))` using `u[i]`; the derived residual
/// `max(p - sum_k P_k min(q_k, p / rho), 0)` with `u[m + 1]`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn decide_spectr(
    target: &Tensor<f32>,
    draft: &Tensor<f32>,
    uniforms: &Tensor<f32>,
    scratch: &mut Tensor<f32>,
    pos: &Pos,
    qb: &Array<usize>,
    qn: &Array<f32>,
    xs: &Array<u32>,
    red: &mut Shared<[f32]>,
    idx: &mut Shared<[u32]>,
    scal: &mut Shared<[f32]>,
    #[comptime] k_max: usize,
) -> (bool, u32) {
    let rho = spectr_rho(target, draft, pos, qb, qn, red);
    let mut accepted = false;
    let mut token = 0u32;
    let mut i = 0usize;
    while i < pos.m && !accepted {
        let x = xs[i] as usize;
        let mut thr = f32::new(0.0);
        if x < pos.v {
            thr = ratio_capped(pos.p(target, x), rho * q_at(draft, qb, qn, i, x));
        }
        if uniforms[pos.ubase + i] < thr {
            accepted = true;
            token = x as u32;
        }
        i += 1;
    }
    if !accepted {
        let mut reaches = Array::<f32>::new(k_max);
        let mut reach = f32::new(1.0);
        for i in 0..pos.m {
            reaches[i] = reach;
            let mut part = f32::new(0.0);
            let mut y = pos.lo;
            while y < pos.hi {
                part += min(q_at(draft, qb, qn, i, y), pos.p(target, y) / rho);
                y += 1;
            }
            let beta = cube_sum(red, part);
            reach *= max(1.0 - beta, f32::new(0.0));
        }
        let w = pos.row(0);
        let mut part = f32::new(0.0);
        let mut y = pos.lo;
        while y < pos.hi {
            let p = pos.p(target, y);
            let mut from_drafts = f32::new(0.0);
            for i in 0..pos.m {
                from_drafts += reaches[i] * min(q_at(draft, qb, qn, i, y), p / rho);
            }
            let r = max(p - from_drafts, f32::new(0.0));
            scratch[w + y] = r;
            part += r;
            y += 1;
        }
        let total = cube_sum(red, part);
        if !has_mass(total) {
            copy_target(target, scratch, pos);
        }
        let u = uniforms[pos.ubase + pos.m + 1];
        token = sample_row(&*scratch, w, pos.lo, pos.hi, u, red, idx, scal);
    }
    (accepted, token)
}

/// Scratch row `r` of candidate slot `slot` (`r = k_max - 1` is the slot's `q~`).
#[cube]
fn slot_row(pos: &Pos, slot: usize, r: usize, #[comptime] k_max: usize) -> usize {
    pos.row(1 + slot * k_max + r)
}

/// Scratch row of the reserve estimate of draft `r`.
#[cube]
fn est_row(pos: &Pos, r: usize, #[comptime] k_max: usize) -> usize {
    pos.row(1 + 2 * k_max + r)
}

/// The host's `proposal` + `overlap`: writes `q~` of the selection rows in `slot` into the slot's
/// last row and returns `sum min(p, q~)`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn consider(
    target: &Tensor<f32>,
    draft: &Tensor<f32>,
    scratch: &mut Tensor<f32>,
    pos: &Pos,
    qb: &Array<usize>,
    qn: &Array<f32>,
    slot: usize,
    red: &mut Shared<[f32]>,
    #[comptime] k_max: usize,
) -> f32 {
    let qt = slot_row(pos, slot, k_max - 1, k_max);
    let mut y = pos.lo;
    while y < pos.hi {
        scratch[qt + y] = 0.0;
        y += 1;
    }
    let mut reach = f32::new(1.0);
    let last = pos.m - 1;
    for k in 0..last {
        let sr = slot_row(pos, slot, k, k_max);
        let mut part = f32::new(0.0);
        let mut y = pos.lo;
        while y < pos.hi {
            let mass = q_at(draft, qb, qn, k, y) * scratch[sr + y];
            scratch[qt + y] += reach * mass;
            part += mass;
            y += 1;
        }
        let taken = cube_sum(red, part);
        reach *= max(1.0 - taken, f32::new(0.0));
    }
    let mut part = f32::new(0.0);
    let mut y = pos.lo;
    while y < pos.hi {
        let qt_y = scratch[qt + y] + reach * q_at(draft, qb, qn, last, y);
        scratch[qt + y] = qt_y;
        part += min(pos.p(target, y), qt_y);
        y += 1;
    }
    cube_sum(red, part)
}

/// One round of the reserve rule into slot `slot`, damping the estimates in place. Returns the
/// largest change of an estimate (the host's stopping criterion).
///
/// In place is safe: row `k` reads the estimates of drafts after `k` only, and those are
/// updated after it.
#[allow(clippy::too_many_arguments)]
#[cube]
fn reserve_round(
    target: &Tensor<f32>,
    draft: &Tensor<f32>,
    scratch: &mut Tensor<f32>,
    pos: &Pos,
    qb: &Array<usize>,
    qn: &Array<f32>,
    reach_est: &mut Array<f32>,
    slot: usize,
    red: &mut Shared<[f32]>,
    #[comptime] k_max: usize,
) -> f32 {
    let last = pos.m - 1;
    let mut change = f32::new(0.0);
    let mut reach = f32::new(1.0);
    for k in 0..last {
        let sr = slot_row(pos, slot, k, k_max);
        let er = est_row(pos, k, k_max);
        let mut part = f32::new(0.0);
        let mut y = pos.lo;
        while y < pos.hi {
            // Mass of `y` the later drafts still supply, accumulated from the last draft as on
            // the host.
            let mut later = f32::new(0.0);
            let mut jj = last;
            while jj > k {
                let mut sel = f32::new(1.0);
                if jj < last {
                    sel = scratch[est_row(pos, jj, k_max) + y];
                }
                later += reach_est[jj] * q_at(draft, qb, qn, jj, y) * sel;
                jj -= 1;
            }
            let qk = q_at(draft, qb, qn, k, y);
            let mass = reach * qk;
            let mut s = f32::new(0.0);
            if mass > 0.0 {
                s = f32::clamp((pos.p(target, y) - later) / mass, 0.0, 1.0);
            }
            scratch[sr + y] = s;
            part += s * qk;
            let e = scratch[er + y];
            change = max(change, f32::abs(e - s));
            scratch[er + y] = 0.5 * (e + s);
            y += 1;
        }
        let taken = cube_sum(red, part);
        change = max(change, f32::abs(reach_est[k] - reach));
        reach_est[k] = 0.5 * (reach_est[k] + reach);
        reach *= max(1.0 - taken, f32::new(0.0));
    }
    change = max(change, f32::abs(reach_est[last] - reach));
    reach_est[last] = 0.5 * (reach_est[last] + reach);
    cube_max(red, change)
}

/// Importance sampling: the best of the SpecInfer-chain, SpecTr-chain and reserve-round
/// selection rows (largest `sum min(p, q~)`, ties keep the earlier), then selection with
/// `u[0..m-1]`, SD of the selected token against `q~` with `u[m]`, residual with `u[m + 1]`.
///
/// Candidates go into the slot not holding the best one, so the best rows are never copied.
#[allow(clippy::too_many_arguments)]
#[cube]
fn decide_importance(
    target: &Tensor<f32>,
    draft: &Tensor<f32>,
    uniforms: &Tensor<f32>,
    scratch: &mut Tensor<f32>,
    pos: &Pos,
    qb: &Array<usize>,
    qn: &Array<f32>,
    xs: &Array<u32>,
    red: &mut Shared<[f32]>,
    idx: &mut Shared<[u32]>,
    scal: &mut Shared<[f32]>,
    #[comptime] k_max: usize,
) -> (bool, u32) {
    let w = pos.row(0);
    let last = pos.m - 1;

    // SpecInfer chain: s_k = min(1, p_k / q_k) into slot 0.
    copy_target(target, scratch, pos);
    for k in 0..last {
        let sr = slot_row(pos, 0, k, k_max);
        let mut y = pos.lo;
        while y < pos.hi {
            scratch[sr + y] = ratio_capped(scratch[w + y], q_at(draft, qb, qn, k, y));
            y += 1;
        }
        if k + 1 < last {
            residual_step(draft, scratch, pos, qb, qn, k, w, red);
        }
    }
    let mut best = 0usize;
    let mut best_acc = consider(target, draft, scratch, pos, qb, qn, 0, red, k_max);

    // SpecTr chain: s_k = min(1, p / (rho q_k)) into slot 1.
    let rho = spectr_rho(target, draft, pos, qb, qn, red);
    for k in 0..last {
        let sr = slot_row(pos, 1, k, k_max);
        let mut y = pos.lo;
        while y < pos.hi {
            scratch[sr + y] = ratio_capped(pos.p(target, y), rho * q_at(draft, qb, qn, k, y));
            y += 1;
        }
    }
    let acc = consider(target, draft, scratch, pos, qb, qn, 1, red, k_max);
    if acc > best_acc {
        best = 1;
        best_acc = acc;
    }

    // Reserve-adjusted ratios: every round of the damped fixed point is a candidate.
    if last > 0 {
        let mut reach_est = Array::<f32>::new(k_max);
        for k in 0..pos.m {
            reach_est[k] = 1.0;
        }
        for k in 0..last {
            let er = est_row(pos, k, k_max);
            let mut y = pos.lo;
            while y < pos.hi {
                scratch[er + y] = 1.0;
                y += 1;
            }
        }
        let mut best_is_reserve = false;
        let mut round = 0u32;
        while round < RESERVE_ITERATIONS {
            let slot = 1 - best;
            let change = reserve_round(
                target,
                draft,
                scratch,
                pos,
                qb,
                qn,
                &mut reach_est,
                slot,
                red,
                k_max,
            );
            let acc = consider(target, draft, scratch, pos, qb, qn, slot, red, k_max);
            // Near convergence the host's acceptances still creep up by far less than an f32
            // ulp, so it keeps a late round; f32 sees a plateau with rounding noise. Among
            // reserve rounds within a few ulps of the best, take the latest: it is the one
            // closest to the host's choice.
            let plateau = best_is_reserve && acc >= best_acc - PLATEAU_ULPS * best_acc;
            if acc > best_acc || plateau {
                best = slot;
                best_acc = max(best_acc, acc);
                best_is_reserve = true;
            }
            round += 1;
            if change <= RESERVE_TOLERANCE {
                round = RESERVE_ITERATIONS;
            }
        }
    }

    // Selection: draft k < m - 1 with u[k] < s_k(x_k), else the last survivor.
    let mut selected = last;
    let mut k = 0usize;
    while k < last {
        let x = xs[k] as usize;
        let s = owned_value(&*scratch, pos, slot_row(pos, best, k, k_max), x, scal);
        if uniforms[pos.ubase + k] < s {
            selected = k;
            k = last;
        } else {
            k += 1;
        }
    }
    let y = xs[selected] as usize;
    let qt = slot_row(pos, best, k_max - 1, k_max);
    let q_tilde = owned_value(&*scratch, pos, qt, y, scal);
    let mut thr = f32::new(0.0);
    if y < pos.v {
        thr = ratio_capped(pos.p(target, y), q_tilde);
    }
    let accepted = uniforms[pos.ubase + pos.m] < thr;
    let mut token = y as u32;
    if !accepted {
        let mut part = f32::new(0.0);
        let mut c = pos.lo;
        while c < pos.hi {
            let r = max(pos.p(target, c) - scratch[qt + c], f32::new(0.0));
            scratch[w + c] = r;
            part += r;
            c += 1;
        }
        let total = cube_sum(red, part);
        if !has_mass(total) {
            copy_target(target, scratch, pos);
        }
        let u = uniforms[pos.ubase + pos.m + 1];
        token = sample_row(&*scratch, w, pos.lo, pos.hi, u, red, idx, scal);
    }
    (accepted, token)
}

/// Verifies one block per cube (sequence `b`); see the module docs and
/// [`super::verify_blocks`] for the layout of the tensors. The sizes come as scalars because
/// `draft` and `drafts` are placeholders when `L = 0`.
// `div_ceil` is not available inside kernels.
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
#[cube(launch)]
pub fn verify_blocks_kernel<I: Numeric>(
    target: &Tensor<f32>,
    draft: &Tensor<f32>,
    drafts: &Tensor<I>,
    uniforms: &Tensor<f32>,
    scratch: &mut Tensor<f32>,
    tokens: &mut Tensor<I>,
    accepted: &mut Tensor<I>,
    survivors: &mut Tensor<I>,
    status: &mut Tensor<I>,
    batch: usize,
    k_all: usize,
    l: usize,
    v: usize,
    #[comptime] scheme: u32,
    #[comptime] k_max: usize,
    #[comptime] units: usize,
    #[comptime] rows: usize,
    #[define(I)] _dtype: ElemType,
) {
    let b = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    // The whole cube leaves together, so the barriers below stay uniform.
    if b >= batch {
        terminate!();
    }
    let unit = UNIT_POS_X as usize;
    let dim = CUBE_DIM_X as usize;
    let chunk = (v + dim - 1) / dim;
    let lo = min(unit * chunk, v);
    let hi = min(lo + chunk, v);
    let srow = b * rows * v;

    let mut red = Shared::<[f32]>::new_slice(units);
    let mut idx = Shared::<[u32]>::new_slice(units + 2);
    let mut scal = Shared::<[f32]>::new_slice(1usize);

    // Survivors (draft indices, ascending), and per survivor its row offset, row sum and token.
    let mut surv = Array::<u32>::new(k_max);
    let mut qb = Array::<usize>::new(k_max);
    let mut qn = Array::<f32>::new(k_max);
    let mut xs = Array::<u32>::new(k_max);
    for k in 0..k_all {
        surv[k] = k as u32;
    }
    let mut m = k_all;
    let mut flags = 0u32;
    let mut done = false;
    let mut j = 0usize;
    let row_stride = (l + 1) * (k_all + 2);

    while j < l && !done {
        let s0 = surv[0] as usize;
        let tbase = ((b * k_all + s0) * (l + 1) + j) * v;
        let sp = row_sum(target, tbase, lo, hi, &mut red);
        if !has_mass(sp) {
            flags |= STATUS_BAD_ROW;
        }
        for i in 0..m {
            let k = surv[i] as usize;
            let base = ((b * k_all + k) * l + j) * v;
            let sq = row_sum(draft, base, lo, hi, &mut red);
            if !has_mass(sq) {
                flags |= STATUS_BAD_ROW;
            }
            qb[i] = base;
            qn[i] = sq;
            // Invalid tokens become V: never accepted, never read.
            let raw = i32::cast_from(drafts[(b * k_all + k) * l + j]);
            let mut x = v as u32;
            if raw >= 0 && (raw as usize) < v {
                x = raw as u32;
            }
            // Invalid token, or zero draft probability (NaN counts as invalid too).
            let bad = x == v as u32 || draft[base + min(x as usize, v - 1)] <= 0.0;
            if bad || draft[base + min(x as usize, v - 1)].is_nan() {
                flags |= STATUS_BAD_TOKEN;
            }
            xs[i] = x;
        }
        let pos = Pos {
            v,
            lo,
            hi,
            tbase,
            sp,
            srow,
            ubase: b * row_stride + j * (k_all + 2),
            m,
        };
        let (ok, token) = if comptime!(scheme == SCHEME_SPECTR) {
            decide_spectr(
                target, draft, uniforms, scratch, &pos, &qb, &qn, &xs, &mut red, &mut idx,
                &mut scal, k_max,
            )
        } else if comptime!(scheme == SCHEME_IS) {
            decide_importance(
                target, draft, uniforms, scratch, &pos, &qb, &qn, &xs, &mut red, &mut idx,
                &mut scal, k_max,
            )
        } else {
            decide_specinfer(
                target, draft, uniforms, scratch, &pos, &qb, &qn, &xs, &mut red, &mut idx,
                &mut scal,
            )
        };
        if unit == 0 {
            tokens[b * (l + 1) + j] = I::cast_from(token);
        }
        if ok {
            // Keep the survivors that drafted the accepted token.
            let mut kept = 0usize;
            for i in 0..m {
                if xs[i] == token {
                    surv[kept] = surv[i];
                    kept += 1;
                }
            }
            m = kept;
            j += 1;
        } else {
            done = true;
        }
    }

    if !done {
        // Bonus token from p_{L+1} of the first survivor, with u[L][0].
        let s0 = surv[0] as usize;
        let tbase = ((b * k_all + s0) * (l + 1) + l) * v;
        let sp = row_sum(target, tbase, lo, hi, &mut red);
        if !has_mass(sp) {
            flags |= STATUS_BAD_ROW;
        }
        let pos = Pos {
            v,
            lo,
            hi,
            tbase,
            sp,
            srow,
            ubase: b * row_stride + l * (k_all + 2),
            m,
        };
        copy_target(target, scratch, &pos);
        let u = uniforms[pos.ubase];
        let token = sample_row(&*scratch, srow, lo, hi, u, &mut red, &mut idx, &mut scal);
        if unit == 0 {
            tokens[b * (l + 1) + l] = I::cast_from(token);
        }
    }

    if unit == 0 {
        // Emitted `j + 1` tokens either way; pad the rest.
        let pad = -1i32;
        let mut t = j + 1;
        while t <= l {
            tokens[b * (l + 1) + t] = I::cast_from(pad);
            t += 1;
        }
        accepted[b] = I::cast_from(j);
        for k in 0..k_all {
            survivors[b * k_all + k] = I::cast_from(0u32);
        }
        for i in 0..m {
            survivors[b * k_all + surv[i] as usize] = I::cast_from(1u32);
        }
        status[b] = I::cast_from(flags);
    }
}
