//! RMSNorm in one launch: one cube per row; each unit sums the squares of a strided share of
//! the row in f32, a shared-memory tree adds the shares, and each unit writes its share
//! scaled by `γ / √(mean + ε)`. [`add_rms_norm`] adds the residual first, in the same pass.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::DType;
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::prelude::*;

use super::reduce::cube_sum;
use super::row_grid;

/// Units per row (a power of two: the tree halves evenly).
const ROW_UNITS: usize = 64;

#[cube(launch)]
fn rms_norm_kernel<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    out: &mut Tensor<F>,
    rows: usize,
    eps: f32,
    #[comptime] units: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    // Whole cubes leave together, before the barriers.
    if row >= rows {
        terminate!();
    }
    let cols = gamma.len();
    let unit = UNIT_POS_X as usize;
    let base = row * cols;
    let mut squares = f32::new(0.0);
    let mut i = unit;
    while i < cols {
        let v = f32::cast_from(x[base + i]);
        squares += v * v;
        i += units;
    }
    let inv = inverse_rms(squares, cols, eps, units);
    scale_row::<F>(x, gamma, out, base, unit, inv, units);
}

/// The residual add before a norm: `sum = x + y` (rounded to the dtype, as a separate add
/// would store it) and the norm of `sum`, in one pass over the row.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn add_rms_norm_kernel<F: Float>(
    x: &Tensor<F>,
    y: &Tensor<F>,
    gamma: &Tensor<F>,
    sum: &mut Tensor<F>,
    out: &mut Tensor<F>,
    rows: usize,
    eps: f32,
    #[comptime] units: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if row >= rows {
        terminate!();
    }
    let cols = gamma.len();
    let unit = UNIT_POS_X as usize;
    let base = row * cols;
    let mut squares = f32::new(0.0);
    let mut i = unit;
    while i < cols {
        let rounded = residual_sum::<F>(x, y, base + i);
        sum[base + i] = rounded;
        let v = f32::cast_from(rounded);
        squares += v * v;
        i += units;
    }
    let inv = inverse_rms(squares, cols, eps, units);
    let mut i = unit;
    while i < cols {
        out[base + i] = normed::<F>(residual_sum::<F>(x, y, base + i), inv, gamma[i]);
        i += units;
    }
}

/// `1 / √(mean + ε)` of the row from every unit's sum of squares (a shared-memory tree).
#[cube]
fn inverse_rms(squares: f32, cols: usize, eps: f32, #[comptime] units: usize) -> f32 {
    f32::new(1.0) / f32::sqrt(cube_sum(squares, units) / f32::cast_from(cols) + eps)
}

/// `out = x · inv · γ` over the unit's strided share of the row at `base`.
#[cube]
fn scale_row<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    out: &mut Tensor<F>,
    base: usize,
    unit: usize,
    inv: f32,
    #[comptime] units: usize,
) {
    let cols = gamma.len();
    let mut i = unit;
    while i < cols {
        out[base + i] = normed::<F>(x[base + i], inv, gamma[i]);
        i += units;
    }
}

/// The residual sum `x[at] + y[at]`, added in f32 and rounded to the dtype as a separate add
/// stores it.
#[cube]
pub(super) fn residual_sum<F: Float>(x: &Tensor<F>, y: &Tensor<F>, at: usize) -> F {
    F::cast_from(f32::cast_from(x[at]) + f32::cast_from(y[at]))
}

/// One normed element `v · inv · γ`, in f32 and rounded to the dtype.
#[cube]
pub(super) fn normed<F: Float>(v: F, inv: f32, gamma: F) -> F {
    F::cast_from(f32::cast_from(v) * inv * f32::cast_from(gamma))
}

/// `x · γ / √(mean(x²) + ε)` over the last dimension, accumulated in f32.
///
/// # Shapes
/// - `x`: `[..., cols]`, `gamma`: `[cols]` in `x`'s dtype; returns `x`'s shape
pub fn rms_norm(x: CubeTensor, gamma: CubeTensor, eps: f64) -> CubeTensor {
    let x = into_contiguous(x);
    let gamma = into_contiguous(gamma);
    let shape = x.meta.shape().clone();
    let cols = gamma.meta.shape().num_elements();
    let rows = shape.num_elements() / cols.max(1);
    let client = x.client.clone();
    let dtype: DType = x.dtype;
    let out = empty_device_contiguous_dtype(client.clone(), x.device.clone(), shape, dtype);
    if rows == 0 || cols == 0 {
        return out;
    }
    rms_norm_kernel::launch(
        &client,
        row_grid(&client, rows),
        CubeDim::new_1d(ROW_UNITS as u32),
        x.into_tensor_arg(),
        gamma.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        rows,
        eps as f32,
        ROW_UNITS,
        dtype_to_storage_type(dtype),
    );
    out
}

/// `(x + y, rms_norm(x + y))`: the residual add and the next norm in one launch.
///
/// # Shapes
/// - `x`, `y`: `[..., cols]`, `gamma`: `[cols]`, one dtype; returns two tensors of `x`'s shape
pub fn add_rms_norm(
    x: CubeTensor,
    y: CubeTensor,
    gamma: CubeTensor,
    eps: f64,
) -> (CubeTensor, CubeTensor) {
    let [x, y, gamma] = [x, y, gamma].map(into_contiguous);
    let shape = x.meta.shape().clone();
    let cols = gamma.meta.shape().num_elements();
    let rows = shape.num_elements() / cols.max(1);
    let client = x.client.clone();
    let dtype: DType = x.dtype;
    let new =
        || empty_device_contiguous_dtype(client.clone(), x.device.clone(), shape.clone(), dtype);
    let (sum, out) = (new(), new());
    if rows == 0 || cols == 0 {
        return (sum, out);
    }
    add_rms_norm_kernel::launch(
        &client,
        row_grid(&client, rows),
        CubeDim::new_1d(ROW_UNITS as u32),
        x.into_tensor_arg(),
        y.into_tensor_arg(),
        gamma.into_tensor_arg(),
        sum.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        rows,
        eps as f32,
        ROW_UNITS,
        dtype_to_storage_type(dtype),
    );
    (sum, out)
}
