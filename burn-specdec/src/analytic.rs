//! Exact acceptance probabilities and output laws, and the paper's Figure 2 setting.

use crate::error::{Result, SpecDecError};
use crate::lp::LpTruncation;
use crate::prob::validate_inputs;
use crate::schemes::weighted::WeightedPlan;
use crate::{Scheme, Verifier};

/// Largest number of draft tuples (or alphabet subsets) an exact enumeration visits.
pub const ENUMERATION_LIMIT: u128 = 10_000_000;

/// Closed-form probability that `scheme` accepts a draft (the LP's value for
/// [`Scheme::Optimal`], including its truncation/fallback).
///
/// # Errors
/// Those of [`Verifier::new`].
pub fn acceptance_probability<T, Q>(scheme: Scheme, p: &[T], qs: &[Q]) -> Result<f64>
where
    T: Copy + Into<f64>,
    Q: AsRef<[T]>,
{
    Ok(Verifier::new(scheme, p, qs)?.acceptance_probability())
}

/// The closed-form acceptance probability of each of `schemes` on the same `(p, q_1..q_K)`,
/// as [`acceptance_probability`] gives them one by one, with the work they share done once:
/// the sequential importance-sampling plan, and per [`LpTruncation`] the LP flow and its
/// weighted reading (an optimal scheme with the fall-back is the best of the three, a weighted
/// one reads the flow, both use the sequential plan where the LP is disabled). Tables of every
/// scheme (`spec_table --exact`) take about half the time.
///
/// # Shapes
/// `p`: `[V]`, `qs`: `K` rows of `[V]`; the result has one entry per scheme, in order.
///
/// # Errors
/// Those of [`Verifier::new`] for any of the schemes.
pub fn acceptance_probabilities<T, Q>(schemes: &[Scheme], p: &[T], qs: &[Q]) -> Result<Vec<f64>>
where
    T: Copy + Into<f64>,
    Q: AsRef<[T]>,
{
    let (target, drafts) = validate_inputs(p, qs)?;
    let mut importance: Option<f64> = None;
    let mut importance_acceptance = || {
        *importance
            .get_or_insert_with(|| crate::schemes::importance::plan(&target, &drafts).acceptance)
    };
    // Per truncation: the flow's and its weighted reading's acceptance (None: LP disabled).
    let mut flows: Vec<(LpTruncation, Option<(f64, f64)>)> = Vec::new();
    let mut lp_acceptances = |trunc: LpTruncation| -> Result<Option<(f64, f64)>> {
        let key = LpTruncation {
            fallback_to_importance_sampling: true,
            ..trunc
        };
        if let Some((_, found)) = flows.iter().find(|(t, _)| *t == key) {
            return Ok(*found);
        }
        let found = match crate::lp::choose_alphabet(&target, &drafts, trunc) {
            Some((alphabet, tail)) => {
                let flow = crate::lp::solve(&target, &drafts, alphabet, tail)?;
                let weighted = WeightedPlan::from_flow(&target, &drafts, &flow);
                Some((flow.acceptance, weighted.acceptance))
            }
            None => None,
        };
        flows.push((key, found));
        Ok(found)
    };
    schemes
        .iter()
        .map(|&scheme| match scheme {
            Scheme::SequentialImportance => Ok(importance_acceptance()),
            Scheme::WeightedImportance(trunc) => Ok(match lp_acceptances(trunc)? {
                Some((_, weighted)) => weighted,
                None => importance_acceptance(),
            }),
            Scheme::Optimal(trunc) => Ok(match lp_acceptances(trunc)? {
                Some((flow, _)) if !trunc.fallback_to_importance_sampling => flow,
                Some((flow, weighted)) => flow.max(weighted).max(importance_acceptance()),
                None => importance_acceptance(),
            }),
            other => Ok(crate::plan_scheme(other, &target, &drafts)?
                .plan
                .acceptance()),
        })
        .collect()
}

/// Visits every draft tuple with positive probability, with that probability.
fn for_each_tuple(verifier: &Verifier, mut visit: impl FnMut(&[usize], f64)) -> Result<()> {
    let k = verifier.num_drafts();
    let supports: Vec<Vec<usize>> = (0..k)
        .map(|j| {
            let q = verifier.draft(j).expect("j < K");
            (0..q.len()).filter(|&x| q[x] > 0.0).collect()
        })
        .collect();
    let needed = supports
        .iter()
        .fold(1_u128, |n, s| n.saturating_mul(s.len() as u128));
    if needed > ENUMERATION_LIMIT {
        return Err(SpecDecError::TooLarge {
            what: "draft-tuple enumeration",
            needed,
            limit: ENUMERATION_LIMIT,
        });
    }
    let mut index = vec![0_usize; k];
    let mut tuple: Vec<usize> = supports.iter().map(|s| s[0]).collect();
    loop {
        let weight: f64 = tuple
            .iter()
            .enumerate()
            .map(|(j, &x)| verifier.draft(j).expect("j < K")[x])
            .product();
        visit(&tuple, weight);
        // Odometer increment, draft 0 fastest.
        let mut j = 0;
        loop {
            if j == k {
                return Ok(());
            }
            index[j] += 1;
            if index[j] < supports[j].len() {
                tuple[j] = supports[j][index[j]];
                break;
            }
            index[j] = 0;
            tuple[j] = supports[j][0];
            j += 1;
        }
    }
}

/// Acceptance probability as `sum_x prod_k q_k(x_k) P(accept | x)`, over all draft tuples.
///
/// Independent of the closed forms, so the two can check each other.
///
/// # Errors
/// Those of [`Verifier::new`], and [`SpecDecError::TooLarge`] beyond [`ENUMERATION_LIMIT`]
/// tuples.
pub fn acceptance_probability_enumerated<T, Q>(scheme: Scheme, p: &[T], qs: &[Q]) -> Result<f64>
where
    T: Copy + Into<f64>,
    Q: AsRef<[T]>,
{
    let verifier = Verifier::new(scheme, p, qs)?;
    let mut total = 0.0;
    for_each_tuple(&verifier, |tuple, w| {
        total += w * verifier.plan.law(tuple).1;
    })?;
    Ok(total)
}

/// The exact law of the output token, `sum_x prod_k q_k(x_k) P(output | x)`; equals the
/// normalised `p` up to round-off for every scheme.
///
/// # Errors
/// As [`acceptance_probability_enumerated`].
pub fn output_law_enumerated<T, Q>(scheme: Scheme, p: &[T], qs: &[Q]) -> Result<Vec<f64>>
where
    T: Copy + Into<f64>,
    Q: AsRef<[T]>,
{
    let verifier = Verifier::new(scheme, p, qs)?;
    let mut law = vec![0.0; verifier.vocab_size()];
    for_each_tuple(&verifier, |tuple, w| {
        for (l, c) in law.iter_mut().zip(verifier.plan.law(tuple).0) {
            *l += w * c;
        }
    })?;
    Ok(law)
}

/// The largest acceptance probability any scheme can reach (untruncated), by max-flow/min-cut:
///
/// ```text
/// min over T of  p(T^c) + 1 - prod_k (1 - q_k(T)).
/// ```
///
/// For two identical drafts this is the paper's explicit expression
/// `min_S { sum_{s in S} p_s + (sum_{s in S^c} q_s)^2 + 2 (sum_{s in S} q_s)(sum_{s in S^c} q_s) }`
/// (with `S = T^c`). Only tokens with `p > 0` and some `q_k > 0` need to be enumerated.
///
/// # Errors
/// Input errors as in [`Verifier::new`], and [`SpecDecError::TooLarge`] when there are more
/// than 2^23 subsets.
pub fn optimal_acceptance_bound<T, Q>(p: &[T], qs: &[Q]) -> Result<f64>
where
    T: Copy + Into<f64>,
    Q: AsRef<[T]>,
{
    let (p, qs) = validate_inputs(p, qs)?;
    let tokens = crate::lp::acceptable_tokens(&p, &qs);
    let needed = 1_u128 << tokens.len().min(127);
    let limit = 1_u128 << 23;
    if needed > limit {
        return Err(SpecDecError::TooLarge {
            what: "min-cut subset enumeration",
            needed,
            limit,
        });
    }
    let p_all: f64 = tokens.iter().map(|&y| p[y]).sum();
    let mut best = f64::INFINITY;
    for mask in 0_u64..(1 << tokens.len()) {
        let mut p_in = 0.0;
        let mut q_in = vec![0.0; qs.len()];
        for (bit, &y) in tokens.iter().enumerate() {
            if mask & (1 << bit) != 0 {
                p_in += p[y];
                for (acc, q) in q_in.iter_mut().zip(&qs) {
                    *acc += q[y];
                }
            }
        }
        let none_in: f64 = q_in.iter().map(|q| (1.0 - q).max(0.0)).product();
        best = best.min((p_all - p_in).max(0.0) + 1.0 - none_in);
    }
    Ok(best)
}

/// One row of the Figure 2 table.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Figure2Row {
    /// `q2`.
    pub q2: f64,
    /// SpecInfer's acceptance probability.
    pub spec_infer: f64,
    /// SpecTr's acceptance probability.
    pub spec_tr: f64,
    /// Importance sampling's acceptance probability.
    pub importance_sampling: f64,
    /// The optimal (LP) scheme's acceptance probability.
    pub optimal: f64,
    /// [`optimal_acceptance_bound`].
    pub bound: f64,
}

/// Figure 2's setting: `p` uniform on 3 tokens, K = 2 identical drafts
/// `q = [q1, q2, 1 - q1 - q2]` (the paper's left plot has `q1 = 1/3`, the right one `q1 = 1/6`).
///
/// # Errors
/// Input errors (e.g. `q1 + q2 > 1`).
pub fn figure2_row(q1: f64, q2: f64) -> Result<Figure2Row> {
    let p = [1.0 / 3.0; 3];
    let third = 1.0 - q1 - q2;
    // Absorbs round-off at the end of a grid (e.g. q1 = 1/3, q2 = 2/3).
    let third = if (-1e-12..0.0).contains(&third) {
        0.0
    } else {
        third
    };
    let q = [q1, q2, third];
    let qs = [q, q];
    Ok(Figure2Row {
        q2,
        spec_infer: acceptance_probability(Scheme::SpecInfer, &p, &qs)?,
        spec_tr: acceptance_probability(Scheme::SpecTr, &p, &qs)?,
        importance_sampling: acceptance_probability(Scheme::SequentialImportance, &p, &qs)?,
        optimal: acceptance_probability(Scheme::OPTIMAL, &p, &qs)?,
        bound: optimal_acceptance_bound(&p, &qs)?,
    })
}

/// The rows as a Markdown table body (4 decimals), as printed in the crate docs and README.
pub fn figure2_markdown(rows: &[Figure2Row]) -> String {
    rows.iter()
        .map(|r| {
            format!(
                "| {:.4} | {:.4} | {:.4} | {:.4} | {:.4} | {:.4} |\n",
                r.q2, r.spec_infer, r.spec_tr, r.importance_sampling, r.optimal, r.bound
            )
        })
        .collect()
}
