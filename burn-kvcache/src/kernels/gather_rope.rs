//! ShadowKV's fused key rebuild: gather the low-rank rows of the selected chunks, multiply by
//! the per-head right factor and rotate by RoPE at the chunk positions, in one pass. One unit
//! per output pair `(j, j + d/2)`: both halves come out of the same two dot products of length
//! `rank`, which is what the rotate-half RoPE needs.

use burn::backend::cubecl::dtype_to_storage_type;
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::{calculate_cube_count_elemwise, prelude::*};

use super::UNITS;
use crate::shapes::gather_rope_shape;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn gather_rope_kernel<F: Float, I: Int>(
    a: &Tensor<F>,
    wt: &Tensor<F>,
    chunks: &Tensor<I>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    out: &mut Tensor<F>,
    chunk: usize,
    pairs: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let idx = ABSOLUTE_POS;
    if idx >= pairs {
        terminate!();
    }
    let rows = a.shape(1);
    let rank = a.shape(2);
    let heads = wt.shape(1);
    let d = wt.shape(3);
    let half = d / 2;
    let k = chunks.shape(2);
    let n = k * chunk;
    let positions = cos.shape(0);

    let j = idx % half;
    let rest = idx / half;
    let tok = rest % n;
    let bh = rest / n;
    let bi = bh / heads;
    let slot = tok / chunk;
    let t = tok % chunk;
    // Indices are never negative (chunk ids); out-of-range positions give zeros.
    let c = usize::cast_from(chunks[bh * k + slot]);
    let pos = c * chunk + t;
    let o = (bh * n + tok) * d + j;
    if pos >= rows || pos >= positions {
        out[o] = F::cast_from(0.0f32);
        out[o + half] = F::cast_from(0.0f32);
        terminate!();
    }
    let arow = (bi * rows + pos) * rank;
    let wbase = bh * rank * d + j;
    let mut x1 = f32::new(0.0);
    let mut x2 = f32::new(0.0);
    for r in 0..rank {
        let av = f32::cast_from(a[arow + r]);
        let w = wbase + r * d;
        x1 += av * f32::cast_from(wt[w]);
        x2 += av * f32::cast_from(wt[w + half]);
    }
    let cs = cos[pos * half + j];
    let sn = sin[pos * half + j];
    out[o] = F::cast_from(x1 * cs - x2 * sn);
    out[o + half] = F::cast_from(x2 * cs + x1 * sn);
}

/// Launches the gather-reconstruct-rope.
///
/// # Shapes
/// - `a`: `[batch, rows, rank]` (left low-rank factor, one row per position)
/// - `wt`: `[batch, heads, rank, d]` (right factor per head), `a`'s dtype, `d` even
/// - `chunks`: `[batch, heads, k]` int chunk ids
/// - `cos`, `sin`: `[positions, d/2]` f32 tables
/// - returns `[batch, heads, k · chunk, d]` in `a`'s dtype; position `c·chunk + t` of chunk `c`
///   is `RoPE(a[b, pos] · wt[b, h], pos)`, or zeros when `pos ≥ rows` or `pos ≥ positions`
pub fn gather_reconstruct_rope(
    a: CubeTensor,
    wt: CubeTensor,
    chunks: CubeTensor,
    cos: CubeTensor,
    sin: CubeTensor,
    chunk: usize,
) -> CubeTensor {
    let a = into_contiguous(a);
    let wt = into_contiguous(wt);
    let chunks = into_contiguous(chunks);
    let cos = into_contiguous(cos);
    let sin = into_contiguous(sin);
    let [b, h, _, d] = wt.meta.shape().dims::<4>();
    let k = chunks.meta.shape().dims::<3>()[2];
    let client = a.client.clone();
    let dtype = a.dtype;
    let out = empty_device_contiguous_dtype(
        client.clone(),
        a.device.clone(),
        gather_rope_shape(wt.meta.shape(), chunks.meta.shape(), &chunk),
        dtype,
    );
    let pairs = b * h * k * chunk * (d / 2);
    if pairs == 0 {
        return out;
    }
    let dtypes = [
        dtype_to_storage_type(dtype),
        dtype_to_storage_type(chunks.dtype),
    ];
    let cube_dim = CubeDim::new_1d(UNITS);
    let cube_count = calculate_cube_count_elemwise(&client, pairs, cube_dim);
    gather_rope_kernel::launch(
        &client,
        cube_count,
        cube_dim,
        a.into_tensor_arg(),
        wt.into_tensor_arg(),
        chunks.into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        chunk,
        pairs,
        dtypes,
    );
    out
}
