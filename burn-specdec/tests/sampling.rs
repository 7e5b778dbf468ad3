//! Monte-Carlo checks: output tokens follow `p` (χ² goodness of fit) and the empirical acceptance
//! rate matches the analytic one (5σ binomial bound), for every scheme on the seeded cases.

use crate::common::{Case, ONE_TOKEN_LP, TINY_LP, cases, forced_tail_cases, schemes_for};
use burn_kernels_testing::chi_square_p_value;
use burn_specdec::{Scheme, Verifier, inverse_cdf};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const SAMPLES: usize = 200_000;
/// Fixed seeds make the tests deterministic; the threshold keeps false alarms rare even across
/// the ~60 (case, scheme) pairs.
const P_VALUE_THRESHOLD: f64 = 1e-4;

struct Run {
    counts: Vec<u64>,
    accepted: u64,
}

fn run(verifier: &Verifier, seed: u64) -> Run {
    let mut rng = StdRng::seed_from_u64(seed);
    let k = verifier.num_drafts();
    let mut counts = vec![0_u64; verifier.vocab_size()];
    let mut accepted = 0;
    let mut drafts = vec![0; k];
    for _ in 0..SAMPLES {
        for (j, x) in drafts.iter_mut().enumerate() {
            *x = inverse_cdf(verifier.draft(j).unwrap(), rng.random()).unwrap();
        }
        let out = verifier.verify_with_rng(&drafts, &mut rng).unwrap();
        counts[out.token] += 1;
        if let Some(j) = out.accepted {
            assert_eq!(drafts[j], out.token, "accepted draft must be the output");
            accepted += 1;
        }
    }
    Run { counts, accepted }
}

fn check(case: &Case, scheme: Scheme, seed: u64) {
    let verifier = Verifier::new(scheme, &case.p, &case.qs).unwrap();
    let r = run(&verifier, seed);
    let p_value = chi_square_p_value(&r.counts, verifier.target());
    assert!(
        p_value >= P_VALUE_THRESHOLD,
        "{} / {}: χ² p-value {p_value:.3e}, counts {:?}, p {:?}",
        case.name,
        scheme.name(),
        r.counts,
        verifier.target()
    );
    let a = verifier.acceptance_probability();
    let rate = r.accepted as f64 / SAMPLES as f64;
    let sigma = (a * (1.0 - a) / SAMPLES as f64).max(0.0).sqrt();
    assert!(
        (rate - a).abs() <= 5.0 * sigma + 1e-12,
        "{} / {}: acceptance rate {rate} vs analytic {a} (σ = {sigma:.2e})",
        case.name,
        scheme.name()
    );
}

#[test]
fn output_follows_p_and_acceptance_matches_analytic() {
    for (i, case) in cases().iter().enumerate() {
        for (j, scheme) in schemes_for(case.qs.len()).into_iter().enumerate() {
            check(case, scheme, 1000 * i as u64 + j as u64);
        }
    }
}

#[test]
fn truncated_optimal_output_follows_p() {
    for (i, case) in cases().iter().enumerate() {
        check(case, Scheme::Optimal(TINY_LP), 77_000 + i as u64);
    }
}

#[test]
fn weighted_importance_with_many_tail_drafts_follows_p() {
    for (i, case) in forced_tail_cases().iter().enumerate() {
        for (j, trunc) in [TINY_LP, ONE_TOKEN_LP].into_iter().enumerate() {
            check(
                case,
                Scheme::WeightedImportance(trunc),
                91_000 + 10 * i as u64 + j as u64,
            );
        }
    }
}

#[test]
fn q_equal_p_always_accepts_and_disjoint_never_does() {
    for case in cases() {
        let same = case.qs.iter().all(|q| *q == case.p);
        let disjoint = case
            .qs
            .iter()
            .all(|q| q.iter().zip(&case.p).all(|(a, b)| a * b == 0.0));
        if !(same || disjoint) {
            continue;
        }
        for scheme in schemes_for(case.qs.len()) {
            let verifier = Verifier::new(scheme, &case.p, &case.qs).unwrap();
            let r = run(&verifier, 5);
            let expected = if same { SAMPLES as u64 } else { 0 };
            assert_eq!(r.accepted, expected, "{} / {}", case.name, scheme.name());
        }
    }
}
