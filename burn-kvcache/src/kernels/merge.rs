//! MiniCache merge of row pairs: one unit per row, three passes over its `d` columns (norms
//! and angle, then the SLERP weights' output, then its renormalized write).

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::{calculate_cube_count_elemwise, prelude::*};

use super::UNITS;
use crate::reference::{NORM_EPS, SIN_EPS};
use crate::shapes::merged_shapes;
use std::f32::consts::FRAC_1_PI;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn merge_kernel<F: Float>(
    a: &Tensor<F>,
    b: &Tensor<F>,
    dir: &mut Tensor<F>,
    mag_a: &mut Tensor<F>,
    mag_b: &mut Tensor<F>,
    dist: &mut Tensor<f32>,
    t: f32,
    gamma: f32,
    #[define(F)] _dtype: ElemType,
) {
    let row = ABSOLUTE_POS;
    if row >= mag_a.len() {
        terminate!();
    }
    let d = a.shape(1);
    let base = row * d;

    let mut sa = f32::new(0.0);
    let mut sb = f32::new(0.0);
    for k in 0..d {
        let x = f32::cast_from(a[base + k]);
        let y = f32::cast_from(b[base + k]);
        sa += x * x;
        sb += y * y;
    }
    let na = f32::sqrt(sa);
    let nb = f32::sqrt(sb);
    let ia = 1.0 / f32::max(na, NORM_EPS);
    let ib = 1.0 / f32::max(nb, NORM_EPS);

    let mut sdiff = f32::new(0.0);
    let mut ssum = f32::new(0.0);
    for k in 0..d {
        let u = f32::cast_from(a[base + k]) * ia;
        let w = f32::cast_from(b[base + k]) * ib;
        sdiff += (u - w) * (u - w);
        ssum += (u + w) * (u + w);
    }
    // 2·atan2(|u − w|, |u + w|): accurate near 0 and π, unlike acos(u·w).
    let theta = 2.0 * f32::atan2(f32::sqrt(sdiff), f32::sqrt(ssum));
    let dn = theta * FRAC_1_PI;
    let s = f32::sin(theta);
    let mut ca = 1.0 - t;
    let mut cb = t;
    if s >= SIN_EPS {
        ca = f32::sin((1.0 - t) * theta) / s;
        cb = f32::sin(t * theta) / s;
    }
    let retain = dn > gamma;
    if retain {
        ca = 1.0;
        cb = 0.0;
    }

    let mut sm = f32::new(0.0);
    for k in 0..d {
        let m = ca * f32::cast_from(a[base + k]) * ia + cb * f32::cast_from(b[base + k]) * ib;
        sm += m * m;
    }
    let im = 1.0 / f32::max(f32::sqrt(sm), NORM_EPS);
    for k in 0..d {
        let m = ca * f32::cast_from(a[base + k]) * ia + cb * f32::cast_from(b[base + k]) * ib;
        dir[base + k] = F::cast_from(m * im);
    }
    mag_a[row] = F::cast_from(na);
    mag_b[row] = F::cast_from(nb);
    dist[row] = dn;
}

/// The merge outputs: `(dir [n, d], mag_a [n], mag_b [n], dist [n] f32)`.
pub type MergeOutput = (CubeTensor, CubeTensor, CubeTensor, CubeTensor);

/// Launches the merge.
///
/// # Shapes
/// - `a`, `b`: `[n, d]`, one float dtype
/// - returns `(dir [n, d], mag_a [n], mag_b [n])` in that dtype and `dist [n]` f32
pub fn merge(a: CubeTensor, b: CubeTensor, t: f32, gamma: f32) -> MergeOutput {
    let a = into_contiguous(a);
    let b = into_contiguous(b);
    let n = a.meta.shape()[0];
    let client = a.client.clone();
    let dtype = a.dtype;
    let alloc = |shape: Shape, dtype: DType| {
        empty_device_contiguous_dtype(client.clone(), a.device.clone(), shape, dtype)
    };
    let (dir_shape, rows_shape) = merged_shapes(a.meta.shape());
    let dir = alloc(dir_shape, dtype);
    let mag_a = alloc(rows_shape.clone(), dtype);
    let mag_b = alloc(rows_shape.clone(), dtype);
    let dist = alloc(rows_shape, DType::F32);
    if n == 0 {
        return (dir, mag_a, mag_b, dist);
    }
    let cube_dim = CubeDim::new_1d(UNITS);
    let cube_count = calculate_cube_count_elemwise(&client, n, cube_dim);
    merge_kernel::launch(
        &client,
        cube_count,
        cube_dim,
        a.into_tensor_arg(),
        b.into_tensor_arg(),
        dir.clone().into_tensor_arg(),
        mag_a.clone().into_tensor_arg(),
        mag_b.clone().into_tensor_arg(),
        dist.clone().into_tensor_arg(),
        t,
        gamma,
        dtype_to_storage_type(dtype),
    );
    (dir, mag_a, mag_b, dist)
}
