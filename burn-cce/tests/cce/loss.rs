//! CCE against the plain path: the loss and its gradients, no further from an f32 ground truth
//! than the plain path in the same dtype.

use burn::tensor::{DType, Device};
use burn_cce::PassKernels;
use burn_kernels_testing::{Tolerance, compare::metrics, float_dtypes};

use super::case::*;
use super::ops::*;

/// `max|gt − cce| ≤ max|gt − ref| + tol`, with `tol` one rounding in `dtype` of the largest
/// ground-truth value, times `1 + extra` where CCE rounds `extra` more times than ref (dE
/// accumulated in the input dtype over that many chunks).
///
/// Where f32 matrix products run in TF32 (CUDA), the rounding is TF32's (unit roundoff 2⁻¹¹),
/// not f32's: CCE and ref each carry independent TF32 errors of that size.
pub(super) fn assert_no_worse(
    name: &str,
    gt: &[f32],
    cce: &[f32],
    reff: &[f32],
    (dtype, tf32): (DType, bool),
    extra: usize,
) {
    assert_eq!(gt.len(), cce.len(), "{name}: length");
    assert!(
        cce.iter().all(|x| x.is_finite()),
        "{name}: non-finite values in the CCE result"
    );
    let scale = gt.iter().fold(0f64, |m, &x| m.max((x as f64).abs()));
    let tol = if tf32 && dtype == DType::F32 {
        Tolerance::tf32()
    } else {
        Tolerance::for_dtype(dtype)
    };
    let err_cce = metrics(cce, gt).max_abs;
    // A non-finite ref gives no slack.
    let err_ref = metrics(reff, gt).max_abs;
    let bound = err_ref + (1 + extra) as f64 * (tol.atol + tol.rtol * scale);
    assert!(
        err_cce <= bound,
        "{name}: max|gt − cce| = {err_cce:.3e} > max|gt − ref| = {err_ref:.3e} + tol \
         (bound {bound:.3e}, scale {scale:.3e}); cce vs gt: {}",
        metrics(cce, gt)
    );
}

pub(super) fn run(device: &Device, case: &Case, dtype: DType) {
    let x = inputs(case);
    let host = Inputs {
        e: rounded(&x.e, dtype),
        c: rounded(&x.c, dtype),
        bias: x.bias.as_ref().map(|b| rounded(b, dtype)),
        targets: x.targets.clone(),
        weights: x.weights.clone(),
    };
    let gt = plain(case, &host, DType::F32, &Device::flex().autodiff());
    let reff = plain(case, &x, dtype, device);
    let (got, lse) = cce(case, &x, dtype, device);
    let name = format!("{case:?} {dtype:?}");
    // The fused training path stores dE₁ in the dtype, then scales it: one more rounding.
    let training =
        matches!(case.passes, PassKernels::Fused | PassKernels::Auto) && dtype != DType::F32;
    let de_extra = de_roundings(case, dtype) + training as usize;
    let prec = (
        dtype,
        burn_kernels_testing::compare::f32_matmul_is_tf32(device),
    );
    assert_no_worse(
        &format!("loss {name}"),
        &gt.loss,
        &got.loss,
        &reff.loss,
        prec,
        0,
    );
    assert_no_worse(
        &format!("dE {name}"),
        &gt.de,
        &got.de,
        &reff.de,
        prec,
        de_extra,
    );
    assert_no_worse(&format!("dC {name}"), &gt.dc, &got.dc, &reff.dc, prec, 0);
    if let (Some(g), Some(c), Some(r)) = (&gt.db, &got.db, &reff.db) {
        assert_no_worse(&format!("db {name}"), g, c, r, prec, 0);
    }
    assert_eq!(lse.len(), case.tokens(), "lse covers every token");
    assert!(lse.iter().all(|x| x.is_finite()), "lse is finite: {name}");
}

/// Extra roundings of dE when it is accumulated in a 16-bit dtype: one per vocabulary chunk.
pub(super) fn de_roundings(case: &Case, dtype: DType) -> usize {
    if case.accum || dtype == DType::F32 {
        return 0;
    }
    // The narrower chunks of stored logits: at least as many roundings as either path makes.
    let chunk = params(case, None).grad_chunk_len(case.tokens(), case.v, case.d, dtype, false);
    case.v.div_ceil(chunk)
}

pub(super) fn loss_and_gradients(device: &Device) {
    for dtype in float_dtypes(device) {
        for (k, case) in cases().into_iter().enumerate() {
            if !runs(device, k, dtype) {
                continue;
            }
            let started = std::time::Instant::now();
            run(device, &case, dtype);
            eprintln!(
                "loss_and_gradients: case {k} {dtype:?} ok [{:.1} s]",
                started.elapsed().as_secs_f64()
            );
        }
    }
}
