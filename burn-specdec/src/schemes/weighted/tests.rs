//! The tail selection of weighted importance sampling: its closed-form law against enumeration,
//! exactness of the whole scheme, and its acceptance against the first-tail-draft rule.

use super::tail::TailRule;
use super::{Leftover, WeightedPlan};
use crate::lp::{self, Flow, LpTruncation, TailTracking};
use burn_kernels_testing::{Dist, random_values};

/// A distribution over `vocab` tokens from a seed; `skew` raises the weights to that power (a
/// larger power spreads them further apart).
fn dist(vocab: usize, seed: u64, skew: i32) -> Vec<f64> {
    let uniform = Dist::Uniform { lo: 0.05, hi: 1.05 };
    let w: Vec<f64> = random_values(vocab, uniform, seed)
        .into_iter()
        .map(|x| f64::from(x).powi(skew))
        .collect();
    let total: f64 = w.iter().sum();
    w.iter().map(|x| x / total).collect()
}

/// Forced-tail cases: V = 4 or 5 with an alphabet of one or two tokens (the rest is the tail),
/// K = 1..8, identical and different drafts.
fn cases() -> Vec<(String, Vec<f64>, Vec<Vec<f64>>, LpTruncation)> {
    let mut out = Vec::new();
    for k in 1..=8usize {
        for (seed, vocab, alphabet, identical) in [
            (0u64, 4usize, 1usize, true),
            (1, 4, 1, false),
            (2, 5, 2, true),
            (3, 4, 2, false),
        ] {
            // 5^8 tuples are too many for a unit test.
            let vocab = if k >= 7 { 4 } else { vocab };
            let s = 1000 * k as u64 + 10 * seed;
            let p = dist(vocab, s, 2);
            let qs: Vec<Vec<f64>> = if identical {
                vec![dist(vocab, s + 1, 3); k]
            } else {
                (0..k).map(|j| dist(vocab, s + 2 + j as u64, 3)).collect()
            };
            let trunc = LpTruncation {
                max_alphabet: alphabet,
                max_variables: 4096,
                fallback_to_importance_sampling: false,
            };
            let name = format!("V={vocab} K={k} alphabet {alphabet} identical {identical}");
            out.push((name, p, qs, trunc));
        }
    }
    out
}

fn flow(p: &[f64], qs: &[Vec<f64>], trunc: LpTruncation) -> Flow {
    let (alphabet, tail) = lp::choose_alphabet(p, qs, trunc).expect("an alphabet fits");
    assert!(!tail.is_empty(), "the case must have a tail");
    lp::solve(p, qs, alphabet, tail).expect("LP solves")
}

/// The plan (best leftover rule, best tail rule) and the plan before the tail rule: proportional
/// leftover, first tail draft.
fn plans(p: &[f64], qs: &[Vec<f64>], trunc: LpTruncation) -> (WeightedPlan, WeightedPlan) {
    let flow = flow(p, qs, trunc);
    (
        WeightedPlan::from_flow(p, qs, &flow),
        WeightedPlan::first_tail_draft_plan(p, qs, &flow),
    )
}

/// For each leftover rule: the plan with the best tail rule that always selects a tail draft,
/// the one with the first tail draft, and the best tail rule that may decline the tail drafts.
fn builds(
    p: &[f64],
    qs: &[Vec<f64>],
    flow: &Flow,
) -> Vec<(Leftover, WeightedPlan, WeightedPlan, WeightedPlan)> {
    [Leftover::Proportional, Leftover::Fill]
        .into_iter()
        .map(|l| {
            (
                l,
                WeightedPlan::build(p, qs, flow, l, false, None),
                WeightedPlan::build(p, qs, flow, l, true, None),
                WeightedPlan::build(p, qs, flow, l, false, Some(0.5)),
            )
        })
        .collect()
}

/// Calls `visit` with every draft tuple and its probability.
fn for_each_tuple(qs: &[Vec<f64>], mut visit: impl FnMut(&[usize], f64)) {
    let (k, vocab) = (qs.len(), qs[0].len());
    let mut drafts = vec![0; k];
    for mut code in 0..vocab.pow(k as u32) {
        let mut prob = 1.0;
        for (j, x) in drafts.iter_mut().enumerate() {
            *x = code % vocab;
            code /= vocab;
            prob *= qs[j][*x];
        }
        if prob > 0.0 {
            visit(&drafts, prob);
        }
    }
}

/// Law of the selected token, by enumerating tuples.
fn selected_law(plan: &WeightedPlan, qs: &[Vec<f64>]) -> Vec<f64> {
    let mut law = vec![0.0; qs[0].len()];
    for_each_tuple(qs, |drafts, prob| {
        for (k, w) in plan.selection(drafts) {
            law[drafts[k]] += prob * w;
        }
    });
    law
}

/// Output law of the whole scheme, by enumerating tuples.
fn output_law(plan: &WeightedPlan, qs: &[Vec<f64>]) -> Vec<f64> {
    let mut law = vec![0.0; qs[0].len()];
    for_each_tuple(qs, |drafts, prob| {
        for (l, x) in law.iter_mut().zip(plan.law(drafts).0) {
            *l += prob * x;
        }
    });
    law
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn closed_form_tail_law_is_the_enumerated_law_of_the_selected_token() {
    let (mut rejection_with_many_tail_drafts, mut stage_rows) = (0, 0);
    let mut tail_first_declining = 0;
    for (name, p, qs, trunc) in cases() {
        let flow = flow(&p, &qs, trunc);
        for (leftover, plan, first, declining) in builds(&p, &qs, &flow) {
            let plans = [
                ("tail rule", &plan),
                ("first tail draft", &first),
                ("declining tail rule", &declining),
            ];
            for (which, plan) in plans {
                let what = format!("{name}, {leftover:?}, {which}");
                let err = max_diff(&selected_law(plan, &qs), &plan.proposal);
                assert!(err < 1e-12, "{what}: |q~ - enumerated| = {err:e}");
                let err = max_diff(&output_law(plan, &qs), &p);
                assert!(err < 1e-12, "{what}: |output law - p| = {err:e}");
            }
        }
        // The tail-first plans (tail drafts offered first, declined mass by the alphabet LP).
        for (i, plan) in super::decline::tail_first(&p, &qs, &flow)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let what = format!("{name}, tail-first plan {i}");
            let err = max_diff(&selected_law(&plan, &qs), &plan.proposal);
            assert!(err < 1e-12, "{what}: |q~ - enumerated| = {err:e}");
            let err = max_diff(&output_law(&plan, &qs), &p);
            assert!(err < 1e-12, "{what}: |output law - p| = {err:e}");
            if plan.tail.declines {
                tail_first_declining += 1;
            }
        }
        let plan = WeightedPlan::from_flow(&p, &qs, &flow);
        if qs.len() >= 3 && plan.tail.rule != TailRule::FirstDraft {
            rejection_with_many_tail_drafts += 1;
        }
        if matches!(plan.tail.rule, TailRule::Reserve { .. }) {
            stage_rows += 1;
        }
    }
    // The cases must exercise the rejection rules with several tail drafts, stage rows included.
    assert!(
        rejection_with_many_tail_drafts >= 12,
        "{rejection_with_many_tail_drafts}"
    );
    assert!(stage_rows >= 3, "{stage_rows}");
    // ... and tail-first plans that decline tail drafts.
    assert!(tail_first_declining >= 12, "{tail_first_declining}");
}

#[test]
fn tail_rule_accepts_at_least_the_first_tail_draft_rule() {
    let mut gains = Vec::new();
    for (name, p, qs, trunc) in cases() {
        let (plan, first) = plans(&p, &qs, trunc);
        let gain = plan.acceptance - first.acceptance;
        assert!(
            gain >= -1e-12,
            "{name}: tail rule {} below first tail draft {}",
            plan.acceptance,
            first.acceptance
        );
        if qs.len() >= 3 {
            gains.push((name, gain));
        }
    }
    // With several tail drafts it is a real gain, not a tie, in most cases.
    let clear = gains.iter().filter(|(_, g)| *g > 1e-3).count();
    assert!(2 * clear > gains.len(), "{gains:?}");
}

#[test]
fn selecting_with_the_tail_rule_against_the_first_draft_law_is_not_exact() {
    // Negative control: the tail rule's selection, but SD against the law of the first tail
    // draft, leaves the output law away from p: the exactness checks above do see `q~`.
    let mut detected = 0;
    for (name, p, qs, trunc) in cases() {
        if qs.len() < 2 {
            continue;
        }
        let flow = flow(&p, &qs, trunc);
        for (leftover, plan, first, _) in builds(&p, &qs, &flow) {
            if plan.tail.rule == TailRule::FirstDraft {
                continue;
            }
            let wrong = WeightedPlan::with_proposal(
                &p,
                &flow,
                plan.select.clone(),
                plan.tail.clone(),
                plan.declined.clone(),
                first.proposal.clone(),
            );
            let err = max_diff(&output_law(&wrong, &qs), &p);
            assert!(
                err > 1e-6,
                "{name}, {leftover:?}: a wrong q~ went unnoticed ({err:e})"
            );
            detected += 1;
        }
    }
    assert!(detected >= 12, "{detected}");
}

#[test]
fn identical_drafts_are_tracked_by_count() {
    let q = dist(5, 7, 1);
    assert_eq!(
        TailTracking::for_drafts(&vec![q.clone(); 4]),
        TailTracking::Count
    );
    let mut other = q.clone();
    other.swap(0, 1);
    assert_eq!(
        TailTracking::for_drafts(&[q.clone(), other.clone()]),
        TailTracking::Mask
    );
    let many: Vec<Vec<f64>> = (0..=lp::TAIL_MASK_MAX_DRAFTS)
        .map(|j| if j == 0 { other.clone() } else { q.clone() })
        .collect();
    assert_eq!(TailTracking::for_drafts(&many), TailTracking::First);
}

#[test]
fn many_different_drafts_select_the_first_tail_draft() {
    // K = 9 different drafts: the set masses keep only the first tail draft, so the plan must
    // use the first-tail-draft rule, and is still exact.
    let k = lp::TAIL_MASK_MAX_DRAFTS + 1;
    let p = dist(3, 5, 2);
    let qs: Vec<Vec<f64>> = (0..k).map(|j| dist(3, 50 + j as u64, 3)).collect();
    let trunc = LpTruncation {
        max_alphabet: 1,
        max_variables: 4096,
        fallback_to_importance_sampling: false,
    };
    let (plan, first) = plans(&p, &qs, trunc);
    assert_eq!(plan.tail.rule, TailRule::FirstDraft);
    assert!(plan.acceptance >= first.acceptance - 1e-12);
    let err = max_diff(&selected_law(&plan, &qs), &plan.proposal);
    assert!(err < 1e-12, "|q~ - enumerated| = {err:e}");
}

/// Every candidate of `from_flow` built without the acceptance bound, in its order: the plan
/// `from_flow` must pick (the first of the best).
fn unpruned_best(p: &[f64], qs: &[Vec<f64>], flow: &Flow) -> WeightedPlan {
    let mut candidates = vec![
        WeightedPlan::build(p, qs, flow, Leftover::Proportional, false, None),
        WeightedPlan::build(p, qs, flow, Leftover::Fill, false, None),
    ];
    for leftover in [Leftover::Proportional, Leftover::Fill] {
        for shift in super::SHIFTS {
            candidates.push(WeightedPlan::build(
                p,
                qs,
                flow,
                leftover,
                false,
                Some(shift),
            ));
        }
    }
    candidates.extend(
        super::decline::tail_first(p, qs, flow)
            .into_iter()
            .flatten(),
    );
    let mut best = 0;
    for (i, plan) in candidates.iter().enumerate() {
        if plan.acceptance > candidates[best].acceptance {
            best = i;
        }
    }
    candidates.swap_remove(best)
}

#[test]
fn acceptance_bound_prunes_only_candidates_that_cannot_win() {
    let mut pruned = 0;
    for (name, p, qs, trunc) in cases() {
        let flow = flow(&p, &qs, trunc);
        let plan = WeightedPlan::from_flow(&p, &qs, &flow);
        let full = unpruned_best(&p, &qs, &flow);
        assert_eq!(
            plan.acceptance, full.acceptance,
            "{name}: the pruned search chose another plan"
        );
        assert_eq!(plan.proposal, full.proposal, "{name}");
        for leftover in [Leftover::Proportional, Leftover::Fill] {
            for shift in [None, Some(0.0), Some(0.5), Some(1.0)] {
                let built = WeightedPlan::build(&p, &qs, &flow, leftover, false, shift);
                // A floor just above the candidate's own acceptance: pruning it is allowed, and
                // a floor at or below it must keep it (the bound is an upper bound).
                let below = built.acceptance - 1e-6;
                let kept = WeightedPlan::build_above(&p, &qs, &flow, leftover, false, shift, below);
                assert!(
                    kept.is_some(),
                    "{name}, {leftover:?} {shift:?}: bound below q~"
                );
                let above = plan.acceptance + 1e-6;
                if built.acceptance < plan.acceptance
                    && WeightedPlan::build_above(&p, &qs, &flow, leftover, false, shift, above)
                        .is_none()
                {
                    pruned += 1;
                }
            }
        }
    }
    // The bound is tight enough to skip candidates in some cases.
    assert!(pruned >= 8, "{pruned}");
}
