//! Target logits `softcap(eᵢ · c[tᵢ] + b[tᵢ])`: one cube per token, f32 accumulation over `D`.
//! Reads one classifier row per token and never forms a logit matrix.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use burn_kernels_core::kernels::reduce::cube_sum;
use cubecl::prelude::*;

use super::{row_grid, row_units};

#[cube(launch)]
fn indexed_dot_kernel<F: Float, I: Numeric>(
    e: &Tensor<F>,
    c: &Tensor<F>,
    bias: &Tensor<F>,
    targets: &Tensor<I>,
    out: &mut Tensor<f32>,
    softcap: f32,
    #[comptime] has_bias: bool,
    #[comptime] has_softcap: bool,
    #[comptime] units: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    // The whole cube leaves together, so the barriers in the reduction stay uniform.
    if row >= e.shape(0) {
        terminate!();
    }
    let d = e.shape(1);
    let target = usize::cast_from(targets[row]);
    let unit = UNIT_POS_X as usize;

    let mut acc = f32::new(0.0);
    let mut k = unit;
    while k < d {
        acc += f32::cast_from(e[row * d + k]) * f32::cast_from(c[target * d + k]);
        k += units;
    }
    let dot = cube_sum(acc, units);

    if unit == 0 {
        let mut x = dot;
        if has_bias {
            x += f32::cast_from(bias[target]);
        }
        if has_softcap {
            x = softcap * f32::tanh(x / softcap);
        }
        out[row] = x;
    }
}

/// Launches the indexed dot product.
///
/// # Shapes
/// - `e`: `[n, D]`, `c`: `[V, D]` (same float dtype), `bias`: `[V]`, `targets`: `[n]` with
///   values in `[0, V)` (checked by the caller)
/// - returns `[n]` f32
pub fn indexed_dot(
    e: CubeTensor,
    c: CubeTensor,
    bias: Option<CubeTensor>,
    targets: CubeTensor,
    softcap: Option<f32>,
) -> CubeTensor {
    let e = into_contiguous(e);
    let c = into_contiguous(c);
    let targets = into_contiguous(targets);
    let [n, d] = e.meta.shape().dims::<2>();
    let client = e.client.clone();
    let out = empty_device_contiguous_dtype(
        client.clone(),
        e.device.clone(),
        Shape::new([n]),
        DType::F32,
    );
    if n == 0 {
        return out;
    }
    let has_bias = bias.is_some();
    // Without a bias the kernel still needs a tensor argument of the right type.
    let bias = bias.map(into_contiguous).unwrap_or_else(|| e.clone());
    let units = row_units(&client, d);
    let dtypes = [
        dtype_to_storage_type(e.dtype),
        dtype_to_storage_type(targets.dtype),
    ];

    indexed_dot_kernel::launch(
        &client,
        row_grid(&client, n),
        CubeDim::new_1d(units),
        e.into_tensor_arg(),
        c.into_tensor_arg(),
        bias.into_tensor_arg(),
        targets.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        softcap.unwrap_or(1.0),
        has_bias,
        softcap.is_some(),
        units as usize,
        dtypes,
    );
    out
}
