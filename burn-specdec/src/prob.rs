//! Input validation and the small distribution helpers every scheme shares.

use crate::error::{DistributionId, Result, SpecDecError};

/// Validates one probability row and returns it normalised, in `f64`.
///
/// Rows only need to be proportional to a distribution (e.g. a masked softmax): they are divided
/// by their sum, so that every scheme works with exact probabilities.
pub(crate) fn normalise<T: Copy + Into<f64>>(which: DistributionId, row: &[T]) -> Result<Vec<f64>> {
    let mut out = Vec::with_capacity(row.len());
    for (index, &v) in row.iter().enumerate() {
        let value: f64 = v.into();
        if !value.is_finite() {
            return Err(SpecDecError::NonFinite {
                which,
                index,
                value,
            });
        }
        if value < 0.0 {
            return Err(SpecDecError::Negative {
                which,
                index,
                value,
            });
        }
        out.push(value);
    }
    let sum: f64 = out.iter().sum();
    if !(sum > 0.0 && sum.is_finite()) {
        return Err(SpecDecError::NotNormalisable { which, sum });
    }
    for v in &mut out {
        *v /= sum;
    }
    Ok(out)
}

/// Validates `p` and the K draft rows; returns them normalised.
pub(crate) fn validate_inputs<T, Q>(p: &[T], qs: &[Q]) -> Result<(Vec<f64>, Vec<Vec<f64>>)>
where
    T: Copy + Into<f64>,
    Q: AsRef<[T]>,
{
    if qs.is_empty() {
        return Err(SpecDecError::NoDrafts);
    }
    if p.is_empty() {
        return Err(SpecDecError::EmptyVocabulary);
    }
    let target = normalise(DistributionId::Target, p)?;
    let mut drafts = Vec::with_capacity(qs.len());
    for (k, q) in qs.iter().enumerate() {
        let q = q.as_ref();
        if q.len() != p.len() {
            return Err(SpecDecError::VocabularyMismatch {
                which: DistributionId::Draft(k),
                expected: p.len(),
                found: q.len(),
            });
        }
        drafts.push(normalise(DistributionId::Draft(k), q)?);
    }
    Ok((target, drafts))
}

/// Checks drafted tokens against the (normalised) draft rows.
pub(crate) fn validate_drafts(qs: &[Vec<f64>], drafts: &[usize]) -> Result<()> {
    if drafts.len() != qs.len() {
        return Err(SpecDecError::DraftCountMismatch {
            drafts: drafts.len(),
            distributions: qs.len(),
        });
    }
    for (k, (&token, q)) in drafts.iter().zip(qs).enumerate() {
        if token >= q.len() {
            return Err(SpecDecError::TokenOutOfRange {
                draft: k,
                token,
                vocab: q.len(),
            });
        }
        if q[token] <= 0.0 {
            return Err(SpecDecError::ZeroDraftProbability { draft: k, token });
        }
    }
    Ok(())
}

/// Checks the caller's uniforms: exactly `expected` of them, each in `[0, 1)`.
pub(crate) fn validate_uniforms(uniforms: &[f64], expected: usize) -> Result<()> {
    if uniforms.len() != expected {
        return Err(SpecDecError::UniformCount {
            expected,
            got: uniforms.len(),
        });
    }
    for (index, &value) in uniforms.iter().enumerate() {
        // `!(..)` so that NaN is rejected too.
        if !(0.0..1.0).contains(&value) {
            return Err(SpecDecError::UniformOutOfRange { index, value });
        }
    }
    Ok(())
}

/// Samples an index from non-negative, not necessarily normalised `weights` by inverse CDF.
///
/// Returns the first `i` with `u * total < weights[0] + ... + weights[i]` (prefix sums in index
/// order, in `f64`), where `total` is the sum of all weights. If rounding leaves no such `i`, the
/// last index with positive weight is returned. A device implementation that wants bit-identical
/// choices must accumulate in the same order and precision. Returns `None` if no weight is
/// positive.
pub fn inverse_cdf(weights: &[f64], u: f64) -> Option<usize> {
    let total: f64 = weights.iter().sum();
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let target = u * total;
    let mut acc = 0.0;
    let mut last_positive = None;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            acc += w;
            last_positive = Some(i);
            if target < acc {
                return Some(i);
            }
        }
    }
    last_positive
}

/// `min(1, num / den)` with the convention that a zero denominator gives 0.
///
/// The convention only matters for tokens that cannot be drafted (`q = 0`), whose acceptance
/// probability is never used.
pub(crate) fn ratio_capped(num: f64, den: f64) -> f64 {
    if den > 0.0 { (num / den).min(1.0) } else { 0.0 }
}

/// Element-wise `max(a - b, 0)`.
pub(crate) fn positive_part_diff(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| (x - y).max(0.0)).collect()
}

/// Returns `weights` normalised, or `fallback` if they carry no mass.
///
/// A residual can only be empty when the branch that samples it has probability zero in exact
/// arithmetic (e.g. `q = p`), so the fallback never changes the output law beyond rounding.
pub(crate) fn normalised_or(weights: Vec<f64>, fallback: &[f64]) -> Vec<f64> {
    let total: f64 = weights.iter().sum();
    if total > 0.0 && total.is_finite() {
        weights.into_iter().map(|w| w / total).collect()
    } else {
        fallback.to_vec()
    }
}
