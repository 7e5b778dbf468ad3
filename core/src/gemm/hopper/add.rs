//! The Hopper GEMM's adding stores: `out += lhs · rhs` into an f32 accumulator
//! ([`hopper_gemm_add`]) or into a compensated 16-bit sum ([`hopper_gemm_add_compensated`]),
//! each product summed in f32 in the kernel's registers and added as its tile is stored: no
//! product is written to memory, and no separate addition runs.

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;

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
