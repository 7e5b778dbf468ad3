//! Goodness-of-fit statistics for the sampling tests.

use statrs::distribution::{ChiSquared, ContinuousCDF};

/// χ² p-value of `counts` against `p`; cells with expected count < 5 are pooled. Panics if a
/// token with `p = 0` was produced.
pub fn chi_square_p_value(counts: &[u64], p: &[f64]) -> f64 {
    let n: u64 = counts.iter().sum();
    let mut cells: Vec<(f64, f64)> = Vec::new();
    let mut pooled = (0.0, 0.0);
    for (&c, &px) in counts.iter().zip(p) {
        if px == 0.0 {
            assert_eq!(c, 0, "token with p = 0 was sampled");
            continue;
        }
        let expected = px * n as f64;
        if expected < 5.0 {
            pooled.0 += c as f64;
            pooled.1 += expected;
        } else {
            cells.push((c as f64, expected));
        }
    }
    if pooled.1 > 0.0 {
        cells.push(pooled);
    }
    if cells.len() < 2 {
        return 1.0;
    }
    let stat: f64 = cells.iter().map(|(o, e)| (o - e) * (o - e) / e).sum();
    ChiSquared::new((cells.len() - 1) as f64).unwrap().sf(stat)
}
