//! Asymmetric min/scale quantization of column groups: one unit per `(row, group)` finds the
//! group's min and max, then writes its codes into its own packed words (no two units share a
//! word, so no atomics).

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::{calculate_cube_count_elemwise, prelude::*};

use super::UNITS;
use crate::QuantLayout;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn quantize_kernel<F: Float>(
    x: &Tensor<F>,
    words: &mut Tensor<u32>,
    scale: &mut Tensor<F>,
    min: &mut Tensor<F>,
    group: usize,
    groups: usize,
    words_per_group: usize,
    bits: u32,
    #[define(F)] _dtype: ElemType,
) {
    let gid = ABSOLUTE_POS;
    if gid >= scale.len() {
        terminate!();
    }
    let cols = x.shape(1);
    let row = gid / groups;
    let g = gid % groups;
    let start = g * group;
    let mut len = cols - start;
    if group < len {
        len = group;
    }
    let base = row * cols + start;

    let mut lo = f32::cast_from(x[base]);
    let mut hi = lo;
    for i in 1..len {
        let v = f32::cast_from(x[base + i]);
        lo = f32::min(lo, v);
        hi = f32::max(hi, v);
    }
    let levels = f32::cast_from((1u32 << bits) - 1);
    // Codes come from the stored (dtype-rounded) scale and min, which dequantization uses.
    let s = f32::cast_from(F::cast_from((hi - lo) / levels));
    let m = f32::cast_from(F::cast_from(lo));
    let mut inv = f32::new(0.0);
    if s > 0.0 {
        inv = 1.0 / s;
    }
    let per_word = (32 / bits) as usize;
    for w in 0..words_per_group {
        let mut word = 0u32;
        for j in 0..per_word {
            let i = w * per_word + j;
            if i < len {
                let q = f32::clamp(
                    f32::round((f32::cast_from(x[base + i]) - m) * inv),
                    0.0,
                    levels,
                );
                word |= u32::cast_from(q) << (j as u32 * bits);
            }
        }
        words[gid * words_per_group + w] = word;
    }
    scale[gid] = F::cast_from(s);
    min[gid] = F::cast_from(m);
}

/// Launches the quantization.
///
/// # Shapes
/// - `x`: `[rows, layout.cols]` of any float dtype
/// - returns `(words [rows, groups · words_per_group] u32, scale [rows, groups], min [rows,
///   groups])`, scale and min in the dtype of `x`
pub fn quantize(x: CubeTensor, layout: QuantLayout) -> (CubeTensor, CubeTensor, CubeTensor) {
    let x = into_contiguous(x);
    let [rows, cols] = x.meta.shape().dims::<2>();
    let client = x.client.clone();
    let dtype = x.dtype;
    let ng = layout.groups();
    let wpg = layout.words_per_group();
    let (words_shape, stats_shape) = layout.packed_shapes(rows);
    let alloc = |shape: Shape, dtype: DType| {
        empty_device_contiguous_dtype(client.clone(), x.device.clone(), shape, dtype)
    };
    let words = alloc(words_shape, DType::U32);
    let scale = alloc(stats_shape.clone(), dtype);
    let min = alloc(stats_shape, dtype);
    if rows == 0 || cols == 0 {
        return (words, scale, min);
    }
    let cube_dim = CubeDim::new_1d(UNITS);
    let cube_count = calculate_cube_count_elemwise(&client, rows * ng, cube_dim);
    quantize_kernel::launch(
        &client,
        cube_count,
        cube_dim,
        x.into_tensor_arg(),
        words.clone().into_tensor_arg(),
        scale.clone().into_tensor_arg(),
        min.clone().into_tensor_arg(),
        layout.group_len(),
        ng,
        wpg,
        layout.bits,
        dtype_to_storage_type(dtype),
    );
    (words, scale, min)
}
