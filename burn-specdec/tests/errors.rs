//! Typed errors.

use burn_specdec::{
    DistributionId, Scheme, SpecDecError, Verifier, acceptance_probability,
    acceptance_probability_enumerated, optimal_acceptance_bound, verify,
};

const P: [f64; 3] = [0.5, 0.3, 0.2];
const Q: [f64; 3] = [0.2, 0.2, 0.6];

fn new_err(scheme: Scheme, p: &[f64], qs: &[Vec<f64>]) -> SpecDecError {
    Verifier::new(scheme, p, qs).unwrap_err()
}

#[test]
fn no_drafts() {
    let none: [Vec<f64>; 0] = [];
    for scheme in [
        Scheme::SpecInfer,
        Scheme::SequentialImportance,
        Scheme::OPTIMAL,
    ] {
        assert_eq!(new_err(scheme, &P, &none), SpecDecError::NoDrafts);
    }
    assert_eq!(
        optimal_acceptance_bound(&P, &none).unwrap_err(),
        SpecDecError::NoDrafts
    );
}

#[test]
fn empty_and_mismatched_vocabularies() {
    assert_eq!(
        new_err(Scheme::SpecTr, &[], &[vec![]]),
        SpecDecError::EmptyVocabulary
    );
    assert_eq!(
        new_err(Scheme::SpecTr, &P, &[Q.to_vec(), vec![0.5, 0.5]]),
        SpecDecError::VocabularyMismatch {
            which: DistributionId::Draft(1),
            expected: 3,
            found: 2
        }
    );
}

#[test]
fn invalid_probabilities() {
    let qs = [Q.to_vec()];
    assert!(matches!(
        new_err(Scheme::SpecInfer, &[0.5, f64::NAN, 0.5], &qs),
        SpecDecError::NonFinite {
            which: DistributionId::Target,
            index: 1,
            ..
        }
    ));
    assert!(matches!(
        new_err(Scheme::SpecInfer, &P, &[vec![0.5, f64::INFINITY, 0.5]]),
        SpecDecError::NonFinite {
            which: DistributionId::Draft(0),
            index: 1,
            ..
        }
    ));
    assert_eq!(
        new_err(Scheme::SpecInfer, &[0.5, -0.1, 0.6], &qs),
        SpecDecError::Negative {
            which: DistributionId::Target,
            index: 1,
            value: -0.1
        }
    );
    assert_eq!(
        new_err(Scheme::OPTIMAL, &P, &[Q.to_vec(), vec![0.0; 3]]),
        SpecDecError::NotNormalisable {
            which: DistributionId::Draft(1),
            sum: 0.0
        }
    );
    assert!(matches!(
        new_err(Scheme::SpecInfer, &[f64::MAX, f64::MAX, 0.0], &qs),
        SpecDecError::NotNormalisable {
            which: DistributionId::Target,
            ..
        }
    ));
    // f32 inputs report the widened value.
    let err = Verifier::new(
        Scheme::SpecTr,
        &[0.5_f32, -0.5, 1.0],
        &[[0.2_f32, 0.3, 0.5]],
    );
    assert!(matches!(
        err,
        Err(SpecDecError::Negative { value: -0.5, .. })
    ));
    // Unnormalised rows are accepted and normalised.
    let v = Verifier::new(Scheme::SpecInfer, &[5.0, 3.0, 2.0], &[vec![2.0, 2.0, 6.0]]).unwrap();
    assert!((v.target()[0] - 0.5).abs() < 1e-15);
}

#[test]
fn single_draft_needs_exactly_one_draft() {
    assert_eq!(
        new_err(Scheme::SingleDraft, &P, &[Q.to_vec(), Q.to_vec()]),
        SpecDecError::SingleDraftOnly { drafts: 2 }
    );
}

#[test]
fn invalid_drafted_tokens() {
    let qs = [Q.to_vec(), vec![0.5, 0.5, 0.0]];
    for scheme in [
        Scheme::SpecInfer,
        Scheme::SpecTr,
        Scheme::SequentialImportance,
        Scheme::OPTIMAL,
    ] {
        let v = Verifier::new(scheme, &P, &qs).unwrap();
        let u = [0.5; 4];
        assert_eq!(
            v.verify(&[0], &[0.5; 3]).unwrap_err(),
            SpecDecError::DraftCountMismatch {
                drafts: 1,
                distributions: 2
            }
        );
        assert_eq!(
            v.verify(&[0, 3], &u).unwrap_err(),
            SpecDecError::TokenOutOfRange {
                draft: 1,
                token: 3,
                vocab: 3
            }
        );
        assert_eq!(
            v.verify(&[0, 2], &u).unwrap_err(),
            SpecDecError::ZeroDraftProbability { draft: 1, token: 2 }
        );
        assert_eq!(
            v.output_law_given_drafts(&[0, 2]).unwrap_err(),
            SpecDecError::ZeroDraftProbability { draft: 1, token: 2 }
        );
        assert!(v.verify(&[0, 1], &u).is_ok());
    }
}

#[test]
fn invalid_uniforms() {
    let qs = [Q.to_vec(), Q.to_vec()];
    assert_eq!(
        verify(Scheme::SpecInfer, &P, &qs, &[0, 1], &[0.5; 3]).unwrap_err(),
        SpecDecError::UniformCount {
            expected: 4,
            got: 3
        }
    );
    for bad in [1.0, -0.1, f64::NAN] {
        let err = verify(Scheme::SpecInfer, &P, &qs, &[0, 1], &[0.5, 0.5, bad, 0.5]).unwrap_err();
        assert!(
            matches!(err, SpecDecError::UniformOutOfRange { index: 2, .. }),
            "{err:?}"
        );
    }
}

#[test]
fn enumerations_refuse_huge_inputs() {
    let p = vec![1.0; 64];
    let qs = vec![vec![1.0; 64]; 5];
    assert!(matches!(
        acceptance_probability_enumerated(Scheme::SpecInfer, &p, &qs).unwrap_err(),
        SpecDecError::TooLarge { .. }
    ));
    assert!(matches!(
        optimal_acceptance_bound(&p, &qs).unwrap_err(),
        SpecDecError::TooLarge { .. }
    ));
    // The closed forms have no such limit.
    assert!(acceptance_probability(Scheme::SequentialImportance, &p, &qs).unwrap() > 0.999);
}

#[test]
fn errors_display() {
    let e = SpecDecError::ZeroDraftProbability { draft: 1, token: 2 };
    assert_eq!(
        e.to_string(),
        "draft 1: token 2 has probability zero under q_1"
    );
    let e = SpecDecError::Negative {
        which: DistributionId::Target,
        index: 0,
        value: -1.0,
    };
    assert_eq!(e.to_string(), "target distribution p[0] = -1 is negative");
}
