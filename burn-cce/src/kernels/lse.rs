//! Row-wise log-sum-exp: one cube per row, f32 online accumulation, shared-memory tree merge.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::Shape;
use burn_cubecl::{kernel::into_contiguous, ops::numeric::empty_device_dtype, tensor::CubeTensor};
use cubecl::prelude::*;

use super::reduce::{cube_merge_lse, merge};
use super::{row_grid, row_units};

#[cube(launch)]
fn logsumexp_rows_kernel<F: Float>(
    input: &Tensor<F>,
    output: &mut Tensor<F>,
    softcap: f32,
    #[comptime] has_softcap: bool,
    #[comptime] units: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let rows = input.shape(0);
    // The whole cube leaves together, so the barriers below stay uniform.
    if row >= rows {
        terminate!();
    }
    let cols = input.shape(1);
    let base = row * cols;
    let stride = CUBE_DIM_X as usize;

    let mut m = f32::new(0.0);
    let mut s = f32::new(0.0);
    let mut col = UNIT_POS_X as usize;
    while col < cols {
        let mut x = f32::cast_from(input[base + col]);
        if has_softcap {
            x = softcap * f32::tanh(x / softcap);
        }
        let (m2, s2) = merge(m, s, x, f32::new(1.0));
        m = m2;
        s = s2;
        col += stride;
    }

    let (m, s) = cube_merge_lse(m, s, units);
    let unit = UNIT_POS_X as usize;

    if unit == 0 {
        // Every row has at least one element, so s ≥ 1 here.
        let lse = m + f32::ln(s);
        output[row] = F::cast_from(lse);
    }
}

/// Launches the row-wise log-sum-exp.
///
/// # Shapes
/// - `input`: `[rows, cols]` of any float dtype, `cols ≥ 1`; returns `[rows]` of that dtype.
pub fn logsumexp_rows(input: CubeTensor, softcap: Option<f32>) -> CubeTensor {
    let input = into_contiguous(input);
    let dims = input.meta.shape().dims::<2>();
    let [rows, cols] = [dims[0], dims[1]];
    let client = input.client.clone();
    let dtype = input.dtype;
    let output = empty_device_dtype(
        client.clone(),
        input.device.clone(),
        Shape::new([rows]),
        dtype,
    );
    if rows == 0 {
        return output;
    }

    let units = row_units(&client, cols);
    logsumexp_rows_kernel::launch(
        &client,
        row_grid(&client, rows),
        CubeDim::new_1d(units),
        input.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        softcap.unwrap_or(1.0),
        softcap.is_some(),
        units as usize,
        dtype_to_storage_type(dtype),
    );
    output
}
