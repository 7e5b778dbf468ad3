//! Two-step importance-sampling (IS) scheme, after the canonical decomposition of Khisti et al.
//! (arXiv 2410.18234, Theorem 1): every optimal multi-draft scheme can be written as
//!
//! 1. *importance-weighted selection*: pick one of the K drafted tokens, `Y in {x_1..x_K}`, with
//!    probabilities that depend on the drafted tuple; `Y` then has some law `q~`;
//! 2. *single-draft speculative sampling* of `Y` against `p` with proposal `q~`: accept with
//!    `min(1, p(Y)/q~(Y))`, else sample `norm(max(p - q~, 0))`.
//!
//! The optimal selection weights come from an LP over all draft tuples (exponential in K; see
//! [`crate::Scheme::Optimal`]). This scheme uses a *sequential* selection family whose law `q~` has
//! a closed form in `O(K V)`, so that a device kernel can compute it per row.
//!
//! # Selection weights
//! Draft `k < K - 1` is selected with probability `s_k(x_k)` if no earlier draft was; otherwise
//! the last draft is selected. Stage `k` is reached with probability
//! `R_k = prod_{j<k} (1 - sum_x q_j(x) s_j(x))` independently of `x_k`, hence
//!
//! ```text
//! q~(y) = sum_{k<K-1} R_k q_k(y) s_k(y) + R_{K-1} q_{K-1}(y).
//! ```
//!
//! The weights are chosen, per `(p, q_1..q_K)`, as the best (largest `sum_y min(p(y), q~(y))`) of
//! these candidates, in this order (ties keep the earlier one):
//! - [`SelectionRule::SpecInferChain`]: `s_k = min(1, p_k / q_k)` with SpecInfer's residual chain
//!   `p_k`;
//! - [`SelectionRule::SpecTrChain`]: `s_k = min(1, p / (rho q_k))` with SpecTr's `rho`;
//! - [`SelectionRule::Reserve`]: *reserve-adjusted importance ratios*
//!   `s_k(y) = clip((p(y) - L_k(y)) / (R_k q_k(y)), 0, 1)`, where
//!   `L_k(y) = sum_{j>k} R_j q_j(y) s_j(y)` is the mass of `y` that later drafts will still
//!   supply (the last draft with `s = 1`). Selecting `y` early only fills the part of `p(y)` that
//!   later drafts cannot. `L_k` depends on the `R_j, s_j` being chosen, so a damped fixed-point
//!   iteration is run (at most [`RESERVE_ITERATIONS`] rounds, starting from `R = 1, s = 1`,
//!   averaging old and new values, stopping once the estimates move by less than 1e-13), and
//!   every round is a candidate. For two identical drafts the best
//!   sequential selection has a first-stage selection probability `alpha` solving
//!   `alpha = sum_y min(q(y), max(0, p(y) - (1 - alpha) q(y)))`; on the Figure 2 grid the reserve
//!   rule reaches it (`tests/figure2.rs`).
//!
//! # Exactness and guarantees
//! Whatever weights are used, `Y ~ q~` exactly and step 2 only reads `Y` and a fresh uniform, so
//! the output law is `min(p, q~) + (1 - sum min(p, q~)) norm(max(p - q~, 0)) = p`; the
//! acceptance probability is `sum_y min(p(y), q~(y))`.
//!
//! The two chain candidates make IS at least as good as SpecInfer and SpecTr for every input: with
//! the chain weights, `q~(y) >= sum_k R_k q_k(y) a_k(y)`, the mass that scheme accepts at `y`,
//! which is at most `p(y)` (it outputs `p`); so `sum_y min(p, q~)` is at least that scheme's
//! acceptance probability.

use super::SelectionPlan;
use crate::SelectionRule;
use crate::prob::{normalised_or, positive_part_diff, ratio_capped};

/// Most rounds of the reserve fixed-point iteration.
pub const RESERVE_ITERATIONS: usize = 128;

/// The iteration stops once no estimate moves by more than this.
const RESERVE_TOLERANCE: f64 = 1e-13;

/// `q~` for sequential selection rows `select` (`K - 1` rows; the last draft is the fallback).
pub(crate) fn proposal(qs: &[Vec<f64>], select: &[Vec<f64>]) -> Vec<f64> {
    let last = qs.len() - 1;
    let mut out = vec![0.0; qs[0].len()];
    let mut reach = 1.0;
    for (q, s) in qs[..last].iter().zip(select) {
        let mut taken = 0.0;
        for ((o, &qx), &sx) in out.iter_mut().zip(q).zip(s) {
            let m = qx * sx;
            *o += reach * m;
            taken += m;
        }
        reach *= (1.0 - taken).max(0.0);
    }
    for (o, &qx) in out.iter_mut().zip(&qs[last]) {
        *o += reach * qx;
    }
    out
}

fn overlap(p: &[f64], q: &[f64]) -> f64 {
    p.iter().zip(q).map(|(a, b)| a.min(*b)).sum()
}

/// One round of the reserve rule given the current estimates; returns the new rows and reaches.
fn reserve_round(
    p: &[f64],
    qs: &[Vec<f64>],
    reach_est: &[f64],
    select_est: &[Vec<f64>],
) -> (Vec<Vec<f64>>, Vec<f64>) {
    let k_drafts = qs.len();
    let v = p.len();
    // later[k] = L_k: supply from drafts j > k under the current estimates.
    let mut later = vec![vec![0.0; v]; k_drafts];
    let mut supply = vec![0.0; v];
    for k in (0..k_drafts).rev() {
        later[k].copy_from_slice(&supply);
        for (y, s) in supply.iter_mut().enumerate() {
            let sel = if k + 1 < k_drafts {
                select_est[k][y]
            } else {
                1.0
            };
            *s += reach_est[k] * qs[k][y] * sel;
        }
    }
    let mut rows = Vec::with_capacity(k_drafts - 1);
    let mut reaches = Vec::with_capacity(k_drafts);
    let mut reach = 1.0;
    for k in 0..k_drafts - 1 {
        let row: Vec<f64> = (0..v)
            .map(|y| {
                let mass = reach * qs[k][y];
                if mass > 0.0 {
                    ((p[y] - later[k][y]) / mass).clamp(0.0, 1.0)
                } else {
                    0.0
                }
            })
            .collect();
        let taken: f64 = row.iter().zip(&qs[k]).map(|(s, q)| s * q).sum();
        reaches.push(reach);
        reach *= (1.0 - taken).max(0.0);
        rows.push(row);
    }
    reaches.push(reach);
    (rows, reaches)
}

/// A candidate selection rule with its law `q~` and acceptance `sum min(p, q~)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// `sum min(p, q~)`.
    pub acceptance: f64,
    /// Sequential selection rows (`K - 1` rows of length V).
    pub select: Vec<Vec<f64>>,
    /// The law of the selected draft token.
    pub q_tilde: Vec<f64>,
    pub rule: SelectionRule,
}

/// Calls `visit` with every candidate the importance-sampling plan compares, in the plan's
/// order (SpecInfer chain, SpecTr chain, then each reserve round); the plan keeps the first
/// strict maximum of `acceptance`. Exposed so that tests of other implementations (the device
/// kernel) can see which choices are near-ties.
pub fn for_each_candidate(p: &[f64], qs: &[Vec<f64>], mut visit: impl FnMut(Candidate)) {
    let k_drafts = qs.len();
    let v = p.len();
    let mut consider = |select: Vec<Vec<f64>>, rule: SelectionRule| {
        let q_tilde = proposal(qs, &select);
        let acceptance = overlap(p, &q_tilde);
        visit(Candidate {
            acceptance,
            select,
            q_tilde,
            rule,
        });
    };

    let chain = super::specinfer::residual_chain(p, qs);
    let specinfer_rows = (0..k_drafts - 1)
        .map(|k| {
            chain[k]
                .iter()
                .zip(&qs[k])
                .map(|(&a, &b)| ratio_capped(a, b))
                .collect()
        })
        .collect();
    consider(specinfer_rows, SelectionRule::SpecInferChain);

    let rho = super::spectr::rho(p, qs);
    let mut spectr_rows = super::spectr::acceptance_rows(p, qs, rho);
    spectr_rows.truncate(k_drafts - 1);
    consider(spectr_rows, SelectionRule::SpecTrChain { rho });

    if k_drafts > 1 {
        let mut reach_est = vec![1.0; k_drafts];
        let mut select_est = vec![vec![1.0; v]; k_drafts - 1];
        for iteration in 1..=RESERVE_ITERATIONS {
            let (rows, reaches) = reserve_round(p, qs, &reach_est, &select_est);
            let mut change: f64 = 0.0;
            for (e, r) in reach_est.iter_mut().zip(&reaches) {
                change = change.max((*e - r).abs());
                *e = 0.5 * (*e + r);
            }
            for (est, row) in select_est.iter_mut().zip(&rows) {
                for (e, s) in est.iter_mut().zip(row) {
                    change = change.max((*e - s).abs());
                    *e = 0.5 * (*e + s);
                }
            }
            consider(rows, SelectionRule::Reserve { iteration });
            if change <= RESERVE_TOLERANCE {
                break;
            }
        }
    }
}

pub(crate) fn plan(p: &[f64], qs: &[Vec<f64>]) -> SelectionPlan {
    let mut best: Option<Candidate> = None;
    for_each_candidate(p, qs, |c| {
        if best.as_ref().is_none_or(|b| c.acceptance > b.acceptance) {
            best = Some(c);
        }
    });

    let Candidate {
        acceptance,
        select,
        q_tilde,
        rule,
    } = best.expect("at least one candidate");
    SelectionPlan {
        accept: p
            .iter()
            .zip(&q_tilde)
            .map(|(&a, &b)| ratio_capped(a, b))
            .collect(),
        residual: normalised_or(positive_part_diff(p, &q_tilde), p),
        proposal: q_tilde,
        select,
        acceptance,
        rule,
    }
}
