//! `x · W` for a few rows (decode steps, speculative verification): a split-K GEMV with a light
//! launch, built to keep many 16-byte reads of `W` in flight.
//!
//! At decode sizes (SmolLM2: `W` of 576 × 576 half floats, 663 KB) the product is bound by how
//! many bytes are in flight, not by bandwidth: the whole matrix is less than what an H100 keeps
//! in flight (~3.3 TB/s × ~600 ns ≈ 2 MB). So a unit reads a vector of `vec` adjacent columns
//! (16 bytes) from 4 rows (8 for long inner dimensions) before it uses any of them, a cube owns only `cv` such column
//! vectors (so a 576-column product still spreads over 36 cubes) and splits the inner dimension
//! over `splits` units; each cube takes one row of `x` (`DEFAULT_ROWS_PER_CUBE`), or up to
//! [`MAX_ROWS_PER_CUBE`] sharing each read of `W` where `BURN_KERNELS_GEMV_RPC` asks.
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
    kernel::{into_contiguous, untile},
    ops::numeric::empty_device_contiguous_dtype,
    tensor::CubeTensor,
};
use cubecl::prelude::*;

use super::gemv::{WeightRowsLaunch, gemv_kernel, gemv_swiglu_kernel, gemv3_kernel};

/// Units per cube (`cv × splits`).
const UNITS: usize = 256;
/// Rows of `W` a unit loads before it multiplies; twice as many for long inner dimensions
/// (from [`LONG_K`]), whose few cubes must keep more bytes in flight each.
const UNROLL: usize = 4;
const LONG_K: usize = 2048;
/// Most rows of `x` one cube multiplies with each read of `W` (`BURN_KERNELS_GEMV_RPC=2|4`).
pub const MAX_ROWS_PER_CUBE: usize = 4;
/// Rows of `x` per cube unless `BURN_KERNELS_GEMV_RPC` says otherwise: one. On an H200
/// (2026-12-05, SmolLM2 shape, f16, the replayed decode step, median of 32) batch 8 took
/// 1.641 ms at one row a cube, 1.890 at two and 2.568 at four; batch 32 3.324 at one and
/// 3.383 at four. The other cubes' reads of the same `W` come from L2.
const DEFAULT_ROWS_PER_CUBE: usize = 1;
/// Most bytes of shared memory a cube spends on its rows of the input (f32) where it stages
/// them (computed once per cube, with the norm applied, instead of by every column unit at
/// every multiply-add; see [`stage_len`]).
const STAGE_BYTES: usize = 32 << 10;

/// The launch's shape parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Plan {
    /// Columns per vector read (16 bytes where `n` allows).
    pub(super) vec: usize,
    /// Column vectors per cube.
    pub(super) cv: usize,
    /// Units along the inner dimension (`UNITS / cv`).
    pub(super) splits: usize,
    /// Rows of `x` per cube.
    pub(super) rows_per_cube: usize,
    /// Rows of `W` a unit reads before it multiplies.
    pub(super) unroll: usize,
    /// The inner dimension where the cube stages its input rows in shared memory, else 0.
    pub(super) stage: usize,
}

impl Plan {
    /// A plan for products with `ns` columns each (one launch), `rows` rows of `x`, an
    /// inner dimension of `k`, `slots` f32 accumulator vectors per row of `x` (two for the
    /// SwiGLU launch), within `max_shared` bytes of shared memory per cube and at most `most`
    /// rows of `x` per cube ([`rows_cap`] for the launches).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        rows: usize,
        k: usize,
        ns: &[usize],
        elem_bytes: usize,
        slots: usize,
        norm: bool,
        max_shared: usize,
        most: usize,
    ) -> Self {
        let vec = vector_width(ns, elem_bytes);
        let n_vecs = ns.iter().sum::<usize>() / vec;
        // Two column vectors per cube keep a plane's reads at 32-byte sectors while small
        // products still cover many SMs; wide ones (from 512 vectors: Llama-3-8B's every
        // projection, the LM heads) have cubes to spare and read 64 bytes a row. Measured on
        // an H200 (2026-11-28, Llama-3-8B decode step, all projections forced): 2 vectors
        // 7.57 ms, 4 vectors 6.46, 8 vectors 6.68.
        let cv = tuning("BURN_KERNELS_GEMV_CV").unwrap_or(if n_vecs >= 512 { 4 } else { 2 });
        let mut rows_per_cube = match rows {
            0..=1 => 1,
            2 => 2,
            _ => MAX_ROWS_PER_CUBE,
        }
        .min(most);
        // Every unit parks its partial sums in shared memory for the reduction (and, with a
        // norm in front, its sum of squares per row).
        // Without staged input rows the kernels still declare one f32 of shared memory for
        // them.
        let per_row = UNITS * (slots * vec + usize::from(norm)) * 4;
        while rows_per_cube > 1 && per_row * rows_per_cube + 4 > max_shared {
            rows_per_cube /= 2;
        }
        let staging = tuning("BURN_KERNELS_GEMV_STAGE") == Some(1);
        let stage = stage_len(
            k,
            rows_per_cube * per_row,
            rows_per_cube,
            max_shared,
            staging,
        );
        Self {
            vec,
            cv,
            splits: UNITS / cv,
            rows_per_cube,
            unroll: tuning("BURN_KERNELS_GEMV_UNROLL").unwrap_or(if k >= LONG_K {
                2 * UNROLL
            } else {
                UNROLL
            }),
            stage,
        }
    }

    /// [`Plan::new`] for a launch reading `x`: its element size, its device's shared memory
    /// and [`rows_cap`].
    pub(super) fn for_input(
        x: &CubeTensor,
        rows: usize,
        k: usize,
        ns: &[usize],
        slots: usize,
        norm: bool,
    ) -> Self {
        let elem = x.dtype.size();
        Self::new(rows, k, ns, elem, slots, norm, max_shared(x), rows_cap())
    }
}

/// The most rows of `x` per cube: `BURN_KERNELS_GEMV_RPC`, else [`DEFAULT_ROWS_PER_CUBE`].
pub(super) fn rows_cap() -> usize {
    tuning("BURN_KERNELS_GEMV_RPC").unwrap_or(DEFAULT_ROWS_PER_CUBE)
}

/// The inner dimension `k` where a cube of `rpc` rows stages its input rows in shared memory
/// (`rpc · k` f32 within [`STAGE_BYTES`], beside `partials` bytes of partial sums), else 0.
/// Off unless `enabled` (`BURN_KERNELS_GEMV_STAGE=1`): on an H200 (2026-12-05, SmolLM2 shape,
/// f16, the replayed decode step) staging made batch 1 slower (0.958 against 0.891 ms) and
/// batch 8 no faster (2.562 against 2.513 ms).
fn stage_len(k: usize, partials: usize, rpc: usize, max_shared: usize, enabled: bool) -> usize {
    let staged = rpc * k * 4;
    match enabled && staged <= STAGE_BYTES && partials + staged <= max_shared {
        true => k,
        false => 0,
    }
}

/// Columns per vector read for products with `ns` columns of `elem_bytes` each: 16 bytes
/// where every `n` allows, else the widest that divides them all.
pub(super) fn vector_width(ns: &[usize], elem_bytes: usize) -> usize {
    let widest = (16 / elem_bytes).max(1);
    [8, 4, 2, 1]
        .into_iter()
        .find(|v| *v <= widest && ns.iter().all(|n| n.is_multiple_of(*v)))
        .unwrap_or(1)
}

/// A plan parameter forced by the environment variable `name` (1, 2, 4 or 8; `_RPC`: the
/// most rows of `x` per cube, 1, 2 or 4; `_STAGE`: 1 stages the input rows in shared
/// memory), for measuring plans against each other on a device (`bench --suite llama`,
/// `decode_profile`); unset, the plan decides.
fn tuning(name: &str) -> Option<usize> {
    use std::sync::OnceLock;
    static CV: OnceLock<Option<usize>> = OnceLock::new();
    static UNROLL: OnceLock<Option<usize>> = OnceLock::new();
    static RPC: OnceLock<Option<usize>> = OnceLock::new();
    static STAGE: OnceLock<Option<usize>> = OnceLock::new();
    let (cell, allowed): (_, &[usize]) = if name.ends_with("_CV") {
        (&CV, &[2, 4, 8])
    } else if name.ends_with("_RPC") {
        (&RPC, &[1, 2, 4])
    } else if name.ends_with("_STAGE") {
        (&STAGE, &[0, 1])
    } else {
        (&UNROLL, &[2, 4, 8])
    };
    *cell.get_or_init(|| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|v| allowed.contains(v))
    })
}

/// `w` (`[k, n]`) as the kernels read it, and its row stride in `vec`-column vectors: rows of
/// unit-stride columns are read in place wherever they start, so a pitched layout (rows Burn
/// pads for alignment, e.g. SmolLM2's 576-column projections) costs no copy; copying it made
/// every decode step copy most of a model's weights. Strided columns are copied.
pub(super) fn weight_rows(w: CubeTensor, vec: usize) -> (CubeTensor, usize) {
    let w = untile(w);
    let [k, n] = w.meta.shape().dims::<2>();
    let [row, col] = [w.meta.strides()[0], w.meta.strides()[1]];
    if k <= 1 {
        (w, n / vec)
    } else if (col == 1 || n == 1) && row >= n && row.is_multiple_of(vec) {
        (w, row / vec)
    } else {
        (into_contiguous(w), n / vec)
    }
}

/// Shared memory a cube may use on `x`'s device.
pub(super) fn max_shared(x: &CubeTensor) -> usize {
    x.client.properties().hardware.max_shared_memory_size
}

/// A `[rows, n]` output of `x`'s dtype on `x`'s device.
pub(super) fn output(x: &CubeTensor, rows: usize, n: usize) -> CubeTensor {
    empty_device_contiguous_dtype(
        x.client.clone(),
        x.device.clone(),
        Shape::new([rows, n]),
        x.dtype,
    )
}

/// The grid and cube of a plan over `n_vecs` column vectors.
pub(super) fn launch_dims(plan: &Plan, rows: usize, n_vecs: usize) -> (CubeCount, CubeDim) {
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
    let [rows, k] = x.meta.shape().dims::<2>();
    let [_, n] = w.meta.shape().dims::<2>();
    let out = output(&x, rows, n);
    if rows == 0 || n == 0 {
        return out;
    }
    let plan = Plan::for_input(&x, rows, k, &[n], 1, false);
    let (w, w_row) = weight_rows(w, plan.vec);
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
        w_row,
        plan.cv,
        plan.splits,
        plan.rows_per_cube,
        plan.unroll,
        plan.stage,
        dtype_to_storage_type(dtype),
    );
    out
}

/// The residual add and RMSNorm a fused launch applies to its input: `rms_norm(x + y)` with
/// `gamma` and `eps`; the launch also returns `x + y` (the residual stream).
#[derive(Debug, Clone)]
pub struct NormIn {
    /// `[rows, k]`, `x`'s shape and dtype.
    pub y: CubeTensor,
    /// `[k]` in `x`'s dtype.
    pub gamma: CubeTensor,
    pub eps: f64,
}

/// The tensors a launch with an optional norm binds: `y`, `gamma` and the sum output, or
/// stand-ins (`x` and a one-element buffer the kernel does not touch) without a norm.
fn norm_args(x: &CubeTensor, norm: Option<NormIn>) -> (CubeTensor, CubeTensor, CubeTensor, f32) {
    match norm {
        Some(n) => {
            let [rows, k] = x.meta.shape().dims::<2>();
            let (y, gamma) = (into_contiguous(n.y), into_contiguous(n.gamma));
            (y, gamma, output(x, rows, k), n.eps as f32)
        }
        None => (x.clone(), x.clone(), output(x, 1, 1), 0.0),
    }
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
    let (a, b, c, _) = gemv3_with(x, None, wa, wb, wc);
    (a, b, c)
}

/// `(x + y, h · wa, h · wb, h · wc)` with `h = rms_norm(x + y)`, in one launch: a layer's
/// residual add, attention norm and Q, K, V projections.
///
/// # Shapes
/// - `x`: `[rows, k]`, `norm.y`: `[rows, k]`, `norm.gamma`: `[k]`, the weights as [`gemv3`];
///   returns `[rows, k]` and the three products
pub fn norm_gemv3(
    x: CubeTensor,
    norm: NormIn,
    wa: CubeTensor,
    wb: CubeTensor,
    wc: CubeTensor,
) -> (CubeTensor, CubeTensor, CubeTensor, CubeTensor) {
    let (a, b, c, sum) = gemv3_with(x, Some(norm), wa, wb, wc);
    (sum, a, b, c)
}

fn gemv3_with(
    x: CubeTensor,
    norm: Option<NormIn>,
    wa: CubeTensor,
    wb: CubeTensor,
    wc: CubeTensor,
) -> (CubeTensor, CubeTensor, CubeTensor, CubeTensor) {
    let x = into_contiguous(x);
    let [rows, k] = x.meta.shape().dims::<2>();
    let ns = [&wa, &wb, &wc].map(|w| w.meta.shape().dims::<2>()[1]);
    let [oa, ob, oc] = ns.map(|n| output(&x, rows, n));
    let has_norm = norm.is_some();
    let (y, gamma, sum, eps) = norm_args(&x, norm);
    if rows == 0 || ns.iter().sum::<usize>() == 0 {
        return (oa, ob, oc, sum);
    }
    let plan = Plan::for_input(&x, rows, k, &ns, 1, has_norm);
    let [(wa, ra), (wb, rb), (wc, rc)] = [wa, wb, wc].map(|w| weight_rows(w, plan.vec));
    let [na, nb, nc] = ns.map(|n| n / plan.vec);
    let (count, dim) = launch_dims(&plan, rows, na + nb + nc);
    let (client, dtype) = (x.client.clone(), x.dtype);
    gemv3_kernel::launch(
        &client,
        count,
        dim,
        plan.vec,
        x.into_tensor_arg(),
        y.into_tensor_arg(),
        gamma.into_tensor_arg(),
        sum.clone().into_tensor_arg(),
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
        WeightRowsLaunch::new(ra, rb, rc),
        eps,
        plan.cv,
        plan.splits,
        plan.rows_per_cube,
        plan.unroll,
        has_norm,
        plan.stage,
        dtype_to_storage_type(dtype),
    );
    (oa, ob, oc, sum)
}

/// `silu(x · wg) · (x · wu)` in one launch, accumulated in f32.
///
/// # Shapes
/// - `x`: `[rows, k]`, `wg`, `wu`: `[k, n]` in `x`'s dtype; returns `[rows, n]`
pub fn gemv_swiglu(x: CubeTensor, wg: CubeTensor, wu: CubeTensor) -> CubeTensor {
    gemv_swiglu_with(x, None, wg, wu).0
}

/// `(x + y, silu(h · wg) · (h · wu))` with `h = rms_norm(x + y)`, in one launch: a layer's
/// residual add after the attention, MLP norm and gated first half.
///
/// # Shapes
/// - `x`, `norm.y`: `[rows, k]`, `norm.gamma`: `[k]`, `wg`, `wu`: `[k, n]`; returns
///   `[rows, k]` and `[rows, n]`
pub fn norm_gemv_swiglu(
    x: CubeTensor,
    norm: NormIn,
    wg: CubeTensor,
    wu: CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let (out, sum) = gemv_swiglu_with(x, Some(norm), wg, wu);
    (sum, out)
}

fn gemv_swiglu_with(
    x: CubeTensor,
    norm: Option<NormIn>,
    wg: CubeTensor,
    wu: CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let x = into_contiguous(x);
    let [rows, k] = x.meta.shape().dims::<2>();
    let [_, n] = wg.meta.shape().dims::<2>();
    let out = output(&x, rows, n);
    let has_norm = norm.is_some();
    let (y, gamma, sum, eps) = norm_args(&x, norm);
    if rows == 0 || n == 0 {
        return (out, sum);
    }
    let plan = Plan::for_input(&x, rows, k, &[n], 2, has_norm);
    let [(wg, g_row), (wu, u_row)] = [wg, wu].map(|w| weight_rows(w, plan.vec));
    let n_vecs = n / plan.vec;
    let (count, dim) = launch_dims(&plan, rows, n_vecs);
    let (client, dtype) = (x.client.clone(), x.dtype);
    gemv_swiglu_kernel::launch(
        &client,
        count,
        dim,
        plan.vec,
        x.into_tensor_arg(),
        y.into_tensor_arg(),
        gamma.into_tensor_arg(),
        sum.clone().into_tensor_arg(),
        wg.into_tensor_arg(),
        wu.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        rows,
        k,
        n_vecs,
        g_row,
        u_row,
        eps,
        plan.cv,
        plan.splits,
        plan.rows_per_cube,
        plan.unroll,
        has_norm,
        plan.stage,
        dtype_to_storage_type(dtype),
    );
    (out, sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_read_16_bytes_where_the_columns_allow() {
        // Plans with up to MAX_ROWS_PER_CUBE rows a cube (the shared-memory budget's cases).
        let plan = |rows, k, ns: &[usize], elem, slots, norm, shared| {
            Plan::new(rows, k, ns, elem, slots, norm, shared, MAX_ROWS_PER_CUBE)
        };
        let p = plan(1, 576, &[576], 2, 1, false, 48 << 10);
        assert_eq!(
            (p.vec, p.cv, p.splits, p.rows_per_cube, p.unroll),
            (8, 2, 128, 1, 4)
        );
        assert_eq!(plan(1, 4096, &[576], 2, 1, false, 48 << 10).unroll, 8);
        assert_eq!(plan(1, 97, &[576], 4, 1, false, 48 << 10).vec, 4);
        assert_eq!(plan(3, 97, &[45], 2, 1, false, 48 << 10).vec, 1);
        assert_eq!(plan(3, 97, &[6], 2, 1, false, 48 << 10).vec, 2);
        assert_eq!(plan(3, 97, &[576, 192, 36], 2, 1, false, 48 << 10).vec, 4);
        assert_eq!(
            plan(3, 97, &[6], 2, 1, false, 48 << 10).rows_per_cube,
            MAX_ROWS_PER_CUBE
        );
        assert_eq!(plan(2, 97, &[49_152], 2, 1, false, 48 << 10).cv, 4);
        assert_eq!(plan(1, 4096, &[4096], 2, 1, false, 48 << 10).cv, 4);
        assert_eq!(plan(1, 576, &[576, 192, 192], 2, 1, false, 48 << 10).cv, 2);
        // Partial sums that would not fit shared memory take fewer rows per cube.
        assert_eq!(plan(3, 97, &[576], 2, 2, false, 48 << 10).rows_per_cube, 2);
        assert_eq!(
            plan(3, 97, &[576], 2, 2, false, (32 << 10) + 4).rows_per_cube,
            2
        );
        assert_eq!(plan(3, 97, &[576], 2, 2, false, 16 << 10).rows_per_cube, 1);
        assert_eq!(
            plan(3, 97, &[576], 2, 1, false, (16 << 10) + 4).rows_per_cube,
            2
        );
        assert_eq!(plan(3, 97, &[576], 2, 1, false, 16 << 10).rows_per_cube, 1);
        // A norm in front adds a sum of squares per unit and row.
        assert_eq!(plan(3, 97, &[576], 2, 2, true, 32 << 10).rows_per_cube, 1);
        assert_eq!(plan(3, 97, &[576], 2, 1, false, 34 << 10).rows_per_cube, 4);
        assert_eq!(plan(3, 97, &[576], 2, 1, true, 34 << 10).rows_per_cube, 2);
        // Staged input rows (when enabled) where they fit beside the partial sums.
        assert_eq!(stage_len(576, 4 * 17408, 4, 227 << 10, true), 576);
        assert_eq!(stage_len(576, 4 * 17408, 4, 227 << 10, false), 0);
        assert_eq!(stage_len(1536, 4 * 8192, 4, 227 << 10, true), 1536);
        assert_eq!(stage_len(4096, 4 * 8192, 4, 227 << 10, true), 0);
        assert_eq!(stage_len(4096, 8192, 1, 227 << 10, true), 4096);
        assert_eq!(stage_len(131, 2 * 8192, 2, (16 << 10) + 4, true), 0);
        assert_eq!(stage_len(131, 2 * 8192, 2, 32 << 10, true), 131);
        // One row a cube by default.
        if std::env::var_os("BURN_KERNELS_GEMV_RPC").is_none() {
            assert_eq!(
                Plan::new(8, 576, &[576], 2, 1, false, 48 << 10, rows_cap()).rows_per_cube,
                1
            );
        }
        for rows in 1..=16 {
            let p = plan(rows, 97, &[200], 2, 1, false, 48 << 10);
            assert_eq!(p.cv * p.splits, UNITS);
            assert!(p.splits.is_multiple_of(8), "the reducers divide the splits");
        }
    }
}
