//! `Plan::decide` integrated exactly over its uniforms reproduces `Plan::law`.
//!
//! `decide` reads each uniform `u[i]` only through comparisons with values of the plan
//! (acceptance and selection probabilities, cumulative sums of table rows and residuals), so it
//! is constant on every cell of the grid those values cut `[0, 1)^(K+2)` into. Evaluating it at
//! each cell's midpoint, weighted by the cell's volume, integrates it exactly (up to rounding):
//! no sampling noise, unlike the Monte Carlo tests in `tests/`.

use super::{Plan, SelectionPlan, SequentialPlan};
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
            for row in w.select.values() {
                let mut acc = 0.0;
                for &(_, prob) in row {
                    acc += prob;
                    dims[k_drafts].push(acc);
                }
            }
            dims[0].extend(&w.accept);
            dims[k_drafts + 1] = cdf_cuts(&w.residual);
        }
    }
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

/// `decide` integrated over the grid: the law of the output token and the acceptance
/// probability given `drafts`.
fn integrate(plan: &Plan, drafts: &[usize], vocab: usize) -> (Vec<f64>, f64) {
    let dims = cuts(plan, drafts.len());
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
                    for (x, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!((g - w).abs() < 1e-12, "{what}: token {x}: {g} vs law {w}");
                    }
                    assert!(
                        (got_acc - want_acc).abs() < 1e-12,
                        "{what}: acceptance {got_acc} vs law {want_acc}"
                    );
                    let mass: f64 = got.iter().sum::<f64>();
                    assert!((mass - 1.0).abs() < 1e-12, "{what}: mass {mass}");
                }
            }
        }
    }
}
