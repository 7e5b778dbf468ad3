//! A decode layer's steps before its attention in one launch: the residual add and RMSNorm,
//! the Q, K and V GEMVs of [`super::linear::norm_gemv3`], RoPE of the queries and keys, and
//! the keys' and values' store into a static KV cache at device-held positions (what
//! `rope2` and `store_kv` did in two more launches).
//!
//! The grid walks the column vectors in RoPE pairs: unit `c` of a cube takes member `c % 2`
//! of pair `c / 2`, the vectors `j` and `j + d/2` of one head, so after the split reduction
//! both halves of every rotated pair sit in the cube's shared memory and the epilogue rotates
//! them there. Everything else (the plan, the loads, the reduction) is the GEMV's.

use burn::backend::cubecl::dtype_to_storage_type;
use burn_cubecl::{kernel::into_contiguous, tensor::CubeTensor};
use cubecl::prelude::*;

use super::gemv::{
    WeightRows, WeightRowsLaunch, norm_prologue, product, reduce_splits, staged_rows, zeros,
};
use super::linear::{NormIn, Plan, launch_dims, output, vector_width, weight_rows};

/// Sizes of one launch (column counts in vectors).
#[derive(CubeLaunch, CubeType, Clone, Copy, Debug)]
pub struct QkvDims {
    pub rows: usize,
    pub k_dim: usize,
    /// Query and key (= value) column vectors.
    pub nq: usize,
    pub nk: usize,
    /// New positions per sequence (`rows = batch · seq`).
    pub seq: usize,
    pub capacity: usize,
    pub eps: f32,
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn qkv_rope_store_kernel<F: Float, I: Int, N: Size>(
    x: &Tensor<F>,
    y: &Tensor<F>,
    gamma: &Tensor<F>,
    sum: &mut Tensor<F>,
    wq: &Tensor<Vector<F, N>>,
    wk: &Tensor<Vector<F, N>>,
    wv: &Tensor<Vector<F, N>>,
    q_out: &mut Tensor<Vector<F, N>>,
    kc: &mut Tensor<Vector<F, N>>,
    vc: &mut Tensor<Vector<F, N>>,
    positions: &Tensor<I>,
    index: &Tensor<I>,
    cos: &Tensor<Vector<f32, N>>,
    sin: &Tensor<Vector<f32, N>>,
    dims: QkvDims,
    w_rows: WeightRows,
    #[comptime] cv: usize,
    #[comptime] splits: usize,
    #[comptime] rpc: usize,
    #[comptime] unroll: usize,
    #[comptime] hv: usize,
    #[comptime] stage: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let c = UNIT_POS_X as usize;
    let s = UNIT_POS_Y as usize;
    let half = comptime!(hv / 2);
    let pair = CUBE_POS_X as usize * comptime!(cv / 2) + c / 2;
    let member = c % 2;
    let colv = (pair / half) * hv + pair % half + member * half;
    let nq = dims.nq;
    let nk = dims.nk;
    let n_vecs = nq + 2 * nk;
    let row0 = CUBE_POS_Y as usize * rpc;
    // The epilogue's reads (each row's position, its angles, its cache slot), issued before the
    // products so that their round trips overlap them: after the epilogue's first store the
    // compiler could no longer move them ahead, and they cost two round trips per row.
    let j = pair % half;
    let mut cs = Array::<Vector<f32, N>>::new(rpc);
    let mut sn = Array::<Vector<f32, N>>::new(rpc);
    let mut at = Array::<u32>::new(rpc);
    if s == 0 {
        #[unroll]
        for r in 0..rpc {
            let mut row = row0 + r;
            if row >= dims.rows {
                row = dims.rows - 1;
            }
            // Positions are never negative (the model clamps padding to 0).
            let t = usize::cast_from(positions[row]) * half + j;
            cs[r] = cos[t];
            sn[r] = sin[t];
            at[r] = u32::cast_from(index[row % dims.seq]);
        }
    }
    let mut acc = zeros::<N>(rpc);
    let mut xs = staged_rows(rpc, stage);
    let inv = norm_prologue::<F>(
        x,
        y,
        gamma,
        sum,
        &mut xs,
        dims.rows,
        dims.k_dim,
        row0,
        dims.eps,
        rpc,
        comptime!(cv * splits),
        true,
        stage,
    );
    if colv < nq {
        product::<F, N>(
            x, y, gamma, &inv, &xs, wq, &mut acc, 0usize, colv, w_rows.a, dims.rows, dims.k_dim,
            row0, s, splits, rpc, unroll, true, stage,
        );
    } else if colv < nq + nk {
        product::<F, N>(
            x,
            y,
            gamma,
            &inv,
            &xs,
            wk,
            &mut acc,
            0usize,
            colv - nq,
            w_rows.b,
            dims.rows,
            dims.k_dim,
            row0,
            s,
            splits,
            rpc,
            unroll,
            true,
            stage,
        );
    } else if colv < n_vecs {
        product::<F, N>(
            x,
            y,
            gamma,
            &inv,
            &xs,
            wv,
            &mut acc,
            0usize,
            colv - nq - nk,
            w_rows.c,
            dims.rows,
            dims.k_dim,
            row0,
            s,
            splits,
            rpc,
            unroll,
            true,
            stage,
        );
    }
    let mut part = Shared::<[Vector<f32, N>]>::new_slice(comptime!(splits * cv * rpc));
    reduce_splits::<N>(&mut part, &acc, c, s, cv, splits, rpc);
    // The partner's totals are another unit's.
    sync_cube();
    if s == 0 && colv < n_vecs {
        let partner = c + 1 - 2 * member;
        #[unroll]
        for r in 0..rpc {
            let row = row0 + r;
            if row < dims.rows {
                write_row::<F, N>(
                    &part,
                    q_out,
                    kc,
                    vc,
                    cs[r],
                    sn[r],
                    usize::cast_from(at[r]),
                    nq,
                    nk,
                    dims.seq,
                    dims.capacity,
                    c,
                    partner,
                    member,
                    colv,
                    row,
                    r,
                    rpc,
                    hv,
                );
            }
        }
    }
}

/// Row `row`'s value of column vector `colv` (this unit's total, rounded to the dtype as a
/// separate projection stores it): rotated by the angles `cs`, `sn` with its pair's other half
/// `partner` where it is a query or a key (`member` 0 is the first half), then stored to the
/// queries, or to the cache at slot `at`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_row<F: Float, N: Size>(
    part: &Shared<[Vector<f32, N>]>,
    q_out: &mut Tensor<Vector<F, N>>,
    kc: &mut Tensor<Vector<F, N>>,
    vc: &mut Tensor<Vector<F, N>>,
    cs: Vector<f32, N>,
    sn: Vector<f32, N>,
    at: usize,
    nq: usize,
    nk: usize,
    seq: usize,
    capacity: usize,
    c: usize,
    partner: usize,
    member: usize,
    colv: usize,
    row: usize,
    r: usize,
    #[comptime] rpc: usize,
    #[comptime] hv: usize,
) {
    let own = Vector::<f32, N>::cast_from(Vector::<F, N>::cast_from(part[c * rpc + r]));
    // The sequence this row belongs to (its cache slot is `at`).
    let b = row / seq;
    if colv < nq + nk {
        let other = Vector::<f32, N>::cast_from(Vector::<F, N>::cast_from(part[partner * rpc + r]));
        // First half: x1·cos − x2·sin; second half: x2·cos + x1·sin.
        let sign = Vector::<f32, N>::new(f32::cast_from(member) * f32::new(2.0) - f32::new(1.0));
        let rotated = Vector::<F, N>::cast_from(own * cs + sign * other * sn);
        if colv < nq {
            q_out[row * nq + colv] = rotated;
        } else {
            let ck = colv - nq;
            let head = ck / hv;
            kc[((b * (nk / hv) + head) * capacity + at) * hv + ck % hv] = rotated;
        }
    } else {
        let vcol = colv - nq - nk;
        let head = vcol / hv;
        vc[((b * (nk / hv) + head) * capacity + at) * hv + vcol % hv] =
            Vector::<F, N>::cast_from(own);
    }
}

/// Why the one-launch kernel cannot run these shapes, if it cannot: the rotated pairs must
/// fall in whole vectors (`head_dim` a multiple of twice the vector width) and every
/// projection must be whole heads.
pub fn unsupported(ns: [usize; 3], head_dim: usize, elem_bytes: usize) -> Option<String> {
    let vec = vector_width(&ns, elem_bytes);
    if head_dim == 0 || !head_dim.is_multiple_of(2 * vec) {
        Some(format!(
            "head dim {head_dim} is not a multiple of twice the vector width {vec}"
        ))
    } else if ns.iter().any(|n| !n.is_multiple_of(head_dim)) || ns[1] != ns[2] {
        Some(format!(
            "projections {ns:?} are not whole heads of {head_dim}"
        ))
    } else {
        None
    }
}

/// The static cache's part of [`norm_gemv3_rope_store`]: where the keys and values go.
#[derive(Debug, Clone)]
pub struct CacheWrite {
    /// `[batch, kv_heads, capacity, head_dim]` each, written in place where nothing else
    /// holds them (else copies).
    pub keys: CubeTensor,
    pub values: CubeTensor,
    /// `[seq]` int, each `< capacity`: the cache position of each new position.
    pub index: CubeTensor,
}

/// The RoPE inputs of [`norm_gemv3_rope_store`].
#[derive(Debug, Clone)]
pub struct RopeIn {
    /// `[rows]` int: each row's position.
    pub positions: CubeTensor,
    /// `[max_positions, head_dim / 2]` f32.
    pub cos: CubeTensor,
    pub sin: CubeTensor,
}

/// `(x + y, rope(h · wq), kc, vc)` with `h = rms_norm(x + y)`, `rope(h · wk)` and `h · wv`
/// stored into `kc`, `vc` at `cache.index`, in one launch.
///
/// # Shapes
/// - `x`, `norm.y`: `[rows, k]` with `rows = batch · seq`, `norm.gamma`: `[k]`, `wq`:
///   `[k, hq · d]`, `wk`, `wv`: `[k, hkv · d]`, one dtype, shapes [`unsupported`] accepts
/// - `rope`, `cache`: as [`RopeIn`] and [`CacheWrite`] (`d` from the cache)
/// - returns `[rows, k]`, `[rows, hq · d]` and the cache's two buffers
pub fn norm_gemv3_rope_store(
    x: CubeTensor,
    norm: NormIn,
    w: [CubeTensor; 3],
    rope: RopeIn,
    cache: CacheWrite,
) -> (CubeTensor, CubeTensor, CubeTensor, CubeTensor) {
    let own = |t: CubeTensor| {
        if t.can_mut() && t.is_contiguous() {
            t
        } else {
            into_contiguous(t.copy())
        }
    };
    let (kc, vc) = (own(cache.keys), own(cache.values));
    let x = into_contiguous(x);
    let [positions, index, cos, sin] =
        [rope.positions, cache.index, rope.cos, rope.sin].map(into_contiguous);
    let (y, gamma) = (into_contiguous(norm.y), into_contiguous(norm.gamma));
    let [rows, k] = x.meta.shape().dims::<2>();
    let [_, _, capacity, d] = kc.meta.shape().dims::<4>();
    let seq = index.meta.shape()[0];
    let ns = w.each_ref().map(|w| w.meta.shape().dims::<2>()[1]);
    let (sum, q) = (output(&x, rows, k), output(&x, rows, ns[0]));
    if rows == 0 {
        return (sum, q, kc, vc);
    }
    let plan = Plan::for_input(&x, rows, k, &ns, 1, true);
    let [(wq, rq), (wk, rk), (wv, rv)] = w.map(|w| weight_rows(w, plan.vec));
    let [nq, nk, _] = ns.map(|n| n / plan.vec);
    let (count, dim) = launch_dims(&plan, rows, nq + 2 * nk);
    let (client, dtype) = (x.client.clone(), x.dtype);
    let dtypes = [
        dtype_to_storage_type(dtype),
        dtype_to_storage_type(positions.dtype),
    ];
    qkv_rope_store_kernel::launch(
        &client,
        count,
        dim,
        plan.vec,
        x.into_tensor_arg(),
        y.into_tensor_arg(),
        gamma.into_tensor_arg(),
        sum.clone().into_tensor_arg(),
        wq.into_tensor_arg(),
        wk.into_tensor_arg(),
        wv.into_tensor_arg(),
        q.clone().into_tensor_arg(),
        kc.clone().into_tensor_arg(),
        vc.clone().into_tensor_arg(),
        positions.into_tensor_arg(),
        index.into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        QkvDimsLaunch::new(rows, k, nq, nk, seq, capacity, norm.eps as f32),
        WeightRowsLaunch::new(rq, rk, rv),
        plan.cv,
        plan.splits,
        plan.rows_per_cube,
        plan.unroll,
        d / plan.vec,
        plan.stage,
        dtypes,
    );
    (sum, q, kc, vc)
}
