//! Rotate-half RoPE in one launch: one unit per rotated pair `(j, j + d/2)` of a head's row,
//! reading the row through its strides (the model passes a `[b, s, h, d] → [b, h, s, d]`
//! view), gathering cos/sin at the row's position and writing a contiguous result. [`rope2`]
//! rotates a layer's queries and keys in one launch.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::Shape;
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::{calculate_cube_count_elemwise, prelude::*};

use super::UNITS;

#[cube(launch)]
fn rope_kernel<F: Float, I: Int>(
    x: &Tensor<F>,
    positions: &Tensor<I>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    out: &mut Tensor<F>,
    pairs: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let idx = ABSOLUTE_POS;
    if idx >= pairs {
        terminate!();
    }
    rotate_pair::<F, I>(x, positions, cos, sin, out, idx);
}

/// The queries and the keys of a layer in one launch: units `0 .. pairs_q` rotate `q`, the
/// rest `k`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn rope2_kernel<F: Float, I: Int>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    positions: &Tensor<I>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    q_out: &mut Tensor<F>,
    k_out: &mut Tensor<F>,
    pairs_q: usize,
    pairs: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let idx = ABSOLUTE_POS;
    if idx >= pairs {
        terminate!();
    }
    if idx < pairs_q {
        rotate_pair::<F, I>(q, positions, cos, sin, q_out, idx);
    } else {
        rotate_pair::<F, I>(k, positions, cos, sin, k_out, idx - pairs_q);
    }
}

/// Rotates pair `idx` (row-major over `[b, h, s, d/2]`) of `x` into the contiguous `out`.
#[cube]
fn rotate_pair<F: Float, I: Int>(
    x: &Tensor<F>,
    positions: &Tensor<I>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    out: &mut Tensor<F>,
    idx: usize,
) {
    let heads = x.shape(1);
    let seq = x.shape(2);
    let d = x.shape(3);
    let half = d / 2;
    let j = idx % half;
    let rest = idx / half;
    let t = rest % seq;
    let bh = rest / seq;
    let h = bh % heads;
    let b = bh / heads;
    let src = b * x.stride(0) + h * x.stride(1) + t * x.stride(2);
    let x1 = f32::cast_from(x[src + j * x.stride(3)]);
    let x2 = f32::cast_from(x[src + (j + half) * x.stride(3)]);
    // Positions are never negative (the model clamps padding to 0).
    let pos = usize::cast_from(positions[b * seq + t]);
    let c = cos[pos * half + j];
    let s = sin[pos * half + j];
    let o = (bh * seq + t) * d + j;
    out[o] = F::cast_from(x1 * c - x2 * s);
    out[o + half] = F::cast_from(x2 * c + x1 * s);
}

/// Rotates `x` by the angles of `positions`.
///
/// # Shapes
/// - `x`: `[b, h, s, d]`, any strides, `d` even
/// - `positions`: `[b, s]` int, each `< cos.shape[0]`
/// - `cos`, `sin`: `[positions, d/2]` f32
/// - returns `[b, h, s, d]`, contiguous, `x`'s dtype
pub fn rope(x: CubeTensor, positions: CubeTensor, cos: CubeTensor, sin: CubeTensor) -> CubeTensor {
    let positions = into_contiguous(positions);
    let cos = into_contiguous(cos);
    let sin = into_contiguous(sin);
    let [b, h, s, d] = x.meta.shape().dims::<4>();
    let client = x.client.clone();
    let dtype = x.dtype;
    let out = empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        Shape::new([b, h, s, d]),
        dtype,
    );
    let pairs = b * h * s * (d / 2);
    if pairs == 0 {
        return out;
    }
    let dtypes = [
        dtype_to_storage_type(dtype),
        dtype_to_storage_type(positions.dtype),
    ];
    let cube_dim = CubeDim::new_1d(UNITS);
    rope_kernel::launch(
        &client,
        calculate_cube_count_elemwise(&client, pairs, cube_dim),
        cube_dim,
        x.into_tensor_arg(),
        positions.into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        pairs,
        dtypes,
    );
    out
}

/// Rotates `q` and `k` by the angles of `positions` in one launch.
///
/// # Shapes
/// - `q`: `[b, hq, s, d]`, `k`: `[b, hk, s, d]`, any strides, one dtype, `d` even
/// - `positions`, `cos`, `sin`: as [`rope`]
/// - returns `q`'s and `k`'s shapes, contiguous
pub fn rope2(
    q: CubeTensor,
    k: CubeTensor,
    positions: CubeTensor,
    cos: CubeTensor,
    sin: CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let [positions, cos, sin] = [positions, cos, sin].map(into_contiguous);
    let client = q.client.clone();
    let dtype = q.dtype;
    let out = |t: &CubeTensor| {
        empty_device_contiguous_dtype(
            client.clone(),
            t.device.clone(),
            t.meta.shape().clone(),
            dtype,
        )
    };
    let (q_out, k_out) = (out(&q), out(&k));
    let pairs_of = |t: &CubeTensor| t.meta.shape().num_elements() / 2;
    let (pairs_q, pairs) = (pairs_of(&q), pairs_of(&q) + pairs_of(&k));
    if pairs == 0 {
        return (q_out, k_out);
    }
    let dtypes = [
        dtype_to_storage_type(dtype),
        dtype_to_storage_type(positions.dtype),
    ];
    let cube_dim = CubeDim::new_1d(UNITS);
    rope2_kernel::launch(
        &client,
        calculate_cube_count_elemwise(&client, pairs, cube_dim),
        cube_dim,
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        positions.into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        q_out.clone().into_tensor_arg(),
        k_out.clone().into_tensor_arg(),
        pairs_q,
        pairs,
        dtypes,
    );
    (q_out, k_out)
}
