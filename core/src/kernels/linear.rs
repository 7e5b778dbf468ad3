//! `x · W` for a few rows (decode steps, speculative verification): a split-K GEMV with a light
//! launch, built to keep many 16-byte reads of `W` in flight.
//!
//! At decode sizes (SmolLM2: `W` of 576 × 576 half floats, 663 KB) the product is bound by how
//! many bytes are in flight, not by bandwidth: the whole matrix is less than what an H100 keeps
//! in flight (~3.3 TB/s × ~600 ns ≈ 2 MB). So a unit reads a vector of `vec` adjacent columns
//! (16 bytes) from 4 rows (8 for long inner dimensions) before it uses any of them, a cube owns only `cv` such column
//! vectors (so a 576-column product still spreads over 36 cubes) and splits the inner dimension
//! over `splits` units, and up to [`MAX_ROWS_PER_CUBE`] rows of `x` share each read of `W`.
//! The partial sums meet in shared memory (two passes, no plane operations, so any plane size
//! works). Burn's matmul launch costs more host time than the whole product at these sizes.
//!
//! Two launches fold a layer's neighbouring products: [`gemv3`] (Q, K and V of one input: one
//! grid over all three weights' columns) and [`gemv_swiglu`] (`silu(x · wg) · (x · wu)`: both
//! products per unit, the gate in the epilogue), so a decode layer's seven projections and its
//! gate take four launches instead of eight.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::Shape;
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::prelude::*;

use super::gemv::{gemv_kernel, gemv_swiglu_kernel, gemv3_kernel};

/// Units per cube (`cv × splits`).
const UNITS: usize = 256;
/// Rows of `W` a unit loads before it multiplies; twice as many for long inner dimensions
/// (from [`LONG_K`]), whose few cubes must keep more bytes in flight each.
const UNROLL: usize = 4;
const LONG_K: usize = 2048;
/// Rows of `x` one cube multiplies with each read of `W`.
pub const MAX_ROWS_PER_CUBE: usize = 4;

/// The launch's shape parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Plan {
    /// Columns per vector read (16 bytes where `n` allows).
    vec: usize,
    /// Column vectors per cube.
    cv: usize,
    /// Units along the inner dimension (`UNITS / cv`).
    splits: usize,
    /// Rows of `x` per cube.
    rows_per_cube: usize,
    /// Rows of `W` a unit reads before it multiplies.
    unroll: usize,
}

impl Plan {
    /// A plan for products with `ns` columns each (one launch), `rows` rows of `x`, an
    /// inner dimension of `k`, `slots` f32 accumulator vectors per row of `x` (two for the
    /// SwiGLU launch), within `max_shared` bytes of shared memory per cube.
    fn new(
        rows: usize,
        k: usize,
        ns: &[usize],
        elem_bytes: usize,
        slots: usize,
        max_shared: usize,
    ) -> Self {
        let widest = (16 / elem_bytes).max(1);
        let vec = [8, 4, 2, 1]
            .into_iter()
            .find(|v| *v <= widest && ns.iter().all(|n| n.is_multiple_of(*v)))
            .unwrap_or(1);
        let n_vecs = ns.iter().sum::<usize>() / vec;
        // Two column vectors per cube keep a plane's reads at 32-byte sectors while small
        // products still cover many SMs; wide ones (the LM head) have cubes to spare.
        let cv = if n_vecs >= 2048 { 4 } else { 2 };
        let mut rows_per_cube = match rows {
            0..=1 => 1,
            2 => 2,
            _ => MAX_ROWS_PER_CUBE,
        };
        // Every unit parks its partial sums in shared memory for the reduction.
        while rows_per_cube > 1 && UNITS * slots * rows_per_cube * vec * 4 > max_shared {
            rows_per_cube /= 2;
        }
        Self {
            vec,
            cv,
            splits: UNITS / cv,
            rows_per_cube,
            unroll: if k >= LONG_K { 2 * UNROLL } else { UNROLL },
        }
    }
}

/// Shared memory a cube may use on `x`'s device.
fn max_shared(x: &CubeTensor) -> usize {
    x.client.properties().hardware.max_shared_memory_size
}

/// A `[rows, n]` output of `x`'s dtype on `x`'s device.
fn output(x: &CubeTensor, rows: usize, n: usize) -> CubeTensor {
    empty_device_contiguous_dtype(
        x.client.clone(),
        x.device.clone(),
        Shape::new([rows, n]),
        x.dtype,
    )
}

/// The grid and cube of a plan over `n_vecs` column vectors.
fn launch_dims(plan: &Plan, rows: usize, n_vecs: usize) -> (CubeCount, CubeDim) {
    (
        CubeCount::Static(
            n_vecs.div_ceil(plan.cv) as u32,
            rows.div_ceil(plan.rows_per_cube) as u32,
            1,
        ),
        CubeDim::new_2d(plan.cv as u32, plan.splits as u32),
    )
}

/// `x · w` accumulated in f32.
///
/// # Shapes
/// - `x`: `[rows, k]`, `w`: `[k, n]` in `x`'s dtype; returns `[rows, n]`
pub fn gemv(x: CubeTensor, w: CubeTensor) -> CubeTensor {
    let x = into_contiguous(x);
    let w = into_contiguous(w);
    let [rows, k] = x.meta.shape().dims::<2>();
    let [_, n] = w.meta.shape().dims::<2>();
    let out = output(&x, rows, n);
    if rows == 0 || n == 0 {
        return out;
    }
    let plan = Plan::new(rows, k, &[n], x.dtype.size(), 1, max_shared(&x));
    let n_vecs = n / plan.vec;
    let (count, dim) = launch_dims(&plan, rows, n_vecs);
    let (client, dtype) = (x.client.clone(), x.dtype);
    gemv_kernel::launch(
        &client,
        count,
        dim,
        plan.vec,
        x.into_tensor_arg(),
        w.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        rows,
        k,
        n_vecs,
        plan.cv,
        plan.splits,
        plan.rows_per_cube,
        plan.unroll,
        dtype_to_storage_type(dtype),
    );
    out
}

/// `(x · wa, x · wb, x · wc)` in one launch, accumulated in f32.
///
/// # Shapes
/// - `x`: `[rows, k]`, `wa`: `[k, na]`, `wb`: `[k, nb]`, `wc`: `[k, nc]` in `x`'s dtype;
///   returns `[rows, na]`, `[rows, nb]`, `[rows, nc]`
pub fn gemv3(
    x: CubeTensor,
    wa: CubeTensor,
    wb: CubeTensor,
    wc: CubeTensor,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let x = into_contiguous(x);
    let [wa, wb, wc] = [wa, wb, wc].map(into_contiguous);
    let [rows, k] = x.meta.shape().dims::<2>();
    let ns = [&wa, &wb, &wc].map(|w| w.meta.shape().dims::<2>()[1]);
    let outs = ns.map(|n| output(&x, rows, n));
    if rows == 0 || ns.iter().sum::<usize>() == 0 {
        let [a, b, c] = outs;
        return (a, b, c);
    }
    let plan = Plan::new(rows, k, &ns, x.dtype.size(), 1, max_shared(&x));
    let [na, nb, nc] = ns.map(|n| n / plan.vec);
    let (count, dim) = launch_dims(&plan, rows, na + nb + nc);
    let (client, dtype) = (x.client.clone(), x.dtype);
    let [oa, ob, oc] = outs;
    gemv3_kernel::launch(
        &client,
        count,
        dim,
        plan.vec,
        x.into_tensor_arg(),
        wa.into_tensor_arg(),
        wb.into_tensor_arg(),
        wc.into_tensor_arg(),
        oa.clone().into_tensor_arg(),
        ob.clone().into_tensor_arg(),
        oc.clone().into_tensor_arg(),
        rows,
        k,
        na,
        nb,
        nc,
        plan.cv,
        plan.splits,
        plan.rows_per_cube,
        plan.unroll,
        dtype_to_storage_type(dtype),
    );
    (oa, ob, oc)
}

/// `silu(x · wg) · (x · wu)` in one launch, accumulated in f32.
///
/// # Shapes
/// - `x`: `[rows, k]`, `wg`, `wu`: `[k, n]` in `x`'s dtype; returns `[rows, n]`
pub fn gemv_swiglu(x: CubeTensor, wg: CubeTensor, wu: CubeTensor) -> CubeTensor {
    let x = into_contiguous(x);
    let [wg, wu] = [wg, wu].map(into_contiguous);
    let [rows, k] = x.meta.shape().dims::<2>();
    let [_, n] = wg.meta.shape().dims::<2>();
    let out = output(&x, rows, n);
    if rows == 0 || n == 0 {
        return out;
    }
    let plan = Plan::new(rows, k, &[n], x.dtype.size(), 2, max_shared(&x));
    let n_vecs = n / plan.vec;
    let (count, dim) = launch_dims(&plan, rows, n_vecs);
    let (client, dtype) = (x.client.clone(), x.dtype);
    gemv_swiglu_kernel::launch(
        &client,
        count,
        dim,
        plan.vec,
        x.into_tensor_arg(),
        wg.into_tensor_arg(),
        wu.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        rows,
        k,
        n_vecs,
        plan.cv,
        plan.splits,
        plan.rows_per_cube,
        plan.unroll,
        dtype_to_storage_type(dtype),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_read_16_bytes_where_the_columns_allow() {
        let p = Plan::new(1, 576, &[576], 2, 1, 48 << 10);
        assert_eq!(
            (p.vec, p.cv, p.splits, p.rows_per_cube, p.unroll),
            (8, 2, 128, 1, 4)
        );
        assert_eq!(Plan::new(1, 4096, &[576], 2, 1, 48 << 10).unroll, 8);
        assert_eq!(Plan::new(1, 97, &[576], 4, 1, 48 << 10).vec, 4);
        assert_eq!(Plan::new(3, 97, &[45], 2, 1, 48 << 10).vec, 1);
        assert_eq!(Plan::new(3, 97, &[6], 2, 1, 48 << 10).vec, 2);
        assert_eq!(Plan::new(3, 97, &[576, 192, 36], 2, 1, 48 << 10).vec, 4);
        assert_eq!(
            Plan::new(3, 97, &[6], 2, 1, 48 << 10).rows_per_cube,
            MAX_ROWS_PER_CUBE
        );
        assert_eq!(Plan::new(2, 97, &[49_152], 2, 1, 48 << 10).cv, 4);
        // Partial sums that would not fit shared memory take fewer rows per cube.
        assert_eq!(Plan::new(3, 97, &[576], 2, 2, 48 << 10).rows_per_cube, 2);
        assert_eq!(Plan::new(3, 97, &[576], 2, 2, 32 << 10).rows_per_cube, 2);
        assert_eq!(Plan::new(3, 97, &[576], 2, 2, 16 << 10).rows_per_cube, 1);
        assert_eq!(Plan::new(3, 97, &[576], 2, 1, 16 << 10).rows_per_cube, 2);
        for rows in 1..=16 {
            let p = Plan::new(rows, 97, &[200], 2, 1, 48 << 10);
            assert_eq!(p.cv * p.splits, UNITS);
            assert!(p.splits.is_multiple_of(8), "the reducers divide the splits");
        }
    }
}
