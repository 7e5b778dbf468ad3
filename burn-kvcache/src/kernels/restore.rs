//! MiniCache restore of one layer: `mag_i · dir_ij`, or the retained row where the slot map
//! points at one. One unit per output element.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::Shape;
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::{calculate_cube_count_elemwise, prelude::*};

use super::UNITS;

#[cube(launch)]
fn restore_kernel<F: Float, I: Int>(
    dir: &Tensor<F>,
    mag: &Tensor<F>,
    slot: &Tensor<I>,
    retained: &Tensor<F>,
    out: &mut Tensor<F>,
    #[comptime] has_retained: bool,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let idx = ABSOLUTE_POS;
    if idx >= out.len() {
        terminate!();
    }
    let d = dir.shape(1);
    let row = idx / d;
    let col = idx % d;
    let mut x = f32::cast_from(mag[row]) * f32::cast_from(dir[idx]);
    if has_retained {
        // Slots are 0 (merged) or r + 1 (retained row r), never negative.
        let s = usize::cast_from(slot[row]);
        if s > 0 {
            x = f32::cast_from(retained[(s - 1) * d + col]);
        }
    }
    out[idx] = F::cast_from(x);
}

/// Launches the restore.
///
/// # Shapes
/// - `dir`: `[n, d]`, `mag`: `[n]` (same float dtype); `retained`: `(slot [n] int, rows [r, d])`
///   with slots in `[0, r]`
/// - returns `[n, d]` in the dtype of `dir`
pub fn restore(
    dir: CubeTensor,
    mag: CubeTensor,
    retained: Option<(CubeTensor, CubeTensor)>,
) -> CubeTensor {
    let dir = into_contiguous(dir);
    let [n, d] = dir.meta.shape().dims::<2>();
    let client = dir.client.clone();
    let dtype = dir.dtype;
    let out = empty_device_contiguous_dtype(
        client.clone(),
        dir.device.clone(),
        Shape::new([n, d]),
        dtype,
    );
    if n * d == 0 {
        return out;
    }
    let mag = into_contiguous(mag);
    let retained = retained.filter(|(_, rows)| rows.meta.shape().num_elements() > 0);
    let has_retained = retained.is_some();
    // Without retained rows the kernel still needs arguments of the right types; separate
    // tensors, since binding the written output twice is not allowed on every runtime.
    let (slot, rows) = match retained {
        Some((slot, rows)) => (into_contiguous(slot), into_contiguous(rows)),
        None => {
            let slot = empty_device_contiguous_dtype(
                client.clone(),
                dir.device.clone(),
                Shape::new([1]),
                burn::tensor::DType::I32,
            );
            (slot, mag.clone())
        }
    };
    let dtypes = [
        dtype_to_storage_type(dtype),
        dtype_to_storage_type(slot.dtype),
    ];
    let cube_dim = CubeDim::new_1d(UNITS);
    let cube_count = calculate_cube_count_elemwise(&client, n * d, cube_dim);
    restore_kernel::launch(
        &client,
        cube_count,
        cube_dim,
        dir.into_tensor_arg(),
        mag.into_tensor_arg(),
        slot.into_tensor_arg(),
        rows.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        has_retained,
        dtypes,
    );
    out
}
