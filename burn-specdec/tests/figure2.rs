//! The paper's Figure 2 setting: alphabet {1, 2, 3}, p uniform, K = 2 identical drafts
//! q = [q1, q2, 1 - q1 - q2].

use burn_specdec::{Figure2Row, figure2_markdown, figure2_row};

/// The paper's explicit optimum for two identical drafts:
/// `min_S { sum_{s in S} p_s + (sum_{s in S^c} q_s)^2 + 2 (sum_{s in S} q_s)(sum_{s in S^c} q_s) }`.
fn paper_closed_form(p: &[f64], q: &[f64]) -> f64 {
    (0..1_u32 << p.len())
        .map(|mask| {
            let inside = |i: usize| mask & (1 << i) != 0;
            let p_s: f64 = (0..p.len()).filter(|&i| inside(i)).map(|i| p[i]).sum();
            let q_s: f64 = (0..q.len()).filter(|&i| inside(i)).map(|i| q[i]).sum();
            let q_c: f64 = (0..q.len()).filter(|&i| !inside(i)).map(|i| q[i]).sum();
            p_s + q_c * q_c + 2.0 * q_s * q_c
        })
        .fold(f64::INFINITY, f64::min)
}

fn grid(q1: f64, steps: u32) -> Vec<f64> {
    let top = 1.0 - q1;
    (0..=steps)
        .map(|i| top * f64::from(i) / f64::from(steps))
        .collect()
}

#[test]
fn optimal_ge_is_ge_baselines_on_both_settings() {
    for q1 in [1.0 / 3.0, 1.0 / 6.0] {
        for q2 in grid(q1, 600) {
            let r = figure2_row(q1, q2).unwrap();
            let q = [q1, q2, (1.0 - q1 - q2).max(0.0)];
            let closed = paper_closed_form(&[1.0 / 3.0; 3], &q);
            let ctx = format!("q1 {q1} q2 {q2}: {r:?}, closed form {closed}");
            assert!(r.optimal >= r.importance_sampling - 1e-12, "{ctx}");
            assert!(
                r.importance_sampling >= r.spec_tr.max(r.spec_infer) - 1e-12,
                "{ctx}"
            );
            assert!((r.optimal - r.bound).abs() < 1e-9, "{ctx}");
            assert!((r.bound - closed).abs() < 1e-12, "{ctx}");
            assert!(r.optimal <= 1.0 + 1e-12, "{ctx}");
        }
    }
}

#[test]
fn acceptance_is_one_exactly_where_the_paper_says() {
    // Perfect acceptance iff p(S) <= 1 - (1 - q(S))^2 for every S; with q1 = 1/3 and p uniform
    // this is 1 - sqrt(2/3) <= q2 <= sqrt(2/3) - 1/3.
    let lo = 1.0 - (2.0_f64 / 3.0).sqrt();
    let hi = (2.0_f64 / 3.0).sqrt() - 1.0 / 3.0;
    for q2 in grid(1.0 / 3.0, 600) {
        let r = figure2_row(1.0 / 3.0, q2).unwrap();
        let inside = q2 > lo + 1e-9 && q2 < hi - 1e-9;
        let outside = q2 < lo - 1e-9 || q2 > hi + 1e-9;
        if inside {
            assert!((r.optimal - 1.0).abs() < 1e-9, "q2 {q2}: {r:?}");
        }
        if outside {
            assert!(r.optimal < 1.0 - 1e-9, "q2 {q2}: {r:?}");
        }
    }
}

fn docs_rows() -> Vec<Figure2Row> {
    let mut q2s: Vec<f64> = (0..=6).map(|i| f64::from(i) / 10.0).collect();
    q2s.push(2.0 / 3.0);
    q2s.iter()
        .map(|&q2| figure2_row(1.0 / 3.0, q2).unwrap())
        .collect()
}

#[test]
fn documented_table_matches_the_code() {
    let table = figure2_markdown(&docs_rows());
    println!("{table}");
    let readme = include_str!("../README.md");
    let lib = include_str!("../src/lib.rs");
    for line in table.lines() {
        assert!(readme.contains(line), "README.md lacks `{line}`");
        assert!(
            lib.contains(&format!("//! {line}")),
            "src/lib.rs docs lack `{line}`"
        );
    }
}

/// Best acceptance over sequential selections for two identical drafts: the first-stage
/// selection probability `alpha` solves `alpha = D(alpha)`,
/// `D(alpha) = sum_y min(q(y), max(0, p(y) - (1 - alpha) q(y)))`, and the value is
/// `sum_y min(p(y), (1 - alpha) q(y)) + alpha`.
fn best_sequential_two_drafts(p: &[f64], q: &[f64]) -> f64 {
    let d = |a: f64| -> f64 {
        p.iter()
            .zip(q)
            .map(|(&py, &qy)| qy.min((py - (1.0 - a) * qy).max(0.0)))
            .sum()
    };
    let (mut lo, mut hi) = (0.0_f64, 1.0_f64);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if mid - d(mid) >= 0.0 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let base: f64 = p
        .iter()
        .zip(q)
        .map(|(&py, &qy)| py.min((1.0 - hi) * qy))
        .sum();
    base + hi
}

#[test]
fn importance_sampling_reaches_the_best_sequential_selection() {
    for q1 in [1.0 / 3.0, 1.0 / 6.0] {
        for q2 in grid(q1, 600) {
            let q = [q1, q2, (1.0 - q1 - q2).max(0.0)];
            let best = best_sequential_two_drafts(&[1.0 / 3.0; 3], &q);
            let r = figure2_row(q1, q2).unwrap();
            assert!(
                (r.importance_sampling - best).abs() < 1e-9,
                "q1 {q1} q2 {q2}: IS {} vs best sequential {best}",
                r.importance_sampling
            );
        }
    }
}
