//! The acceptance-maximising coupling for K drafts as a linear program.
//!
//! # Formulation
//! A scheme is a conditional law of the output `Y` given the drafted tuple `x = (x_1..x_K)`,
//! `x_k ~ q_k` independently, with `P(Y = y) = p(y)`. Its acceptance probability is
//! `P(Y in {x_1..x_K})`. Only the *set* `S = {x_1..x_K}` matters for which outputs count as
//! accepted, so (splitting any flow in proportion to the tuple probabilities) an optimal scheme
//! can be written with variables `f(S, y) >= 0` for `y in S` -- the probability of drafting set
//! `S` and accepting `y`:
//!
//! ```text
//! maximise    sum_{S, y in S} f(S, y)
//! subject to  sum_{y in S} f(S, y) <= P(S)    for every set S   (draft marginal)
//!             sum_{S contains y} f(S, y) <= p(y)   for every y   (target marginal)
//! ```
//!
//! This is a bipartite max-flow. Completing it to a coupling is always possible: given set `S`,
//! accept `y` with probability `f(S, y) / P(S)`, and otherwise sample the residual
//! `norm(p - inflow)`, where `inflow(y) = sum_S f(S, y)`. The output law is
//! `inflow + (1 - F) * (p - inflow) / (1 - F) = p` (with `F = sum f`) for *any* feasible `f`, so
//! exactness never depends on the LP solver's accuracy; optimality does, up to its tolerance.
//! By max-flow/min-cut the optimum equals
//! `min_{T} [ p(T^c) + 1 - prod_k (1 - q_k(T)) ]` ([`crate::optimal_acceptance_bound`]); for two
//! identical drafts this is the paper's closed form
//! `min_S { sum_{s in S} p_s + (sum_{s in S^c} q_s)^2 + 2 (sum_{s in S} q_s)(sum_{s in S^c} q_s) }`.
//! The same flow is the paper's canonical two-step scheme: selecting `y` with probability
//! `f(S, y) / P(S)` (and any draft otherwise) is an importance-weighted selection whose law `q~`
//! dominates `inflow`, and single-draft SD against it accepts `sum min(p, q~) = F`.
//!
//! # Truncation
//! The number of sets grows like `C(V, K)`. Following the paper's alphabet and LP-size
//! truncations:
//! - only tokens with `p(y) > 0` and some `q_k(y) > 0` can ever be accepted; they are ranked by
//!   `p(y) + mean_k q_k(y)` (ties by index) and the top `m` form the LP alphabet;
//! - the other acceptable tokens (the *tail*) are lumped into one symbol `R` with
//!   `p(R) = sum_tail p` and `q_k(R) = sum_tail q_k`; drafted tokens that cannot be accepted
//!   (`p = 0`) count as "no symbol";
//! - `m` is the largest value `<= max_alphabet` whose worst-case variable count
//!   `sum_{j <= K} j C(m + [tail non-empty], j)` is at most `max_variables`.
//!
//! When the coupling accepts `R` for a drafted set `S`, the token is decided by single-draft SD
//! *inside the tail*: with `k*` the first draft that drafted a tail token, accept `x_{k*}` with
//! probability `min(1, p_R(x)/q_{k*,R}(x))` for the conditionals `p_R = p(.|tail)`,
//! `q_{k,R} = q_k(.|tail)`, else sample `norm(max(p_R - q_{k*,R}, 0))`. Given `S` (and `k*`),
//! `x_{k*} ~ q_{k*,R}` (the set only records that some draft hit the tail), so this outputs exactly
//! `p_R`, and it accepts with probability `gamma_{k*} = sum_t min(p_R(t), q_{k*,R}(t))`. Each
//! unit of flow into `R` from `S` is therefore worth `g(S) = E[gamma_{k*} | S]` accepted tokens,
//! which is the LP's objective coefficient for those variables (computed exactly from the
//! set-mass recursion, see below). The top-level residual emits tail tokens in proportion to
//! `p`, so the symbol-level argument above still gives exactly `p`: truncation costs acceptance,
//! never exactness. The optimal scheme then compares the LP coupling's acceptance with the
//! same flow read as weighted importance sampling (`schemes::weighted`) and with the sequential
//! importance-sampling scheme's, and uses the best (unless
//! [`LpTruncation::fallback_to_importance_sampling`] is off); sequential IS is also the fallback
//! when no alphabet fits the budget (`max_variables = 0`).
//!
//! # Set masses
//! The set masses come from a dynamic program over the drafts that also records which drafts hit
//! the tail (`TailTracking`): their number when all drafts are identical (given `S` and that
//! number `n`, the tail tokens are `n` independent draws of `q_R`), the bit mask of the tail drafts
//! for up to `TAIL_MASK_MAX_DRAFTS` different drafts (given `S` and the mask, tail draft `k`
//! drew `q_{k,R}` independently of the others), and only the first tail draft beyond that. The
//! coupling reads `k*` off this record; weighted importance sampling uses all of it to select
//! among the tail drafts (`schemes::weighted`).

use std::collections::BTreeMap;

use microlp::{ComparisonOp, OptimizationDirection, Problem};

use crate::error::{Result, SpecDecError};
use crate::prob::normalised_or;

/// Alphabet and size limits of the optimal-coupling LP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LpTruncation {
    /// Largest number of tokens the LP handles individually (at most 62: sets are `u64` bit
    /// masks, one bit is the lumped tail).
    pub max_alphabet: usize,
    /// Budget on the worst-case number of LP variables; 0 disables the LP.
    pub max_variables: usize,
    /// Use the weighted or the sequential importance-sampling plan when it accepts more than
    /// the (truncated) LP coupling. Turning this off keeps the LP coupling whenever the LP is
    /// enabled, e.g. to study the truncation itself (the paper's Table 2); it is exact either
    /// way.
    pub fallback_to_importance_sampling: bool,
}

impl LpTruncation {
    /// The paper's best alphabet truncation (40 tokens) with a 4096-variable budget: exact (no
    /// truncation) for `V <= 40, K = 2`; smaller alphabets for larger K.
    pub const DEFAULT: Self = Self {
        max_alphabet: 40,
        max_variables: 4096,
        fallback_to_importance_sampling: true,
    };
}

impl Default for LpTruncation {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// What the optimal scheme's LP did for one `(p, q_1..q_K)`.
#[derive(Clone, Debug, PartialEq)]
pub struct LpInfo {
    /// Tokens the LP handles individually, by rank.
    pub alphabet: Vec<usize>,
    /// Number of acceptable tokens lumped into the tail symbol (0: no truncation).
    pub tail_tokens: usize,
    /// Number of drafted-set patterns with positive probability.
    pub sets: usize,
    /// Number of LP variables.
    pub variables: usize,
    /// Acceptance probability of the LP coupling (0 if the LP was disabled).
    pub lp_acceptance: f64,
    /// Whether the importance-sampling plan was used instead (it accepted more, or the LP was
    /// disabled).
    pub fell_back_to_importance_sampling: bool,
}

impl LpInfo {
    /// No LP ran (no alphabet fits the budget): the sequential IS plan is used.
    pub(crate) fn disabled(p: &[f64], qs: &[Vec<f64>]) -> Self {
        Self {
            alphabet: Vec::new(),
            tail_tokens: acceptable_tokens(p, qs).len(),
            sets: 0,
            variables: 0,
            lp_acceptance: 0.0,
            fell_back_to_importance_sampling: true,
        }
    }

    /// Whether some acceptable token was lumped into the tail.
    pub fn truncated(&self) -> bool {
        self.tail_tokens > 0
    }
}

/// An output symbol of the coupling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Symbol {
    /// A token of the LP alphabet.
    Token(usize),
    /// The lumped tail.
    Tail,
}

/// A solved (and repaired) flow, with everything the per-token decision needs.
#[derive(Clone, Debug)]
pub(crate) struct Flow {
    /// `bit_of[token]`: alphabet tokens have their own bit, tail tokens share `tail_bit`.
    pub bit_of: Vec<Option<u32>>,
    pub tail_bit: Option<u32>,
    /// Set mask -> `(symbol, f(S, symbol) / P(S))`, in bit order.
    pub table: BTreeMap<u64, Vec<(Symbol, f64)>>,
    /// `tail_accept[k][t] = min(1, p_R(t) / q_{k,R}(t))` (0 outside the tail).
    pub tail_accept: Vec<Vec<f64>>,
    /// `norm(max(p_R - q_{k,R}, 0))`, or `p_R` if empty.
    pub tail_residual: Vec<Vec<f64>>,
    /// Normalised law of the output on the reject branch.
    pub residual: Vec<f64>,
    pub acceptance: f64,
    pub info: LpInfo,
    /// `P(S, D)` of [`pattern_masses`] (`D` the tail record of [`Flow::tracking`]), kept for the
    /// weighted-IS reading of the flow.
    pub patterns: BTreeMap<(u64, u64), f64>,
    /// How `patterns` record the drafts that hit the tail.
    pub tracking: TailTracking,
}

/// Largest number of different drafts for which the set-mass recursion records the exact set of
/// drafts that hit the tail (a `K`-bit mask; up to `2^K` records per drafted set).
pub(crate) const TAIL_MASK_MAX_DRAFTS: usize = 8;

/// What the set-mass recursion records about the drafts that hit the lumped tail: the second
/// part of a pattern key, 0 when no draft did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TailTracking {
    /// All drafts are identical: the number `n` of tail drafts. The tail drafts are
    /// interchangeable, so the record stands for drafts `0..n`.
    Count,
    /// Different drafts, `K <= TAIL_MASK_MAX_DRAFTS`: the bit mask of the tail drafts.
    Mask,
    /// Different drafts, larger `K`: `1 +` the index of the first tail draft.
    First,
}

impl TailTracking {
    /// `Count` when every draft row equals the first exactly, else `Mask` or `First` by `K`.
    pub(crate) fn for_drafts(qs: &[Vec<f64>]) -> Self {
        if qs.iter().all(|q| q == &qs[0]) {
            Self::Count
        } else if qs.len() <= TAIL_MASK_MAX_DRAFTS {
            Self::Mask
        } else {
            Self::First
        }
    }

    /// The record after draft `k` hits the tail.
    fn push(self, record: u64, k: usize) -> u64 {
        match self {
            Self::Count => record + 1,
            Self::Mask => record | (1 << k),
            Self::First if record == 0 => k as u64 + 1,
            Self::First => record,
        }
    }

    /// The tail drafts a record stands for, in increasing order (for `Count`, the first `n`
    /// drafts, which have the same law as any `n` of them).
    pub(crate) fn drafts(self, record: u64) -> Vec<usize> {
        match self {
            Self::Count => (0..record as usize).collect(),
            Self::Mask => (0..64).filter(|&k| record & (1 << k) != 0).collect(),
            Self::First if record == 0 => Vec::new(),
            Self::First => vec![record as usize - 1],
        }
    }

    /// Whether a selection among the tail drafts may look beyond the first one: the record keeps
    /// their joint law.
    pub(crate) fn keeps_all(self) -> bool {
        self != Self::First
    }
}

/// Tokens that can be accepted at all, best first.
pub(crate) fn acceptable_tokens(p: &[f64], qs: &[Vec<f64>]) -> Vec<usize> {
    let k = qs.len() as f64;
    let score = |y: usize| p[y] + qs.iter().map(|q| q[y]).sum::<f64>() / k;
    let mut tokens: Vec<usize> = (0..p.len())
        .filter(|&y| p[y] > 0.0 && qs.iter().any(|q| q[y] > 0.0))
        .collect();
    tokens.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(a.cmp(&b)));
    tokens
}

/// Worst-case number of flow variables for `symbols` symbols and `k` drafts.
pub(crate) fn variable_bound(symbols: usize, k: usize) -> u128 {
    let mut total: u128 = 0;
    let mut binom: u128 = 1;
    for j in 1..=k.min(symbols) {
        binom = binom * (symbols - j + 1) as u128 / j as u128;
        total = total.saturating_add(binom.saturating_mul(j as u128));
    }
    total
}

/// Splits the acceptable tokens into the LP alphabet and the tail; `None` if the LP is disabled.
pub(crate) fn choose_alphabet(
    p: &[f64],
    qs: &[Vec<f64>],
    trunc: LpTruncation,
) -> Option<(Vec<usize>, Vec<usize>)> {
    let mut tokens = acceptable_tokens(p, qs);
    let mut m = tokens.len().min(trunc.max_alphabet).min(62);
    loop {
        let symbols = m + usize::from(m < tokens.len());
        if variable_bound(symbols, qs.len()) <= trunc.max_variables as u128 {
            break;
        }
        if m == 0 {
            return None;
        }
        m -= 1;
    }
    let tail = tokens.split_off(m);
    Some((tokens, tail))
}

/// `P(S, D)` for every drafted symbol-set mask `S` and record `D` of the tail drafts (see
/// `TailTracking`), by dynamic programming over the drafts. Mask 0 collects tuples with no
/// acceptable symbol.
fn pattern_masses(
    bit_of: &[Option<u32>],
    tail_bit: Option<u32>,
    qs: &[Vec<f64>],
    tracking: TailTracking,
) -> BTreeMap<(u64, u64), f64> {
    let mut masses = BTreeMap::from([((0_u64, 0_u64), 1.0)]);
    for (k, q) in qs.iter().enumerate() {
        // Mass of q_k per own bit, lumped tail and "no symbol", summed directly (no `1 - sum`).
        let mut per_bit: BTreeMap<u32, f64> = BTreeMap::new();
        let mut none = 0.0;
        for (y, &qy) in q.iter().enumerate() {
            match bit_of[y] {
                Some(b) if qy > 0.0 => *per_bit.entry(b).or_insert(0.0) += qy,
                Some(_) => {}
                None => none += qy,
            }
        }
        let mut next = BTreeMap::new();
        for (&(mask, record), &w) in &masses {
            if none > 0.0 {
                *next.entry((mask, record)).or_insert(0.0) += w * none;
            }
            for (&b, &qb) in &per_bit {
                let record = if Some(b) == tail_bit {
                    tracking.push(record, k)
                } else {
                    record
                };
                *next.entry((mask | (1 << b), record)).or_insert(0.0) += w * qb;
            }
        }
        masses = next;
    }
    masses.retain(|_, w| *w > 0.0);
    masses
}

/// Capacities are multiplied by this before solving: the solver's feasibility tolerance is
/// absolute (1e-7), and probabilities are at most 1.
const SCALE: f64 = 1.0e6;

/// One LP variable: flow from a set into a symbol (an alphabet index, or `m` for the tail).
struct Var {
    set: usize,
    symbol: usize,
    var: microlp::Variable,
}

/// The tail's conditionals and, per draft, single-draft SD inside the tail: `p_R = p(.|tail)`,
/// `q_{k,R}`'s acceptance `min(1, p_R/q_{k,R})`, residual `norm(max(p_R - q_{k,R}, 0))` and
/// acceptance probability `gamma_k = sum min(p_R, q_{k,R})` (0 where draft `k` never hits the
/// tail).
struct TailSd {
    p_tail_mass: f64,
    p_tail: Vec<f64>,
    accept: Vec<Vec<f64>>,
    residual: Vec<Vec<f64>>,
    gamma: Vec<f64>,
}

impl TailSd {
    fn new(p: &[f64], qs: &[Vec<f64>], tail: &[usize]) -> Self {
        let (v, k_drafts) = (p.len(), qs.len());
        let p_tail_mass: f64 = tail.iter().map(|&t| p[t]).sum();
        let mut p_tail = vec![0.0; v];
        for &t in tail {
            p_tail[t] = p[t] / p_tail_mass;
        }
        let mut accept = vec![vec![0.0; v]; k_drafts];
        let mut residual = vec![p_tail.clone(); k_drafts];
        let mut gamma = vec![0.0; k_drafts];
        for (k, q) in qs.iter().enumerate() {
            let q_tail_mass: f64 = tail.iter().map(|&t| q[t]).sum();
            if q_tail_mass <= 0.0 {
                continue;
            }
            let mut rest = vec![0.0; v];
            for &t in tail {
                let qt = q[t] / q_tail_mass;
                if qt > 0.0 {
                    accept[k][t] = (p_tail[t] / qt).min(1.0);
                }
                gamma[k] += p_tail[t].min(qt);
                rest[t] = (p_tail[t] - qt).max(0.0);
            }
            residual[k] = normalised_or(rest, &p_tail);
        }
        TailSd {
            p_tail_mass,
            p_tail,
            accept,
            residual,
            gamma,
        }
    }
}

/// The drafted sets (non-empty masks) with their masses `P(S)` and tail values
/// `g(S) = E[gamma_{k*} | S]` (`k*` the first tail draft of the pattern's record), by mask.
fn set_values(
    patterns: &BTreeMap<(u64, u64), f64>,
    tracking: TailTracking,
    gamma: &[f64],
) -> Vec<(u64, f64, f64)> {
    let mut sets: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for (&(mask, record), &w) in patterns {
        if mask == 0 {
            continue;
        }
        let entry = sets.entry(mask).or_insert((0.0, 0.0));
        entry.0 += w;
        if let Some(&first) = tracking.drafts(record).first() {
            entry.1 += w * gamma[first];
        }
    }
    sets.into_iter()
        .map(|(mask, (mass, g))| (mask, mass, g / mass))
        .collect()
}

/// Makes the solver's flows feasible whatever its rounding: scales each set's outflow down to
/// `P(S)`, then each symbol's inflow down to its capacity.
fn repair(
    vars: &[Var],
    flows: &mut [f64],
    sets: &[(u64, f64, f64)],
    symbols: usize,
    capacity: impl Fn(usize) -> f64,
) {
    let mut out_of = vec![0.0; sets.len()];
    for (x, f) in vars.iter().zip(flows.iter()) {
        out_of[x.set] += f;
    }
    for (x, f) in vars.iter().zip(flows.iter_mut()) {
        if out_of[x.set] > sets[x.set].1 {
            *f *= sets[x.set].1 / out_of[x.set];
        }
    }
    let mut into = vec![0.0; symbols];
    for (x, f) in vars.iter().zip(flows.iter()) {
        into[x.symbol] += f;
    }
    for (x, f) in vars.iter().zip(flows.iter_mut()) {
        if into[x.symbol] > capacity(x.symbol) {
            *f *= capacity(x.symbol) / into[x.symbol];
        }
    }
}

/// Builds and solves the (truncated) flow LP, repairs round-off so that the flow is exactly
/// feasible, and assembles the coupling.
pub(crate) fn solve(
    p: &[f64],
    qs: &[Vec<f64>],
    alphabet: Vec<usize>,
    tail: Vec<usize>,
) -> Result<Flow> {
    solve_with(p, qs, alphabet, tail, None)
}

/// [`solve`] with the set masses of the sets that hold the tail symbol scaled by
/// `tail_set_weight(mask, record)` and no flow into the tail symbol: the LP over the alphabet
/// for what a selection that offers the tail first leaves of each pattern
/// (`schemes::weighted`). The coupling read off it is not meant to be used.
pub(crate) fn solve_with(
    p: &[f64],
    qs: &[Vec<f64>],
    alphabet: Vec<usize>,
    tail: Vec<usize>,
    tail_set_weight: Option<&dyn Fn(u64, u64) -> f64>,
) -> Result<Flow> {
    let v = p.len();
    let m = alphabet.len();
    let mut bit_of = vec![None; v];
    for (bit, &y) in alphabet.iter().enumerate() {
        bit_of[y] = Some(bit as u32);
    }
    let tail_bit = (!tail.is_empty()).then_some(m as u32);
    for &t in &tail {
        bit_of[t] = tail_bit;
    }

    let TailSd {
        p_tail_mass,
        p_tail,
        accept: tail_accept,
        residual: tail_residual,
        gamma,
    } = TailSd::new(p, qs, &tail);
    let tracking = TailTracking::for_drafts(qs);
    let mut patterns = pattern_masses(&bit_of, tail_bit, qs, tracking);
    if let (Some(weight), Some(b)) = (tail_set_weight, tail_bit) {
        for (&(mask, record), w) in patterns.iter_mut() {
            if mask & (1 << b) != 0 {
                *w *= weight(mask, record);
            }
        }
        patterns.retain(|_, w| *w > 0.0);
    }
    let sets = set_values(&patterns, tracking, &gamma);

    let capacity = |symbol: usize| {
        if symbol == m {
            p_tail_mass
        } else {
            p[alphabet[symbol]]
        }
    };
    let mut problem = Problem::new(OptimizationDirection::Maximize);
    let mut vars = Vec::new();
    let mut by_set = vec![Vec::new(); sets.len()];
    let mut by_symbol = vec![Vec::new(); m + 1];
    for (set, &(mask, mass, g)) in sets.iter().enumerate() {
        for (symbol, symbol_vars) in by_symbol.iter_mut().enumerate() {
            if mask & (1 << symbol) == 0 {
                continue;
            }
            let value = match symbol == m {
                true if tail_set_weight.is_some() => 0.0,
                true => g,
                false => 1.0,
            };
            // A tail flow worth nothing would only use up capacity.
            if value <= 0.0 {
                continue;
            }
            let var = problem.add_var(value, (0.0, SCALE * mass.min(capacity(symbol))));
            by_set[set].push(var);
            symbol_vars.push(var);
            vars.push(Var { set, symbol, var });
        }
    }
    for (set, terms) in by_set.iter().enumerate() {
        if terms.len() > 1 {
            let terms: Vec<_> = terms.iter().map(|&v| (v, 1.0)).collect();
            problem.add_constraint(terms.as_slice(), ComparisonOp::Le, SCALE * sets[set].1);
        }
    }
    for (symbol, terms) in by_symbol.iter().enumerate() {
        if terms.len() > 1 {
            let terms: Vec<_> = terms.iter().map(|&v| (v, 1.0)).collect();
            problem.add_constraint(terms.as_slice(), ComparisonOp::Le, SCALE * capacity(symbol));
        }
    }
    let mut flows: Vec<f64> = if vars.is_empty() {
        Vec::new()
    } else {
        let solution = problem
            .solve()
            .map_err(|e| SpecDecError::Lp(format!("{e:?}")))?
            .into_solution()
            .map_err(|e| SpecDecError::Lp(format!("{e:?}")))?;
        vars.iter()
            .map(|x| {
                let bound = sets[x.set].1.min(capacity(x.symbol));
                (solution.var_value(x.var) / SCALE).clamp(0.0, bound)
            })
            .collect()
    };

    repair(&vars, &mut flows, &sets, m + 1, capacity);

    let mut table: BTreeMap<u64, Vec<(Symbol, f64)>> = BTreeMap::new();
    let mut inflow = vec![0.0; m + 1];
    let mut acceptance = 0.0;
    for (x, &f) in vars.iter().zip(&flows) {
        if f <= 0.0 {
            continue;
        }
        let (mask, mass, g) = sets[x.set];
        let conditional = f / mass;
        let flow = mass * conditional;
        let symbol = if x.symbol == m {
            acceptance += flow * g;
            Symbol::Tail
        } else {
            acceptance += flow;
            Symbol::Token(alphabet[x.symbol])
        };
        inflow[x.symbol] += flow;
        table.entry(mask).or_default().push((symbol, conditional));
    }

    // Reject branch: what the accepted symbols leave of p; tail tokens in proportion to p.
    let mut residual = p.to_vec();
    for (bit, &y) in alphabet.iter().enumerate() {
        residual[y] = (p[y] - inflow[bit]).max(0.0);
    }
    let tail_left = (p_tail_mass - inflow[m]).max(0.0);
    for &t in &tail {
        residual[t] = tail_left * p_tail[t];
    }
    let info = LpInfo {
        tail_tokens: tail.len(),
        alphabet,
        sets: sets.len(),
        variables: vars.len(),
        lp_acceptance: acceptance,
        fell_back_to_importance_sampling: false,
    };
    Ok(Flow {
        bit_of,
        tail_bit,
        table,
        tail_accept,
        tail_residual,
        residual: normalised_or(residual, p),
        acceptance,
        info,
        patterns,
        tracking,
    })
}
