//! Selection among the drafts that hit the lumped tail, and its exact law.
//!
//! When weighted importance sampling selects the tail symbol, the tail drafts `k_0 < k_1 < ..`
//! of the tuple are visited in order: the `i`-th (all but the last) is selected with probability
//! `a_{i,k_i}(x_{k_i})`, using the uniform `u[1 + i]`, else the visit goes on; the last one is
//! selected if no earlier one was (or, where the rule declines and the set holds an alphabet
//! symbol, tested too: if it is not selected either, every tail draft was declined and
//! `super::decline` picks an alphabet symbol). With the conditionals `p_R = p(.|tail)`,
//! `q_{k,R} = q_k(.|tail)` the selection rows are
//!
//! - [`TailRule::FirstDraft`]: `a = 1`, i.e. the first tail draft (the rule of the LP coupling);
//! - [`TailRule::Rejection`]: `a_{i,k}(t) = min(1, p_R(t) / (c q_{k,R}(t)))` for every stage;
//! - [`TailRule::Reserve`] (identical drafts): one row `a_i` per stage, refined from the
//!   rejection rule (see [`TailProblem::solve`]).
//!
//! # Law
//! Given the drafted set and the record `D` of the tail drafts kept by the set-mass recursion
//! (`lp::TailTracking`), tail draft `k` drew `x_k ~ q_{k,R}` independently of the
//! others, so the `i`-th visited draft is reached with probability
//! `r_i(D) = prod_{l<i} (1 - abar_{l,k_l})`, `abar_{i,k} = sum_t q_{k,R}(t) a_{i,k}(t)`, whatever
//! the earlier drafts drew. With `W_D` the selection mass of the tail symbol on the patterns with
//! record `D`, the selected tail token has law
//!
//! ```text
//! q~(t) = sum_D W_D [ sum_{i < |D|-1} r_i(D) a_{i,k_i}(t) q_{k_i,R}(t) + r_{|D|-1}(D) q_{k_last,R}(t) ].
//! ```
//!
//! For `n` identical drafts and one row `a` this is `q_R(t) sum_n W_n [a(t) sum_{j<n-1}
//! (1-abar)^j + (1-abar)^{n-1}]`. Where the record only keeps the first tail draft (many
//! different drafts), only [`TailRule::FirstDraft`] is used.
//!
//! # Choice of the rows
//! Any rows are exact (the scheme is single-draft SD against this law); they only change the
//! acceptance `sum_t min(p(t), q~(t))` over the tail tokens, which is maximised over: the
//! first-draft rule (kept on ties, so the acceptance never drops below it), a log-spaced grid of
//! `c` between the smallest and the largest ratio `p_R / q_{k,R}` (`c` below the smallest is the
//! first-draft rule; at the largest every `a` is `p_R / (c q_R)`), a golden-section refinement
//! around the best grid point, and, for identical drafts, the rounds of a stage-wise reserve
//! refinement of the best `c` (at most `RESERVE_ROUNDS`; it stops earlier once the rows or
//! the overlap stop moving, typically after ~10-30 at K = 8).
//! Where the rule may decline, the score adds what the declined mass can at most add on the
//! alphabet (`min(declined, room)`); the plan then compares the true acceptances.
//!
//! With declining, for `n` tail drafts of a declinable visit all `n` are tested (stage rows
//! `0..n`), and the visit's mass `W_D r_n(D)` left after the last is declined; the law above
//! loses its fall-back term for those visits.

use crate::prob::ratio_capped;

/// Grid points of the search over `log c`.
const GRID: usize = 16;

/// Golden-section steps after the grid.
const REFINE: usize = 20;

/// Most rounds of the stage-wise reserve refinement.
const RESERVE_ROUNDS: usize = 128;

/// The refinement stops once no selection probability moves by more than this ...
const RESERVE_TOLERANCE: f64 = 1e-12;

/// ... or once the overlap gained less than `STALL_GAIN` over the last `STALL_ROUNDS` rounds (it
/// then creeps: on the SmolLM2 rows at K = 8 the rounds after the stall, up to
/// `RESERVE_ROUNDS`, added at most 1e-13 while taking 7 times as many rounds).
const STALL_ROUNDS: usize = 4;
const STALL_GAIN: f64 = 1e-12;

/// How a visited tail draft is selected.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum TailRule {
    /// Always the first tail draft.
    FirstDraft,
    /// `a_k(t) = min(1, p_R(t) / (c q_{k,R}(t)))`.
    Rejection { c: f64 },
    /// Identical drafts: one row per visiting stage, from `Rejection { c }` after this many
    /// rounds of the reserve refinement.
    Reserve { c: f64, round: usize },
}

/// The rule chosen for one plan, with the per-token selection probabilities `decide` reads.
#[derive(Clone, Debug)]
pub(crate) struct TailSelection {
    pub(crate) rule: TailRule,
    /// Selection rows over the vocabulary (0 outside the tail), one per slot: the visiting stage
    /// for identical drafts (`by_stage`; the last row serves later stages), else the draft.
    /// None for [`TailRule::FirstDraft`].
    pub(crate) rows: Vec<Vec<f64>>,
    pub(crate) by_stage: bool,
    /// Whether the last tail draft is tested too where the drafted set holds an alphabet symbol
    /// (`declinable`): if every tail draft is declined, an alphabet symbol of the set is
    /// selected instead (see the module docs).
    pub(crate) declines: bool,
    /// Per slot (as `rows`): the probability `1 - abar` that a visited tail draft is not selected.
    pub(crate) pass: Vec<f64>,
}

impl TailSelection {
    /// The probability of selecting the `i`-th visited tail draft, draft `k`, that drafted `x`
    /// when it is not the last tail draft.
    pub(crate) fn accept(&self, i: usize, k: usize, x: usize) -> f64 {
        if self.rule == TailRule::FirstDraft {
            return 1.0;
        }
        self.rows[self.slot(i, k)][x]
    }

    /// The row of the `i`-th visited tail draft, draft `k`.
    fn slot(&self, i: usize, k: usize) -> usize {
        let slot = if self.by_stage { i } else { k };
        slot.min(self.rows.len() - 1)
    }

    /// How many of `n` tail drafts are tested: all where the selection may decline them all.
    fn tested(&self, n: usize, declinable: bool) -> usize {
        if self.declines && declinable {
            n
        } else {
            n - 1
        }
    }

    /// The selected draft among `tail_drafts` (increasing, non-empty), None if every one was
    /// declined (only where `declinable`); `u[1 + i]` decides on the `i`-th.
    pub(crate) fn choose(
        &self,
        tail_drafts: &[usize],
        drafts: &[usize],
        u: &[f64],
        declinable: bool,
    ) -> Option<usize> {
        let n = tail_drafts.len();
        let tested = self.tested(n, declinable);
        for (i, &k) in tail_drafts[..tested].iter().enumerate() {
            if u[1 + i] < self.accept(i, k, drafts[k]) {
                return Some(k);
            }
        }
        (tested < n).then(|| tail_drafts[n - 1])
    }

    /// Probability of selecting each of `tail_drafts` (the law of [`TailSelection::choose`]),
    /// and of declining them all.
    pub(crate) fn shares(
        &self,
        tail_drafts: &[usize],
        drafts: &[usize],
        declinable: bool,
    ) -> (Vec<(usize, f64)>, f64) {
        let n = tail_drafts.len();
        let tested = self.tested(n, declinable);
        let mut reach = 1.0;
        let mut out = Vec::with_capacity(n);
        for (i, &k) in tail_drafts[..tested].iter().enumerate() {
            let a = self.accept(i, k, drafts[k]);
            out.push((k, reach * a));
            reach *= 1.0 - a;
        }
        if tested < n {
            out.push((tail_drafts[n - 1], reach));
            reach = 0.0;
        }
        (out, reach)
    }

    /// The probability of declining every tail draft of a record (`tail_drafts`, whose tokens
    /// were drawn from their tail conditionals independently) where `declinable`.
    pub(crate) fn declined(&self, tail_drafts: &[usize], declinable: bool) -> f64 {
        if !(self.declines && declinable) {
            return 0.0;
        }
        tail_drafts
            .iter()
            .enumerate()
            .map(|(i, &k)| self.pass[self.slot(i, k)])
            .product()
    }
}

/// Selection rows on the tail tokens, one per slot (see [`TailSelection::rows`]); empty for the
/// first-draft rule.
type Rows = Vec<Vec<f64>>;

/// A scored rule: `sum_t min(p(t), q~(t))`, `q~` on the tail tokens, and the rows.
struct Scored {
    rule: TailRule,
    overlap: f64,
    law: Vec<f64>,
    rows: Rows,
}

/// The tail part of the selection problem, on the tail tokens only.
pub(crate) struct TailProblem<'a> {
    /// Tail tokens (vocabulary indices).
    tokens: &'a [usize],
    /// `p(t)` and `p_R(t)`.
    p: Vec<f64>,
    p_cond: Vec<f64>,
    /// `q_{k,R}(t)`, one shared row for identical drafts (zero for drafts that never hit it).
    q_cond: Vec<Vec<f64>>,
    /// `(D, W_D, declinable)`: the tail drafts of a record, increasing, the tail symbol's
    /// selection mass, and whether its sets hold an alphabet symbol (records are split by it).
    visits: Vec<(Vec<usize>, f64, bool)>,
    /// Whether declinable visits test their last tail draft too.
    decline: bool,
    /// What the selection leaves of the alphabet's target mass, `sum max(p - q~, 0)` over the
    /// alphabet: the most that declined selections can add to the acceptance (scores only).
    room: f64,
}

impl<'a> TailProblem<'a> {
    /// `shared`: the drafts are identical (the records count the tail drafts).
    pub(crate) fn new(
        p: &[f64],
        qs: &[Vec<f64>],
        tokens: &'a [usize],
        shared: bool,
        visits: Vec<(Vec<usize>, f64, bool)>,
        decline: Option<f64>,
    ) -> Self {
        let conditional = |row: &[f64]| -> Vec<f64> {
            let mass: f64 = tokens.iter().map(|&t| row[t]).sum();
            tokens
                .iter()
                .map(|&t| if mass > 0.0 { row[t] / mass } else { 0.0 })
                .collect()
        };
        let rows = if shared { &qs[..1] } else { qs };
        Self {
            tokens,
            p: tokens.iter().map(|&t| p[t]).collect(),
            p_cond: conditional(p),
            q_cond: rows.iter().map(|q| conditional(q)).collect(),
            visits,
            decline: decline.is_some(),
            room: decline.unwrap_or(0.0),
        }
    }

    fn shared(&self) -> bool {
        self.q_cond.len() == 1
    }

    /// Number of slots for `rows`: stages for identical drafts, else drafts.
    fn slots(&self, rows: &Rows) -> usize {
        if self.shared() {
            rows.len().max(1)
        } else {
            self.q_cond.len()
        }
    }

    /// Slot of the `i`-th visited tail draft `k` among `slots`.
    fn slot(&self, i: usize, k: usize, slots: usize) -> usize {
        if self.shared() { i.min(slots - 1) } else { k }
    }

    /// The `q_{k,R}` row of a slot.
    fn q_row(&self, slot: usize) -> &[f64] {
        &self.q_cond[slot.min(self.q_cond.len() - 1)]
    }

    /// `min(1, p_R / (c q_R))` for each draft row.
    fn rejection_rows(&self, c: f64) -> Rows {
        self.q_cond
            .iter()
            .map(|q| {
                q.iter()
                    .zip(&self.p_cond)
                    .map(|(&qt, &pt)| ratio_capped(pt, c * qt))
                    .collect()
            })
            .collect()
    }

    /// Per slot: the pass probability `1 - abar` (summed as `sum q (1 - a)` so that `a = 1`
    /// passes nothing).
    fn pass(&self, rows: &Rows) -> Vec<f64> {
        (0..self.slots(rows))
            .map(|s| {
                let q = self.q_row(s);
                // The first-draft rule (no rows, `a = 1`) passes nothing.
                match rows.is_empty() {
                    true => 0.0,
                    false => {
                        let a = &rows[s.min(rows.len() - 1)];
                        q.iter().zip(a).map(|(&qt, &at)| qt * (1.0 - at)).sum()
                    }
                }
            })
            .collect()
    }

    /// Per slot: the mass of visits that test it (`sel`, including the reach), per draft row the
    /// mass that falls back to it (`last`), and the mass declined by every tail draft, given
    /// the slots' pass probabilities.
    fn stage_masses(&self, rows: &Rows) -> (Vec<f64>, Vec<f64>, f64) {
        self.stage_masses_with(&self.pass(rows))
    }

    /// [`TailProblem::stage_masses`] from the slots' pass probabilities `pass`.
    fn stage_masses_with(&self, pass: &[f64]) -> (Vec<f64>, Vec<f64>, f64) {
        let slots = pass.len();
        let (mut sel, mut last) = (vec![0.0; slots], vec![0.0; self.q_cond.len()]);
        let mut declined = 0.0;
        for (drafts, w, declinable) in &self.visits {
            let tested = drafts.len() - usize::from(!(self.decline && *declinable));
            let mut reach = *w;
            for (i, &k) in drafts.iter().enumerate() {
                if i == tested {
                    last[k.min(self.q_cond.len() - 1)] += reach;
                } else {
                    let s = self.slot(i, k, slots);
                    sel[s] += reach;
                    reach *= pass[s];
                }
            }
            if tested == drafts.len() {
                declined += reach;
            }
        }
        (sel, last, declined)
    }

    /// Most stages a visit tests.
    fn stages(&self) -> usize {
        self.visits
            .iter()
            .map(|(d, _, declinable)| d.len() - usize::from(!(self.decline && *declinable)))
            .max()
            .unwrap_or(0)
    }

    /// `q~` on the tail tokens for selection rows `rows` (see the module docs), from their
    /// stage masses `sel` and `last`.
    fn law_with(&self, rows: &Rows, sel: &[f64], last: &[f64]) -> Vec<f64> {
        let mut out = vec![0.0; self.tokens.len()];
        // The row slices are taken out of the loops (which then vectorise); the products are
        // those of `m * a(s, i) * q(i)`, in that order (`a = 1` for the first-draft rule).
        for (s, &m) in sel.iter().enumerate().filter(|&(_, &m)| m > 0.0) {
            let q = &self.q_row(s)[..out.len()];
            if rows.is_empty() {
                for (o, &qt) in out.iter_mut().zip(q) {
                    *o += m * qt;
                }
            } else {
                let a = &rows[s.min(rows.len() - 1)][..out.len()];
                for ((o, &at), &qt) in out.iter_mut().zip(a).zip(q) {
                    *o += m * at * qt;
                }
            }
        }
        for (r, &m) in last.iter().enumerate().filter(|&(_, &m)| m > 0.0) {
            for (o, &q) in out.iter_mut().zip(&self.q_cond[r]) {
                *o += m * q;
            }
        }
        out
    }

    /// `sum min(p, q~)` on the tail, plus (where declining) what the `declined` mass can at most
    /// add on the alphabet.
    fn overlap(&self, law: &[f64], declined: f64) -> f64 {
        let overlap: f64 = self.p.iter().zip(law).map(|(a, b)| a.min(*b)).sum();
        if self.decline {
            overlap + declined.min(self.room)
        } else {
            overlap
        }
    }

    /// The tail's overlap `sum min(p, q~)`, plus (where declining) what the declined mass can
    /// at most add on the alphabet.
    fn score(&self, rule: TailRule, rows: Rows) -> Scored {
        let (sel, last, declined) = self.stage_masses(&rows);
        let law = self.law_with(&rows, &sel, &last);
        Scored {
            rule,
            overlap: self.overlap(&law, declined),
            law,
            rows,
        }
    }

    /// Smallest and largest `p_R / q_{k,R}` over tail tokens some draft can draft.
    fn ratio_range(&self) -> Option<(f64, f64)> {
        let mut range: Option<(f64, f64)> = None;
        for q in &self.q_cond {
            for (&qt, &pt) in q.iter().zip(&self.p_cond) {
                if qt > 0.0 {
                    let r = pt / qt;
                    range = Some(range.map_or((r, r), |(lo, hi)| (lo.min(r), hi.max(r))));
                }
            }
        }
        range
    }

    /// The best common-`c` rejection rule: a log grid, then golden-section search.
    fn search_c(&self, best: &mut Scored) {
        let Some((lo, hi)) = self.ratio_range() else {
            return;
        };
        let mut consider = |log_c: f64| {
            let c = log_c.exp();
            let scored = self.score(TailRule::Rejection { c }, self.rejection_rows(c));
            let value = scored.overlap;
            if value > best.overlap {
                *best = scored;
            }
            value
        };
        let (lo, hi) = (lo.ln(), hi.ln());
        let at = |j: usize| lo + (hi - lo) * j as f64 / (GRID - 1) as f64;
        let scores: Vec<f64> = (0..GRID).map(|j| consider(at(j))).collect();
        let top = (0..GRID).fold(0, |b, j| if scores[j] > scores[b] { j } else { b });
        let (mut a, mut b) = (at(top.saturating_sub(1)), at((top + 1).min(GRID - 1)));
        let ratio = (5.0_f64.sqrt() - 1.0) / 2.0;
        let (mut x1, mut x2) = (b - ratio * (b - a), a + ratio * (b - a));
        let (mut f1, mut f2) = (consider(x1), consider(x2));
        for _ in 0..REFINE {
            if f1 >= f2 {
                (b, x2, f2) = (x2, x1, f1);
                x1 = b - ratio * (b - a);
                f1 = consider(x1);
            } else {
                (a, x1, f1) = (x1, x2, f2);
                x2 = a + ratio * (b - a);
                f2 = consider(x2);
            }
        }
    }

    /// Identical drafts: one row per visiting stage, refined from the common-`c` rule by damped
    /// reserve rounds (as the sequential IS plan's reserve rule): stage `i` selects `t` with
    /// `clip((p(t) - L_i(t)) / (m_i q_R(t)), 0, 1)`, `L_i` what the other stages and the
    /// fall-backs supply to `t` and `m_i` the mass that reaches stage `i` and tests it. Every
    /// round is a candidate.
    fn refine_stages(&self, best: &mut Scored) {
        let TailRule::Rejection { c } = best.rule else {
            return;
        };
        let stages = self.stages();
        if !self.shared() || stages < 1 {
            return;
        }
        let q = &self.q_cond[0];
        let mut rows: Rows = vec![best.rows[0].clone(); stages];
        let mut pass = self.pass(&rows);
        let (mut sel, mut last, _) = self.stage_masses_with(&pass);
        let mut law = self.law_with(&rows, &sel, &last);
        // The overlap of every round so far.
        let mut history: Vec<f64> = Vec::with_capacity(RESERVE_ROUNDS);
        for round in 1..=RESERVE_ROUNDS {
            let mut change: f64 = 0.0;
            for (s, row) in rows.iter_mut().enumerate().rev() {
                // The slot's pass probability, summed as in `pass`, with the updated row.
                let mut slot_pass = 0.0;
                let m = sel[s];
                for (((a, &qt), l), &pt) in row.iter_mut().zip(q).zip(law.iter_mut()).zip(&self.p) {
                    let supply = m * qt;
                    if supply > 0.0 {
                        let others = *l - supply * *a;
                        let target = ((pt - others) / supply).clamp(0.0, 1.0);
                        let next = 0.5 * (*a + target);
                        change = change.max((next - *a).abs());
                        *l += supply * (next - *a);
                        *a = next;
                    }
                    slot_pass += qt * (1.0 - *a);
                }
                pass[s] = slot_pass;
            }
            let declined;
            (sel, last, declined) = self.stage_masses_with(&pass);
            law = self.law_with(&rows, &sel, &last);
            let overlap = self.overlap(&law, declined);
            history.push(overlap);
            if overlap > best.overlap {
                *best = Scored {
                    rule: TailRule::Reserve { c, round },
                    overlap,
                    law: law.clone(),
                    rows: rows.clone(),
                };
            }
            let stalled =
                round > STALL_ROUNDS && overlap - history[round - 1 - STALL_ROUNDS] < STALL_GAIN;
            if change <= RESERVE_TOLERANCE || stalled {
                break;
            }
        }
    }

    /// An upper bound on the score of every rule (see [`TailProblem::score`]): a visit can only
    /// select a token one of its tail drafts drew, so `q~(t) <= U(t) = sum_D W_D (1 -
    /// prod_{k in D} (1 - q_{k,R}(t)))`, and the tail's overlap is at most `sum_t min(p(t),
    /// U(t))`; with what declined mass can add (at most `room`), the score is also at most the
    /// tail symbol's whole selection mass `sum_D W_D`, which the tail law and the declined mass
    /// share.
    pub(crate) fn upper_bound(&self) -> f64 {
        let mut reach = vec![0.0; self.tokens.len()];
        let mut total = 0.0;
        // `ln (1 - q_{k,R})` per draft row, computed once (the visits repeat the rows).
        let log_pass: Vec<Vec<f64>> = self
            .q_cond
            .iter()
            .map(|q| q.iter().map(|&qt| (-qt).ln_1p()).collect())
            .collect();
        for (drafts, w, _) in self.visits.iter().filter(|&(_, w, _)| *w > 0.0) {
            total += w;
            // `ln prod (1 - q)`, kept in logs so that small `q` do not round away.
            let mut log_missed = vec![0.0; self.tokens.len()];
            for &k in drafts {
                let row = &log_pass[k.min(self.q_cond.len() - 1)];
                for (m, &l) in log_missed.iter_mut().zip(row) {
                    *m += l;
                }
            }
            for (r, m) in reach.iter_mut().zip(log_missed) {
                *r += w * -m.exp_m1();
            }
        }
        let tail: f64 = self.p.iter().zip(&reach).map(|(a, b)| a.min(*b)).sum();
        (tail + self.room).min(total)
    }

    /// The best rule (see the module docs: first tail draft, then common `c` by
    /// [`TailProblem::search_c`], then stage rows by [`TailProblem::refine_stages`]), its
    /// selection rows over the vocabulary (`vocab` entries) and `q~` on the tail tokens.
    /// `first_only`: the record keeps only the first tail draft, so only the first-draft rule
    /// is exact.
    pub(crate) fn solve(&self, vocab: usize, first_only: bool) -> (TailSelection, Vec<f64>) {
        let mut best = self.score(TailRule::FirstDraft, Vec::new());
        let any_visit = self.visits.iter().any(|(_, w, _)| *w > 0.0);
        if !first_only && any_visit {
            self.search_c(&mut best);
            self.refine_stages(&mut best);
        }
        let rows = best
            .rows
            .iter()
            .map(|row| {
                let mut full = vec![0.0; vocab];
                for (&t, &a) in self.tokens.iter().zip(row) {
                    full[t] = a;
                }
                full
            })
            .collect();
        let selection = TailSelection {
            rule: best.rule,
            pass: self.pass(&best.rows),
            rows,
            by_stage: self.shared(),
            declines: self.decline && best.rule != TailRule::FirstDraft,
        };
        (selection, best.law)
    }
}
