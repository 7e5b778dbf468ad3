//! Adds an f32 block of rows into a matrix in place, rounding once to the matrix's dtype:
//! `out[row0 + i, :] = round(out[row0 + i, :] + src[i, :])`. The backward accumulates dE with
//! it, so that no `N × D` temporary is allocated beside dE.

use burn::backend::cubecl::dtype_to_storage_type;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

#[cube(launch)]
fn add_rows_kernel<F: Float>(
    out: &mut Tensor<F>,
    src: &Tensor<f32>,
    row0: usize,
    #[define(F)] _dtype: ElemType,
) {
    let idx = ABSOLUTE_POS;
    let cols = src.shape(1);
    if idx >= src.shape(0) * cols {
        terminate!();
    }
    let row = idx / cols;
    let col = idx % cols;
    // Strided on both sides: a 2-D allocation may be pitched (row-padded) on CUDA.
    let o = (row0 + row) * out.stride(0) + col * out.stride(1);
    let s = row * src.stride(0) + col * src.stride(1);
    out[o] = F::cast_from(f32::cast_from(out[o]) + src[s]);
}

/// `out[row0 .. row0 + rows] += src`, the sum taken in f32 and rounded once to `out`'s dtype.
///
/// # Shapes
/// - `out`: `[n, d]` (f32, f16 or bf16), written in place; `src`: `[rows, d]` f32,
///   `row0 + rows ≤ n`
pub fn add_rows(out: &CubeTensor, src: CubeTensor, row0: usize) {
    let [n, d] = out.meta.shape().dims::<2>();
    let [rows, src_d] = src.meta.shape().dims::<2>();
    assert!(
        src_d == d && row0 + rows <= n,
        "add_rows: [{rows}, {src_d}] at row {row0} into [{n}, {d}]"
    );
    if rows == 0 || d == 0 {
        return;
    }
    let client = out.client.clone();
    let (cube_count, cube_dim) = super::elementwise_grid(&client, rows * d);
    let dtype = dtype_to_storage_type(out.dtype);
    add_rows_kernel::launch(
        &client,
        cube_count,
        cube_dim,
        out.clone().into_tensor_arg(),
        src.into_tensor_arg(),
        row0,
        dtype,
    );
}
