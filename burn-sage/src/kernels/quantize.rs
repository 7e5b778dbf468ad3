//! Smoothing + group quantization: one cube per `(batch·head, group)` finds the group's
//! `max|x − mean|`, then writes `round(x − mean) / scale` clamped to `±qmax` as integers.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::DType;
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use burn_kernels_core::kernels::reduce::cube_max;
use cubecl::prelude::*;

use super::common::{F32_MIN_POSITIVE, grid, round_away};
use super::scales_shape;
use crate::GroupLayout;

const UNITS: usize = 128;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn quantize_kernel<F: Float, I: Int>(
    x: &Tensor<F>,
    mean: &Tensor<f32>,
    out: &mut Tensor<I>,
    scales: &mut Tensor<f32>,
    rows: usize,
    dim: usize,
    mean_blocks: usize,
    mean_block: usize,
    block: usize,
    interleave: usize,
    groups: usize,
    qmax: f32,
    #[comptime] units: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if cube >= scales.len() {
        terminate!();
    }
    let bh = cube / groups;
    let grp = cube % groups;
    let first = (grp / interleave) * block + grp % interleave;
    let n = (block / interleave) * dim;
    let unit = UNIT_POS_X as usize;

    let mut amax = f32::new(0.0);
    let mut e = unit;
    while e < n {
        let r = first + (e / dim) * interleave;
        if r < rows {
            let c = e % dim;
            let val = f32::cast_from(x[(bh * rows + r) * dim + c])
                - mean[(bh * mean_blocks + r / mean_block) * dim + c];
            amax = f32::max(amax, f32::abs(val));
        }
        e += units;
    }
    let scale = f32::max(cube_max(amax, units) / qmax, f32::new(F32_MIN_POSITIVE));
    if unit == 0 {
        scales[cube] = scale;
    }
    let mut e = unit;
    while e < n {
        let r = first + (e / dim) * interleave;
        if r < rows {
            let c = e % dim;
            let idx = (bh * rows + r) * dim + c;
            let val = f32::cast_from(x[idx]) - mean[(bh * mean_blocks + r / mean_block) * dim + c];
            let v = f32::clamp(round_away(val / scale), -qmax, qmax);
            out[idx] = I::cast_from(v);
        }
        e += units;
    }
}

/// Quantizes `x − mean` per group into integers of `int_dtype` (i8, or i32 where the runtime
/// has no 8-bit buffers).
///
/// # Shapes
/// - `x`: `[b, h, s, d]` float; `mean`: `[b, h, nm, d]` f32, rows `[m·mean_block, (m+1)·mean_block)`
///   use mean row `m`
/// - returns `(ints [b, h, s, d], scales [b, h, layout.groups(s)] f32)`
pub fn quantize(
    x: CubeTensor,
    mean: CubeTensor,
    mean_block: usize,
    layout: GroupLayout,
    qmax: f32,
    int_dtype: DType,
) -> (CubeTensor, CubeTensor) {
    let x = into_contiguous(x);
    let mean = into_contiguous(mean);
    let [b, h, s, d] = x.meta.shape().dims::<4>();
    let nm = mean.meta.shape().dims::<4>()[2];
    let client = x.client.clone();
    let groups = layout.groups(s);
    let out = empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        x.meta.shape().clone(),
        int_dtype,
    );
    let scales = empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        scales_shape(x.meta.shape(), &layout),
        DType::F32,
    );
    let dtypes = [
        dtype_to_storage_type(x.dtype),
        dtype_to_storage_type(int_dtype),
    ];
    quantize_kernel::launch(
        &client,
        grid(&client, b * h * groups),
        CubeDim::new_1d(UNITS as u32),
        x.into_tensor_arg(),
        mean.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        scales.clone().into_tensor_arg(),
        s,
        d,
        nm,
        mean_block,
        layout.block,
        layout.interleave,
        groups,
        qmax,
        UNITS,
        dtypes,
    );
    (out, scales)
}
