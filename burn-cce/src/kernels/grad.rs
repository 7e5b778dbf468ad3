//! The logit gradient of one chunk, `G = (softmax − onehot) · dout · cap'`, recomputed from
//! the chunk's logits and the saved log-sum-exp, written in the dtype of the GEMMs that
//! consume it (dE += G·C, dC = Gᵀ·E).

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::zspace::{Strides, metadata::Metadata};
use cubecl::{calculate_cube_count_elemwise, prelude::*};

const UNITS: u32 = 256;

/// Elements between `G`'s rows: `chunk` rounded up to 16 bytes. `G` is an operand of the dE and
/// dC GEMMs (`G · C_chunk`, `Gᵀ · E`), and core's Hopper kernel reads an operand by TMA only
/// where its stride is a multiple of 16 bytes; a gathered chunk of the filtered backward has
/// any length, and its GEMMs fell to cubek's unit-stride kernel (Gemma-2 shape with the paper's
/// filter, automatic blocks: 8 such products a call, 0.58 ms each; H100, 2026-12-06).
pub fn row_stride(chunk: usize, dtype: DType) -> usize {
    chunk.next_multiple_of((16 / dtype.size()).max(1))
}

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
    row0: usize,
    softcap: f32,
    #[comptime] has_bias: bool,
    #[comptime] has_softcap: bool,
    #[comptime] gathered: bool,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    // One unit per element, linear index: the plainest launch shape, which every runtime
    // handles alike.
    let idx = ABSOLUTE_POS;
    if idx >= logits.len() {
        terminate!();
    }
    let cols = logits.shape(1);
    let row = idx / cols;
    let col = idx % cols;
    // The chunk's rows are tokens row0.. of the per-token vectors.
    let token = row0 + row;
    let mut vocab_id = v0 + col;
    if gathered {
        vocab_id = usize::cast_from(vocab_ids[col]);
    }
    let mut raw = logits[idx];
    if has_bias {
        raw += f32::cast_from(bias[vocab_id]);
    }
    let mut x = raw;
    let mut slope = f32::new(1.0);
    if has_softcap {
        let t = f32::tanh(raw / softcap);
        x = softcap * t;
        slope = 1.0 - t * t;
    }
    let mut g = f32::exp(x - lse[token]);
    if usize::cast_from(targets[token]) == vocab_id {
        g -= 1.0;
    }
    // `out`'s rows may be padded (see `row_stride`).
    let at = row * out.stride(0) + col;
    out[at] = F::cast_from(g * dout[token] * slope);
}

/// `G` for one chunk. Entries are `v0 + j` for column `j`, or `vocab_ids[j]` when given (a
/// gathered chunk); row `i` is token `row0 + i`.
///
/// # Shapes
/// - `logits`: `[rows, chunk]` f32 (raw `E·Cᵀ` of tokens `row0 .. row0 + rows`), `bias`: `[V]`
///   or `None`, `lse`, `dout`: `[n]` f32, `targets`: `[n]`, `vocab_ids`: `[chunk]`
/// - returns `[rows, chunk]` in `dtype`, its rows [`row_stride`] elements apart
#[allow(clippy::too_many_arguments)]
pub fn grad_chunk(
    logits: CubeTensor,
    bias: Option<CubeTensor>,
    lse: CubeTensor,
    dout: CubeTensor,
    targets: CubeTensor,
    vocab_ids: Option<CubeTensor>,
    v0: usize,
    row0: usize,
    softcap: Option<f32>,
    dtype: DType,
) -> CubeTensor {
    let logits = into_contiguous(logits);
    let [n, chunk] = logits.meta.shape().dims::<2>();
    let client = logits.client.clone();
    let stride = row_stride(chunk, dtype);
    let storage = empty_device_contiguous_dtype(
        client.clone(),
        logits.device.clone(),
        Shape::new([n * stride]),
        dtype,
    );
    let out = CubeTensor::new(
        client.clone(),
        storage.handle,
        Metadata::new([n, chunk], Strides::new(&[stride, 1])),
        logits.device.clone(),
        dtype,
    );
    if n == 0 || chunk == 0 {
        return out;
    }
    let has_bias = bias.is_some();
    // Without a bias the kernel still needs a tensor of the output dtype; a separate one-element
    // buffer, since binding the written output twice is not allowed on every runtime.
    let bias = bias.map(into_contiguous).unwrap_or_else(|| {
        empty_device_contiguous_dtype(
            client.clone(),
            logits.device.clone(),
            Shape::new([1]),
            dtype,
        )
    });
    let gathered = vocab_ids.is_some();
    let targets = into_contiguous(targets);
    let vocab_ids = vocab_ids
        .map(into_contiguous)
        .unwrap_or_else(|| targets.clone());
    let dtypes = [
        dtype_to_storage_type(dtype),
        dtype_to_storage_type(targets.dtype),
    ];
    let cube_dim = CubeDim::new_1d(UNITS);
    let cube_count = calculate_cube_count_elemwise(&client, n * chunk, cube_dim);

    grad_kernel::launch(
        &client,
        cube_count,
        cube_dim,
        logits.into_tensor_arg(),
        bias.into_tensor_arg(),
        into_contiguous(lse).into_tensor_arg(),
        into_contiguous(dout).into_tensor_arg(),
        targets.into_tensor_arg(),
        vocab_ids.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        v0,
        row0,
        softcap.unwrap_or(1.0),
        has_bias,
        softcap.is_some(),
        gathered,
        dtypes,
    );
    out
}
