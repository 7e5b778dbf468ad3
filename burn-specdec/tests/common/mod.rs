//! Shared test cases and helpers.
#![allow(dead_code)]

use burn_specdec::{LpTruncation, Scheme};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One `(p, q_1..q_K)` test case.
pub struct Case {
    pub name: &'static str,
    pub p: Vec<f64>,
    pub qs: Vec<Vec<f64>>,
}

/// A random distribution over `v` tokens (normalised exponentials, i.e. Dirichlet(1)), with each
/// token zeroed with probability `zero` (at least one token is kept).
pub fn random_dist(rng: &mut StdRng, v: usize, zero: f64) -> Vec<f64> {
    let mut d: Vec<f64> = (0..v).map(|_| -(1.0 - rng.random::<f64>()).ln()).collect();
    for x in d.iter_mut() {
        if rng.random::<f64>() < zero {
            *x = 0.0;
        }
    }
    if d.iter().all(|&x| x == 0.0) {
        d[rng.random_range(0..v)] = 1.0;
    }
    let s: f64 = d.iter().sum();
    d.iter().map(|x| x / s).collect()
}

fn identical(q: Vec<f64>, k: usize) -> Vec<Vec<f64>> {
    vec![q; k]
}

/// The seeded cases: K = 1..4, V = 3..8, identical and different drafts, sparse supports,
/// `q = p`, disjoint supports.
pub fn cases() -> Vec<Case> {
    let mut rng = StdRng::seed_from_u64(0x5bec_dec0);
    let mut cases = Vec::new();
    let p = random_dist(&mut rng, 3, 0.0);
    let q = random_dist(&mut rng, 3, 0.0);
    cases.push(Case {
        name: "V3 K1",
        p,
        qs: vec![q],
    });
    let p = random_dist(&mut rng, 8, 0.2);
    let q = random_dist(&mut rng, 8, 0.2);
    cases.push(Case {
        name: "V8 K1 sparse",
        p,
        qs: vec![q],
    });
    cases.push(Case {
        name: "V3 K2 figure 2 (q2 = 0.1)",
        p: vec![1.0 / 3.0; 3],
        qs: identical(vec![1.0 / 3.0, 0.1, 2.0 / 3.0 - 0.1], 2),
    });
    let p = random_dist(&mut rng, 4, 0.0);
    let q = random_dist(&mut rng, 4, 0.0);
    cases.push(Case {
        name: "V4 K2 identical",
        p,
        qs: identical(q, 2),
    });
    let p = random_dist(&mut rng, 5, 0.0);
    let qs = (0..2).map(|_| random_dist(&mut rng, 5, 0.0)).collect();
    cases.push(Case {
        name: "V5 K2 different",
        p,
        qs,
    });
    let p = random_dist(&mut rng, 6, 0.3);
    let q = random_dist(&mut rng, 6, 0.3);
    cases.push(Case {
        name: "V6 K3 identical sparse",
        p,
        qs: identical(q, 3),
    });
    let p = random_dist(&mut rng, 6, 0.0);
    let qs = (0..3).map(|_| random_dist(&mut rng, 6, 0.0)).collect();
    cases.push(Case {
        name: "V6 K3 different",
        p,
        qs,
    });
    let p = random_dist(&mut rng, 8, 0.0);
    let q = random_dist(&mut rng, 8, 0.0);
    cases.push(Case {
        name: "V8 K4 identical",
        p,
        qs: identical(q, 4),
    });
    let p = random_dist(&mut rng, 7, 0.25);
    let qs = (0..4).map(|_| random_dist(&mut rng, 7, 0.25)).collect();
    cases.push(Case {
        name: "V7 K4 different sparse",
        p,
        qs,
    });
    let p = random_dist(&mut rng, 5, 0.0);
    cases.push(Case {
        name: "V5 K2 q = p",
        p: p.clone(),
        qs: identical(p, 2),
    });
    let p = random_dist(&mut rng, 4, 0.0);
    cases.push(Case {
        name: "V4 K3 q = p",
        p: p.clone(),
        qs: identical(p, 3),
    });
    cases.push(Case {
        name: "V6 K2 disjoint supports",
        p: vec![0.5, 0.3, 0.2, 0.0, 0.0, 0.0],
        qs: vec![
            vec![0.0, 0.0, 0.0, 0.2, 0.5, 0.3],
            vec![0.0, 0.0, 0.0, 0.6, 0.1, 0.3],
        ],
    });
    cases.push(Case {
        name: "V5 K3 partly disjoint",
        p: vec![0.4, 0.4, 0.2, 0.0, 0.0],
        qs: vec![
            vec![0.1, 0.0, 0.0, 0.5, 0.4],
            vec![0.0, 0.2, 0.0, 0.8, 0.0],
            vec![0.3, 0.3, 0.0, 0.0, 0.4],
        ],
    });
    cases
}

/// The schemes applicable with `k` drafts.
pub fn schemes_for(k: usize) -> Vec<Scheme> {
    let mut s = vec![
        Scheme::SpecInfer,
        Scheme::SpecTr,
        Scheme::SequentialImportance,
        Scheme::WEIGHTED_IMPORTANCE,
        Scheme::OPTIMAL,
    ];
    if k == 1 {
        s.insert(0, Scheme::SingleDraft);
    }
    s
}

/// A deliberately tiny LP alphabet that always uses the LP coupling, to exercise the lumped
/// tail symbol.
pub const TINY_LP: LpTruncation = LpTruncation {
    max_alphabet: 2,
    max_variables: 4096,
    fallback_to_importance_sampling: false,
};

/// [`TINY_LP`] with the importance-sampling fallback on.
pub const TINY_LP_WITH_FALLBACK: LpTruncation = LpTruncation {
    fallback_to_importance_sampling: true,
    ..TINY_LP
};

pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// LP alphabet of one token: everything else is the lumped tail.
pub const ONE_TOKEN_LP: LpTruncation = LpTruncation {
    max_alphabet: 1,
    ..TINY_LP
};

/// Cases whose LP at [`TINY_LP`] or [`ONE_TOKEN_LP`] leaves several tokens in the tail, with
/// K = 3..8 identical or different drafts, so that many drafts hit the tail together (V = 4, or
/// 5 for K <= 5).
pub fn forced_tail_cases() -> Vec<Case> {
    const NAMES: [&str; 12] = [
        "V5 K3 identical, forced tail",
        "V5 K3 different, forced tail",
        "V5 K4 identical, forced tail",
        "V5 K4 different, forced tail",
        "V5 K5 identical, forced tail",
        "V5 K5 different, forced tail",
        "V4 K6 identical, forced tail",
        "V4 K6 different, forced tail",
        "V4 K7 identical, forced tail",
        "V4 K7 different, forced tail",
        "V4 K8 identical, forced tail",
        "V4 K8 different, forced tail",
    ];
    let mut rng = StdRng::seed_from_u64(0x7a11);
    let mut cases = Vec::new();
    for (i, name) in NAMES.into_iter().enumerate() {
        let k = 3 + i / 2;
        let v = if k <= 5 { 5 } else { 4 };
        let p = random_dist(&mut rng, v, 0.0);
        let qs = if i % 2 == 0 {
            identical(random_dist(&mut rng, v, 0.0), k)
        } else {
            (0..k).map(|_| random_dist(&mut rng, v, 0.0)).collect()
        };
        cases.push(Case { name, p, qs });
    }
    cases
}
