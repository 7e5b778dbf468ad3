//! `Plan::decide` integrated exactly over its uniforms reproduces `Plan::law`.
//!
//! `decide` reads each uniform `u[i]` only through comparisons with values of the plan
//! (acceptance and selection probabilities, cumulative sums of table rows and residuals), so it
//! is constant on every cell of the grid those values cut `[0, 1)^(K+2)` into. Evaluating it at
//! each cell's midpoint, weighted by the cell's volume, integrates it exactly (up to rounding):
//! no sampling noise, unlike the Monte Carlo tests in `tests/`.

use super::weighted::WeightedPlan;
use super::weighted::tail::TailRule;
use super::{Plan, SelectionPlan, SequentialPlan};
use crate::lp::Symbol;
use crate::{LpTruncation, Scheme, Verifier};
use burn_kernels_testing::{Dist, random_values};

/// Running sums of `weights` over their total: where `inverse_cdf` changes its answer.
fn cdf_cuts(weights: &[f64]) -> Vec<f64> {
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    weights
        .iter()
        .map(|w| {
            acc += w;
            acc / total
        })
        .collect()
}

/// For each uniform `u[0..K+2]`, the values `decide` compares it with.
fn cuts(plan: &Plan, k_drafts: usize) -> Vec<Vec<f64>> {
    let mut dims = vec![Vec::new(); k_drafts + 2];
    match plan {
        Plan::Sequential(SequentialPlan {
            accept, residual, ..
        }) => {
            for (k, row) in accept.iter().enumerate() {
                dims[k].extend(row);
            }
            dims[k_drafts + 1] = cdf_cuts(residual);
        }
        Plan::Selection(SelectionPlan {
            select,
            accept,
            residual,
            ..
        }) => {
            for (k, row) in select.iter().enumerate() {
                dims[k].extend(row);
            }
            dims[k_drafts].extend(accept);
            dims[k_drafts + 1] = cdf_cuts(residual);
        }
        Plan::Coupling(c) => {
            let flow = &c.flow;
            for row in flow.table.values() {
                let mut acc = 0.0;
                for &(_, prob) in row {
                    acc += prob;
                    dims[k_drafts].push(acc);
                }
            }
            for row in &flow.tail_accept {
                dims[0].extend(row);
            }
            dims[k_drafts + 1] = cdf_cuts(&flow.residual);
            for row in &flow.tail_residual {
                dims[k_drafts + 1].extend(cdf_cuts(row));
            }
        }
        Plan::Weighted(w) => {
            for (mask, row) in &w.select {
                dims[k_drafts].extend(selection_cuts(w, *mask, row));
            }
            dims[0].extend(&w.accept);
            // The selection among the tail drafts: `u[1 + i]` for the i-th tail draft.
            for dim in dims.iter_mut().take(k_drafts).skip(1) {
                for row in &w.tail.rows {
                    dim.extend(row);
                }
            }
            dims[k_drafts + 1] = cdf_cuts(&w.residual);
        }
    }
    finish(dims)
}

/// Adds the ends of `[0, 1]` to every dimension's cuts, sorted and deduplicated.
fn finish(dims: Vec<Vec<f64>>) -> Vec<Vec<f64>> {
    dims.into_iter()
        .map(|mut cut| {
            cut.extend([0.0, 1.0]);
            cut.retain(|c| (0.0..=1.0).contains(c));
            cut.sort_by(f64::total_cmp);
            cut.dedup();
            cut
        })
        .collect()
}

/// Where `decide` changes its answer in `u[K]` for a set's selection row: the row's running
/// sums, and inside the tail symbol's interval `[lo, hi)` (the last symbol's reaches 1) the
/// running sums of the row of the alphabet symbol taken when every tail draft is declined.
fn selection_cuts(w: &WeightedPlan, mask: u64, row: &[(Symbol, f64)]) -> Vec<f64> {
    let mut out = Vec::new();
    let mut acc = 0.0;
    for (i, &(symbol, prob)) in row.iter().enumerate() {
        let lo = acc;
        acc += prob;
        out.push(acc);
        let hi = if i + 1 == row.len() { 1.0 } else { acc };
        if let (Symbol::Tail, Some(declined)) = (symbol, w.declined.get(&mask)) {
            let mut inner = 0.0;
            for &(_, share) in declined {
                inner += share;
                out.push(lo + (hi - lo) * inner);
            }
        }
    }
    out
}

/// The cuts of a weighted-IS plan for one tuple only: the SD test of its drafted tokens, the
/// selection row of its set, the tail test of its `i`-th tail draft for `u[1 + i]`, and the
/// residual. Far fewer cells than [`cuts`] for large K.
fn tuple_cuts(w: &WeightedPlan, drafts: &[usize]) -> Vec<Vec<f64>> {
    let k_drafts = drafts.len();
    let mut dims = vec![Vec::new(); k_drafts + 2];
    dims[0].extend(drafts.iter().map(|&x| w.accept[x]));
    let mask = w.mask(drafts);
    if let Some(row) = w.select.get(&mask) {
        dims[k_drafts].extend(selection_cuts(w, mask, row));
    }
    for (i, k) in w.tail_drafts(drafts).into_iter().enumerate() {
        if i + 1 < k_drafts {
            dims[1 + i].push(w.tail.accept(i, k, drafts[k]));
        }
    }
    dims[k_drafts + 1] = cdf_cuts(&w.residual);
    finish(dims)
}

/// `decide` integrated over the grid: the law of the output token and the acceptance
/// probability given `drafts`.
fn integrate(plan: &Plan, drafts: &[usize], vocab: usize) -> (Vec<f64>, f64) {
    integrate_over(plan, drafts, vocab, &cuts(plan, drafts.len()))
}

/// `decide` integrated over the grid of `dims`.
fn integrate_over(
    plan: &Plan,
    drafts: &[usize],
    vocab: usize,
    dims: &[Vec<f64>],
) -> (Vec<f64>, f64) {
    let cells: Vec<usize> = dims.iter().map(|c| c.len() - 1).collect();
    let (mut law, mut accepted) = (vec![0.0; vocab], 0.0);
    let mut index = vec![0usize; dims.len()];
    let mut u = vec![0.0; dims.len()];
    loop {
        let mut volume = 1.0;
        for (i, cut) in dims.iter().enumerate() {
            let (lo, hi) = (cut[index[i]], cut[index[i] + 1]);
            u[i] = 0.5 * (lo + hi);
            volume *= hi - lo;
        }
        let out = plan.decide(drafts, &u);
        law[out.token] += volume;
        if out.accepted.is_some() {
            accepted += volume;
        }
        // Next cell, odometer order.
        let mut i = 0;
        while i < index.len() {
            index[i] += 1;
            if index[i] < cells[i] {
                break;
            }
            index[i] = 0;
            i += 1;
        }
        if i == index.len() {
            return (law, accepted);
        }
    }
}

/// Every draft tuple of `K` tokens out of `vocab`.
/// The integrated token distribution and acceptance `got` equal the plan's law `want` (to
/// 1e-12).
fn assert_law(what: &str, got: (&[f64], f64), want: (&[f64], f64)) {
    let ((got, got_acc), (want, want_acc)) = (got, want);
    for (x, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() < 1e-12, "{what}: token {x}: {g} vs law {w}");
    }
    assert!(
        (got_acc - want_acc).abs() < 1e-12,
        "{what}: acceptance {got_acc} vs law {want_acc}"
    );
}

fn tuples(vocab: usize, k: usize) -> Vec<Vec<usize>> {
    (0..vocab.pow(k as u32))
        .map(|mut code| {
            (0..k)
                .map(|_| {
                    let x = code % vocab;
                    code /= vocab;
                    x
                })
                .collect()
        })
        .collect()
}

/// A distribution over `vocab` tokens from a seed, with one zero entry when `zero` (so plans
/// meet tokens the target or a draft never produces).
fn dist(vocab: usize, seed: u64, zero: Option<usize>) -> Vec<f64> {
    let uniform = Dist::Uniform { lo: 0.05, hi: 1.05 };
    let mut w: Vec<f64> = random_values(vocab, uniform, seed)
        .into_iter()
        .map(f64::from)
        .collect();
    if let Some(z) = zero {
        w[z] = 0.0;
    }
    let total: f64 = w.iter().sum();
    w.iter().map(|x| x / total).collect()
}

#[test]
fn decide_integrated_over_its_grid_is_law() {
    let schemes = [
        Scheme::SpecInfer,
        Scheme::SpecTr,
        Scheme::SequentialImportance,
        Scheme::Optimal(LpTruncation::DEFAULT),
        Scheme::WEIGHTED_IMPORTANCE,
        // One alphabet token, the rest lumped into the tail symbol.
        Scheme::WeightedImportance(LpTruncation {
            max_alphabet: 1,
            max_variables: 4096,
            fallback_to_importance_sampling: false,
        }),
    ];
    // (vocabulary, drafts): the grid has (cuts + 1)^(K + 2) cells per tuple.
    for (vocab, k) in [(4, 1), (4, 2), (3, 3)] {
        for seed in 0..3u64 {
            let p = dist(vocab, 100 + seed, (seed == 1).then_some(vocab - 1));
            let qs: Vec<Vec<f64>> = (0..k)
                .map(|i| dist(vocab, 200 + 10 * seed + i as u64, (seed == 2).then_some(0)))
                .collect();
            let mut all = schemes.to_vec();
            if k == 1 {
                all.push(Scheme::SingleDraft);
            }
            for scheme in all {
                let v = Verifier::new(scheme, &p, &qs).expect("valid inputs");
                for drafts in tuples(vocab, k) {
                    let (want, want_acc) = v.plan.law(&drafts);
                    let (got, got_acc) = integrate(&v.plan, &drafts, vocab);
                    let what = format!(
                        "{} V={vocab} K={k} seed {seed} drafts {drafts:?}",
                        scheme.name()
                    );
                    assert_law(&what, (&got, got_acc), (&want, want_acc));
                    let mass: f64 = got.iter().sum::<f64>();
                    assert!((mass - 1.0).abs() < 1e-12, "{what}: mass {mass}");
                }
            }
        }
    }
}

#[test]
fn weighted_tail_selection_integrated_over_its_grid_is_law() {
    // Forced tails (one alphabet token) with up to K = 8 tail drafts, identical and different
    // drafts, on each tuple's own grid.
    let trunc = LpTruncation {
        max_alphabet: 1,
        max_variables: 4096,
        fallback_to_importance_sampling: false,
    };
    let (mut rejection, mut stage_rows) = (0, 0);
    for k in 3..=8usize {
        let vocab = if k <= 5 { 4 } else { 3 };
        for (seed, identical) in [(0u64, true), (1, false)] {
            let s = 500 + 20 * k as u64 + 10 * seed;
            let p = dist(vocab, s, None);
            let qs: Vec<Vec<f64>> = if identical {
                vec![dist(vocab, s + 1, None); k]
            } else {
                (0..k)
                    .map(|j| dist(vocab, s + 2 + j as u64, None))
                    .collect()
            };
            let scheme = Scheme::WeightedImportance(trunc);
            let v = Verifier::new(scheme, &p, &qs).expect("valid inputs");
            let Plan::Weighted(w) = &v.plan else {
                panic!("weighted plan expected");
            };
            match w.tail.rule {
                TailRule::FirstDraft => {}
                TailRule::Rejection { .. } => rejection += 1,
                TailRule::Reserve { .. } => {
                    (rejection, stage_rows) = (rejection + 1, stage_rows + 1)
                }
            }
            // Every tuple up to K = 6, every 7th beyond.
            let step = if k <= 6 { 1 } else { 7 };
            for drafts in tuples(vocab, k).into_iter().step_by(step) {
                let (want, want_acc) = v.plan.law(&drafts);
                let dims = tuple_cuts(w, &drafts);
                let (got, got_acc) = integrate_over(&v.plan, &drafts, vocab, &dims);
                let what = format!("K={k} identical {identical} drafts {drafts:?}");
                assert_law(&what, (&got, got_acc), (&want, want_acc));
                let mass: f64 = got.iter().sum::<f64>();
                assert!((mass - 1.0).abs() < 1e-12, "{what}: mass {mass}");
            }
        }
    }
    assert!(
        rejection >= 6,
        "a tail rejection rule was chosen {rejection} times"
    );
    assert!(stage_rows >= 1, "stage rows were chosen {stage_rows} times");
}

#[test]
fn declining_tail_plans_integrated_over_their_grid_are_law() {
    // Tail-first plans (the tail drafts offered first; declined mass to alphabet symbols by the
    // re-solved alphabet LP, drawn with u[K] rescaled), with two alphabet tokens so that the
    // declined rows have several symbols, on each tuple's own grid.
    let trunc = LpTruncation {
        max_alphabet: 2,
        max_variables: 4096,
        fallback_to_importance_sampling: false,
    };
    let mut checked = 0;
    for k in 2..=4usize {
        for seed in 0..3u64 {
            let vocab = 5;
            let s = 900 + 20 * k as u64 + seed;
            let p = dist(vocab, s, None);
            let qs = vec![dist(vocab, s + 1, None); k];
            let (alphabet, tail) = crate::lp::choose_alphabet(&p, &qs, trunc).expect("fits");
            let flow = crate::lp::solve(&p, &qs, alphabet, tail).expect("LP solves");
            for w in super::weighted::decline::tail_first(&p, &qs, &flow)
                .into_iter()
                .flatten()
                .filter(|w| w.tail.declines && w.declined.values().any(|r| r.len() > 1))
            {
                let plan = Plan::Weighted(w.clone());
                for drafts in tuples(vocab, k) {
                    let (want, want_acc) = plan.law(&drafts);
                    let dims = tuple_cuts(&w, &drafts);
                    let (got, got_acc) = integrate_over(&plan, &drafts, vocab, &dims);
                    let what = format!("K={k} seed {seed} drafts {drafts:?}");
                    assert_law(&what, (&got, got_acc), (&want, want_acc));
                }
                checked += 1;
            }
        }
    }
    assert!(
        checked >= 3,
        "declining plans with several declined symbols: {checked}"
    );
}
