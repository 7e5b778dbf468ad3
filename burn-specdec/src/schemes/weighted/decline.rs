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

/// The tail-first plans: the sets that hold the tail symbol offer it first (the last tail
/// draft is tested too where the set holds an alphabet symbol); what the tail drafts decline
/// goes to the alphabet symbols by the LP over the alphabet with the set masses that the tail
/// stage leaves, `P'(S, D) = P(S, D) prod_i (1 - abar_i)`, its unused mass placed by each
/// leftover rule. Two offer policies: every set that holds the tail, or only those whose
/// alphabet symbols all had their target mass filled by the original flow (a set holding a
/// symbol with room left selects among its alphabet symbols only, by the same LP). None
/// without a tail (plans whose LP fails are left out: they are only candidates).
pub(crate) fn tail_first(p: &[f64], qs: &[Vec<f64>], flow: &Flow) -> Option<Vec<WeightedPlan>> {
    let tail_bit = flow.tail_bit?;
    let alphabet = &flow.info.alphabet;
    // Alphabet bits whose target mass the original flow leaves partly uncovered.
    let mut set_mass: HashMap<u64, f64> = HashMap::new();
    for (&(mask, _), &w) in &flow.patterns {
        *set_mass.entry(mask).or_insert(0.0) += w;
    }
    let mut inflow: HashMap<Symbol, f64> = HashMap::new();
    for (mask, row) in &flow.table {
        for &(symbol, w) in row {
            *inflow.entry(symbol).or_insert(0.0) += set_mass.get(mask).copied().unwrap_or(0.0) * w;
        }
    }
    let room_bits: u64 = (0..alphabet.len())
        .filter(|&b| {
            let y = alphabet[b];
            p[y] - inflow.get(&Symbol::Token(y)).copied().unwrap_or(0.0) > ROOM_TOLERANCE * p[y]
        })
        .fold(0, |m, b| m | (1 << b));
    let holds_tail = |mask: u64| mask & (1 << tail_bit) != 0;
    let every = |mask: u64| holds_tail(mask);
    let filled = |mask: u64| holds_tail(mask) && (!declinable(flow, mask) || mask & room_bits == 0);
    let policies: [&dyn Fn(u64) -> bool; 2] = [&every, &filled];
    let mut plans = Vec::new();
    for offers in policies {
        plans.extend(offered(p, qs, flow, offers).into_iter().flatten());
    }
    Some(plans)
}

/// A set's alphabet symbols have room left if the flow leaves more than this fraction of
/// their target mass.
const ROOM_TOLERANCE: f64 = 1e-9;

/// The tail-first plans (one per leftover rule) where the sets `offers` accepts offer the tail
/// first; None if the alphabet LP fails.
fn offered(
    p: &[f64],
    qs: &[Vec<f64>],
    flow: &Flow,
    offers: &dyn Fn(u64) -> bool,
) -> Option<[WeightedPlan; 2]> {
    let v = p.len();
    let mut weight: BTreeMap<(u64, bool), f64> = BTreeMap::new();
    for (&(mask, record), &mass) in &flow.patterns {
        if offers(mask) {
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
        if !offers(mask) {
            return 1.0;
        }
        let declinable = declinable_bits(flow.tail_bit, mask);
        tail.declined(&flow.tracking.drafts(record), declinable)
    };
    let rest = lp::solve_with(p, qs, alphabet.clone(), tail_tokens.clone(), Some(&leave)).ok()?;
    Some([Leftover::Proportional, Leftover::Fill].map(|leftover| {
        let rows = selection_rows(p, &rest, leftover);
        let mut proposal = vec![0.0; v];
        for (&t, &q) in tail_tokens.iter().zip(&tail_law) {
            proposal[t] += q;
        }
        assemble(p, flow, &rest, &rows, offers, tail.clone(), proposal)
    }))
}

/// The alphabet part of a set's row, renormalised (its best-ranked symbol if none).
fn alphabet_row(flow: &Flow, mask: u64, row: Option<&Vec<(Symbol, f64)>>) -> Vec<(usize, f64)> {
    let mut out: Vec<(usize, f64)> = row
        .into_iter()
        .flatten()
        .filter_map(|&(s, w)| match s {
            Symbol::Token(y) if w > 0.0 => Some((y, w)),
            _ => None,
        })
        .collect();
    let total: f64 = out.iter().map(|&(_, w)| w).sum();
    if total > 0.0 {
        out.iter_mut().for_each(|(_, w)| *w /= total);
    } else {
        let alphabet = &flow.info.alphabet;
        let best = (0..alphabet.len()).find(|&b| mask & (1 << b) != 0);
        out = vec![(alphabet[best.expect("an alphabet symbol")], 1.0)];
    }
    out
}

/// A tail-first plan from the alphabet LP's selection rows `rows` (see [`tail_first`]);
/// `proposal` holds the tail stage's law.
fn assemble(
    p: &[f64],
    flow: &Flow,
    rest: &Flow,
    rows: &HashMap<u64, Vec<(Symbol, f64)>>,
    offers: &dyn Fn(u64) -> bool,
    tail: TailSelection,
    mut proposal: Vec<f64>,
) -> WeightedPlan {
    let tail_bit = flow.tail_bit.expect("a tail");
    let holds_tail = |mask: u64| mask & (1 << tail_bit) != 0;
    let (mut select, mut declined) = (HashMap::new(), HashMap::new());
    for &(mask, _) in flow.patterns.keys() {
        if mask == 0 || select.contains_key(&mask) {
            continue;
        }
        if offers(mask) {
            select.insert(mask, vec![(Symbol::Tail, 1.0)]);
            if declinable(flow, mask) {
                declined.insert(mask, alphabet_row(flow, mask, rows.get(&mask)));
            }
        } else if holds_tail(mask) {
            let row = alphabet_row(flow, mask, rows.get(&mask));
            let row = row.into_iter().map(|(y, w)| (Symbol::Token(y), w));
            select.insert(mask, row.collect());
        } else if let Some(row) = rows.get(&mask) {
            select.insert(mask, row.clone());
        }
    }
    for (&(mask, _), &mass) in &rest.patterns {
        if offers(mask) {
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
