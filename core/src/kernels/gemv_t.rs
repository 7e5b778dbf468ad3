//! `x · Eᵀ` for a few rows of `x`, reading `E` (`[n, k]`) along its rows: a tied LM head,
//! whose weight is the `[vocab, hidden]` embedding. Burn's matmul of a few rows by the
//! embedding's transposed view took 55 µs at one row and 1.4 ms at eight on an H200
//! (SmolLM2, 49 152 × 576, f16), for a read of 57 MB.
//!
//! Each plane (a row of the cube) owns [`PER_PLANE`] rows of `E`; its lanes walk the inner
//! dimension in 16-byte vectors, all of the plane's rows read before any is used, and every
//! read of `E` meets up to [`MAX_ROWS_PER_CUBE`] rows of `x`. The lanes' sums meet in shared
//! memory (no plane operations, so any plane size works).

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::Shape;
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::prelude::*;

use super::linear::{vector_width, weight_rows};

/// Rows of `E` per plane.
const PER_PLANE: usize = 4;
/// Lanes along the inner dimension and planes per cube.
const LANES: usize = 32;
const PLANES: usize = 8;
/// Rows of `x` one cube multiplies with each read of `E`.
pub const MAX_ROWS_PER_CUBE: usize = 4;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn gemv_t_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    e: &Tensor<Vector<F, N>>,
    out: &mut Tensor<F>,
    rows: usize,
    k_vecs: usize,
    n_out: usize,
    e_row: usize,
    #[comptime] rpc: usize,
    #[comptime] vec: usize,
    #[define(F)] _dtype: ElemType,
) {
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let v0 = (CUBE_POS_X as usize * PLANES + plane) * PER_PLANE;
    let row0 = CUBE_POS_Y as usize * rpc;
    let mut acc = Array::<Vector<f32, N>>::new(comptime!(PER_PLANE * rpc));
    #[unroll]
    for i in 0..comptime!(PER_PLANE * rpc) {
        acc[i] = Vector::<f32, N>::new(f32::new(0.0));
    }
    let mut kv = lane;
    while kv < k_vecs {
        let mut ev = Array::<Vector<F, N>>::new(PER_PLANE);
        #[unroll]
        for i in 0..PER_PLANE {
            let mut v = v0 + i;
            if v >= n_out {
                v = n_out - 1;
            }
            ev[i] = e[v * e_row + kv];
        }
        #[unroll]
        for r in 0..rpc {
            let mut row = row0 + r;
            if row >= rows {
                row = rows - 1;
            }
            let xv = Vector::<f32, N>::cast_from(x[row * k_vecs + kv]);
            #[unroll]
            for i in 0..PER_PLANE {
                acc[r * PER_PLANE + i] += xv * Vector::<f32, N>::cast_from(ev[i]);
            }
        }
        kv += LANES;
    }
    let slots = comptime!(PER_PLANE * rpc);
    let mut red = Shared::<[f32]>::new_slice(comptime!(PLANES * PER_PLANE * rpc * LANES));
    #[unroll]
    for i in 0..slots {
        // The sum of the vector's lanes.
        let a = acc[i];
        let mut t = f32::new(0.0);
        #[unroll]
        for l in 0..vec {
            t += a.extract(l);
        }
        red[(plane * slots + i) * LANES + lane] = t;
    }
    sync_cube();
    // Runtime, not comptime: the loop mutates it (CUBE_DIM_X is LANES).
    let mut half = CUBE_DIM_X as usize / 2;
    while half > 0 {
        if lane < half {
            #[unroll]
            for i in 0..slots {
                let at = (plane * slots + i) * LANES + lane;
                red[at] += red[at + half];
            }
        }
        sync_cube();
        half /= 2;
    }
    if lane < slots {
        let r = lane / PER_PLANE;
        let v = v0 + lane % PER_PLANE;
        let row = row0 + r;
        if row < rows && v < n_out {
            out[row * n_out + v] = F::cast_from(red[(plane * slots + lane) * LANES]);
        }
    }
}

/// `x · eᵀ` accumulated in f32.
///
/// # Shapes
/// - `x`: `[rows, k]`, `e`: `[n, k]` in `x`'s dtype (rows of `e` anywhere, unit-stride
///   columns read in place); returns `[rows, n]`
pub fn gemv_t(x: CubeTensor, e: CubeTensor) -> CubeTensor {
    let x = into_contiguous(x);
    let [rows, k] = x.meta.shape().dims::<2>();
    let [n, _] = e.meta.shape().dims::<2>();
    let out = empty_device_contiguous_dtype(
        x.client.clone(),
        x.device.clone(),
        Shape::new([rows, n]),
        x.dtype,
    );
    if rows == 0 || n == 0 {
        return out;
    }
    let vec = vector_width(&[k], x.dtype.size());
    // `e`'s rows are what `weight_rows` calls rows: read in place wherever they start.
    let (e, e_row) = weight_rows(e, vec);
    let rpc = rows.min(MAX_ROWS_PER_CUBE);
    let count = CubeCount::Static(
        n.div_ceil(PLANES * PER_PLANE) as u32,
        rows.div_ceil(rpc) as u32,
        1,
    );
    let (client, dtype) = (x.client.clone(), x.dtype);
    gemv_t_kernel::launch(
        &client,
        count,
        CubeDim::new_2d(LANES as u32, PLANES as u32),
        vec,
        x.into_tensor_arg(),
        e.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        rows,
        k / vec,
        n,
        e_row,
        rpc,
        vec,
        dtype_to_storage_type(dtype),
    );
    out
}
