//! SpecTr's k-sequential selection (Sun et al., 2023, "SpecTr: Fast Speculative Decoding via
//! Optimal Transport").
//!
//! # Rule
//! Fix `rho >= 1`. Draft `k = 1..K` (in order) is accepted with probability
//! `a_k(x_k) = min(1, p(x_k) / (rho * q_k(x_k)))`; the first accepted draft is output. If all are
//! rejected the output is sampled from a residual `r`.
//!
//! # Residual (derivation)
//! Let `m_k(x) = q_k(x) a_k(x) = min(q_k(x), p(x)/rho)` and `beta_k = sum_x m_k(x)`, the
//! probability that draft `k` is accepted once reached. Draft `k` is reached with probability
//! `P_k = prod_{j<k} (1 - beta_j)`, independently of `x_k` (earlier tests only read earlier drafts),
//! so the output law is
//!
//! ```text
//! P(out = x) = sum_k P_k m_k(x) + P_{K+1} r(x).
//! ```
//!
//! Setting this equal to `p` gives `r(x) = (p(x) - sum_k P_k m_k(x)) / P_{K+1}`. It sums to one
//! because `sum_k P_k beta_k = sum_k (P_k - P_{k+1}) = 1 - P_{K+1}`, and it is a distribution iff
//! `sum_k P_k m_k(x) <= p(x)` for all `x`. Since `m_k(x) <= p(x)/rho`, this holds whenever
//!
//! ```text
//! c(rho) := sum_k P_k(rho) <= rho.
//! ```
//!
//! With identical drafts `c = (1 - (1 - beta)^K) / beta`, and `c(rho) = rho` is exactly SpecTr's
//! equation `1 - (1 - beta(rho))^K = rho * beta(rho)` for the optimal `rho*`. Larger `rho` lowers
//! the acceptance `1 - P_{K+1}`, so we take the smallest valid `rho`: bisection on
//! `g(rho) = rho - c(rho)` over `[1, K]` (`g(K) >= 0` always, as `c <= K`), returning the upper
//! end of the final bracket, where `g >= 0` holds, so the residual is always a distribution. For
//! identical drafts `g` is increasing and this is `rho*` to machine precision; for different
//! drafts it is a valid root (the natural generalisation, documented as such). `K = 1` gives
//! `rho = 1`, i.e. single-draft speculative sampling.

use super::SequentialPlan;
use crate::prob::{normalised_or, ratio_capped};

/// `(c(rho), P_{K+1}(rho))`.
fn reach(p: &[f64], qs: &[Vec<f64>], rho: f64) -> (f64, f64) {
    let mut c = 0.0;
    let mut reach = 1.0;
    for q in qs {
        c += reach;
        let beta: f64 = p.iter().zip(q).map(|(&a, &b)| b.min(a / rho)).sum();
        reach *= (1.0 - beta).max(0.0);
    }
    (c, reach)
}

/// The smallest `rho` in `[1, K]` (up to bisection precision, from above) with `c(rho) <= rho`.
pub(crate) fn rho(p: &[f64], qs: &[Vec<f64>]) -> f64 {
    let g = |rho: f64| rho - reach(p, qs, rho).0;
    if g(1.0) >= 0.0 {
        return 1.0;
    }
    let (mut lo, mut hi) = (1.0_f64, qs.len() as f64);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if mid <= lo || mid >= hi {
            break;
        }
        if g(mid) >= 0.0 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

/// `a_k(x) = min(1, p(x) / (rho q_k(x)))` for every draft.
pub(crate) fn acceptance_rows(p: &[f64], qs: &[Vec<f64>], rho: f64) -> Vec<Vec<f64>> {
    qs.iter()
        .map(|q| {
            p.iter()
                .zip(q)
                .map(|(&a, &b)| ratio_capped(a, rho * b))
                .collect()
        })
        .collect()
}

pub(crate) fn plan(p: &[f64], qs: &[Vec<f64>]) -> (SequentialPlan, f64) {
    let rho = rho(p, qs);
    let mut from_drafts = vec![0.0; p.len()];
    let mut reach = 1.0;
    for q in qs {
        let mut beta = 0.0;
        for ((f, &px), &qx) in from_drafts.iter_mut().zip(p).zip(q) {
            let m = qx.min(px / rho);
            *f += reach * m;
            beta += m;
        }
        reach *= (1.0 - beta).max(0.0);
    }
    let residual = p
        .iter()
        .zip(&from_drafts)
        .map(|(a, b)| (a - b).max(0.0))
        .collect();
    let plan = SequentialPlan {
        accept: acceptance_rows(p, qs, rho),
        residual: normalised_or(residual, p),
        acceptance: 1.0 - reach,
    };
    (plan, rho)
}
