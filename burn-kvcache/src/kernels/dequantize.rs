//! Unpacking and dequantization, `min + code·scale`: one unit per output element.

use burn::backend::cubecl::dtype_to_storage_type;
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::{calculate_cube_count_elemwise, prelude::*};

use super::UNITS;
use crate::QuantLayout;
use crate::shapes::dequantized_shape;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn dequantize_kernel<F: Float>(
    words: &Tensor<u32>,
    scale: &Tensor<F>,
    min: &Tensor<F>,
    out: &mut Tensor<F>,
    group: usize,
    groups: usize,
    words_per_group: usize,
    bits: u32,
    #[define(F)] _dtype: ElemType,
) {
    let idx = ABSOLUTE_POS;
    if idx >= out.len() {
        terminate!();
    }
    let cols = out.shape(1);
    let row = idx / cols;
    let col = idx % cols;
    let g = col / group;
    let i = col % group;
    let gid = row * groups + g;
    out[idx] = F::cast_from(code_value::<F>(
        words,
        gid * words_per_group,
        i,
        bits,
        min[gid],
        scale[gid],
    ));
}

/// `min + code·scale` for code `i` of the group whose words start at `base` (codes packed
/// `32/bits` to a word, little end first); shared with the quantized attention kernel.
#[cube]
pub(crate) fn code_value<F: Float>(
    words: &Tensor<u32>,
    base: usize,
    i: usize,
    bits: u32,
    min: F,
    scale: F,
) -> f32 {
    let per_word = (32 / bits) as usize;
    let word = words[base + i / per_word];
    let code = (word >> ((i % per_word) as u32 * bits)) & ((1u32 << bits) - 1);
    f32::cast_from(min) + f32::cast_from(code) * f32::cast_from(scale)
}

/// Launches the dequantization.
///
/// # Shapes
/// - `words`: `[rows, groups · words_per_group]` u32, `scale`, `min`: `[rows, groups]`
/// - returns `[rows, layout.cols]` in the dtype of `scale`
pub fn dequantize(
    words: CubeTensor,
    scale: CubeTensor,
    min: CubeTensor,
    layout: QuantLayout,
) -> CubeTensor {
    let scale = into_contiguous(scale);
    let shape = dequantized_shape(scale.meta.shape(), &layout);
    let (rows, cols) = (shape[0], shape[1]);
    let client = scale.client.clone();
    let dtype = scale.dtype;
    let out = empty_device_contiguous_dtype(client.clone(), scale.device.clone(), shape, dtype);
    if rows * cols == 0 {
        return out;
    }
    let cube_dim = CubeDim::new_1d(UNITS);
    let cube_count = calculate_cube_count_elemwise(&client, rows * cols, cube_dim);
    dequantize_kernel::launch(
        &client,
        cube_count,
        cube_dim,
        into_contiguous(words).into_tensor_arg(),
        scale.into_tensor_arg(),
        into_contiguous(min).into_tensor_arg(),
        out.clone().into_tensor_arg(),
        layout.group_len(),
        layout.groups(),
        layout.words_per_group(),
        layout.bits,
        dtype_to_storage_type(dtype),
    );
    out
}
