//! The GEMV kernels of [`super::linear`], split into their stages: the optional residual add
//! and RMSNorm of the input ([`norm_rows`], [`input_value`]), a chunk's loads of `W`
//! ([`load_chunk`]), its multiply-adds ([`fma_chunk`]), a unit's walk over the inner dimension
//! ([`product`]) and the cube's reduction of the split partials ([`reduce_splits`]).

use cubecl::prelude::*;

use super::rms_norm::{normed, residual_sum};

/// The row strides (in vectors) of a three-weight launch's `W`s: Burn pads the rows of
/// some tensors for alignment (a pitched layout), which the GEMVs read in place.
#[derive(CubeLaunch, CubeType, Clone, Copy, Debug)]
pub struct WeightRows {
    pub a: usize,
    pub b: usize,
    pub c: usize,
}

/// Units that sum the split partials in the first reduction pass (divides every `splits`).
const REDUCERS: usize = 8;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn gemv_kernel<F: Float, N: Size>(
    x: &Tensor<F>,
    w: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    rows: usize,
    k_dim: usize,
    n_vecs: usize,
    w_row: usize,
    #[comptime] cv: usize,
    #[comptime] splits: usize,
    #[comptime] rpc: usize,
    #[comptime] unroll: usize,
    #[comptime] stage: usize,
    #[define(F)] _dtype: ElemType,
) {
    let c = UNIT_POS_X as usize;
    let s = UNIT_POS_Y as usize;
    let colv = CUBE_POS_X as usize * cv + c;
    let row0 = CUBE_POS_Y as usize * rpc;
    let mut acc = zeros::<N>(rpc);
    let mut xs = staged_rows(rpc, stage);
    // No norm: `x` stands in for the norm's inputs, which are not read.
    let inv = Array::<f32>::new(1usize);
    stage_rows::<F>(
        x,
        x,
        x,
        &inv,
        &mut xs,
        rows,
        k_dim,
        row0,
        rpc,
        comptime!(cv * splits),
        false,
        stage,
    );
    if colv < n_vecs {
        product::<F, N>(
            x, x, x, &inv, &xs, w, &mut acc, 0usize, colv, w_row, rows, k_dim, row0, s, splits,
            rpc, unroll, false, stage,
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
/// the weight its column falls in. With `norm`, the input is `rms_norm(x + y)` (`gamma`,
/// `eps`; see [`norm_rows`]) and `x + y` goes to `sum`; without, `y`, `gamma` and `sum` are
/// not touched.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn gemv3_kernel<F: Float, N: Size>(
    x: &Tensor<F>,
    y: &Tensor<F>,
    gamma: &Tensor<F>,
    sum: &mut Tensor<F>,
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
    w_rows: WeightRows,
    eps: f32,
    #[comptime] cv: usize,
    #[comptime] splits: usize,
    #[comptime] rpc: usize,
    #[comptime] unroll: usize,
    #[comptime] norm: bool,
    #[comptime] stage: usize,
    #[define(F)] _dtype: ElemType,
) {
    let c = UNIT_POS_X as usize;
    let s = UNIT_POS_Y as usize;
    let colv = CUBE_POS_X as usize * cv + c;
    let row0 = CUBE_POS_Y as usize * rpc;
    let mut acc = zeros::<N>(rpc);
    let mut xs = staged_rows(rpc, stage);
    let inv = norm_prologue::<F>(
        x,
        y,
        gamma,
        sum,
        &mut xs,
        rows,
        k_dim,
        row0,
        eps,
        rpc,
        comptime!(cv * splits),
        norm,
        stage,
    );
    if colv < na {
        product::<F, N>(
            x, y, gamma, &inv, &xs, wa, &mut acc, 0usize, colv, w_rows.a, rows, k_dim, row0, s,
            splits, rpc, unroll, norm, stage,
        );
    } else if colv < na + nb {
        let cb = colv - na;
        product::<F, N>(
            x, y, gamma, &inv, &xs, wb, &mut acc, 0usize, cb, w_rows.b, rows, k_dim, row0, s,
            splits, rpc, unroll, norm, stage,
        );
    } else if colv < na + nb + nc {
        let cc = colv - na - nb;
        product::<F, N>(
            x, y, gamma, &inv, &xs, wc, &mut acc, 0usize, cc, w_rows.c, rows, k_dim, row0, s,
            splits, rpc, unroll, norm, stage,
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
/// column vector in the same unit (twice the reads in flight), the gate applied in f32. With
/// `norm`, the input is `rms_norm(x + y)` and `x + y` goes to `sum`, as in [`gemv3_kernel`].
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn gemv_swiglu_kernel<F: Float, N: Size>(
    x: &Tensor<F>,
    y: &Tensor<F>,
    gamma: &Tensor<F>,
    sum: &mut Tensor<F>,
    wg: &Tensor<Vector<F, N>>,
    wu: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    rows: usize,
    k_dim: usize,
    n_vecs: usize,
    g_row: usize,
    u_row: usize,
    eps: f32,
    #[comptime] cv: usize,
    #[comptime] splits: usize,
    #[comptime] rpc: usize,
    #[comptime] unroll: usize,
    #[comptime] norm: bool,
    #[comptime] stage: usize,
    #[define(F)] _dtype: ElemType,
) {
    let c = UNIT_POS_X as usize;
    let s = UNIT_POS_Y as usize;
    let colv = CUBE_POS_X as usize * cv + c;
    let row0 = CUBE_POS_Y as usize * rpc;
    let mut acc = zeros::<N>(comptime!(2 * rpc));
    let mut xs = staged_rows(rpc, stage);
    let inv = norm_prologue::<F>(
        x,
        y,
        gamma,
        sum,
        &mut xs,
        rows,
        k_dim,
        row0,
        eps,
        rpc,
        comptime!(cv * splits),
        norm,
        stage,
    );
    if colv < n_vecs {
        let full = k_dim / (splits * unroll);
        for chunk in 0..full {
            swiglu_chunk::<F, N>(
                x, y, gamma, &inv, &xs, wg, wu, &mut acc, chunk, colv, g_row, u_row, rows, k_dim,
                row0, s, splits, rpc, unroll, false, norm, stage,
            );
        }
        if full * splits * unroll < k_dim {
            swiglu_chunk::<F, N>(
                x, y, gamma, &inv, &xs, wg, wu, &mut acc, full, colv, g_row, u_row, rows, k_dim,
                row0, s, splits, rpc, unroll, true, norm, stage,
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

/// The inverse RMS of the cube's `rpc` rows where the launch fuses the norm (see
/// [`norm_rows`], which also writes `x + y` to `sum`; unread and unset without `norm`), and
/// with `stage` (the inner dimension, 0 for none) the cube's input rows in `xs`
/// (`[rpc, stage]` f32): each element computed once per cube, exactly as [`input_value`]
/// gives it, instead of once per column unit and product.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn norm_prologue<F: Float>(
    x: &Tensor<F>,
    y: &Tensor<F>,
    gamma: &Tensor<F>,
    sum: &mut Tensor<F>,
    xs: &mut Shared<[f32]>,
    rows: usize,
    k_dim: usize,
    row0: usize,
    eps: f32,
    #[comptime] rpc: usize,
    #[comptime] units: usize,
    #[comptime] norm: bool,
    #[comptime] stage: usize,
) -> Array<f32> {
    let mut inv = Array::<f32>::new(rpc);
    if norm {
        norm_rows::<F>(x, y, sum, &mut inv, rows, k_dim, row0, eps, rpc, units);
    }
    stage_rows::<F>(
        x, y, gamma, &inv, xs, rows, k_dim, row0, rpc, units, norm, stage,
    );
    inv
}

/// With `stage`, the cube's input rows into `xs` (`[rpc, stage]` f32), each element as
/// [`input_value`] gives it; nothing without.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_rows<F: Float>(
    x: &Tensor<F>,
    y: &Tensor<F>,
    gamma: &Tensor<F>,
    inv: &Array<f32>,
    xs: &mut Shared<[f32]>,
    rows: usize,
    k_dim: usize,
    row0: usize,
    #[comptime] rpc: usize,
    #[comptime] units: usize,
    #[comptime] norm: bool,
    #[comptime] stage: usize,
) {
    if comptime!(stage > 0) {
        let tid = UNIT_POS as usize;
        #[unroll]
        for r in 0..rpc {
            let row = row0 + r;
            if row < rows {
                let mut i = tid;
                while i < k_dim {
                    xs[r * stage + i] =
                        input_value::<F>(x, y, gamma, inv, row * k_dim + i, i, r, norm);
                    i += units;
                }
            }
        }
        sync_cube();
    }
}

/// The shared input rows of a launch: `[rpc, stage]` f32, or one unused slot without staging.
#[cube]
pub(super) fn staged_rows(#[comptime] rpc: usize, #[comptime] stage: usize) -> Shared<[f32]> {
    Shared::<[f32]>::new_slice(comptime!(if stage > 0 { rpc * stage } else { 1 }))
}

/// The norm prologue of a fused launch: for each of the cube's rows, `sum = x + y` (rounded
/// to the dtype, as a separate add stores it; written out by the cubes of the first column
/// block only) and `inv[r] = 1 / √(mean(sum²) + ε)`, all the cube's `units` sharing each row
/// (a shared-memory tree).
#[cube]
#[allow(clippy::too_many_arguments)]
fn norm_rows<F: Float>(
    x: &Tensor<F>,
    y: &Tensor<F>,
    sum: &mut Tensor<F>,
    inv: &mut Array<f32>,
    rows: usize,
    k_dim: usize,
    row0: usize,
    eps: f32,
    #[comptime] rpc: usize,
    #[comptime] units: usize,
) {
    let tid = UNIT_POS as usize;
    let write = CUBE_POS_X == 0;
    let mut red = Shared::<[f32]>::new_slice(comptime!(rpc * units));
    #[unroll]
    for r in 0..rpc {
        let row = row0 + r;
        let mut squares = f32::new(0.0);
        if row < rows {
            let mut i = tid;
            while i < k_dim {
                let at = row * k_dim + i;
                let v = residual_sum::<F>(x, y, at);
                if write {
                    sum[at] = v;
                }
                let f = f32::cast_from(v);
                squares += f * f;
                i += units;
            }
        }
        red[r * units + tid] = squares;
    }
    sync_cube();
    // Runtime, not comptime: the loop mutates it.
    let mut half = CUBE_DIM as usize / 2;
    while half > 0 {
        if tid < half {
            #[unroll]
            for r in 0..rpc {
                red[r * units + tid] += red[r * units + tid + half];
            }
        }
        sync_cube();
        half /= 2;
    }
    #[unroll]
    for r in 0..rpc {
        inv[r] = f32::new(1.0) / f32::sqrt(red[r * units] / f32::cast_from(k_dim) + eps);
    }
}

/// Element `k` of row `r`'s input at `at`: `x` itself, or with `norm` the normed residual
/// sum `(x + y) · inv[r] · γ[k]`, each step rounded to the dtype as the separate add and norm
/// store it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn input_value<F: Float>(
    x: &Tensor<F>,
    y: &Tensor<F>,
    gamma: &Tensor<F>,
    inv: &Array<f32>,
    at: usize,
    k: usize,
    r: usize,
    #[comptime] norm: bool,
) -> f32 {
    let mut v = f32::cast_from(x[at]);
    if norm {
        let s = F::cast_from(v + f32::cast_from(y[at]));
        v = f32::cast_from(normed::<F>(s, inv[r], gamma[k]));
    }
    v
}

#[cube]
pub(super) fn zeros<N: Size>(#[comptime] len: usize) -> Array<Vector<f32, N>> {
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
pub(super) fn product<F: Float, N: Size>(
    x: &Tensor<F>,
    y: &Tensor<F>,
    gamma: &Tensor<F>,
    inv: &Array<f32>,
    xs: &Shared<[f32]>,
    w: &Tensor<Vector<F, N>>,
    acc: &mut Array<Vector<f32, N>>,
    #[comptime] first: usize,
    colv: usize,
    w_row: usize,
    rows: usize,
    k_dim: usize,
    row0: usize,
    s: usize,
    #[comptime] splits: usize,
    #[comptime] rpc: usize,
    #[comptime] unroll: usize,
    #[comptime] norm: bool,
    #[comptime] stage: usize,
) {
    let full = k_dim / (splits * unroll);
    for chunk in 0..full {
        let mut wr = Array::<Vector<F, N>>::new(unroll);
        load_chunk::<F, N>(
            w, &mut wr, chunk, s, k_dim, w_row, colv, splits, unroll, false,
        );
        fma_chunk::<F, N>(
            x, y, gamma, inv, xs, &wr, acc, first, chunk, s, k_dim, rows, row0, splits, rpc,
            unroll, false, norm, stage,
        );
    }
    if full * splits * unroll < k_dim {
        let mut wr = Array::<Vector<F, N>>::new(unroll);
        load_chunk::<F, N>(
            w, &mut wr, full, s, k_dim, w_row, colv, splits, unroll, true,
        );
        fma_chunk::<F, N>(
            x, y, gamma, inv, xs, &wr, acc, first, full, s, k_dim, rows, row0, splits, rpc, unroll,
            true, norm, stage,
        );
    }
}

/// One chunk of both SwiGLU products: the gate's sums in `acc[..rpc]`, the up's after.
#[cube]
#[allow(clippy::too_many_arguments)]
fn swiglu_chunk<F: Float, N: Size>(
    x: &Tensor<F>,
    y: &Tensor<F>,
    gamma: &Tensor<F>,
    inv: &Array<f32>,
    xs: &Shared<[f32]>,
    wg: &Tensor<Vector<F, N>>,
    wu: &Tensor<Vector<F, N>>,
    acc: &mut Array<Vector<f32, N>>,
    chunk: usize,
    colv: usize,
    g_row: usize,
    u_row: usize,
    rows: usize,
    k_dim: usize,
    row0: usize,
    s: usize,
    #[comptime] splits: usize,
    #[comptime] rpc: usize,
    #[comptime] unroll: usize,
    #[comptime] checked: bool,
    #[comptime] norm: bool,
    #[comptime] stage: usize,
) {
    let mut gr = Array::<Vector<F, N>>::new(unroll);
    let mut ur = Array::<Vector<F, N>>::new(unroll);
    load_chunk::<F, N>(
        wg, &mut gr, chunk, s, k_dim, g_row, colv, splits, unroll, checked,
    );
    load_chunk::<F, N>(
        wu, &mut ur, chunk, s, k_dim, u_row, colv, splits, unroll, checked,
    );
    fma_chunk::<F, N>(
        x, y, gamma, inv, xs, &gr, acc, 0usize, chunk, s, k_dim, rows, row0, splits, rpc, unroll,
        checked, norm, stage,
    );
    fma_chunk::<F, N>(
        x, y, gamma, inv, xs, &ur, acc, rpc, chunk, s, k_dim, rows, row0, splits, rpc, unroll,
        checked, norm, stage,
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
    w_row: usize,
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
                wv = w[k * w_row + colv];
            }
            wr[u] = wv;
        } else {
            wr[u] = w[k * w_row + colv];
        }
    }
}

/// `acc[first + r] += x[row0 + r, k] · wr[u]` for the chunk's rows `k` (those before `k_dim`
/// when `checked`) and the cube's rows.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fma_chunk<F: Float, N: Size>(
    x: &Tensor<F>,
    y: &Tensor<F>,
    gamma: &Tensor<F>,
    inv: &Array<f32>,
    xs: &Shared<[f32]>,
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
    #[comptime] norm: bool,
    #[comptime] stage: usize,
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
                    let xv = if comptime!(stage > 0) {
                        xs[r * stage + k]
                    } else {
                        input_value::<F>(x, y, gamma, inv, row * k_dim + k, k, r, norm)
                    };
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
pub(super) fn reduce_splits<N: Size>(
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
