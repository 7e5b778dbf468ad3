//! Weighted importance sampling: the paper's canonical two-step scheme with the importance
//! weights of its linear program (Khisti et al., 2024, arXiv 2410.18234, Sec. 4).
//!
//! 1. *Selection*: given the drafted tuple, select one drafted token with weights that depend on
//!    the tuple only through its set `S` of symbols. The weights are the (truncated) max-flow LP's
//!    of [`crate::lp`]: symbol `y` with probability `f(S, y) / P(S)`. The mass the LP leaves
//!    unused, `1 - sum_y f(S, y) / P(S)`, is placed by the better (in acceptance) of two rules:
//!    spread over the symbols of `S` in proportion to what the flow leaves of their target mass
//!    (`p(y) - inflow(y)`; the best-ranked symbol when nothing is left), or filling, set by set
//!    (fewest symbols first), what the flow and the sets before leave of those target masses,
//!    with what none of them has room for going to the tail symbol if `S` holds it (tail tokens
//!    are accepted only in part, so more mass can still help), else to the best-ranked symbol
//!    (`Leftover`). When the lumped tail symbol is selected, one of the drafts that
//!    drafted a tail token is selected by a sequential rejection rule over all of them (`tail`):
//!    visited in order, tail draft `k` is selected with probability
//!    `min(1, p_R(x)/(c q_{k,R}(x)))` (the conditionals on the tail), the last one if no earlier
//!    one is; `c` is chosen per plan (for identical drafts the rows may then be refined per
//!    visiting stage), and the first tail draft alone (the LP coupling's rule) competes as
//!    `c -> 0`.
//!
//!    The tail symbol stands for many tokens, so a selection that cannot look at which tail
//!    token was drafted covers `p` on the tail poorly (at flat drafts, K = 8, T = 2, this cost
//!    ~1% acceptance against sequential IS). Two more candidate families let the tail rule
//!    *decline* every tail draft of a set that also holds an alphabet symbol (the last tail
//!    draft is then tested too, with `u[1 + i]` as the others), so that the tail is selected
//!    token by token, like sequential IS selects drafts:
//!    - *shifted* (`SHIFTS`): a fraction of the alphabet symbols' weight in those sets is offered
//!      to the tail symbol instead; what the tail drafts decline goes to the set's alphabet
//!      symbols by filling what the rest of the selection leaves of their target mass
//!      (`decline::rows`);
//!    - *tail first* (`decline::tail_first`): every set holding the tail offers it first
//!      (or, second policy, only the sets whose alphabet symbols the flow already filled; the
//!      others select among their alphabet symbols only); what the tail stage leaves of each
//!      pattern, `P(S, D) prod_i (1 - abar_i)`, goes to the alphabet by the LP re-solved over
//!      the alphabet with those set masses (`lp::solve_with`), its unused mass placed by the
//!      leftover rule. At K = 8, T = 2 these plans close most of the gap to Optimal.
//!
//!    The declined alphabet symbol is drawn with `u[K]` rescaled to the tail symbol's interval
//!    (given that symbol, `u[K]` is uniform on it). The plan keeps the best candidate.
//! 2. *Single-draft SD against `q~`*, the exact law of the selected token: accept it with
//!    probability `min(1, p(y) / q~(y))`, else sample `norm(max(p - q~, 0))`.
//!
//! `q~` is computed from the set masses `P(S, D)` kept by the flow, `D` recording the drafts
//! that hit the tail (their number for identical drafts, their mask for up to
//! `lp::TAIL_MASK_MAX_DRAFTS` different ones, else only the first; see
//! `lp::TailTracking`): alphabet tokens get `sum_S P(S) w(S, y)`, and tail tokens the
//! closed form of `tail`, which holds because given `S` and `D` the tail drafts drew their
//! tail conditionals independently (so all are declined with probability
//! `prod_i (1 - abar_i)`, and the declined mass of `S` is known in closed form too). Where `D` keeps only the first tail draft, that draft is
//! selected. Tuples with no acceptable symbol select a token with `p = 0`, which SD always
//! rejects. The output is exactly `p` for any weights and any tail rule (single-draft SD is exact
//! against any exactly known proposal law), so neither the truncation, the LP solver's accuracy
//! nor the choice of `c` can bias it; they only change the acceptance
//! `sum_y min(p(y), q~(y))`, which is at least the LP's value without truncation
//! (`q~ >= inflow`, `inflow <= p`) and, with truncation, at least that of the proportional
//! rule with the first tail draft (the plan before the tail rule used all tail drafts).

use std::collections::{BTreeMap, HashMap};

use super::{Plan, sample};
use crate::Outcome;
use crate::error::Result;
use crate::lp::{self, Flow, LpInfo, LpTruncation, Symbol, TailTracking};
use crate::prob::normalised_or;

pub(crate) mod decline;
pub(crate) mod tail;

#[cfg(test)]
mod tests;

use tail::{TailProblem, TailSelection};

/// "Select a symbol of the drafted set with the LP's weights, then SD against `q~`."
#[derive(Clone, Debug)]
pub(crate) struct WeightedPlan {
    pub(crate) bit_of: Vec<Option<u32>>,
    pub(crate) tail_bit: Option<u32>,
    /// Set mask -> the selection law over its symbols (sums to 1).
    pub(crate) select: HashMap<u64, Vec<(Symbol, f64)>>,
    /// Which tail draft a selected tail symbol stands for.
    pub(crate) tail: TailSelection,
    /// Set mask -> the law of the alphabet symbol selected when the tail symbol was selected
    /// and every tail draft declined (sums to 1; sets that hold the tail and an alphabet symbol,
    /// where the tail rule declines).
    pub(crate) declined: HashMap<u64, Vec<(usize, f64)>>,
    /// `q~`: the law of the selected token.
    pub(crate) proposal: Vec<f64>,
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
    /// The best of the two leftover rules, each with the best tail rule that always selects a
    /// tail draft and the best that may decline them all (the first of these on ties).
    ///
    /// The tail-first plans are built first; every other candidate is skipped as soon as its
    /// acceptance bound shows it cannot beat the best so far (`build_above`), which leaves the
    /// chosen plan unchanged.
    pub(crate) fn from_flow(p: &[f64], qs: &[Vec<f64>], flow: &Flow) -> Self {
        let mut specs = vec![(Leftover::Proportional, None), (Leftover::Fill, None)];
        for leftover in [Leftover::Proportional, Leftover::Fill] {
            specs.extend(SHIFTS.map(|shift| (leftover, Some(shift))));
        }
        let tail_first: Vec<Self> = decline::tail_first(p, qs, flow)
            .into_iter()
            .flatten()
            .collect();
        let mut floor = tail_first
            .iter()
            .map(|plan| plan.acceptance)
            .fold(f64::NEG_INFINITY, f64::max);
        // In the order of the candidates (the first of equal ones is kept).
        let mut candidates = Vec::new();
        for (leftover, shift) in specs {
            let plan = Self::build_above(p, qs, flow, leftover, false, shift, floor);
            if let Some(plan) = plan {
                floor = floor.max(plan.acceptance);
                candidates.push(plan);
            }
        }
        candidates.extend(tail_first);
        let mut best = 0;
        for (i, plan) in candidates.iter().enumerate() {
            if plan.acceptance > candidates[best].acceptance {
                best = i;
            }
        }
        candidates.swap_remove(best)
    }

    /// The plan before the tail selection used all tail drafts: proportional leftover, first
    /// tail draft (kept for comparisons).
    #[cfg(test)]
    pub(crate) fn first_tail_draft_plan(p: &[f64], qs: &[Vec<f64>], flow: &Flow) -> Self {
        Self::build(p, qs, flow, Leftover::Proportional, true, None)
    }

    /// [`WeightedPlan::build_above`] without a floor.
    #[cfg(test)]
    pub(crate) fn build(
        p: &[f64],
        qs: &[Vec<f64>],
        flow: &Flow,
        leftover: Leftover,
        first_tail_draft: bool,
        decline: Option<f64>,
    ) -> Self {
        Self::build_above(
            p,
            qs,
            flow,
            leftover,
            first_tail_draft,
            decline,
            f64::NEG_INFINITY,
        )
        .expect("no floor")
    }

    /// The plan with `leftover` and the best tail rule. `first_tail_draft`: select the first
    /// tail draft whenever the tail symbol is selected; `decline`: the tail rule may decline
    /// every tail draft of a set that holds an alphabet symbol, after shifting that fraction of
    /// the alphabet symbols' weight to the tail symbol (see the module docs). None, before the
    /// tail rule is searched, when an upper bound on the plan's acceptance shows that it cannot
    /// reach `floor` ([`TailProblem::upper_bound`] plus the alphabet's overlap, which the tail
    /// rule changes only through declined mass, which that bound covers).
    pub(crate) fn build_above(
        p: &[f64],
        qs: &[Vec<f64>],
        flow: &Flow,
        leftover: Leftover,
        first_tail_draft: bool,
        decline: Option<f64>,
        floor: f64,
    ) -> Option<Self> {
        let v = p.len();
        let mut select = selection_rows(p, flow, leftover);
        if let Some(shift) = decline {
            shift_to_tail(flow, &mut select, shift);
        }
        let mut proposal = vec![0.0; v];
        // Selection mass of the tail symbol per tail record and declinability.
        let mut tail_weight: BTreeMap<(u64, bool), f64> = BTreeMap::new();
        for (&(mask, record), &mass) in &flow.patterns {
            let Some(row) = select.get(&mask) else {
                continue;
            };
            for &(symbol, w) in row {
                match symbol {
                    Symbol::Token(y) => proposal[y] += mass * w,
                    Symbol::Tail => {
                        let key = (record, declinable(flow, mask));
                        *tail_weight.entry(key).or_insert(0.0) += mass * w;
                    }
                }
            }
        }
        let tail_tokens: Vec<usize> = (0..v)
            .filter(|&y| flow.tail_bit.is_some() && flow.bit_of[y] == flow.tail_bit)
            .collect();
        let visits = tail_weight
            .into_iter()
            .map(|((record, d), w)| (flow.tracking.drafts(record), w, d))
            .collect();
        let shared = flow.tracking == TailTracking::Count;
        let room = flow
            .info
            .alphabet
            .iter()
            .map(|&y| (p[y] - proposal[y]).max(0.0));
        let decline = decline.map(|_| room.sum());
        let problem = TailProblem::new(p, qs, &tail_tokens, shared, visits, decline);
        if floor > f64::NEG_INFINITY {
            let alphabet: f64 = p.iter().zip(&proposal).map(|(&a, &b)| a.min(b)).sum();
            if alphabet + problem.upper_bound() < floor - BOUND_MARGIN {
                return None;
            }
        }
        let first_only = first_tail_draft || !flow.tracking.keeps_all();
        let (tail, tail_law) = problem.solve(v, first_only);
        for (&t, &q) in tail_tokens.iter().zip(&tail_law) {
            proposal[t] += q;
        }
        let declined = decline::rows(p, flow, &select, &tail, &mut proposal);
        Some(Self::with_proposal(
            p, flow, select, tail, declined, proposal,
        ))
    }

    /// The SD stage against `proposal`.
    pub(crate) fn with_proposal(
        p: &[f64],
        flow: &Flow,
        select: HashMap<u64, Vec<(Symbol, f64)>>,
        tail: TailSelection,
        declined: HashMap<u64, Vec<(usize, f64)>>,
        proposal: Vec<f64>,
    ) -> Self {
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
            tail,
            declined,
            proposal,
            accept,
            residual: normalised_or(rest, p),
            acceptance,
        }
    }

    pub(crate) fn mask(&self, drafts: &[usize]) -> u64 {
        drafts
            .iter()
            .filter_map(|&x| self.bit_of[x])
            .fold(0, |m, b| m | (1 << b))
    }

    /// The drafts that drafted a tail token, in order.
    pub(crate) fn tail_drafts(&self, drafts: &[usize]) -> Vec<usize> {
        (0..drafts.len())
            .filter(|&k| self.tail_bit.is_some() && self.bit_of[drafts[k]] == self.tail_bit)
            .collect()
    }

    /// The first draft that drafted `token`.
    fn carrier(drafts: &[usize], token: usize) -> usize {
        drafts
            .iter()
            .position(|&x| x == token)
            .expect("a selected symbol was drafted")
    }

    /// Uses `u[K]` for the selection, `u[1..K-1]` for the selection among the tail drafts,
    /// `u[0]` for the SD test and `u[K + 1]` for the residual.
    pub(crate) fn decide(&self, drafts: &[usize], u: &[f64]) -> Outcome {
        let k_drafts = drafts.len();
        let reject = || Outcome {
            accepted: None,
            token: sample(&self.residual, u[k_drafts + 1]),
        };
        let mask = self.mask(drafts);
        let Some(row) = self.select.get(&mask) else {
            return reject();
        };
        // The chosen symbol and its interval `[lo, hi)` of `u[K]` (the last symbol's reaches 1).
        let (mut acc, mut lo, mut hi) = (0.0, 0.0, 1.0);
        let mut chosen = row.last().expect("a selection row is never empty").0;
        for (i, &(symbol, w)) in row.iter().enumerate() {
            if u[k_drafts] < acc + w || i + 1 == row.len() {
                chosen = symbol;
                lo = acc;
                if i + 1 < row.len() {
                    hi = acc + w;
                }
                break;
            }
            acc += w;
        }
        let k = match chosen {
            Symbol::Token(y) => Self::carrier(drafts, y),
            Symbol::Tail => {
                let declinable = declinable_bits(self.tail_bit, mask);
                let tail_drafts = self.tail_drafts(drafts);
                match self.tail.choose(&tail_drafts, drafts, u, declinable) {
                    Some(k) => k,
                    // Given the tail symbol, `u[K]` is uniform on `[lo, hi)`: rescaled, it
                    // picks the alphabet symbol.
                    None => {
                        let v = ((u[k_drafts] - lo) / (hi - lo)).clamp(0.0, 1.0);
                        Self::carrier(drafts, decline::pick(&self.declined[&mask], v))
                    }
                }
            }
        };
        if u[0] < self.accept[drafts[k]] {
            Outcome {
                accepted: Some(k),
                token: drafts[k],
            }
        } else {
            reject()
        }
    }

    /// The law of the selected draft given the tuple: `(draft, probability)`.
    pub(crate) fn selection(&self, drafts: &[usize]) -> Vec<(usize, f64)> {
        let mask = self.mask(drafts);
        let Some(row) = self.select.get(&mask) else {
            return Vec::new();
        };
        // The row sums to 1 up to round-off; the last symbol takes what the cumulative sum
        // leaves, as in `decide`.
        let total: f64 = row.iter().map(|&(_, w)| w).sum();
        let mut out = Vec::new();
        for (i, &(symbol, w)) in row.iter().enumerate() {
            let w = if i + 1 == row.len() {
                w + (1.0 - total)
            } else {
                w
            };
            match symbol {
                Symbol::Token(y) => out.push((Self::carrier(drafts, y), w)),
                Symbol::Tail => {
                    let tail_drafts = self.tail_drafts(drafts);
                    let declinable = declinable_bits(self.tail_bit, mask);
                    let (shares, declined) = self.tail.shares(&tail_drafts, drafts, declinable);
                    for (k, share) in shares {
                        out.push((k, w * share));
                    }
                    if declined > 0.0 {
                        for (y, share) in decline::shares(&self.declined[&mask]) {
                            out.push((Self::carrier(drafts, y), w * declined * share));
                        }
                    }
                }
            }
        }
        out
    }

    pub(crate) fn law(&self, drafts: &[usize]) -> (Vec<f64>, f64) {
        let mut law = vec![0.0; self.residual.len()];
        let mut accepted = 0.0;
        let mut rejected = 1.0;
        let selection = self.selection(drafts);
        if !selection.is_empty() {
            rejected = 0.0;
        }
        for (k, w) in selection {
            let y = drafts[k];
            law[y] += w * self.accept[y];
            accepted += w * self.accept[y];
            rejected += w * (1.0 - self.accept[y]);
        }
        for (l, r) in law.iter_mut().zip(&self.residual) {
            *l += rejected * r;
        }
        (law, accepted)
    }
}

/// A candidate plan is skipped when its acceptance bound is below the best plan's acceptance by
/// more than this (far above the bound's round-off, far below any gain that matters).
const BOUND_MARGIN: f64 = 1e-9;

/// Fractions of the alphabet symbols' selection weight offered to the tail symbol instead in
/// the sets that hold both, when the tail rule may decline (see the module docs).
const SHIFTS: [f64; 3] = [0.0, 0.5, 1.0];

/// Moves `shift` of the alphabet symbols' weight to the tail symbol in every declinable set.
fn shift_to_tail(flow: &Flow, select: &mut HashMap<u64, Vec<(Symbol, f64)>>, shift: f64) {
    if shift <= 0.0 {
        return;
    }
    for (&mask, row) in select.iter_mut() {
        if !declinable(flow, mask) {
            continue;
        }
        let mut moved = 0.0;
        for (symbol, w) in row.iter_mut() {
            if *symbol != Symbol::Tail {
                moved += *w * shift;
                *w *= 1.0 - shift;
            }
        }
        match row.iter_mut().find(|(s, _)| *s == Symbol::Tail) {
            Some((_, w)) => *w += moved,
            None => row.push((Symbol::Tail, moved)),
        }
        row.retain(|&(_, w)| w > 0.0);
    }
}

/// Whether a drafted set (a mask over `flow`'s bits) holds an alphabet symbol besides the
/// tail symbol, so that the tail rule may decline its tail drafts.
fn declinable(flow: &Flow, mask: u64) -> bool {
    declinable_bits(flow.tail_bit, mask)
}

fn declinable_bits(tail_bit: Option<u32>, mask: u64) -> bool {
    tail_bit.is_some_and(|b| mask & (1 << b) != 0 && mask & !(1 << b) != 0)
}

/// Where a drafted set's selection mass goes when the LP's flow leaves some of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Leftover {
    /// Spread over the set's symbols in proportion to what the flow leaves of their target mass
    /// (`p(y) - inflow(y)`; the best-ranked symbol when nothing is left).
    Proportional,
    /// Set by set (fewest symbols first), fill what the flow and the earlier sets leave of the
    /// target masses of the set's symbols, in proportion to it; what none of them has room for
    /// goes to the tail symbol if drafted (tail tokens are accepted only in part, so more mass
    /// can still help), else to the best-ranked symbol.
    Fill,
}

/// What the flow leaves of each symbol's target mass: `p(y) - inflow(y)`, at least 0.
fn room_left(p: &[f64], flow: &Flow, set_mass: &HashMap<u64, f64>) -> HashMap<Symbol, f64> {
    let alphabet = &flow.info.alphabet;
    let mut room: HashMap<Symbol, f64> = HashMap::new();
    for &y in alphabet {
        room.insert(Symbol::Token(y), p[y]);
    }
    if flow.tail_bit.is_some() {
        let tail_p = (0..p.len())
            .filter(|&y| flow.bit_of[y] == flow.tail_bit)
            .map(|y| p[y])
            .sum();
        room.insert(Symbol::Tail, tail_p);
    }
    for (mask, row) in &flow.table {
        let mass = set_mass.get(mask).copied().unwrap_or(0.0);
        for &(symbol, w) in row {
            *room.entry(symbol).or_insert(0.0) -= mass * w;
        }
    }
    room.into_iter().map(|(s, r)| (s, r.max(0.0))).collect()
}

/// Set mask -> the selection law over its symbols: the flow's conditional row, plus the mass it
/// leaves, placed by `leftover` (mass on a symbol whose target mass is already covered adds
/// nothing to `sum min(p, q~)`).
fn selection_rows(p: &[f64], flow: &Flow, leftover: Leftover) -> HashMap<u64, Vec<(Symbol, f64)>> {
    let alphabet = &flow.info.alphabet;
    let symbol_of = |bit: u32| {
        if Some(bit) == flow.tail_bit {
            Symbol::Tail
        } else {
            Symbol::Token(alphabet[bit as usize])
        }
    };
    let mut set_mass: HashMap<u64, f64> = HashMap::new();
    for (&(mask, _), &w) in &flow.patterns {
        *set_mass.entry(mask).or_insert(0.0) += w;
    }
    let mut room = room_left(p, flow, &set_mass);
    // Sets with fewer symbols first: they have fewer places for their leftover.
    let mut masks: Vec<u64> = set_mass.keys().copied().filter(|&m| m != 0).collect();
    masks.sort_by_key(|&m| (m.count_ones(), m));
    let mut select = HashMap::new();
    for mask in masks {
        let mass = set_mass[&mask];
        let mut row = flow.table.get(&mask).cloned().unwrap_or_default();
        let left = (1.0 - row.iter().map(|&(_, w)| w).sum::<f64>()).max(0.0);
        let symbols: Vec<Symbol> = (0..64)
            .filter(|b| mask & (1 << b) != 0)
            .map(symbol_of)
            .collect();
        let total: f64 = symbols.iter().map(|s| room[s]).sum();
        let mut shares = Vec::new();
        let mut rest = left;
        if total > 0.0 && mass > 0.0 {
            match leftover {
                Leftover::Proportional => {
                    shares = symbols
                        .iter()
                        .map(|s| (*s, left * room[s] / total))
                        .collect();
                    rest = 0.0;
                }
                Leftover::Fill => {
                    // Absolute mass: at most the room, which it uses up.
                    let fill = (left * mass).min(total);
                    for s in &symbols {
                        let r = room.get_mut(s).expect("every symbol has a room entry");
                        let give = fill * *r / total;
                        *r = (*r - give).max(0.0);
                        shares.push((*s, give / mass));
                    }
                    rest = (left - fill / mass).max(0.0);
                }
            }
        }
        if rest > 0.0 {
            let to = if leftover == Leftover::Fill && symbols.contains(&Symbol::Tail) {
                Symbol::Tail
            } else {
                symbols[0]
            };
            shares.push((to, rest));
        }
        for (symbol, share) in shares {
            match row.iter_mut().find(|(s, _)| *s == symbol) {
                Some((_, w)) => *w += share,
                None => row.push((symbol, share)),
            }
        }
        row.retain(|&(_, w)| w > 0.0);
        select.insert(mask, row);
    }
    select
}
