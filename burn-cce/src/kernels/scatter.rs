//! Adds the rows of a chunk's gradient into the full gradient at the chunk's vocabulary ids, in
//! place: `out[ids[i], :] = round(out[ids[i], :] + src[i, :])`, the sum taken in f32. The
//! backward writes dC (and db) of gathered chunks with it.
//!
//! Burn's `select_assign` with `Add` does the same, but on CUDA it casts the whole half-precision
//! target to f32 and back around an atomic scatter (Burn 0.23: 7 GB of traffic per chunk for
//! Gemma-2's `[256000, 2304]` bf16 dC, and an f32 copy of it beside dC). The ids of one chunk are
//! distinct (the plan lists every kept entry once), so no atomics are needed: one unit per value.

use burn::backend::cubecl::dtype_to_storage_type;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

#[cube(launch)]
fn add_rows_at_kernel<F: Float, G: Float, I: Numeric>(
    out: &mut Tensor<F>,
    src: &Tensor<G>,
    ids: &Tensor<I>,
    #[define(F, G, I)] _dtypes: [ElemType; 3],
) {
    let idx = ABSOLUTE_POS;
    let cols = src.shape(1);
    if idx >= src.shape(0) * cols {
        terminate!();
    }
    let row = idx / cols;
    let col = idx % cols;
    let target = usize::cast_from(ids[row * ids.stride(0)]);
    // Strided on every side: a 2-D allocation may be pitched (row-padded) on CUDA.
    let o = target * out.stride(0) + col * out.stride(1);
    let s = row * src.stride(0) + col * src.stride(1);
    out[o] = F::cast_from(f32::cast_from(out[o]) + f32::cast_from(src[s]));
}

/// `out[ids[i]] += src[i]` for every row `i`, the sum taken in f32 and rounded once to `out`'s
/// dtype; `out` is written in place.
///
/// # Shapes
/// - `out`: `[V, d]` (f32, f16 or bf16); `src`: `[rows, d]` (any float dtype); `ids`: `[rows]`
///   integers in `[0, V)`, **distinct** (a repeated id would race). Vectors go in as one-column
///   matrices (a reshape).
///
/// # Panics
/// If the shapes disagree. The ids are not checked on the device: the backward's plan lists
/// entries of `0..V`, each once.
pub fn add_rows_at(out: &CubeTensor, src: CubeTensor, ids: CubeTensor) {
    let [rows, d] = src.meta.shape().dims::<2>();
    let [_, out_d] = out.meta.shape().dims::<2>();
    let id_count = ids.meta.shape()[0];
    assert!(
        out_d == d && id_count == rows,
        "add_rows_at: [{rows}, {d}] at {id_count} ids into a matrix of {out_d} columns"
    );
    if rows == 0 || d == 0 {
        return;
    }
    let client = out.client.clone();
    let (cube_count, cube_dim) = super::elementwise_grid(&client, rows * d);
    let dtypes = [
        dtype_to_storage_type(out.dtype),
        dtype_to_storage_type(src.dtype),
        dtype_to_storage_type(ids.dtype),
    ];
    add_rows_at_kernel::launch(
        &client,
        cube_count,
        cube_dim,
        out.clone().into_tensor_arg(),
        src.into_tensor_arg(),
        ids.into_tensor_arg(),
        dtypes,
    );
}
