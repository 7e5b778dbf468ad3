//! `2^y` by a polynomial on the FMA pipe, for the softmax of the Hopper kernel.
//!
//! CubeCL's CUDA path (LLVM) lowers `f32::exp` to libdevice's `expf`, about eleven instructions
//! with its `MUFU.EX2` and the range reduction that makes it exact to 2 ulp; CubeCL has no
//! `exp2` and no approximate variant. A softmax needs neither the accuracy nor the range:
//! [`exp2_poly`] takes nine, with the logits in base 2 (`log₂e` folded into their scales).

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype};
use cubecl::prelude::*;

use super::common::grid;

/// Coefficients (of `f⁰` to `f⁴`) of the degree-4 minimax polynomial of `2^f` on `[−½, ½]`,
/// relative error 2.6·10⁻⁶: the log-sum-exp the kernel writes is then within f32's tolerance
/// of the reference (degree 3, at 7.5·10⁻⁵, was not: `ln` of a single key's weight came out
/// 7·10⁻⁵ off).
const C0: f64 = 0.999_999_261_445_714_4;
const C1: f64 = 0.693_121_814_736_770_8;
const C2: f64 = 0.240_247_448_279_440_53;
const C3: f64 = 0.055_917_860_319_303_916;
const C4: f64 = 0.009_570_101_908_081_146;
/// `1.5·2²³`: adding it to an integer-valued f32 of magnitude below 2²² puts the integer, two's
/// complement, in the low bits of the sum's mantissa.
const ROUND_MAGIC: f64 = 12_582_912.0;
/// The relative error bound of [`exp2_poly`] over `[−125, 127]`: the polynomial's, plus f32
/// rounding in its evaluation.
pub const EXP2_POLY_REL_ERR: f32 = 4.0e-6;
/// Below this, [`exp2_poly`] returns `2^EXP2_POLY_MIN` (about 2.4·10⁻³⁸), not a smaller value.
pub const EXP2_POLY_MIN: f32 = -125.0;

/// `2^y`: `y = r + f` with `r = round(y)` and `f ∈ [−½, ½]`, `2^f` by the polynomial
/// [`C0`]..[`C4`], `r` added to the result's exponent bits. `y` is clamped below at
/// [`EXP2_POLY_MIN`] (callers that need exact zeros for masked scores select them) and must stay
/// below 127.5.
///
/// `r` comes from `round`, not from adding and subtracting a magic constant (one instruction
/// fewer on CUDA): compilers that may reassociate floats (lavapipe) fold that to `f = 0`.
#[cube]
pub fn exp2_poly(y: f32) -> f32 {
    let y = f32::max(y, f32::new(EXP2_POLY_MIN as f64));
    let r = f32::round(y);
    let f = y - r;
    let p = (((f32::new(C4) * f + f32::new(C3)) * f + f32::new(C2)) * f + f32::new(C1)) * f
        + f32::new(C0);
    // `r + magic` is exact and holds `r` in its low bits: shifted into the exponent field, the
    // magic's own bits fall off the top.
    let t = r + f32::new(ROUND_MAGIC);
    f32::reinterpret((u32::reinterpret(t) << 23u32) + u32::reinterpret(p))
}

#[cube(launch_unchecked)]
fn exp2_poly_kernel(x: &Tensor<f32>, out: &mut Tensor<f32>) {
    let i = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * 256 + UNIT_POS as usize;
    if i < x.len() {
        out[i] = exp2_poly(x[i]);
    }
}

/// [`exp2_poly`] of every element of `x` (f32, any shape), as a kernel: what the tests check it
/// with on every runtime.
pub fn exp2_poly_map(x: CubeTensor) -> CubeTensor {
    assert_eq!(x.dtype, DType::F32, "exp2_poly_map takes f32");
    let x = into_contiguous(x);
    let client = x.client.clone();
    let out = empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        x.meta.shape().clone(),
        DType::F32,
    );
    let n = x.meta.shape().num_elements();
    // SAFETY: each unit reads and writes one index below the length.
    unsafe {
        exp2_poly_kernel::launch_unchecked(
            &client,
            grid(&client, n.div_ceil(256)),
            CubeDim::new_1d(256),
            x.into_tensor_arg(),
            out.clone().into_tensor_arg(),
        );
    }
    out
}
