//! Weighted importance sampling: the paper's canonical two-step scheme with the importance
//! weights of its linear program (Khisti et al., 2024, arXiv 2410.18234, Sec. 4).
//!
//! 1. *Selection*: given the drafted tuple, select one drafted token with weights that depend on
//!    the tuple only through its set `S` of symbols. The weights are the (truncated) max-flow LP's
//!    of [`crate::lp`]: symbol `y` with probability `f(S, y) / P(S)`, and the mass the LP leaves
//!    unused, `1 - sum_y f(S, y) / P(S)`, spread over the symbols of `S` in proportion to what
//!    the flow leaves of their target mass (`p(y) - inflow(y)`; the best-ranked symbol when
//!    nothing is left). The tail symbol selects the first draft that drafted a tail token.
//! 2. *Single-draft SD against `q~`*, the exact law of the selected token: accept it with
//!    probability `min(1, p(y) / q~(y))`, else sample `norm(max(p - q~, 0))`.
//!
//! `q~` is computed from the set masses `P(S, k*)` (kept by the flow, `k*` the first
//! tail draft): alphabet tokens get `sum_S P(S) w(S, y)`, and a tail token `t` gets
//! `sum_k W_k q_k(t) / q_k(tail)` with `W_k` the selection mass of the tail symbol when `k* = k`
//! (given `S` and `k*`, the token of draft `k*` is distributed as `q_k` conditioned on the tail).
//! Tuples with no acceptable symbol select a token with `p = 0`, which SD always rejects. The
//! output is exactly `p` for any weights (single-draft SD is exact against any proposal law),
//! so neither the truncation nor the LP solver's accuracy can bias it; they only change the
//! acceptance `sum_y min(p(y), q~(y))`, which is at least the LP's value without truncation
//! (`q~ >= inflow`, `inflow <= p`).

use std::collections::HashMap;

use super::{Plan, sample};
use crate::Outcome;
use crate::error::Result;
use crate::lp::{self, Flow, LpInfo, LpTruncation, Symbol};
use crate::prob::normalised_or;

/// "Select a symbol of the drafted set with the LP's weights, then SD against `q~`."
#[derive(Clone, Debug)]
pub(crate) struct WeightedPlan {
    pub(crate) bit_of: Vec<Option<u32>>,
    pub(crate) tail_bit: Option<u32>,
    /// Set mask -> the selection law over its symbols (sums to 1).
    pub(crate) select: HashMap<u64, Vec<(Symbol, f64)>>,
    /// `min(1, p / q~)` (0 where `q~ = 0`).
    pub(crate) accept: Vec<f64>,
    /// `norm(max(p - q~, 0))`.
    pub(crate) residual: Vec<f64>,
    /// `sum_y min(p(y), q~(y))`.
    pub acceptance: f64,
}

pub(crate) fn plan(p: &[f64], qs: &[Vec<f64>], trunc: LpTruncation) -> Result<(Plan, LpInfo)> {
    match lp::choose_alphabet(p, qs, trunc) {
        Some((alphabet, tail)) => {
            let flow = lp::solve(p, qs, alphabet, tail)?;
            let plan = WeightedPlan::from_flow(p, qs, &flow);
            let mut info = flow.info;
            info.fell_back_to_importance_sampling = false;
            Ok((Plan::Weighted(plan), info))
        }
        // No alphabet fits the budget: the sequential IS plan, as the optimal scheme does.
        None => {
            let info = LpInfo::disabled(p, qs);
            Ok((Plan::Selection(super::importance::plan(p, qs)), info))
        }
    }
}

impl WeightedPlan {
    pub(crate) fn from_flow(p: &[f64], qs: &[Vec<f64>], flow: &Flow) -> Self {
        let v = p.len();
        let k_drafts = qs.len();
        let alphabet = &flow.info.alphabet;
        let symbol_of = |bit: u32| {
            if Some(bit) == flow.tail_bit {
                Symbol::Tail
            } else {
                Symbol::Token(alphabet[bit as usize])
            }
        };
        let masses = &flow.patterns;
        // What the LP's flow leaves of each symbol's target mass: the leftover selection mass of
        // a set goes to its symbols in proportion to it (mass on a symbol whose target mass is
        // already covered adds nothing to `sum min(p, q~)`).
        let mut set_mass: HashMap<u64, f64> = HashMap::new();
        for (&(mask, _), &w) in masses {
            *set_mass.entry(mask).or_insert(0.0) += w;
        }
        let tail_p: f64 = (0..v)
            .filter(|&y| flow.tail_bit.is_some() && flow.bit_of[y] == flow.tail_bit)
            .map(|y| p[y])
            .sum();
        let mut remaining: HashMap<Symbol, f64> = HashMap::new();
        for (bit, &y) in alphabet.iter().enumerate() {
            remaining.insert(symbol_of(bit as u32), p[y]);
        }
        if flow.tail_bit.is_some() {
            remaining.insert(Symbol::Tail, tail_p);
        }
        for (mask, row) in &flow.table {
            let mass = set_mass.get(mask).copied().unwrap_or(0.0);
            for &(symbol, w) in row {
                *remaining.entry(symbol).or_insert(0.0) -= mass * w;
            }
        }
        let mut select: HashMap<u64, Vec<(Symbol, f64)>> = HashMap::new();
        let mut proposal = vec![0.0; v];
        let mut tail_weight = vec![0.0; k_drafts];
        for (&(mask, first), &mass) in masses {
            if mask == 0 {
                continue;
            }
            let row = select.entry(mask).or_insert_with(|| {
                let mut row = flow.table.get(&mask).cloned().unwrap_or_default();
                let left = (1.0 - row.iter().map(|&(_, w)| w).sum::<f64>()).max(0.0);
                let symbols: Vec<Symbol> = (0..64)
                    .filter(|b| mask & (1 << b) != 0)
                    .map(symbol_of)
                    .collect();
                let room = |s: &Symbol| remaining.get(s).copied().unwrap_or(0.0).max(0.0);
                let total: f64 = symbols.iter().map(room).sum();
                let shares: Vec<(Symbol, f64)> = if total > 0.0 {
                    symbols
                        .iter()
                        .map(|s| (*s, left * room(s) / total))
                        .collect()
                } else {
                    vec![(symbols[0], left)]
                };
                for (symbol, share) in shares {
                    match row.iter_mut().find(|(s, _)| *s == symbol) {
                        Some((_, w)) => *w += share,
                        None => row.push((symbol, share)),
                    }
                }
                row.retain(|&(_, w)| w > 0.0);
                row
            });
            for &(symbol, w) in row.iter() {
                match symbol {
                    Symbol::Token(y) => proposal[y] += mass * w,
                    Symbol::Tail => tail_weight[first] += mass * w,
                }
            }
        }
        for (k, q) in qs.iter().enumerate() {
            if tail_weight[k] <= 0.0 {
                continue;
            }
            let in_tail = |y: usize| flow.tail_bit.is_some() && flow.bit_of[y] == flow.tail_bit;
            let q_tail: f64 = (0..v).filter(|&y| in_tail(y)).map(|y| q[y]).sum();
            for y in (0..v).filter(|&y| in_tail(y)) {
                proposal[y] += tail_weight[k] * q[y] / q_tail;
            }
        }
        let accept: Vec<f64> = p
            .iter()
            .zip(&proposal)
            .map(|(&py, &qy)| if qy > 0.0 { (py / qy).min(1.0) } else { 0.0 })
            .collect();
        let acceptance = p.iter().zip(&proposal).map(|(&a, &b)| a.min(b)).sum();
        let rest = p
            .iter()
            .zip(&proposal)
            .map(|(&a, &b)| (a - b).max(0.0))
            .collect();
        Self {
            bit_of: flow.bit_of.clone(),
            tail_bit: flow.tail_bit,
            select,
            accept,
            residual: normalised_or(rest, p),
            acceptance,
        }
    }

    fn mask(&self, drafts: &[usize]) -> u64 {
        drafts
            .iter()
            .filter_map(|&x| self.bit_of[x])
            .fold(0, |m, b| m | (1 << b))
    }

    /// The draft that carries `symbol`: the first that drafted the token, or the first tail
    /// draft.
    fn carrier(&self, drafts: &[usize], symbol: Symbol) -> usize {
        match symbol {
            Symbol::Token(y) => drafts.iter().position(|&x| x == y),
            Symbol::Tail => drafts.iter().position(|&x| self.bit_of[x] == self.tail_bit),
        }
        .expect("a selected symbol was drafted")
    }

    /// Uses `u[K]` for the selection, `u[0]` for the SD test and `u[K + 1]` for the residual.
    pub(crate) fn decide(&self, drafts: &[usize], u: &[f64]) -> Outcome {
        let k_drafts = drafts.len();
        let reject = || Outcome {
            accepted: None,
            token: sample(&self.residual, u[k_drafts + 1]),
        };
        let Some(row) = self.select.get(&self.mask(drafts)) else {
            return reject();
        };
        let mut acc = 0.0;
        let mut chosen = row.last().expect("a selection row is never empty").0;
        for &(symbol, w) in row {
            acc += w;
            if u[k_drafts] < acc {
                chosen = symbol;
                break;
            }
        }
        let k = self.carrier(drafts, chosen);
        if u[0] < self.accept[drafts[k]] {
            Outcome {
                accepted: Some(k),
                token: drafts[k],
            }
        } else {
            reject()
        }
    }

    pub(crate) fn law(&self, drafts: &[usize]) -> (Vec<f64>, f64) {
        let mut law = vec![0.0; self.residual.len()];
        let mut accepted = 0.0;
        let mut rejected = 1.0;
        if let Some(row) = self.select.get(&self.mask(drafts)) {
            rejected = 0.0;
            // The row sums to 1 up to round-off; the last symbol takes what the cumulative
            // sum leaves, as in `decide`.
            let total: f64 = row.iter().map(|&(_, w)| w).sum();
            for (i, &(symbol, w)) in row.iter().enumerate() {
                let w = if i + 1 == row.len() {
                    w + (1.0 - total)
                } else {
                    w
                };
                let y = drafts[self.carrier(drafts, symbol)];
                law[y] += w * self.accept[y];
                accepted += w * self.accept[y];
                rejected += w * (1.0 - self.accept[y]);
            }
        }
        for (l, r) in law.iter_mut().zip(&self.residual) {
            *l += rejected * r;
        }
        (law, accepted)
    }
}
