//! Error metrics and assertions.

use burn::tensor::{DType, TensorData};
use std::fmt;

/// Error metrics of `actual` against `expected`, the ones the papers report.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Metrics {
    pub len: usize,
    pub max_abs: f64,
    pub max_rel: f64,
    /// `Σ|a − e| / Σ|e|`.
    pub rel_l1: f64,
    pub rmse: f64,
    /// `‖a − e‖₂ / ‖e‖₂`.
    pub rel_l2: f64,
    pub cos_sim: f64,
    /// Positions where one side is NaN or the two disagree on an infinity.
    pub non_finite_mismatches: usize,
    /// Index of the element that violates the tolerance most (or has the largest error).
    pub worst_index: usize,
}

impl fmt::Display for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "n={} max_abs={:.3e} max_rel={:.3e} rel_l1={:.3e} rel_l2={:.3e} rmse={:.3e} cos_sim={:.7} non_finite_mismatches={}",
            self.len,
            self.max_abs,
            self.max_rel,
            self.rel_l1,
            self.rel_l2,
            self.rmse,
            self.cos_sim,
            self.non_finite_mismatches
        )
    }
}

/// Computes [`Metrics`]. Infinities must match exactly; a NaN on either side is a mismatch
/// unless both are NaN. Finite pairs feed the statistics.
pub fn metrics(actual: &[f32], expected: &[f32]) -> Metrics {
    assert_eq!(
        actual.len(),
        expected.len(),
        "metrics: length mismatch (actual {}, expected {})",
        actual.len(),
        expected.len()
    );
    let (mut max_abs, mut max_rel, mut l1, mut l1_ref, mut sq) = (0f64, 0f64, 0f64, 0f64, 0f64);
    let (mut dot, mut na, mut ne) = (0f64, 0f64, 0f64);
    let mut mismatches = 0;
    let mut worst = (0usize, -1f64);
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let (a, e) = (a as f64, e as f64);
        if !(a.is_finite() && e.is_finite()) {
            let same = (a.is_nan() && e.is_nan()) || a == e;
            if !same {
                mismatches += 1;
                if worst.1 < f64::INFINITY {
                    worst = (i, f64::INFINITY);
                }
            }
            continue;
        }
        let d = (a - e).abs();
        max_abs = max_abs.max(d);
        if e != 0.0 {
            max_rel = max_rel.max(d / e.abs());
        }
        l1 += d;
        l1_ref += e.abs();
        sq += d * d;
        dot += a * e;
        na += a * a;
        ne += e * e;
        if d > worst.1 {
            worst = (i, d);
        }
    }
    let n = actual.len().max(1) as f64;
    let cos_sim = if na == 0.0 && ne == 0.0 {
        1.0
    } else if na == 0.0 || ne == 0.0 {
        0.0
    } else {
        dot / (na.sqrt() * ne.sqrt())
    };
    Metrics {
        len: actual.len(),
        max_abs,
        max_rel,
        rel_l1: if l1_ref > 0.0 { l1 / l1_ref } else { l1 },
        rmse: (sq / n).sqrt(),
        rel_l2: if ne > 0.0 {
            (sq / ne).sqrt()
        } else {
            sq.sqrt()
        },
        cos_sim,
        non_finite_mismatches: mismatches,
        worst_index: worst.0,
    }
}

/// Element-wise tolerance: `|a − e| ≤ atol + rtol·|e|`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    pub atol: f64,
    pub rtol: f64,
}

impl Tolerance {
    /// The tolerance for one rounding of a value stored in `dtype` (PyTorch's
    /// `torch.testing` defaults, which follow the dtype's machine epsilon).
    pub fn for_dtype(dtype: DType) -> Self {
        match dtype {
            DType::F64 => Tolerance {
                atol: 1e-7,
                rtol: 1e-7,
            },
            DType::F32 | DType::Flex32 => Tolerance {
                atol: 1e-5,
                rtol: 1.3e-6,
            },
            DType::F16 => Tolerance {
                atol: 1e-5,
                rtol: 1e-3,
            },
            DType::BF16 => Tolerance {
                atol: 1e-5,
                rtol: 1.6e-2,
            },
            other => panic!("Tolerance::for_dtype: {other:?} is not a float dtype"),
        }
    }

    /// One rounding to TF32 (10 explicit mantissa bits), the precision of f32 matrix products on
    /// CUDA tensor cores.
    pub fn tf32() -> Self {
        Tolerance {
            atol: 1e-5,
            rtol: 2f64.powi(-11),
        }
    }

    /// The tolerance for a value computed by a reduction over `len` terms whose inputs are stored
    /// in `dtype` and whose accumulation is in f32 on both sides: rounding errors of the
    /// two summation orders add like a random walk, so both bounds grow with `sqrt(len)`, on top
    /// of the final rounding into `dtype`.
    pub fn for_reduction(dtype: DType, len: usize) -> Self {
        let out = Self::for_dtype(dtype);
        let acc = Self::for_dtype(DType::F32);
        let walk = (len.max(1) as f64).sqrt();
        Tolerance {
            atol: out.atol + acc.atol * walk,
            rtol: out.rtol + acc.rtol * walk,
        }
    }

    /// This tolerance with `atol` scaled by `magnitude` (at least 1): for outputs whose size
    /// grows with their inputs (logits, products of products), where an absolute bound made for
    /// unit-sized values would be too tight.
    pub fn atol_scaled(self, magnitude: f64) -> Self {
        Tolerance {
            atol: self.atol * magnitude.max(1.0),
            ..self
        }
    }

    fn violation(&self, actual: f64, expected: f64) -> f64 {
        (actual - expected).abs() - (self.atol + self.rtol * expected.abs())
    }
}

/// Asserts `actual` matches `expected` within `tol` element-wise (and that non-finite values
/// agree), panicking with the metrics and the worst element otherwise.
pub fn assert_close(name: &str, actual: &[f32], expected: &[f32], tol: Tolerance) {
    let m = metrics(actual, expected);
    let mut worst: Option<(usize, f64)> = None;
    let mut violations = 0usize;
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let (a, e) = (a as f64, e as f64);
        let bad = if a.is_finite() && e.is_finite() {
            let v = tol.violation(a, e);
            (v > 0.0).then_some(v)
        } else {
            let same = (a.is_nan() && e.is_nan()) || a == e;
            (!same).then_some(f64::INFINITY)
        };
        if let Some(v) = bad {
            violations += 1;
            if worst.is_none_or(|(_, w)| v > w) {
                worst = Some((i, v));
            }
        }
    }
    if let Some((i, _)) = worst {
        panic!(
            "{name}: {violations} of {} elements outside tolerance (atol={:.1e}, rtol={:.1e}); \
             worst at index {i}: actual={} expected={}\n  metrics: {m}",
            actual.len(),
            tol.atol,
            tol.rtol,
            actual[i],
            expected[i],
        );
    }
}

/// `‖out − ref‖₂ / ‖ref‖₂` expected of an f32 matrix product on the matrix units in TF32
/// (10-bit mantissa, as on CUDA): well under 1e-3 (see the device library's METHOD.md).
pub const TF32_REL_L2: f64 = 1e-3;

/// Whether f32 matrix products on this backend run in TF32 (CUDA's matrix units) rather than in
/// full f32, which decides how closely their results can match an f64 oracle: on CUDA unless
/// cubek's `MatmulConfig::allow_tf32` is off, as [`crate::runtimes::exact_f32_matmul`] sets it
/// for the CUDA tests.
pub fn f32_matmul_is_tf32(device: &burn::tensor::Device) -> bool {
    crate::runtimes::is_cuda(device) && cubek::std::config::MatmulConfig::get().allow_tf32
}

/// Checks an output of f32 matrix products: element-wise within the f32 reduction tolerance
/// where the backend computes in f32, by relative L2 error within [`TF32_REL_L2`] where it
/// computes in TF32. Non-finite values must agree either way.
pub fn assert_matmul_close(
    name: &str,
    actual: &[f32],
    expected: &[f32],
    reduction_len: usize,
    device: &burn::tensor::Device,
) {
    assert_product_close(name, actual, expected, DType::F32, reduction_len, device);
}

/// Checks an output of matrix products whose inputs are stored in `dtype` (f32 accumulation):
/// f32 as [`assert_matmul_close`]; 16-bit inputs are exact in the f32 accumulator (no TF32
/// rounding), so they are checked element-wise within the reduction tolerance of `dtype`.
pub fn assert_product_close(
    name: &str,
    actual: &[f32],
    expected: &[f32],
    dtype: DType,
    reduction_len: usize,
    device: &burn::tensor::Device,
) {
    let tol = Tolerance::for_reduction(dtype, reduction_len);
    if dtype == DType::F32 {
        assert_close_unless_tf32(name, actual, expected, tol, device);
    } else {
        assert_close(name, actual, expected, tol);
    }
}

/// Checks an output of f32 matrix products element-wise within `tol` where the backend
/// computes in f32, by relative L2 error within [`TF32_REL_L2`] where it computes in TF32.
/// Non-finite values must agree either way.
pub fn assert_close_unless_tf32(
    name: &str,
    actual: &[f32],
    expected: &[f32],
    tol: Tolerance,
    device: &burn::tensor::Device,
) {
    if !f32_matmul_is_tf32(device) {
        return assert_close(name, actual, expected, tol);
    }
    let m = metrics(actual, expected);
    assert!(
        m.non_finite_mismatches == 0 && m.rel_l2 <= TF32_REL_L2,
        "{name}: relative L2 error {:.3e} above the TF32 bound {TF32_REL_L2:.0e}\n  metrics: {m}",
        m.rel_l2
    );
}

/// The relative L2 error `‖out − ref‖₂ / ‖ref‖₂` that `roundings` roundings of a result to
/// `dtype` can leave (each at most the dtype's unit roundoff relative to the value): for
/// 16-bit outputs of a computation carried in f32, compared with the same computation in f32.
pub fn rounding_rel_l2(dtype: DType, roundings: u32) -> f64 {
    let unit = match dtype {
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        DType::F32 | DType::Flex32 => 2f64.powi(-24),
        other => panic!("rounding_rel_l2: {other:?} is not a float dtype"),
    };
    roundings as f64 * unit
}

/// Asserts the relative L2 error of `actual` against `expected` is at most `bound` and that
/// non-finite values agree, panicking with the metrics otherwise.
pub fn assert_rel_l2(name: &str, actual: &[f32], expected: &[f32], bound: f64) {
    let m = metrics(actual, expected);
    assert!(
        m.non_finite_mismatches == 0 && m.rel_l2 <= bound,
        "{name}: relative L2 {:.3e} above {bound:.1e}\n  metrics: {m}",
        m.rel_l2
    );
}

/// [`assert_close`] on two [`TensorData`] of the same shape, of any float dtype.
pub fn assert_close_data(name: &str, actual: TensorData, expected: TensorData, tol: Tolerance) {
    assert_eq!(
        actual.shape(),
        expected.shape(),
        "{name}: shape mismatch (actual {:?}, expected {:?})",
        actual.shape(),
        expected.shape()
    );
    assert_close(name, &to_f32(actual), &to_f32(expected), tol);
}

/// The values of a float [`TensorData`] as f32.
pub fn to_f32(data: TensorData) -> Vec<f32> {
    data.convert::<f32>()
        .try_to_vec::<f32>()
        .expect("float tensor data")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_of_identical_vectors_are_exact() {
        let v = [1.0, -2.0, 3.5, f32::NEG_INFINITY];
        let m = metrics(&v, &v);
        assert_eq!(m.max_abs, 0.0);
        assert_eq!(m.non_finite_mismatches, 0);
        assert!((m.cos_sim - 1.0).abs() < 1e-12);
    }

    #[test]
    fn metrics_count_nan_and_infinity_mismatches() {
        let m = metrics(&[f32::NAN, 1.0, f32::INFINITY], &[0.0, 1.0, 1.0]);
        assert_eq!(m.non_finite_mismatches, 2);
    }

    #[test]
    fn metrics_report_known_errors() {
        let m = metrics(&[1.0, 2.0, 2.0], &[1.0, 2.0, 4.0]);
        assert_eq!(m.max_abs, 2.0);
        assert_eq!(m.max_rel, 0.5);
        assert!((m.rel_l1 - 2.0 / 7.0).abs() < 1e-12);
        assert!((m.rmse - (4.0f64 / 3.0).sqrt()).abs() < 1e-12);
        assert_eq!(m.worst_index, 2);
    }

    #[test]
    #[should_panic(expected = "outside tolerance")]
    fn assert_close_fails_readably() {
        assert_close(
            "demo",
            &[1.0, 2.0],
            &[1.0, 2.1],
            Tolerance::for_dtype(DType::F32),
        );
    }

    #[test]
    #[should_panic(expected = "outside tolerance")]
    fn assert_close_rejects_nan_for_finite() {
        assert_close(
            "nan",
            &[f32::NAN],
            &[0.0],
            Tolerance::for_dtype(DType::BF16),
        );
    }

    #[test]
    fn dtype_tolerances_are_ordered_by_precision() {
        let f32t = Tolerance::for_dtype(DType::F32).rtol;
        let f16t = Tolerance::for_dtype(DType::F16).rtol;
        let bf16t = Tolerance::for_dtype(DType::BF16).rtol;
        assert!(f32t < f16t && f16t < bf16t);
        assert!(Tolerance::for_reduction(DType::F32, 10_000).rtol > f32t);
    }
}
