//! The prompt-lookup draft: what it proposes, its typed errors, and that one-hot drafts (its
//! distribution) keep every scheme's output law exactly `p`.

use crate::common::{max_abs_diff, random_dist, schemes_for};
use burn_specdec::{
    PromptLookup, Scheme, SpecDecError, acceptance_probability, output_law_enumerated,
};
use rand::SeedableRng;
use rand::rngs::StdRng;

#[test]
fn proposes_what_followed_the_longest_most_recent_match() {
    let lookup = PromptLookup::new(1, 3).unwrap();
    // The 3-gram [7, 8, 9] occurred twice: the most recent occurrence (followed by 5) wins
    // over the older one (followed by 4).
    let ctx = [7, 8, 9, 4, 1, 7, 8, 9, 5, 2, 7, 8, 9];
    assert_eq!(lookup.next_token(&ctx), Some(5));
    // A longer match beats a more recent shorter one: [2, 3] → 6 (bigram), not 3 → 1.
    let ctx = [2, 3, 6, 3, 1, 2, 3];
    assert_eq!(lookup.next_token(&ctx), Some(6));
    // Continued drafts follow the matched text, re-matched after each drafted token.
    let ctx = [10, 11, 12, 13, 14, 99, 10, 11];
    assert_eq!(lookup.propose(&ctx, 4), vec![12, 13, 14, 99]);
    // A repeated token matches itself (overlapping occurrences).
    assert_eq!(lookup.propose(&[5, 5], 3), vec![5, 5, 5]);
}

#[test]
fn without_a_match_the_last_token_repeats() {
    let lookup = PromptLookup::default();
    assert_eq!(lookup.next_token(&[1, 2, 3]), None);
    assert_eq!(lookup.next_token(&[4]), None);
    assert_eq!(lookup.next_token(&[]), None);
    assert_eq!(lookup.propose(&[1, 2, 3], 3), vec![3, 3, 3]);
    assert_eq!(lookup.propose(&[], 2), vec![0, 0]);
    assert_eq!(lookup.propose(&[1, 2, 3], 0), Vec::<u32>::new());
    // A 2-gram minimum ignores single-token matches.
    let bigrams = PromptLookup::new(2, 4).unwrap();
    assert_eq!(bigrams.next_token(&[6, 1, 2, 6]), None);
    assert_eq!(bigrams.next_token(&[6, 1, 2, 6, 1]), Some(2));
}

#[test]
fn empty_ngram_ranges_are_typed_errors() {
    assert_eq!(
        PromptLookup::new(0, 3),
        Err(SpecDecError::NgramRange { min: 0, max: 3 })
    );
    assert_eq!(
        PromptLookup::new(4, 2),
        Err(SpecDecError::NgramRange { min: 4, max: 2 })
    );
}

/// A lookup draft's distribution is one-hot. Every scheme, with one-hot drafts (on tokens the
/// target favours, disfavours or excludes), emits exactly `p`, and SD accepts with `p(x)`.
#[test]
fn one_hot_drafts_keep_the_output_law() {
    let mut rng = StdRng::seed_from_u64(11);
    for v in [2usize, 5, 7] {
        let mut p = random_dist(&mut rng, v, 0.0);
        p[v - 1] = 0.0;
        let s: f64 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= s);
        for token in 0..v {
            let mut q = vec![0.0; v];
            q[token] = 1.0;
            for k in [1usize, 2, 3] {
                let qs = vec![q.clone(); k];
                for scheme in schemes_for(k) {
                    let law = output_law_enumerated(scheme, &p, &qs).unwrap();
                    let err = max_abs_diff(&law, &p);
                    assert!(
                        err < 1e-12,
                        "V={v} x={token} K={k} {}: {err:e}",
                        scheme.name()
                    );
                }
            }
            let a = acceptance_probability(Scheme::SingleDraft, &p, &[&q]).unwrap();
            assert!((a - p[token]).abs() < 1e-12, "SD accepts x with p(x)");
        }
    }
}
