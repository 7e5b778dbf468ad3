//! Deterministic checks: exact output laws by enumerating all draft tuples, closed forms against
//! enumeration, scheme orderings, and the randomness contract.

use crate::common::{
    ONE_TOKEN_LP, TINY_LP, TINY_LP_WITH_FALLBACK, cases, forced_tail_cases, max_abs_diff,
    random_dist, schemes_for,
};
use burn_specdec::{
    LpTruncation, Scheme, SelectionRule, Verifier, acceptance_probabilities,
    acceptance_probability, acceptance_probability_enumerated, optimal_acceptance_bound,
    output_law_enumerated, uniforms_per_token,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn all_schemes(k: usize) -> Vec<Scheme> {
    let mut s = schemes_for(k);
    s.push(Scheme::Optimal(TINY_LP));
    s.push(Scheme::Optimal(TINY_LP_WITH_FALLBACK));
    s.push(Scheme::WeightedImportance(TINY_LP));
    s
}

#[test]
fn output_law_is_exactly_p() {
    for case in cases() {
        for scheme in all_schemes(case.qs.len()) {
            let law = output_law_enumerated(scheme, &case.p, &case.qs).unwrap();
            let err = max_abs_diff(&law, &case.p);
            assert!(
                err < 1e-12,
                "{} / {}: |law - p| = {err:e}",
                case.name,
                scheme.name()
            );
        }
    }
}

/// The schemes whose lumped tail many drafts hit in [`forced_tail_cases`].
fn forced_tail_schemes() -> Vec<Scheme> {
    let mut s = Vec::new();
    for trunc in [TINY_LP, ONE_TOKEN_LP] {
        s.push(Scheme::WeightedImportance(trunc));
        s.push(Scheme::Optimal(trunc));
        s.push(Scheme::Optimal(LpTruncation {
            fallback_to_importance_sampling: true,
            ..trunc
        }));
    }
    s
}

#[test]
fn forced_tails_with_many_tail_drafts_stay_exact() {
    for case in forced_tail_cases() {
        for scheme in forced_tail_schemes() {
            let what = format!("{} / {scheme:?}", case.name);
            let v = Verifier::new(scheme, &case.p, &case.qs).unwrap();
            assert!(v.lp_info().unwrap().truncated(), "{what}: no tail");
            let law = output_law_enumerated(scheme, &case.p, &case.qs).unwrap();
            let err = max_abs_diff(&law, &case.p);
            assert!(err < 1e-12, "{what}: |law - p| = {err:e}");
            let closed = acceptance_probability(scheme, &case.p, &case.qs).unwrap();
            let enumerated = acceptance_probability_enumerated(scheme, &case.p, &case.qs).unwrap();
            assert!(
                (closed - enumerated).abs() < 1e-12,
                "{what}: closed {closed} vs enumerated {enumerated}"
            );
            if let Scheme::WeightedImportance(_) = scheme {
                // The selection law is a distribution, and SD against it accepts sum min(p, q~).
                let q_tilde = v.selection_law().unwrap();
                let mass: f64 = q_tilde.iter().sum();
                let overlap: f64 = q_tilde.iter().zip(&case.p).map(|(a, b)| a.min(*b)).sum();
                assert!(mass <= 1.0 + 1e-12, "{what}: q~ mass {mass}");
                assert!(
                    (overlap - closed).abs() < 1e-12,
                    "{what}: {overlap} vs {closed}"
                );
            }
        }
    }
}

#[test]
fn closed_form_acceptance_matches_enumeration() {
    for case in cases() {
        for scheme in all_schemes(case.qs.len()) {
            let closed = acceptance_probability(scheme, &case.p, &case.qs).unwrap();
            let enumerated = acceptance_probability_enumerated(scheme, &case.p, &case.qs).unwrap();
            assert!(
                (closed - enumerated).abs() < 1e-12,
                "{} / {}: closed {closed} vs enumerated {enumerated}",
                case.name,
                scheme.name()
            );
        }
    }
}

/// Random `(p, qs)` with V = 3..8, K = 1..4, identical or different drafts, some sparse.
fn random_cases(n: usize, seed: u64) -> Vec<(Vec<f64>, Vec<Vec<f64>>)> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let v = rng.random_range(3..=8);
            let k = rng.random_range(1..=4);
            let zero = if i % 3 == 0 { 0.3 } else { 0.0 };
            let p = random_dist(&mut rng, v, zero);
            let qs = if i % 2 == 0 {
                vec![random_dist(&mut rng, v, zero); k]
            } else {
                (0..k).map(|_| random_dist(&mut rng, v, zero)).collect()
            };
            (p, qs)
        })
        .collect()
}

#[test]
fn scheme_ordering_and_lp_optimality() {
    for (p, qs) in random_cases(300, 11) {
        let acc = |s| acceptance_probability(s, &p, &qs).unwrap();
        let (si, tr, is, opt) = (
            acc(Scheme::SpecInfer),
            acc(Scheme::SpecTr),
            acc(Scheme::SequentialImportance),
            acc(Scheme::OPTIMAL),
        );
        let bound = optimal_acceptance_bound(&p, &qs).unwrap();
        let ctx = format!("p {p:?} qs {qs:?}: SI {si} TR {tr} IS {is} OPT {opt} bound {bound}");
        assert!(is >= si.max(tr) - 1e-12, "IS below a baseline: {ctx}");
        assert!(opt >= is - 1e-12, "Optimal below IS: {ctx}");
        assert!(
            opt <= bound + 1e-12,
            "Optimal above the min-cut bound: {ctx}"
        );
        // The default budget covers every case here, so the LP is untruncated and optimal.
        assert!((opt - bound).abs() < 1e-9, "LP not optimal: {ctx}");
        // Untruncated, weighted IS selects with the LP's weights and reaches the optimum.
        let wis = acc(Scheme::WEIGHTED_IMPORTANCE);
        assert!(
            (wis - opt).abs() < 1e-9,
            "weighted IS {wis} below Optimal: {ctx}"
        );
        let truncated = acc(Scheme::Optimal(TINY_LP_WITH_FALLBACK));
        assert!(truncated >= is - 1e-12, "truncated Optimal below IS: {ctx}");
        let truncated_wis = acc(Scheme::WeightedImportance(TINY_LP));
        assert!(
            truncated >= truncated_wis - 1e-12,
            "truncated Optimal below truncated weighted IS: {ctx}"
        );
        let lp_only = acc(Scheme::Optimal(TINY_LP));
        assert!(
            lp_only <= opt + 1e-12,
            "truncation gained acceptance: {ctx}"
        );
        if qs.len() == 1 {
            let sd = acc(Scheme::SingleDraft);
            let overlap: f64 = p.iter().zip(&qs[0]).map(|(a, b)| a.min(*b)).sum();
            for x in [si, tr, is, opt] {
                assert!(
                    (x - sd).abs() < 1e-12 && (sd - overlap).abs() < 1e-12,
                    "{ctx}"
                );
            }
        }
    }
}

#[test]
fn q_equal_p_accepts_surely_and_disjoint_supports_never() {
    let mut rng = StdRng::seed_from_u64(3);
    for k in 1..=4 {
        for v in 3..=8 {
            let p = random_dist(&mut rng, v, 0.0);
            for scheme in schemes_for(k) {
                let same = acceptance_probability(scheme, &p, &vec![p.clone(); k]).unwrap();
                assert!(
                    (same - 1.0).abs() < 1e-12,
                    "{} K={k} V={v}: {same}",
                    scheme.name()
                );
                let mut p_left = p.clone();
                let mut q_right = p.clone();
                for x in 0..v {
                    if x < v / 2 {
                        q_right[x] = 0.0;
                    } else {
                        p_left[x] = 0.0;
                    }
                }
                let none = acceptance_probability(scheme, &p_left, &vec![q_right; k]).unwrap();
                assert_eq!(none, 0.0, "{} K={k} V={v}", scheme.name());
            }
        }
    }
}

#[test]
fn more_drafts_never_hurt_the_optimal_scheme() {
    for (p, qs) in random_cases(100, 12) {
        let q = qs[0].clone();
        let mut prev = 0.0;
        for k in 1..=4 {
            let drafts = vec![q.clone(); k];
            let opt = acceptance_probability(Scheme::OPTIMAL, &p, &drafts).unwrap();
            let bound = optimal_acceptance_bound(&p, &drafts).unwrap();
            assert!(opt >= prev - 1e-12, "Optimal decreased at K={k}");
            assert!((opt - bound).abs() < 1e-9, "K={k}: {opt} vs bound {bound}");
            prev = opt;
        }
    }
}

#[test]
fn truncation_and_fallback_are_reported() {
    let case = &cases()[8];
    assert_eq!(case.qs.len(), 4);
    let truncated = Verifier::new(Scheme::Optimal(TINY_LP), &case.p, &case.qs).unwrap();
    let info = truncated.lp_info().unwrap();
    assert!(info.truncated() && info.alphabet.len() == 2, "{info:?}");
    assert!(!info.fell_back_to_importance_sampling);
    let no_budget = LpTruncation {
        max_variables: 0,
        ..LpTruncation::DEFAULT
    };
    let fallback = Verifier::new(Scheme::Optimal(no_budget), &case.p, &case.qs).unwrap();
    let info = fallback.lp_info().unwrap();
    assert!(info.fell_back_to_importance_sampling && info.alphabet.is_empty());
    let is = Verifier::new(Scheme::SequentialImportance, &case.p, &case.qs).unwrap();
    assert_eq!(
        fallback.acceptance_probability(),
        is.acceptance_probability()
    );
    assert_eq!(fallback.selection_law(), is.selection_law());
    let full = Verifier::new(Scheme::OPTIMAL, &case.p, &case.qs).unwrap();
    let info = full.lp_info().unwrap();
    assert!(
        !info.truncated() && !info.fell_back_to_importance_sampling,
        "{info:?}"
    );
}

#[test]
fn spectr_rho_solves_the_spectr_equation() {
    // Identical drafts: 1 - (1 - beta(rho))^K = rho * beta(rho), beta(rho) = sum min(q, p/rho).
    for (p, qs) in random_cases(100, 13) {
        let k = qs.len() as i32;
        let q = &qs[0];
        let drafts = vec![q.clone(); qs.len()];
        let v = Verifier::new(Scheme::SpecTr, &p, &drafts).unwrap();
        let rho = v.spectr_rho().unwrap();
        assert!((1.0..=f64::from(k)).contains(&rho));
        let beta: f64 = p.iter().zip(q).map(|(a, b)| b.min(a / rho)).sum();
        let lhs = 1.0 - (1.0 - beta).powi(k);
        if k > 1 && rho > 1.0 {
            assert!(
                (lhs - rho * beta).abs() < 1e-9,
                "rho {rho}: {lhs} vs {}",
                rho * beta
            );
        }
        assert!((v.acceptance_probability() - lhs).abs() < 1e-12);
    }
}

#[test]
fn is_selection_rule_beats_the_chains_when_it_matters() {
    // Figure 2 at q2 = 0.1: the reserve rule is the best sequential selection.
    let p = [1.0 / 3.0; 3];
    let q = [1.0 / 3.0, 0.1, 2.0 / 3.0 - 0.1];
    let v = Verifier::new(Scheme::SequentialImportance, &p, &[q, q]).unwrap();
    assert!(matches!(
        v.selection_rule(),
        Some(SelectionRule::Reserve { .. })
    ));
    let law = v.selection_law().unwrap();
    assert!((law.iter().sum::<f64>() - 1.0).abs() < 1e-12);
}

#[test]
fn verify_with_rng_consumes_exactly_k_plus_2_uniforms_in_order() {
    for case in cases() {
        let k = case.qs.len();
        for scheme in all_schemes(k) {
            let v = Verifier::new(scheme, &case.p, &case.qs).unwrap();
            let mut a = StdRng::seed_from_u64(9);
            let mut b = StdRng::seed_from_u64(9);
            for t in 0..200 {
                let drafts: Vec<usize> = (0..k)
                    .map(|j| {
                        let q = v.draft(j).unwrap();
                        (0..q.len()).cycle().skip(t).find(|&x| q[x] > 0.0).unwrap()
                    })
                    .collect();
                let from_rng = v.verify_with_rng(&drafts, &mut a).unwrap();
                let u: Vec<f64> = (0..uniforms_per_token(k)).map(|_| b.random()).collect();
                assert_eq!(from_rng, v.verify(&drafts, &u).unwrap());
            }
        }
    }
}

#[test]
fn f32_rows_give_the_same_decisions_as_f64_rows() {
    let case = &cases()[6];
    let p32: Vec<f32> = case.p.iter().map(|&x| x as f32).collect();
    let q32: Vec<Vec<f32>> = case
        .qs
        .iter()
        .map(|q| q.iter().map(|&x| x as f32).collect())
        .collect();
    let p64: Vec<f64> = p32.iter().map(|&x| f64::from(x)).collect();
    let q64: Vec<Vec<f64>> = q32
        .iter()
        .map(|q| q.iter().map(|&x| f64::from(x)).collect())
        .collect();
    let mut rng = StdRng::seed_from_u64(4);
    for scheme in schemes_for(case.qs.len()) {
        let a = Verifier::new(scheme, &p32, &q32).unwrap();
        let b = Verifier::new(scheme, &p64, &q64).unwrap();
        assert_eq!(a.acceptance_probability(), b.acceptance_probability());
        for _ in 0..500 {
            let drafts: Vec<usize> = (0..case.qs.len())
                .map(|j| rng.random_range(0..3) + j)
                .collect();
            let u: Vec<f64> = (0..uniforms_per_token(drafts.len()))
                .map(|_| rng.random())
                .collect();
            assert_eq!(
                a.verify(&drafts, &u).unwrap(),
                b.verify(&drafts, &u).unwrap()
            );
        }
    }
}

/// `acceptance_probabilities` shares the LP and the sequential plan between schemes; every
/// value must be the one-by-one value, on the seeded cases, the forced tails, and random rows
/// over 61 and 200 tokens (the default truncation's 40-token alphabet plus a tail) with 2, 3
/// and 8 identical or different drafts, for mixed truncations in one call (a disabled LP too).
#[test]
fn shared_acceptances_equal_one_by_one() {
    let disabled = LpTruncation {
        max_variables: 0,
        ..LpTruncation::DEFAULT
    };
    let mut rng = StdRng::seed_from_u64(0x5a4e);
    let mut rows: Vec<(String, Vec<f64>, Vec<Vec<f64>>)> = cases()
        .into_iter()
        .chain(forced_tail_cases())
        .map(|c| (c.name.to_string(), c.p, c.qs))
        .collect();
    for (v, k, same) in [
        (61, 2, true),
        (61, 3, false),
        (200, 8, true),
        (200, 2, false),
    ] {
        let p = random_dist(&mut rng, v, 0.1);
        let q = random_dist(&mut rng, v, 0.1);
        let qs = (0..k)
            .map(|_| {
                if same {
                    q.clone()
                } else {
                    random_dist(&mut rng, v, 0.1)
                }
            })
            .collect();
        rows.push((format!("V{v} K{k} random"), p, qs));
    }
    let (mut checked, mut positive) = (0, 0);
    for (name, p, qs) in &rows {
        let mut schemes = all_schemes(qs.len());
        schemes.extend([
            Scheme::Optimal(disabled),
            Scheme::WeightedImportance(disabled),
            Scheme::WeightedImportance(TINY_LP_WITH_FALLBACK),
            Scheme::Optimal(ONE_TOKEN_LP),
        ]);
        let shared = acceptance_probabilities(&schemes, p, qs).unwrap();
        assert_eq!(shared.len(), schemes.len(), "{name}");
        for (scheme, got) in schemes.iter().zip(&shared) {
            let want = acceptance_probability(*scheme, p, qs).unwrap();
            assert!(
                (got - want).abs() <= 1e-12,
                "{name} / {scheme:?}: shared {got} vs one by one {want}"
            );
            checked += 1;
            positive += usize::from(*got > 0.0);
        }
    }
    // Disjoint supports accept nothing; most cases accept something.
    assert!(
        checked > 300 && positive * 10 > checked * 9,
        "{positive} of {checked} positive"
    );
}
