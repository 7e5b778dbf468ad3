//! The SwiGLU gate, `silu(g) · u = g · σ(g) · u`, in one element-wise launch (f32 inside).

use burn::backend::cubecl::dtype_to_storage_type;
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::{calculate_cube_count_elemwise, prelude::*};

use super::UNITS;

#[cube(launch)]
fn silu_mul_kernel<F: Float>(
    gate: &Tensor<F>,
    up: &Tensor<F>,
    out: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let g = f32::cast_from(gate[i]);
    let sig = f32::new(1.0) / (f32::new(1.0) + f32::exp(-g));
    out[i] = F::cast_from(g * sig * f32::cast_from(up[i]));
}

/// # Shapes
/// - `gate`, `up`: the same shape and dtype; returns it
pub fn silu_mul(gate: CubeTensor, up: CubeTensor) -> CubeTensor {
    let gate = into_contiguous(gate);
    let up = into_contiguous(up);
    let shape = gate.meta.shape().clone();
    let n = shape.num_elements();
    let client = gate.client.clone();
    let dtype = gate.dtype;
    let out = empty_device_contiguous_dtype(client.clone(), gate.device.clone(), shape, dtype);
    if n == 0 {
        return out;
    }
    let cube_dim = CubeDim::new_1d(UNITS);
    silu_mul_kernel::launch(
        &client,
        calculate_cube_count_elemwise(&client, n, cube_dim),
        cube_dim,
        gate.into_tensor_arg(),
        up.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        dtype_to_storage_type(dtype),
    );
    out
}

#[cube(launch)]
fn silu_mul_backward_kernel<F: Float>(
    gate: &Tensor<F>,
    up: &Tensor<F>,
    dout: &Tensor<F>,
    dgate: &mut Tensor<F>,
    dup: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= dgate.len() {
        terminate!();
    }
    let g = f32::cast_from(gate[i]);
    let u = f32::cast_from(up[i]);
    let d = f32::cast_from(dout[i]);
    let sig = f32::new(1.0) / (f32::new(1.0) + f32::exp(-g));
    dup[i] = F::cast_from(d * g * sig);
    dgate[i] = F::cast_from(d * u * sig * (f32::new(1.0) + g * (f32::new(1.0) - sig)));
}

/// The gradients of [`silu_mul`] from the output's gradient `dout`, in one element-wise launch
/// (f32 inside): `d_up = dout · silu(g)`, `d_gate = dout · u · σ(g) · (1 + g · (1 − σ(g)))`.
///
/// # Shapes
/// - `gate`, `up`, `dout`: the same shape and dtype; returns `(d_gate, d_up)` of it
pub fn silu_mul_backward(
    gate: CubeTensor,
    up: CubeTensor,
    dout: CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let [gate, up, dout] = [gate, up, dout].map(into_contiguous);
    let shape = gate.meta.shape().clone();
    let n = shape.num_elements();
    let client = gate.client.clone();
    let dtype = gate.dtype;
    let new =
        || empty_device_contiguous_dtype(client.clone(), gate.device.clone(), shape.clone(), dtype);
    let (dgate, dup) = (new(), new());
    if n == 0 {
        return (dgate, dup);
    }
    let cube_dim = CubeDim::new_1d(UNITS);
    silu_mul_backward_kernel::launch(
        &client,
        calculate_cube_count_elemwise(&client, n, cube_dim),
        cube_dim,
        gate.into_tensor_arg(),
        up.into_tensor_arg(),
        dout.into_tensor_arg(),
        dgate.clone().into_tensor_arg(),
        dup.clone().into_tensor_arg(),
        dtype_to_storage_type(dtype),
    );
    (dgate, dup)
}
