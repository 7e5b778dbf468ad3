//! The logit gradient of one chunk, `G = (softmax − onehot) · dout · cap'`, recomputed from
//! the chunk's logits and the saved log-sum-exp, written in the dtype of the GEMMs that
//! consume it (dE += G·C, dC = Gᵀ·E).

use burn::tensor::{DType, Shape};
use burn_cubecl::{
    CubeRuntime, kernel::into_contiguous, ops::numeric::empty_device_dtype, tensor::CubeTensor,
};
use cubecl::prelude::*;

const UNITS: u32 = 256;

#[cube(launch)]
fn grad_kernel<F: Float, I: Numeric>(
    logits: &Tensor<f32>,
    bias: &Tensor<F>,
    lse: &Tensor<f32>,
    dout: &Tensor<f32>,
    targets: &Tensor<I>,
    vocab_ids: &Tensor<I>,
    out: &mut Tensor<F>,
    v0: usize,
    softcap: f32,
    #[comptime] has_bias: bool,
    #[comptime] has_softcap: bool,
    #[comptime] gathered: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let cols = logits.shape(1);
    let col = ABSOLUTE_POS_X as usize;
    if col >= cols {
        terminate!();
    }
    let mut vocab_id = v0 + col;
    if gathered {
        vocab_id = usize::cast_from(vocab_ids[col]);
    }
    let mut b = f32::new(0.0);
    if has_bias {
        b = f32::cast_from(bias[vocab_id]);
    }
    // Rows beyond the grid's second dimension are taken in further passes.
    let mut row = CUBE_POS_Y as usize;
    while row < logits.shape(0) {
        let idx = row * cols + col;
        let raw = logits[idx] + b;
        let mut x = raw;
        let mut slope = f32::new(1.0);
        if has_softcap {
            let t = f32::tanh(raw / softcap);
            x = softcap * t;
            slope = 1.0 - t * t;
        }
        let mut g = f32::exp(x - lse[row]);
        if usize::cast_from(targets[row]) == vocab_id {
            g -= 1.0;
        }
        out[idx] = F::cast_from(g * dout[row] * slope);
        row += CUBE_COUNT_Y as usize;
    }
}

/// `G` for one chunk. Entries are `v0 + j` for column `j`, or `vocab_ids[j]` when given (a
/// gathered chunk).
///
/// # Shapes
/// - `logits`: `[n, chunk]` f32 (raw `E·Cᵀ`), `bias`: `[V]` or `None`, `lse`, `dout`: `[n]`
///   f32, `targets`: `[n]`, `vocab_ids`: `[chunk]`
/// - returns `[n, chunk]` in `dtype`
#[allow(clippy::too_many_arguments)]
pub fn grad_chunk<R: CubeRuntime>(
    logits: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    lse: CubeTensor<R>,
    dout: CubeTensor<R>,
    targets: CubeTensor<R>,
    vocab_ids: Option<CubeTensor<R>>,
    v0: usize,
    softcap: Option<f32>,
    dtype: DType,
) -> CubeTensor<R> {
    let logits = into_contiguous(logits);
    let [n, chunk] = logits.meta.shape().dims::<2>();
    let client = logits.client.clone();
    let out = empty_device_dtype::<R>(
        client.clone(),
        logits.device.clone(),
        Shape::new([n, chunk]),
        dtype,
    );
    if n == 0 || chunk == 0 {
        return out;
    }
    let has_bias = bias.is_some();
    let bias = bias.map(into_contiguous).unwrap_or_else(|| out.clone());
    let gathered = vocab_ids.is_some();
    let targets = into_contiguous(targets);
    let vocab_ids = vocab_ids
        .map(into_contiguous)
        .unwrap_or_else(|| targets.clone());
    let dtypes = [dtype.into(), targets.dtype.into()];
    let max_y = client.properties().hardware.max_cube_count.1.min(65_535) as usize;

    grad_kernel::launch::<R>(
        &client,
        CubeCount::Static(
            chunk.div_ceil(UNITS as usize) as u32,
            n.min(max_y) as u32,
            1,
        ),
        CubeDim::new_1d(UNITS),
        logits.into_tensor_arg(),
        bias.into_tensor_arg(),
        into_contiguous(lse).into_tensor_arg(),
        into_contiguous(dout).into_tensor_arg(),
        targets.into_tensor_arg(),
        vocab_ids.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        v0,
        softcap.unwrap_or(1.0),
        has_bias,
        softcap.is_some(),
        gathered,
        dtypes,
    );
    out
}
