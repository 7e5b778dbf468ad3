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

/// Units per cube (`cv × splits`).
const UNITS: usize = 256;
/// Rows of `W` a unit loads before it multiplies; twice as many for long inner dimensions
/// (from [`LONG_K`]), whose few cubes must keep more bytes in flight each.
const UNROLL: usize = 4;
const LONG_K: usize = 2048;
/// Units that sum the split partials in the first reduction pass (divides every `splits`).
const REDUCERS: usize = 8;
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
    /// inner dimension of `k`.
    fn new(rows: usize, k: usize, ns: &[usize], elem_bytes: usize) -> Self {
        let widest = (16 / elem_bytes).max(1);
        let vec = [8, 4, 2, 1]
            .into_iter()
            .find(|v| *v <= widest && ns.iter().all(|n| n.is_multiple_of(*v)))
            .unwrap_or(1);
        let n_vecs = ns.iter().sum::<usize>() / vec;
        // Two column vectors per cube keep a plane's reads at 32-byte sectors while small
        // products still cover many SMs; wide ones (the LM head) have cubes to spare.
        let cv = if n_vecs >= 2048 { 4 } else { 2 };
        let rows_per_cube = match rows {
            0..=1 => 1,
            2 => 2,
            _ => MAX_ROWS_PER_CUBE,
        };
        Self {
            vec,
            cv,
            splits: UNITS / cv,
            rows_per_cube,
            unroll: if k >= LONG_K { 2 * UNROLL } else { UNROLL },
        }
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn gemv_kernel<F: Float, N: Size>(
    x: &Tensor<F>,
    w: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    rows: usize,
    k_dim: usize,
    n_vecs: usize,
    #[comptime] cv: usize,
    #[comptime] splits: usize,
    #[comptime] rpc: usize,
    #[comptime] unroll: usize,
    #[define(F)] _dtype: ElemType,
) {
    let c = UNIT_POS_X as usize;
    let s = UNIT_POS_Y as usize;
    let colv = CUBE_POS_X as usize * cv + c;
    let row0 = CUBE_POS_Y as usize * rpc;
    let mut acc = zeros::<N>(rpc);
    if colv < n_vecs {
        product::<F, N>(
            x, w, &mut acc, 0usize, colv, n_vecs, rows, k_dim, row0, s, splits, rpc, unroll,
        );
    }
    let mut part = Shared::<[Vector<f32, N>]>::new_slice(splits * cv * rpc);
    reduce_splits::<N>(&mut part, &acc, c, s, cv, splits, rpc);
    if s == 0 && colv < n_vecs {
        #[unroll]
        for r in 0..rpc {
            let row = row0 + r;
            if row < rows {
                out[row * n_vecs + colv] = Vector::<F, N>::cast_from(part[c * rpc + r]);
            }
        }
    }
}

/// Three products of one `x` in one launch (a layer's Q, K and V projections): the column
/// vectors of `wa`, `wb` and `wc` follow each other along the grid and every unit reads from
/// the weight its column falls in.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn gemv3_kernel<F: Float, N: Size>(
    x: &Tensor<F>,
    wa: &Tensor<Vector<F, N>>,
    wb: &Tensor<Vector<F, N>>,
    wc: &Tensor<Vector<F, N>>,
    oa: &mut Tensor<Vector<F, N>>,
    ob: &mut Tensor<Vector<F, N>>,
    oc: &mut Tensor<Vector<F, N>>,
    rows: usize,
    k_dim: usize,
    na: usize,
    nb: usize,
    nc: usize,
    #[comptime] cv: usize,
    #[comptime] splits: usize,
    #[comptime] rpc: usize,
    #[comptime] unroll: usize,
    #[define(F)] _dtype: ElemType,
) {
    let c = UNIT_POS_X as usize;
    let s = UNIT_POS_Y as usize;
    let colv = CUBE_POS_X as usize * cv + c;
    let row0 = CUBE_POS_Y as usize * rpc;
    let mut acc = zeros::<N>(rpc);
    if colv < na {
        product::<F, N>(
            x, wa, &mut acc, 0usize, colv, na, rows, k_dim, row0, s, splits, rpc, unroll,
        );
    } else if colv < na + nb {
        let cb = colv - na;
        product::<F, N>(
            x, wb, &mut acc, 0usize, cb, nb, rows, k_dim, row0, s, splits, rpc, unroll,
        );
    } else if colv < na + nb + nc {
        let cc = colv - na - nb;
        product::<F, N>(
            x, wc, &mut acc, 0usize, cc, nc, rows, k_dim, row0, s, splits, rpc, unroll,
        );
    }
    let mut part = Shared::<[Vector<f32, N>]>::new_slice(splits * cv * rpc);
    reduce_splits::<N>(&mut part, &acc, c, s, cv, splits, rpc);
    if s == 0 {
        #[unroll]
        for r in 0..rpc {
            let row = row0 + r;
            if row < rows {
                let v = Vector::<F, N>::cast_from(part[c * rpc + r]);
                if colv < na {
                    oa[row * na + colv] = v;
                } else if colv < na + nb {
                    ob[row * nb + colv - na] = v;
                } else if colv < na + nb + nc {
                    oc[row * nc + colv - na - nb] = v;
                }
            }
        }
    }
}

/// A SwiGLU MLP's first half in one launch: `silu(x · wg) · (x · wu)`, both products of each
/// column vector in the same unit (twice the reads in flight), the gate applied in f32.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn gemv_swiglu_kernel<F: Float, N: Size>(
    x: &Tensor<F>,
    wg: &Tensor<Vector<F, N>>,
    wu: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    rows: usize,
    k_dim: usize,
    n_vecs: usize,
    #[comptime] cv: usize,
    #[comptime] splits: usize,
    #[comptime] rpc: usize,
    #[comptime] unroll: usize,
    #[define(F)] _dtype: ElemType,
) {
    let c = UNIT_POS_X as usize;
    let s = UNIT_POS_Y as usize;
    let colv = CUBE_POS_X as usize * cv + c;
    let row0 = CUBE_POS_Y as usize * rpc;
    let mut acc = zeros::<N>(comptime!(2 * rpc));
    if colv < n_vecs {
        let full = k_dim / (splits * unroll);
        for chunk in 0..full {
            swiglu_chunk::<F, N>(
                x, wg, wu, &mut acc, chunk, colv, n_vecs, rows, k_dim, row0, s, splits, rpc,
                unroll, false,
            );
        }
        if full * splits * unroll < k_dim {
            swiglu_chunk::<F, N>(
                x, wg, wu, &mut acc, full, colv, n_vecs, rows, k_dim, row0, s, splits, rpc, unroll,
                true,
            );
        }
    }
    let mut part = Shared::<[Vector<f32, N>]>::new_slice(comptime!(splits * cv * 2 * rpc));
    reduce_splits::<N>(&mut part, &acc, c, s, cv, splits, comptime!(2 * rpc));
    if s == 0 && colv < n_vecs {
        let one = Vector::<f32, N>::new(f32::new(1.0));
        let zero = Vector::<f32, N>::new(f32::new(0.0));
        #[unroll]
        for r in 0..rpc {
            let row = row0 + r;
            if row < rows {
                let g = part[c * 2 * rpc + r];
                let u = part[c * 2 * rpc + rpc + r];
                let sig = one / (one + (zero - g).exp());
                out[row * n_vecs + colv] = Vector::<F, N>::cast_from(g * sig * u);
            }
        }
    }
}

#[cube]
fn zeros<N: Size>(#[comptime] len: usize) -> Array<Vector<f32, N>> {
    let mut acc = Array::<Vector<f32, N>>::new(len);
    #[unroll]
    for i in 0..len {
        acc[i] = Vector::<f32, N>::new(f32::new(0.0));
    }
    acc
}

/// Unit `s`'s share of `x · w` for column vector `colv` of `w`, added to
/// `acc[first .. first + rpc]`: rows s, s + splits, s + 2·splits, … (a plane reads adjacent
/// rows), `unroll` at a time; only the last chunk checks the inner dimension's end.
#[cube]
#[allow(clippy::too_many_arguments)]
fn product<F: Float, N: Size>(
    x: &Tensor<F>,
    w: &Tensor<Vector<F, N>>,
    acc: &mut Array<Vector<f32, N>>,
    #[comptime] first: usize,
    colv: usize,
    n_vecs: usize,
    rows: usize,
    k_dim: usize,
    row0: usize,
    s: usize,
    #[comptime] splits: usize,
    #[comptime] rpc: usize,
    #[comptime] unroll: usize,
) {
    let full = k_dim / (splits * unroll);
    for chunk in 0..full {
        let mut wr = Array::<Vector<F, N>>::new(unroll);
        load_chunk::<F, N>(
            w, &mut wr, chunk, s, k_dim, n_vecs, colv, splits, unroll, false,
        );
        fma_chunk::<F, N>(
            x, &wr, acc, first, chunk, s, k_dim, rows, row0, splits, rpc, unroll, false,
        );
    }
    if full * splits * unroll < k_dim {
        let mut wr = Array::<Vector<F, N>>::new(unroll);
        load_chunk::<F, N>(
            w, &mut wr, full, s, k_dim, n_vecs, colv, splits, unroll, true,
        );
        fma_chunk::<F, N>(
            x, &wr, acc, first, full, s, k_dim, rows, row0, splits, rpc, unroll, true,
        );
    }
}

/// One chunk of both SwiGLU products: the gate's sums in `acc[..rpc]`, the up's after.
#[cube]
#[allow(clippy::too_many_arguments)]
fn swiglu_chunk<F: Float, N: Size>(
    x: &Tensor<F>,
    wg: &Tensor<Vector<F, N>>,
    wu: &Tensor<Vector<F, N>>,
    acc: &mut Array<Vector<f32, N>>,
    chunk: usize,
    colv: usize,
    n_vecs: usize,
    rows: usize,
    k_dim: usize,
    row0: usize,
    s: usize,
    #[comptime] splits: usize,
    #[comptime] rpc: usize,
    #[comptime] unroll: usize,
    #[comptime] checked: bool,
) {
    let mut gr = Array::<Vector<F, N>>::new(unroll);
    let mut ur = Array::<Vector<F, N>>::new(unroll);
    load_chunk::<F, N>(
        wg, &mut gr, chunk, s, k_dim, n_vecs, colv, splits, unroll, checked,
    );
    load_chunk::<F, N>(
        wu, &mut ur, chunk, s, k_dim, n_vecs, colv, splits, unroll, checked,
    );
    fma_chunk::<F, N>(
        x, &gr, acc, 0usize, chunk, s, k_dim, rows, row0, splits, rpc, unroll, checked,
    );
    fma_chunk::<F, N>(
        x, &ur, acc, rpc, chunk, s, k_dim, rows, row0, splits, rpc, unroll, checked,
    );
}

/// Reads the chunk's `unroll` rows of column vector `colv` (zeros past `k_dim` when
/// `checked`) before any is used.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_chunk<F: Float, N: Size>(
    w: &Tensor<Vector<F, N>>,
    wr: &mut Array<Vector<F, N>>,
    chunk: usize,
    s: usize,
    k_dim: usize,
    n_vecs: usize,
    colv: usize,
    #[comptime] splits: usize,
    #[comptime] unroll: usize,
    #[comptime] checked: bool,
) {
    #[unroll]
    for u in 0..unroll {
        let k = (chunk * unroll + u) * splits + s;
        if checked {
            let mut wv = Vector::<F, N>::new(F::new(0.0));
            if k < k_dim {
                wv = w[k * n_vecs + colv];
            }
            wr[u] = wv;
        } else {
            wr[u] = w[k * n_vecs + colv];
        }
    }
}

/// `acc[first + r] += x[row0 + r, k] · wr[u]` for the chunk's rows `k` (those before `k_dim`
/// when `checked`) and the cube's rows.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fma_chunk<F: Float, N: Size>(
    x: &Tensor<F>,
    wr: &Array<Vector<F, N>>,
    acc: &mut Array<Vector<f32, N>>,
    #[comptime] first: usize,
    chunk: usize,
    s: usize,
    k_dim: usize,
    rows: usize,
    row0: usize,
    #[comptime] splits: usize,
    #[comptime] rpc: usize,
    #[comptime] unroll: usize,
    #[comptime] checked: bool,
) {
    #[unroll]
    for u in 0..unroll {
        let k = (chunk * unroll + u) * splits + s;
        if !checked || k < k_dim {
            let wf = Vector::<f32, N>::cast_from(wr[u]);
            #[unroll]
            for r in 0..rpc {
                let row = row0 + r;
                if rpc == 1 || row < rows {
                    let xv = f32::cast_from(x[row * k_dim + k]);
                    acc[first + r] += wf * Vector::<f32, N>::new(xv);
                }
            }
        }
    }
}

/// Sums the `splits` partials of each of a unit's `slots` accumulators through shared memory:
/// reducer `s` (of [`REDUCERS`]) adds slots `s, s + REDUCERS, …` into slot `s`, then every
/// unit of split 0 adds the reducers' sums, leaving its totals in `part[c · slots + i]`.
#[cube]
fn reduce_splits<N: Size>(
    part: &mut Shared<[Vector<f32, N>]>,
    acc: &Array<Vector<f32, N>>,
    c: usize,
    s: usize,
    #[comptime] cv: usize,
    #[comptime] splits: usize,
    #[comptime] slots: usize,
) {
    #[unroll]
    for i in 0..slots {
        part[(s * cv + c) * slots + i] = acc[i];
    }
    sync_cube();
    if s < REDUCERS {
        #[unroll]
        for i in 0..slots {
            let mut sum = part[(s * cv + c) * slots + i];
            #[unroll]
            for m in 1..comptime!(splits / REDUCERS) {
                sum += part[((s + m * REDUCERS) * cv + c) * slots + i];
            }
            part[(s * cv + c) * slots + i] = sum;
        }
    }
    sync_cube();
    if s == 0 {
        #[unroll]
        for i in 0..slots {
            let mut sum = part[c * slots + i];
            #[unroll]
            for m in 1..REDUCERS {
                sum += part[(m * cv + c) * slots + i];
            }
            part[c * slots + i] = sum;
        }
    }
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
    let plan = Plan::new(rows, k, &[n], x.dtype.size());
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
    let plan = Plan::new(rows, k, &ns, x.dtype.size());
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
    let plan = Plan::new(rows, k, &[n], x.dtype.size());
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
        let p = Plan::new(1, 576, &[576], 2);
        assert_eq!(
            (p.vec, p.cv, p.splits, p.rows_per_cube, p.unroll),
            (8, 2, 128, 1, 4)
        );
        assert_eq!(Plan::new(1, 4096, &[576], 2).unroll, 8);
        assert_eq!(Plan::new(1, 97, &[576], 4).vec, 4);
        assert_eq!(Plan::new(3, 97, &[45], 2).vec, 1);
        assert_eq!(Plan::new(3, 97, &[6], 2).vec, 2);
        assert_eq!(Plan::new(3, 97, &[576, 192, 36], 2).vec, 4);
        assert_eq!(Plan::new(3, 97, &[6], 2).rows_per_cube, MAX_ROWS_PER_CUBE);
        assert_eq!(Plan::new(2, 97, &[49_152], 2).cv, 4);
        for rows in 1..=16 {
            let p = Plan::new(rows, 97, &[200], 2);
            assert_eq!(p.cv * p.splits, UNITS);
            assert!(p.splits.is_multiple_of(REDUCERS));
        }
    }
}
