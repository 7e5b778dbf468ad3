//! Token-level verification schemes.
//!
//! Every scheme is split into a *plan*, computed once from `(p, q_1..q_K)` and independent of the
//! drafted tokens, and a cheap per-token *decision* that reads the drafted tokens and the caller's
//! uniforms. A batched device kernel computes the same plan per row and runs the same decision;
//! the uniform layout is tabulated in the crate docs ([`crate::uniforms_per_token`]).
//!
//! Four plan shapes cover the six schemes:
//! - `SequentialPlan`: try draft `k = 0..K` in turn, accept it with probability
//!   `accept[k][x_k]`, otherwise sample the final residual (single-draft SD, SpecInfer, SpecTr).
//! - `SelectionPlan`: select one draft by sequential importance weights, then single-draft SD
//!   of the selected token against the selection law `q~` (importance sampling).
//! - `CouplingPlan`: the conditional law of the output given the *set* of drafted tokens,
//!   read off an optimal max-flow LP (the LP-optimal scheme), with a lumped tail symbol under
//!   truncation.
//! - `WeightedPlan`: select one drafted token with the same LP's weights, then single-draft SD
//!   against the selection's exact law (the paper's weighted importance sampling).

pub mod importance;
pub mod optimal;
pub mod single;
pub mod specinfer;
pub mod spectr;
pub mod weighted;

#[cfg(test)]
mod grid_tests;

use crate::Outcome;
use crate::lp::{Flow, Symbol};
use crate::prob::inverse_cdf;

/// "Try each draft in turn, then sample the residual."
#[derive(Clone, Debug)]
pub(crate) struct SequentialPlan {
    /// `accept[k][x]`: probability of accepting draft `k` if it drafted `x` and was reached.
    pub accept: Vec<Vec<f64>>,
    /// Normalised law of the output when every draft is rejected.
    pub residual: Vec<f64>,
    /// Closed-form probability that some draft is accepted.
    pub acceptance: f64,
}

impl SequentialPlan {
    /// Uses `u[k]` for the test of draft `k` and `u[K + 1]` for the residual.
    fn decide(&self, drafts: &[usize], u: &[f64]) -> Outcome {
        let k_drafts = drafts.len();
        for (k, &x) in drafts.iter().enumerate() {
            if u[k] < self.accept[k][x] {
                return Outcome {
                    accepted: Some(k),
                    token: x,
                };
            }
        }
        Outcome {
            accepted: None,
            token: sample(&self.residual, u[k_drafts + 1]),
        }
    }

    fn law(&self, drafts: &[usize]) -> (Vec<f64>, f64) {
        let mut law = vec![0.0; self.residual.len()];
        let mut reach = 1.0;
        for (k, &x) in drafts.iter().enumerate() {
            let a = self.accept[k][x];
            law[x] += reach * a;
            reach *= 1.0 - a;
        }
        for (l, r) in law.iter_mut().zip(&self.residual) {
            *l += reach * r;
        }
        (law, 1.0 - reach)
    }
}

/// "Select one draft with importance weights, then run single-draft SD against `q~`."
#[derive(Clone, Debug)]
pub(crate) struct SelectionPlan {
    /// `select[k][x]` for `k < K - 1`: probability of selecting draft `k` if it drafted `x` and
    /// no earlier draft was selected. The last draft is selected when no earlier one is.
    pub select: Vec<Vec<f64>>,
    /// `q~`: law of the selected token.
    pub proposal: Vec<f64>,
    /// `min(1, p / q~)`.
    pub accept: Vec<f64>,
    /// `norm(max(p - q~, 0))`.
    pub residual: Vec<f64>,
    /// `sum_x min(p(x), q~(x))`.
    pub acceptance: f64,
    /// Which selection rule produced `select`.
    pub rule: crate::SelectionRule,
}

impl SelectionPlan {
    /// Index of the selected draft, using `u[k]` for the selection test of draft `k < K - 1`.
    fn selected(&self, drafts: &[usize], u: &[f64]) -> usize {
        for (k, row) in self.select.iter().enumerate() {
            if u[k] < row[drafts[k]] {
                return k;
            }
        }
        drafts.len() - 1
    }

    /// Uses `u[0..K-1]` for the selection, `u[K]` for the SD test and `u[K + 1]` for the residual.
    fn decide(&self, drafts: &[usize], u: &[f64]) -> Outcome {
        let k_drafts = drafts.len();
        let k = self.selected(drafts, u);
        let y = drafts[k];
        if u[k_drafts] < self.accept[y] {
            Outcome {
                accepted: Some(k),
                token: y,
            }
        } else {
            Outcome {
                accepted: None,
                token: sample(&self.residual, u[k_drafts + 1]),
            }
        }
    }

    fn law(&self, drafts: &[usize]) -> (Vec<f64>, f64) {
        let mut law = vec![0.0; self.residual.len()];
        let mut reach = 1.0;
        let mut accepted = 0.0;
        let mut rejected = 0.0;
        for (k, &y) in drafts.iter().enumerate() {
            let s = if k + 1 < drafts.len() {
                self.select[k][y]
            } else {
                1.0
            };
            let chosen = reach * s;
            law[y] += chosen * self.accept[y];
            accepted += chosen * self.accept[y];
            rejected += chosen * (1.0 - self.accept[y]);
            reach *= 1.0 - s;
        }
        for (l, r) in law.iter_mut().zip(&self.residual) {
            *l += rejected * r;
        }
        (law, accepted)
    }
}

/// "Given the drafted symbol set `S`, accept symbol `y` with probability `f(S, y) / P(S)`"; the
/// lumped tail symbol is resolved by single-draft SD inside the tail (see [`crate::lp`]).
#[derive(Clone, Debug)]
pub(crate) struct CouplingPlan {
    pub flow: Flow,
}

impl CouplingPlan {
    fn mask(&self, drafts: &[usize]) -> u64 {
        drafts
            .iter()
            .filter_map(|&x| self.flow.bit_of[x])
            .fold(0, |m, b| m | (1 << b))
    }

    /// First draft whose token is in the tail.
    fn first_tail(&self, drafts: &[usize]) -> Option<usize> {
        let tail = self.flow.tail_bit?;
        drafts
            .iter()
            .position(|&x| self.flow.bit_of[x] == Some(tail))
    }

    /// Uses `u[K]` to pick a symbol or the reject branch, `u[0]` for the in-tail SD test, and
    /// `u[K + 1]` for either residual.
    fn decide(&self, drafts: &[usize], u: &[f64]) -> Outcome {
        let k_drafts = drafts.len();
        if let Some(row) = self.flow.table.get(&self.mask(drafts)) {
            let mut acc = 0.0;
            for &(symbol, prob) in row {
                acc += prob;
                if u[k_drafts] >= acc {
                    continue;
                }
                return match symbol {
                    Symbol::Token(token) => Outcome {
                        accepted: drafts.iter().position(|&x| x == token),
                        token,
                    },
                    Symbol::Tail => {
                        let k = self.first_tail(drafts).expect("tail symbol in the set");
                        let x = drafts[k];
                        if u[0] < self.flow.tail_accept[k][x] {
                            Outcome {
                                accepted: Some(k),
                                token: x,
                            }
                        } else {
                            Outcome {
                                accepted: None,
                                token: sample(&self.flow.tail_residual[k], u[k_drafts + 1]),
                            }
                        }
                    }
                };
            }
        }
        Outcome {
            accepted: None,
            token: sample(&self.flow.residual, u[k_drafts + 1]),
        }
    }

    fn law(&self, drafts: &[usize]) -> (Vec<f64>, f64) {
        let mut law = vec![0.0; self.flow.residual.len()];
        let mut chosen = 0.0;
        let mut accepted = 0.0;
        if let Some(row) = self.flow.table.get(&self.mask(drafts)) {
            for &(symbol, prob) in row {
                chosen += prob;
                match symbol {
                    Symbol::Token(token) => {
                        law[token] += prob;
                        accepted += prob;
                    }
                    Symbol::Tail => {
                        let k = self.first_tail(drafts).expect("tail symbol in the set");
                        let a = self.flow.tail_accept[k][drafts[k]];
                        law[drafts[k]] += prob * a;
                        accepted += prob * a;
                        for (l, r) in law.iter_mut().zip(&self.flow.tail_residual[k]) {
                            *l += prob * (1.0 - a) * r;
                        }
                    }
                }
            }
        }
        let rest = (1.0 - chosen).max(0.0);
        for (l, r) in law.iter_mut().zip(&self.flow.residual) {
            *l += rest * r;
        }
        (law, accepted)
    }
}

/// A prepared scheme.
#[derive(Clone, Debug)]
pub(crate) enum Plan {
    Sequential(SequentialPlan),
    Selection(SelectionPlan),
    Coupling(CouplingPlan),
    Weighted(weighted::WeightedPlan),
}

impl Plan {
    pub fn acceptance(&self) -> f64 {
        match self {
            Self::Sequential(s) => s.acceptance,
            Self::Selection(s) => s.acceptance,
            Self::Coupling(c) => c.flow.acceptance,
            Self::Weighted(w) => w.acceptance,
        }
    }

    /// Inputs must have been validated.
    pub fn decide(&self, drafts: &[usize], u: &[f64]) -> Outcome {
        match self {
            Self::Sequential(s) => s.decide(drafts, u),
            Self::Selection(s) => s.decide(drafts, u),
            Self::Coupling(c) => c.decide(drafts, u),
            Self::Weighted(w) => w.decide(drafts, u),
        }
    }

    /// Exact law of the output token given the drafted tuple, and the acceptance probability
    /// given the tuple (both marginalise the uniforms).
    pub fn law(&self, drafts: &[usize]) -> (Vec<f64>, f64) {
        match self {
            Self::Sequential(s) => s.law(drafts),
            Self::Selection(s) => s.law(drafts),
            Self::Coupling(c) => c.law(drafts),
            Self::Weighted(w) => w.law(drafts),
        }
    }
}

/// Residual sampling. Residual rows always carry mass (see `prob::normalised_or`).
pub(crate) fn sample(residual: &[f64], u: f64) -> usize {
    inverse_cdf(residual, u).unwrap_or(0)
}
