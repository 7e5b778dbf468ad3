//! Sequential importance sampling on the device ([`crate::Scheme::SequentialImportance`]): the
//! candidate selection rows (SpecInfer chain, SpecTr chain, reserve-rule rounds), their overlap
//! with the target, and the decision, as the host's `importance` module does; called by
//! [`super::kernel::verify_blocks_kernel`].

use cubecl::prelude::*;

use super::cube::{cube_max, cube_sum, ratio_capped};
use super::rows::{
    PLATEAU_ULPS, Pos, RESERVE_ITERATIONS, RESERVE_TOLERANCE, copy_target, owned_value, q_at,
    residual_step, sample_residual, spectr_rho,
};
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
pub(super) fn decide_importance(
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
    let rho = spectr_rho(target, draft, pos, qb, qn, red, k_max);
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
        token = sample_residual(target, uniforms, scratch, pos, part, red, idx, scal);
    }
    (accepted, token)
}
