//! RMSNorm in one launch: one cube per row; each unit sums the squares of a strided share of
//! the row in f32, a shared-memory tree adds the shares, and each unit writes its share
//! scaled by `γ / √(mean + ε)`. [`add_rms_norm`] adds the residual first, in the same pass.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, Shape};
use burn_cubecl::{
    CubeBackend, kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype,
    tensor::CubeTensor,
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

/// Rows one cube of [`rms_norm_backward`] walks; the γ gradients of its rows sum in registers.
const BACKWARD_ROWS: usize = 8;
/// Units of a [`rms_norm_backward`] cube: one plane (CUDA's warp), whose sums need no barrier.
const PLANE: usize = 32;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_backward_kernel<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    dy: &Tensor<F>,
    dx: &mut Tensor<F>,
    dgamma: &mut Tensor<f32>,
    rows: usize,
    eps: f32,
    #[comptime] share: usize,
    #[define(F)] _dtype: ElemType,
) {
    let block = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let first = block * BACKWARD_ROWS;
    if first >= rows {
        terminate!();
    }
    let cols = gamma.len();
    let unit = UNIT_POS_X as usize;
    let n = f32::cast_from(cols);
    let mut acc = Array::<f32>::new(share);
    #[unroll]
    for j in 0..share {
        acc[j] = f32::new(0.0);
    }
    let mut end = first + BACKWARD_ROWS;
    if end > rows {
        end = rows;
    }
    let mut row = first;
    while row < end {
        let base = row * cols;
        let mut squares = f32::new(0.0);
        let mut dot = f32::new(0.0);
        #[unroll]
        for j in 0..share {
            let c = unit + j * PLANE;
            if c < cols {
                let v = f32::cast_from(x[base + c]);
                squares += v * v;
                dot += f32::cast_from(dy[base + c]) * f32::cast_from(gamma[c]) * v;
            }
        }
        let inv = f32::new(1.0) / f32::sqrt(plane_sum(squares) / n + eps);
        // dx = inv · dy·γ − x · inv³ · Σ(dy·γ·x) / cols
        let k = inv * inv * inv * plane_sum(dot) / n;
        #[unroll]
        for j in 0..share {
            let c = unit + j * PLANE;
            if c < cols {
                let v = f32::cast_from(x[base + c]);
                let d = f32::cast_from(dy[base + c]);
                dx[base + c] = F::cast_from(inv * d * f32::cast_from(gamma[c]) - v * k);
                acc[j] += d * v * inv;
            }
        }
        row += 1;
    }
    #[unroll]
    for j in 0..share {
        let c = unit + j * PLANE;
        if c < cols {
            dgamma[block * cols + c] = acc[j];
        }
    }
}

/// The gradients of [`rms_norm`] from the output's gradient `dy`: `dx` in `x`'s dtype and `dγ`
/// in f32, accumulated in f32 (the row's `1 / √(mean + ε)` recomputed, not saved). One plane a
/// cube of `BACKWARD_ROWS` rows; the cubes' partial `dγ` are summed by Burn's reduce.
/// Planes of 32 units: CUDA only.
///
/// # Shapes
/// - `x`, `dy`: `[..., cols]`, `gamma`: `[cols]`, one dtype; returns `x`'s shape and `[cols]`
pub fn rms_norm_backward(
    x: CubeTensor,
    gamma: CubeTensor,
    dy: CubeTensor,
    eps: f64,
) -> (CubeTensor, CubeTensor) {
    let [x, gamma, dy] = [x, gamma, dy].map(into_contiguous);
    let shape = x.meta.shape().clone();
    let cols = gamma.meta.shape().num_elements();
    let rows = shape.num_elements() / cols.max(1);
    let client = x.client.clone();
    let dtype: DType = x.dtype;
    let dx = empty_device_contiguous_dtype(client.clone(), x.device.clone(), shape, dtype);
    let blocks = rows.div_ceil(BACKWARD_ROWS);
    if blocks == 0 || cols == 0 {
        let dgamma =
            CubeBackend::float_zeros(Shape::new([cols]), &x.device, burn::tensor::FloatDType::F32);
        return (dx, dgamma);
    }
    let partial = empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        Shape::new([blocks, cols]),
        DType::F32,
    );
    rms_norm_backward_kernel::launch(
        &client,
        row_grid(&client, blocks),
        CubeDim::new_1d(PLANE as u32),
        x.into_tensor_arg(),
        gamma.into_tensor_arg(),
        dy.into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        partial.clone().into_tensor_arg(),
        rows,
        eps as f32,
        cols.div_ceil(PLANE),
        dtype_to_storage_type(dtype),
    );
    let dgamma = CubeBackend::float_sum_dim(partial, 0);
    (dx, CubeBackend::float_reshape(dgamma, Shape::new([cols])))
}
