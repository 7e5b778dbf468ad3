//! `x · W` for a few rows (decode steps, speculative verification): a split-K GEMV with a light
//! launch. A cube owns 32 output columns of one row; its 16 unit rows each sum a sixteenth of
//! the inner dimension (adjacent units read adjacent columns of `W`, so the reads coalesce), and a
//! shared-memory pass adds the eight partial sums. Burn's matmul launch costs more host time
//! than the whole product at these sizes.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::Shape;
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::prelude::*;

/// Output columns per cube and inner-dimension splits per column.
const COLS: u32 = 32;
const SPLITS: u32 = 16;

#[cube(launch)]
fn gemv_kernel<F: Float>(
    x: &Tensor<F>,
    w: &Tensor<F>,
    out: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let k_dim = w.shape(0);
    let n_dim = w.shape(1);
    let col = (CUBE_POS_X * COLS) as usize + UNIT_POS_X as usize;
    let row = CUBE_POS_Y as usize;
    let split = UNIT_POS_Y as usize;
    let mut acc = f32::new(0.0);
    if col < n_dim {
        let per = k_dim.div_ceil(SPLITS as usize);
        let start = split * per;
        let mut end = start + per;
        if end > k_dim {
            end = k_dim;
        }
        for k in start..end {
            acc += f32::cast_from(x[row * k_dim + k]) * f32::cast_from(w[k * n_dim + col]);
        }
    }
    let mut partial = Shared::<[f32]>::new_slice((COLS * SPLITS) as usize);
    partial[(UNIT_POS_Y * COLS + UNIT_POS_X) as usize] = acc;
    sync_cube();
    if split == 0 && col < n_dim {
        let mut sum = f32::new(0.0);
        #[unroll]
        for s in 0..SPLITS {
            sum += partial[(s * COLS + UNIT_POS_X) as usize];
        }
        out[row * n_dim + col] = F::cast_from(sum);
    }
}

/// `x · w` accumulated in f32.
///
/// # Shapes
/// - `x`: `[rows, k]`, `w`: `[k, n]` in `x`'s dtype; returns `[rows, n]`
pub fn gemv(x: CubeTensor, w: CubeTensor) -> CubeTensor {
    let x = into_contiguous(x);
    let w = into_contiguous(w);
    let [rows, _] = x.meta.shape().dims::<2>();
    let [_, n] = w.meta.shape().dims::<2>();
    let client = x.client.clone();
    let dtype = x.dtype;
    let out = empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        Shape::new([rows, n]),
        dtype,
    );
    if rows == 0 || n == 0 {
        return out;
    }
    gemv_kernel::launch(
        &client,
        CubeCount::Static((n as u32).div_ceil(COLS), rows as u32, 1),
        CubeDim::new_2d(COLS, SPLITS),
        x.into_tensor_arg(),
        w.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        dtype_to_storage_type(dtype),
    );
    out
}
