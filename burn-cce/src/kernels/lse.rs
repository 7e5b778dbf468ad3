//! Row-wise log-sum-exp: one cube per row, f32 online accumulation, shared-memory tree merge.

use burn::tensor::Shape;
use burn_cubecl::{
    CubeRuntime, kernel::into_contiguous, ops::numeric::empty_device_dtype, tensor::CubeTensor,
};
use cubecl::prelude::*;

/// Merges two partial `(max, Σ exp(x − max))` pairs; `s = 0` marks an empty partial.
///
/// No infinity literal appears: CUDA's NVRTC has no `inf` identifier. Infinite inputs still
/// work: `-inf` entries add `exp(-inf) = 0`, and a row max of `±inf` gives `±inf + ln(s)`.
#[cube]
fn merge(m1: f32, s1: f32, m2: f32, s2: f32) -> (f32, f32) {
    let mut m = m1;
    let mut s = s1 + s2;
    if s1 == 0.0 {
        m = m2;
        s = s2;
    } else if s2 == 0.0 {
        s = s1;
    } else if m2 > m1 {
        m = m2;
        s = s1 * f32::exp(m1 - m2) + s2;
    } else if m1 > m2 {
        s = s1 + s2 * f32::exp(m2 - m1);
    } else if m1 != m2 {
        // One side is NaN: propagate it.
        m = m1 + m2;
    }
    (m, s)
}

#[cube(launch)]
fn logsumexp_rows_kernel<F: Float>(
    input: &Tensor<F>,
    output: &mut Tensor<F>,
    softcap: f32,
    #[comptime] has_softcap: bool,
    #[comptime] units: usize,
    #[define(F)] _dtype: StorageType,
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

    let mut shared_m = SharedMemory::<f32>::new(units);
    let mut shared_s = SharedMemory::<f32>::new(units);
    let unit = UNIT_POS_X as usize;
    shared_m[unit] = m;
    shared_s[unit] = s;
    sync_cube();

    let mut half = stride / 2;
    while half > 0 {
        if unit < half {
            let (m2, s2) = merge(
                shared_m[unit],
                shared_s[unit],
                shared_m[unit + half],
                shared_s[unit + half],
            );
            shared_m[unit] = m2;
            shared_s[unit] = s2;
        }
        sync_cube();
        half /= 2;
    }

    if unit == 0 {
        // Every row has at least one element, so s ≥ 1 here.
        let lse = shared_m[0] + f32::ln(shared_s[0]);
        output[row] = F::cast_from(lse);
    }
}

/// Launches the row-wise log-sum-exp.
///
/// # Shapes
/// - `input`: `[rows, cols]` of any float dtype, `cols ≥ 1`; returns `[rows]` of that dtype.
pub fn logsumexp_rows<R: CubeRuntime>(input: CubeTensor<R>, softcap: Option<f32>) -> CubeTensor<R> {
    let input = into_contiguous(input);
    let dims = input.meta.shape().dims::<2>();
    let [rows, cols] = [dims[0], dims[1]];
    let client = input.client.clone();
    let dtype = input.dtype;
    let output = empty_device_dtype::<R>(
        client.clone(),
        input.device.clone(),
        Shape::new([rows]),
        dtype,
    );
    if rows == 0 {
        return output;
    }

    // A power of two so the tree merge halves evenly; small rows get a small cube.
    let max_units = client.properties().hardware.max_cube_dim.0.min(256);
    let units = (cols as u32)
        .next_power_of_two()
        .clamp(32, max_units.max(32));
    let max_x = client.properties().hardware.max_cube_count.0.min(65_535) as usize;
    let cubes_x = rows.min(max_x);
    let cubes_y = rows.div_ceil(cubes_x);

    logsumexp_rows_kernel::launch::<R>(
        &client,
        CubeCount::Static(cubes_x as u32, cubes_y as u32, 1),
        CubeDim::new_1d(units),
        input.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        softcap.unwrap_or(1.0),
        softcap.is_some(),
        units as usize,
        dtype.into(),
    );
    output
}
