//! The Hopper GEMM's adding stores: `out += lhs · rhs` into an f32 accumulator
//! ([`hopper_gemm_add`]) or into a compensated 16-bit sum ([`hopper_gemm_add_compensated`]),
//! each product summed in f32 in the kernel's registers and added as its tile is stored: no
//! product is written to memory, and no separate addition runs.

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::wgmma::Accumulator;

use super::{Epilogue, HopperTile, Plan, Reduction, epilogue, gemm_into, launch, plan};

/// Where `t` is not a contiguous `[m, n]` tensor of one of `dtypes` for `plan`'s product, why.
fn refused(t: &CubeTensor, plan: &Plan, dtypes: &[DType], what: &str) -> Option<String> {
    let strides = t.meta.strides();
    let contiguous = strides.len() == 2 && strides[0] == plan.n && strides[1] == 1;
    let shaped = t.meta.shape().num_dims() == 2 && t.meta.shape().dims::<2>() == [plan.m, plan.n];
    (!dtypes.contains(&t.dtype) || !shaped || !contiguous).then(|| {
        format!(
            "{what} of {:?} {:?} for a [{}, {}] product (contiguous {dtypes:?} only)",
            t.dtype,
            t.meta.shape(),
            plan.m,
            plan.n
        )
    })
}

/// Adds `lhs · rhs` (`[m, k] · [k, n]`) into `out` (contiguous `[m, n]` f32), summed in f32 in
/// the kernel's registers: `out` takes the place of a product and its addition (an f32
/// accumulator over chunks of K, as burn-cce's dE blocks). An error where
/// [`super::unsupported`] says why not, where `out` is not contiguous f32 of that shape, and
/// where the kernel (tile and dtype) failed to launch on this device (checked at its first
/// launch in the process; `out` then holds no valid sum).
pub fn hopper_gemm_add(lhs: &CubeTensor, rhs: &CubeTensor, out: &CubeTensor) -> Result<(), String> {
    let plan = plan(&lhs.client, lhs, rhs)?;
    if let Some(why) = refused(out, &plan, &[DType::F32], "an accumulator") {
        return Err(why);
    }
    let tile = HopperTile {
        epilogue: Epilogue::Add,
        ..plan.tile
    };
    epilogue::verified((tile, lhs.dtype), out.clone(), || {
        gemm_into(lhs, rhs, &plan, (out, DType::F32), true)
    })
    .map(|_| ())
}

/// Adds `lhs · rhs` (`[m, k] · [k, n]`) into the compensated sum `sum + fix · |sum| · 2⁻¹⁵`:
/// `sum` (contiguous `[m, n]` bf16 or f16) holds the running sum rounded to its dtype, `fix`
/// (contiguous `[m, n]` i8) each value's rounding error in units of `|sum| · 2⁻¹⁵`. Each
/// product is summed in f32 in the kernel's registers and added in f32; both tensors are
/// rewritten. Zero-filled, they are a zero sum.
///
/// For a long sum kept in a 16-bit tensor (burn-cce's dE over vocabulary chunks) with one byte
/// per value besides it, rather than an f32 accumulator's four: with bf16 each addition rounds
/// the pair at about `|sum| · 2⁻¹⁶` (bf16 alone: `2⁻⁹`), and `sum` is the compensated sum
/// rounded to bf16. f16's narrow exponent range gives small values less: prefer bf16.
///
/// One launch, K never split. An error where [`super::unsupported`] says why not, where `sum`
/// or `fix` is not as above, and where the kernel (tile and dtype) failed to launch on this
/// device (checked at its first launch in the process; the pair then holds no valid sum).
pub fn hopper_gemm_add_compensated(
    lhs: &CubeTensor,
    rhs: &CubeTensor,
    sum: &CubeTensor,
    fix: &CubeTensor,
) -> Result<(), String> {
    let plan = plan(&lhs.client, lhs, rhs)?;
    let why = refused(sum, &plan, &[DType::BF16, DType::F16], "a sum")
        .or_else(|| refused(fix, &plan, &[DType::I8], "corrections"));
    if let Some(why) = why {
        return Err(why);
    }
    let tile = HopperTile {
        epilogue: Epilogue::AddCompensated,
        ..plan.tile
    };
    let reduction = Reduction {
        epilogue: Epilogue::AddCompensated,
        fix: fix.clone(),
        ..Reduction::none(lhs)
    };
    epilogue::verified((tile, lhs.dtype), sum.clone(), || {
        launch(lhs, rhs, &plan, (sum.clone(), sum.dtype), 1, reduction)
    })
    .map(|_| ())
}

/// The unit of a compensated sum's correction, relative to its value: `|hi| · 2⁻¹⁵`. A value
/// rounded to bf16 is within `|hi| · 2⁻⁸` of the exact sum, so the correction fits an `i8`.
const CORRECTION_UNIT: f64 = 1.0 / 32768.0;

/// The value of a compensated pair plus `x`, in f32: `hi + (x + q · |hi| · 2⁻¹⁵)`.
#[cube]
fn compensated_value<O: Float>(x: f32, hi: O, q: i8) -> f32 {
    let hi = f32::cast_from(hi);
    hi + (x + f32::cast_from(q) * (f32::abs(hi) * f32::new(CORRECTION_UNIT)))
}

/// The correction of `sum` rounded to `hi`: `(sum − hi) / (|hi| · 2⁻¹⁵)`, rounded, within
/// ±127; 0 where `hi` is zero, infinite or NaN.
#[cube]
fn correction<O: Float>(sum: f32, hi: O) -> i8 {
    let hi = f32::cast_from(hi);
    let unit = f32::abs(hi) * f32::new(CORRECTION_UNIT);
    let mut q = f32::new(0.0);
    if unit > 0.0 && !unit.is_inf() {
        q = f32::clamp(f32::round((sum - hi) / unit), -127.0, 127.0);
    }
    if q.is_nan() {
        q = f32::new(0.0);
    }
    i8::cast_from(q)
}

/// Stores (or corrections) loaded before any of them is written, per batch: a store may alias
/// a later load, so the compiler keeps a load after every earlier store, and one batch's loads
/// then overlap instead of each waiting for the last store.
#[allow(clippy::manual_is_multiple_of)]
const fn batch_of(stores: usize) -> usize {
    if stores % 8 == 0 {
        8
    } else if stores % 4 == 0 {
        4
    } else if stores % 2 == 0 {
        2
    } else {
        1
    }
}

/// [`Epilogue::AddCompensated`] of one consumer warpgroup's tile (`rows0`, `col0`), `width`
/// values (1 or 2 adjacent columns) per store of `out`: per value, the f32 sum of the tile's
/// value and the pair (`out`, `fix`), rounded into `out` with its rounding error into `fix`
/// (rows `stride` apart). A zero, infinite or NaN sum gets no correction. One matrix: the
/// offsets have no batch term, as [`hopper_gemm_add_compensated`] launches with no batch and
/// K unsplit.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn store_compensated<O: Float, N2: Size>(
    acc: &Accumulator<f32>,
    unit: u32,
    rows0: u32,
    col0: u32,
    m: u32,
    n: u32,
    stride: u32,
    out: &mut Tensor<Vector<O, N2>>,
    fix: &mut Tensor<i8>,
    #[comptime] width: usize,
    #[comptime] values: usize,
) {
    let stores = comptime![values / width];
    let batch = comptime![batch_of(stores)];
    #[unroll]
    for b in 0..comptime![stores / batch] {
        let mut olds = Array::<Vector<O, N2>>::new(batch);
        let mut qs = Array::<i8>::new(comptime![batch * width]);
        #[unroll]
        for t in 0..batch {
            let (r, col) = acc.position_of_nth(unit, ((b * batch + t) * width) as u32);
            let (row, col) = (rows0 + r, col0 + col);
            if row < m && col < n {
                let elem = row as usize * stride as usize + col as usize;
                olds[t] = out[elem / width];
                #[unroll]
                for h in 0..width {
                    qs[t * width + h] = fix[elem + h];
                }
            }
        }
        #[unroll]
        for t in 0..batch {
            let nth = (b * batch + t) * width;
            let (r, col) = acc.position_of_nth(unit, nth as u32);
            let (row, col) = (rows0 + r, col0 + col);
            if row < m && col < n {
                let elem = row as usize * stride as usize + col as usize;
                let old = olds[t];
                let mut v = Vector::<O, N2>::empty();
                #[unroll]
                for h in 0..width {
                    let sum =
                        compensated_value::<O>(acc.get(nth + h), old.extract(h), qs[t * width + h]);
                    let hi = O::cast_from(sum);
                    v.insert(h, hi);
                    fix[elem + h] = correction::<O>(sum, hi);
                }
                out[elem / width] = v;
            }
        }
    }
}
