//! Folds one chunk of logits into running per-token log-sum-exp state `(m, s)`:
//! `lse = m + ln s` over every chunk seen so far. One cube per token row, f32 throughout.

use burn::backend::cubecl::dtype_to_storage_type;
use burn_cubecl::{kernel::into_contiguous, tensor::CubeTensor};
use cubecl::prelude::*;

use super::reduce::{cube_merge_lse, merge};
use super::{row_grid, row_units};

#[cube(launch)]
fn lse_chunk_kernel<F: Float>(
    logits: &Tensor<f32>,
    bias: &Tensor<F>,
    m: &mut Tensor<f32>,
    s: &mut Tensor<f32>,
    v0: usize,
    softcap: f32,
    #[comptime] has_bias: bool,
    #[comptime] has_softcap: bool,
    #[comptime] units: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if row >= logits.shape(0) {
        terminate!();
    }
    let cols = logits.shape(1);
    let base = row * cols;

    let mut lm = f32::new(0.0);
    let mut ls = f32::new(0.0);
    let mut col = UNIT_POS_X as usize;
    while col < cols {
        let mut x = logits[base + col];
        if has_bias {
            x += f32::cast_from(bias[v0 + col]);
        }
        if has_softcap {
            x = softcap * f32::tanh(x / softcap);
        }
        let (m2, s2) = merge(lm, ls, x, f32::new(1.0));
        lm = m2;
        ls = s2;
        col += units;
    }

    let (cm, cs) = cube_merge_lse(lm, ls, units);
    if UNIT_POS_X == 0 {
        let (m2, s2) = merge(m[row], s[row], cm, cs);
        m[row] = m2;
        s[row] = s2;
    }
}

/// Folds `logits` (vocabulary entries `v0 .. v0 + chunk`) into `m` and `s` in place.
///
/// # Shapes
/// - `logits`: `[n, chunk]` f32 (raw `E·Cᵀ`), `bias`: `[V]` or `None`, `m`, `s`: `[n]` f32,
///   starting at `s = 0` (empty)
pub fn lse_chunk(
    logits: CubeTensor,
    bias: Option<CubeTensor>,
    m: &CubeTensor,
    s: &CubeTensor,
    v0: usize,
    softcap: Option<f32>,
) {
    let logits = into_contiguous(logits);
    let [n, chunk] = logits.meta.shape().dims::<2>();
    if n == 0 || chunk == 0 {
        return;
    }
    let client = logits.client.clone();
    let has_bias = bias.is_some();
    // Without a bias the kernel still needs a tensor argument; its dtype only has to be a float.
    let bias = bias.map(into_contiguous).unwrap_or_else(|| logits.clone());
    let units = row_units(&client, chunk);
    let dtype = dtype_to_storage_type(bias.dtype);

    lse_chunk_kernel::launch(
        &client,
        row_grid(&client, n),
        CubeDim::new_1d(units),
        logits.into_tensor_arg(),
        bias.into_tensor_arg(),
        m.clone().into_tensor_arg(),
        s.clone().into_tensor_arg(),
        v0,
        softcap.unwrap_or(1.0),
        has_bias,
        softcap.is_some(),
        units as usize,
        dtype,
    );
}

#[cube(launch)]
fn merge_tiles_kernel(partials: &Tensor<f32>, m: &mut Tensor<f32>, s: &mut Tensor<f32>) {
    let row = ABSOLUTE_POS;
    let rows = m.len();
    if row >= rows {
        terminate!();
    }
    let tiles = partials.len() / (2 * rows);
    let half = tiles * rows;
    let mut lm = m[row];
    let mut ls = s[row];
    for t in 0..tiles {
        let (m2, s2) = merge(
            lm,
            ls,
            partials[t * rows + row],
            partials[half + t * rows + row],
        );
        lm = m2;
        ls = s2;
    }
    m[row] = lm;
    s[row] = ls;
}

/// Folds per-tile `(max, Σexp)` pairs (core's `hopper_row_lse`, whose `Σ = 0` marks a tile
/// with no column) into `m` and `s` in place.
///
/// # Shapes
/// - `partials`: `[2, tiles, n]` f32 (the maxima, then the sums), `m`, `s`: `[n]` f32
pub fn merge_tiles(partials: CubeTensor, m: &CubeTensor, s: &CubeTensor) {
    let n = m.meta.shape()[0];
    if n == 0 {
        return;
    }
    let client = partials.client.clone();
    let (count, dim) = super::elementwise_grid(&client, n);
    merge_tiles_kernel::launch(
        &client,
        count,
        dim,
        into_contiguous(partials).into_tensor_arg(),
        m.clone().into_tensor_arg(),
        s.clone().into_tensor_arg(),
    );
}
