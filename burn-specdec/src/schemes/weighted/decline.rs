//! Where the selection goes when the tail rule declines every tail draft of a set that also
//! holds alphabet symbols: to those alphabet symbols, filling what the rest of the selection
//! leaves of their target mass.
//!
//! Given the drafted set `S` and the record `D` of its tail drafts, the tail drafts drew their
//! tail conditionals independently, so every one of them is declined with probability
//! `prod_i (1 - abar_i)` ([`TailSelection::declined`]) whatever the alphabet symbols of `S`.
//! The declined mass of `S` is `sum_D P(S, D) w(S, R) prod_i (1 - abar_i)`; sets are served
//! fewest symbols first (they have fewer places to go), each spreading its mass over its
//! alphabet symbols in proportion to what `p` minus the selection law so far leaves of their
//! target mass, and what none of them has room for going to the best-ranked one. Any such law is
//! exact (the selection's law `q~` is computed with it); the room rule only serves the
//! acceptance.

use std::collections::{BTreeMap, HashMap};

use super::tail::{TailProblem, TailSelection};
use super::{Leftover, Symbol, WeightedPlan, declinable, declinable_bits, selection_rows};
use crate::lp::{self, Flow, TailTracking};

/// The tail-first plan: every set that holds the tail symbol offers it first (the last tail
/// draft is tested too where the set holds an alphabet symbol); what the tail drafts decline
/// goes to the alphabet symbols by the LP over the alphabet with the set masses that the tail
/// stage leaves, `P'(S, D) = P(S, D) prod_i (1 - abar_i)`, its unused mass placed by
/// each leftover rule. None without a tail, or if that LP fails (the plan is then not a
/// candidate).
pub(crate) fn tail_first(p: &[f64], qs: &[Vec<f64>], flow: &Flow) -> Option<Vec<WeightedPlan>> {
    let tail_bit = flow.tail_bit?;
    let v = p.len();
    let holds_tail = |mask: u64| mask & (1 << tail_bit) != 0;
    let mut weight: BTreeMap<(u64, bool), f64> = BTreeMap::new();
    for (&(mask, record), &mass) in &flow.patterns {
        if holds_tail(mask) {
            *weight
                .entry((record, declinable(flow, mask)))
                .or_insert(0.0) += mass;
        }
    }
    let tail_tokens: Vec<usize> = (0..v)
        .filter(|&y| flow.bit_of[y] == flow.tail_bit)
        .collect();
    let visits = weight
        .into_iter()
        .map(|((record, d), w)| (flow.tracking.drafts(record), w, d))
        .collect();
    let alphabet = &flow.info.alphabet;
    let room = alphabet.iter().map(|&y| p[y]).sum();
    let shared = flow.tracking == TailTracking::Count;
    let problem = TailProblem::new(p, qs, &tail_tokens, shared, visits, Some(room));
    let (tail, tail_law) = problem.solve(v, !flow.tracking.keeps_all());
    let leave = |mask: u64, record: u64| {
        let declinable = declinable_bits(flow.tail_bit, mask);
        tail.declined(&flow.tracking.drafts(record), declinable)
    };
    let rest = lp::solve_with(p, qs, alphabet.clone(), tail_tokens.clone(), Some(&leave)).ok()?;
    let plans = [Leftover::Proportional, Leftover::Fill].map(|leftover| {
        let rows = selection_rows(p, &rest, leftover);
        assemble(p, flow, &rest, &rows, tail.clone(), &tail_law, &tail_tokens)
    });
    Some(plans.into())
}

/// The tail-first plan from the alphabet LP's selection rows `rows` (see [`tail_first`]).
fn assemble(
    p: &[f64],
    flow: &Flow,
    rest: &Flow,
    rows: &HashMap<u64, Vec<(Symbol, f64)>>,
    tail: TailSelection,
    tail_law: &[f64],
    tail_tokens: &[usize],
) -> WeightedPlan {
    let v = p.len();
    let alphabet = &flow.info.alphabet;
    let tail_bit = flow.tail_bit.expect("a tail");
    let holds_tail = |mask: u64| mask & (1 << tail_bit) != 0;
    let mut proposal = vec![0.0; v];
    for (&t, &q) in tail_tokens.iter().zip(tail_law) {
        proposal[t] += q;
    }
    let (mut select, mut declined) = (HashMap::new(), HashMap::new());
    for &(mask, _) in flow.patterns.keys() {
        if mask == 0 || select.contains_key(&mask) {
            continue;
        }
        if !holds_tail(mask) {
            if let Some(row) = rows.get(&mask) {
                select.insert(mask, row.clone());
            }
            continue;
        }
        select.insert(mask, vec![(Symbol::Tail, 1.0)]);
        if declinable(flow, mask) {
            // The alphabet part of the set's row, renormalised (its best-ranked symbol if none).
            let mut row: Vec<(usize, f64)> = rows
                .get(&mask)
                .into_iter()
                .flatten()
                .filter_map(|&(s, w)| match s {
                    Symbol::Token(y) if w > 0.0 => Some((y, w)),
                    _ => None,
                })
                .collect();
            let total: f64 = row.iter().map(|&(_, w)| w).sum();
            if total > 0.0 {
                row.iter_mut().for_each(|(_, w)| *w /= total);
            } else {
                let best = (0..alphabet.len()).find(|&b| mask & (1 << b) != 0);
                row = vec![(alphabet[best.expect("an alphabet symbol")], 1.0)];
            }
            declined.insert(mask, row);
        }
    }
    for (&(mask, _), &mass) in &rest.patterns {
        if holds_tail(mask) {
            for (y, share) in shares(&declined[&mask]) {
                proposal[y] += mass * share;
            }
        } else if let Some(row) = select.get(&mask) {
            for &(symbol, w) in row {
                if let Symbol::Token(y) = symbol {
                    proposal[y] += mass * w;
                }
            }
        }
    }
    WeightedPlan::with_proposal(p, flow, select, tail, declined, proposal)
}

/// Set mask -> the law of the alphabet token selected after every tail draft was declined
/// (sums to 1), for every declinable set the tail symbol can be selected in; adds the declined
/// mass to `proposal`.
pub(super) fn rows(
    p: &[f64],
    flow: &Flow,
    select: &HashMap<u64, Vec<(Symbol, f64)>>,
    tail: &TailSelection,
    proposal: &mut [f64],
) -> HashMap<u64, Vec<(usize, f64)>> {
    let mut out = HashMap::new();
    if !tail.declines {
        return out;
    }
    // Declined mass per set.
    let mut mass: BTreeMap<u64, f64> = BTreeMap::new();
    for (&(mask, record), &w) in &flow.patterns {
        if !declinable(flow, mask) {
            continue;
        }
        let Some(&(_, w_tail)) = select
            .get(&mask)
            .and_then(|row| row.iter().find(|(s, _)| *s == Symbol::Tail))
        else {
            continue;
        };
        let declined = tail.declined(&flow.tracking.drafts(record), true);
        *mass.entry(mask).or_insert(0.0) += w * w_tail * declined;
    }
    let alphabet = &flow.info.alphabet;
    let mut room: Vec<f64> = alphabet
        .iter()
        .map(|&y| (p[y] - proposal[y]).max(0.0))
        .collect();
    let mut masks: Vec<u64> = mass.keys().copied().collect();
    masks.sort_by_key(|&m| (m.count_ones(), m));
    for mask in masks {
        let total_mass = mass[&mask];
        // Alphabet bits of the set, best-ranked first (bits follow the alphabet's rank).
        let bits: Vec<usize> = (0..alphabet.len())
            .filter(|&b| mask & (1 << b) != 0)
            .collect();
        let total_room: f64 = bits.iter().map(|&b| room[b]).sum();
        let mut row: Vec<(usize, f64)> = Vec::with_capacity(bits.len());
        if total_mass > 0.0 && total_room > 0.0 {
            let fill = total_mass.min(total_room);
            for &b in &bits {
                let give = fill * room[b] / total_room;
                room[b] = (room[b] - give).max(0.0);
                row.push((alphabet[b], give / total_mass));
            }
        }
        let rest = 1.0 - row.iter().map(|&(_, s)| s).sum::<f64>();
        if rest > 0.0 || row.is_empty() {
            let best = alphabet[bits[0]];
            match row.iter_mut().find(|(y, _)| *y == best) {
                Some((_, s)) => *s += rest.max(0.0),
                None => row.push((best, rest.max(0.0))),
            }
        }
        row.retain(|&(_, s)| s > 0.0);
        if row.is_empty() {
            row.push((alphabet[bits[0]], 1.0));
        }
        for (y, share) in shares(&row) {
            proposal[y] += total_mass * share;
        }
        out.insert(mask, row);
    }
    out
}

/// The shares of a declined row as [`pick`] draws them: the last entry takes what the others
/// leave of 1.
pub(super) fn shares(row: &[(usize, f64)]) -> Vec<(usize, f64)> {
    let mut left = 1.0;
    let mut out = Vec::with_capacity(row.len());
    for (i, &(y, s)) in row.iter().enumerate() {
        let s = if i + 1 == row.len() { left } else { s };
        left -= s;
        out.push((y, s));
    }
    out
}

/// The token of a declined row at the uniform `v` (inverse CDF; the last entry beyond).
pub(super) fn pick(row: &[(usize, f64)], v: f64) -> usize {
    let mut acc = 0.0;
    for &(y, s) in &row[..row.len() - 1] {
        acc += s;
        if v < acc {
            return y;
        }
    }
    row[row.len() - 1].0
}
