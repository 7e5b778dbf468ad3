//! Gradient-filter scores: for each vocabulary entry of a chunk, the largest
//! `|softmax − onehot|` over a slice of tokens. An entry whose score stays below `filter_eps`
//! for every token contributes nothing representable to dE or dC and is skipped.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::prelude::*;

/// Tokens scanned by one cube; the partial maxima of the slices are reduced by the caller.
const ROWS_PER_SLICE: usize = 128;
const UNITS: u32 = 256;

// `div_ceil` is not available inside kernels.
#[allow(clippy::manual_div_ceil)]
#[cube(launch)]
fn score_kernel<F: Float, I: Numeric>(
    logits: &Tensor<f32>,
    bias: &Tensor<F>,
    lse: &Tensor<f32>,
    targets: &Tensor<I>,
    partial: &mut Tensor<f32>,
    v0: usize,
    softcap: f32,
    #[comptime] has_bias: bool,
    #[comptime] has_softcap: bool,
    #[comptime] rows_per_slice: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    // Cube c covers column block c % blocks and row slice c / blocks; the grid is linear
    // (spilling into its second dimension), as in the row kernels.
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let cols = logits.shape(1);
    let dim = CUBE_DIM_X as usize;
    let blocks = (cols + dim - 1) / dim;
    let slice = cube / blocks;
    let col = (cube % blocks) * dim + UNIT_POS_X as usize;
    let rows = logits.shape(0);
    if col >= cols || slice * rows_per_slice >= rows {
        terminate!();
    }
    let start = slice * rows_per_slice;
    let end = min(start + rows_per_slice, rows);
    let vocab_id = v0 + col;
    let mut b = f32::new(0.0);
    if has_bias {
        b = f32::cast_from(bias[vocab_id]);
    }

    let mut best = f32::new(0.0);
    let mut row = start;
    while row < end {
        let mut x = logits[row * cols + col] + b;
        if has_softcap {
            x = softcap * f32::tanh(x / softcap);
        }
        let p = f32::exp(x - lse[row]);
        let mut g = f32::abs(p);
        if usize::cast_from(targets[row]) == vocab_id {
            g = f32::abs(p - 1.0);
        }
        // A NaN marks the entry as needed (2 exceeds any |p − onehot|), so a NaN input
        // reaches the gradient instead of being filtered into a silent 0.
        if g.is_nan() {
            g = f32::new(2.0);
        }
        best = max(best, g);
        row += 1;
    }
    partial[slice * cols + col] = best;
}

/// Per-entry scores of one chunk (entries `v0 .. v0 + chunk`).
///
/// # Shapes
/// - `logits`: `[n, chunk]` f32 (raw `E·Cᵀ`), `bias`: `[V]` or `None`, `lse`: `[n]` f32,
///   `targets`: `[n]`
/// - returns `[slices, chunk]` f32 partial maxima; their maximum over the first dimension is
///   the score
pub fn score_chunk(
    logits: CubeTensor,
    bias: Option<CubeTensor>,
    lse: CubeTensor,
    targets: CubeTensor,
    v0: usize,
    softcap: Option<f32>,
) -> CubeTensor {
    let logits = into_contiguous(logits);
    let [n, chunk] = logits.meta.shape().dims::<2>();
    let client = logits.client.clone();
    let slices = n.div_ceil(ROWS_PER_SLICE).max(1);
    let partial = empty_device_contiguous_dtype(
        client.clone(),
        logits.device.clone(),
        Shape::new([slices, chunk]),
        DType::F32,
    );
    let has_bias = bias.is_some();
    let bias = bias.map(into_contiguous).unwrap_or_else(|| logits.clone());
    let dtypes = [
        dtype_to_storage_type(bias.dtype),
        dtype_to_storage_type(targets.dtype),
    ];

    score_kernel::launch(
        &client,
        super::row_grid(&client, chunk.div_ceil(UNITS as usize) * slices),
        CubeDim::new_1d(UNITS),
        logits.into_tensor_arg(),
        bias.into_tensor_arg(),
        into_contiguous(lse).into_tensor_arg(),
        into_contiguous(targets).into_tensor_arg(),
        partial.clone().into_tensor_arg(),
        v0,
        softcap.unwrap_or(1.0),
        has_bias,
        softcap.is_some(),
        ROWS_PER_SLICE,
        dtypes,
    );
    partial
}
