//! ShadowKV's landmark scoring in two launches: how much a KV head's group of queries wants
//! each landmark, `max` over the group's query heads of `Σ` over its query positions of
//! `softmax(q·lᵀ·scale)` over the row's landmarks.
//!
//! 1. [`landmark_logits_kernel`]: a cube per 256 landmarks of one (sequence, KV head). The
//!    group's query rows go to shared memory; the cube's landmarks are read once, in their own
//!    dtype (no f32 copy of the landmarks), 16 columns at a time: consecutive units load
//!    consecutive columns of a row into shared memory, then each unit takes its landmark's
//!    columns from there. Each unit writes its logit against every query row, then the cube's
//!    maximum and sum of exponentials per row (a partial log-sum-exp). (Session 61's version
//!    had each unit read its own row from global memory, a warp touching 32 rows a load: 0.73
//!    ms a layer at 128K, batch 10, H100, for 0.34 GB.)
//! 2. [`landmark_group_max_kernel`]: the same grid. A unit a query row combines the row's
//!    partials into its log-sum-exp; then each unit writes its landmark's score.
//!
//! Landmarks past a row's count take the logit −10³⁰, as the reference's mask gives them.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::DType;
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::prelude::*;

use crate::shapes::landmark_scores_shape;

/// Landmarks (units) per cube.
const UNITS: usize = 256;
/// Landmark columns staged in shared memory at a time.
const COLS: usize = 16;
/// The staging's stride between columns: two rows of a warp's load land in distinct banks.
const STRIDE: usize = UNITS + 2;
/// Most query rows a KV head the kernel takes (the reductions' shared memory is the staging's).
const MAX_QUERY_ROWS: usize = COLS * STRIDE / UNITS;
/// Shared memory a cube may hold, in f32 values (48 KiB, CUDA's static limit).
const SHARED_VALUES: usize = 12_288;

/// A query row's columns as the kernel keeps them: whole blocks of [`COLS`].
const fn padded(dd: usize) -> usize {
    dd.div_ceil(COLS) * COLS
}

/// Why the kernel cannot score a KV head's group of `rows` query rows of `dd` values, if it
/// cannot: more rows than its reductions hold, or query rows and staging past 48 KiB of shared
/// memory.
pub fn unsupported(rows: usize, dd: usize) -> Option<String> {
    let shared = rows * padded(dd) + COLS * STRIDE;
    if rows > MAX_QUERY_ROWS {
        Some(format!(
            "{rows} query rows a KV head (at most {MAX_QUERY_ROWS})"
        ))
    } else if shared > SHARED_VALUES {
        Some(format!(
            "{rows} query rows of {dd} values a KV head: {} B of shared memory (at most {})",
            4 * shared,
            4 * SHARED_VALUES
        ))
    } else {
        None
    }
}
/// The logit of a landmark past the row's count (the reference's mask value).
const MASKED: f32 = -1.0e30;
/// The value of a unit past the end of the landmarks: below every logit, masked ones included.
const ABSENT: f32 = -3.0e38;

/// The maxima (or with `!max`, sums) over the cube of each of the `rows` values in `vals`,
/// written back into `vals` for every unit (`sm` holds `rows · UNITS` values).
#[cube]
fn reduce_rows(
    vals: &mut Array<f32>,
    sm: &mut Shared<[f32]>,
    tid: usize,
    #[comptime] rows: usize,
    #[comptime] max: bool,
) {
    #[unroll]
    for i in 0..rows {
        sm[i * UNITS + tid] = vals[i];
    }
    sync_cube();
    let mut stride = comptime!(UNITS / 2).runtime();
    while stride > 0 {
        if tid < stride {
            #[unroll]
            for i in 0..rows {
                let other = sm[i * UNITS + tid + stride];
                if max {
                    sm[i * UNITS + tid] = f32::max(sm[i * UNITS + tid], other);
                } else {
                    sm[i * UNITS + tid] += other;
                }
            }
        }
        sync_cube();
        stride /= 2;
    }
    #[unroll]
    for i in 0..rows {
        vals[i] = sm[i * UNITS];
    }
    sync_cube();
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn landmark_logits_kernel<F: Float, I: Int>(
    q: &Tensor<f32>,
    landmarks: &Tensor<F>,
    sizes: &Tensor<I>,
    logits: &mut Tensor<f32>,
    partials: &mut Tensor<f32>,
    scale: f32,
    #[comptime] qrows: usize,
    #[comptime] dd: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let h = landmarks.shape(1);
    let t_len = landmarks.shape(2);
    let hq = q.shape(1);
    let sq = q.shape(2);
    let bh = CUBE_POS_Y as usize;
    let blk = CUBE_POS_X as usize;
    let blocks = CUBE_COUNT_X as usize;
    let tid = UNIT_POS as usize;
    // Query row `i` of the group is head `hh·g + i / sq`, position `i mod sq`: rows
    // `(b·hq + hh·g)·sq ..` of the contiguous queries, `qrows = g·sq` of them.
    let q0 = ((bh / h) * hq + (bh % h) * (hq / h)) * sq * dd;
    // The group's query rows, each padded with zeros to `ddp` columns (whole column blocks).
    let ddp = comptime!(padded(dd));
    let q_len = comptime!(qrows * padded(dd));
    let mut q_sm = Shared::<[f32]>::new_slice(q_len);
    for step in 0..comptime!(q_len.div_ceil(UNITS)) {
        let idx = step * UNITS + tid;
        if idx < q_len {
            let (i, c) = (idx / ddp, idx % ddp);
            let mut x = f32::new(0.0);
            if c < dd {
                x = q[q0 + i * dd + c];
            }
            q_sm[idx] = x;
        }
    }
    sync_cube();

    let n = usize::cast_from(sizes[bh * 2]);
    let t = blk * UNITS + tid;
    let mut vals = Array::<f32>::new(qrows);
    #[unroll]
    for i in 0..qrows {
        vals[i] = f32::new(0.0);
    }
    // The cube's landmarks, `COLS` columns at a time, staged column-major in shared memory:
    // consecutive units load consecutive columns of a row (whole sectors of it), then each unit
    // reads its own landmark's column with its neighbours (no bank conflicts at `STRIDE`).
    // Rows past the row's count, columns past `dd` stage as zeros.
    let mut sm = Shared::<[f32]>::new_slice(comptime!(COLS * STRIDE));
    let row_base = bh * t_len + blk * UNITS;
    for cb in 0..comptime!(dd.div_ceil(COLS)) {
        #[unroll]
        for step in 0..COLS {
            let idx = step * UNITS + tid;
            let (row, col) = (idx / COLS, idx % COLS);
            let (lt, c) = (blk * UNITS + row, cb * COLS + col);
            let mut x = f32::new(0.0);
            if lt < n && lt < t_len && c < dd {
                x = f32::cast_from(landmarks[(row_base + row) * dd + c]);
            }
            sm[col * STRIDE + row] = x;
        }
        sync_cube();
        #[unroll]
        for col in 0..COLS {
            let l = sm[col * STRIDE + tid];
            let c = cb * COLS + col;
            #[unroll]
            for i in 0..qrows {
                vals[i] += q_sm[i * ddp + c] * l;
            }
        }
        sync_cube();
    }
    #[unroll]
    for i in 0..qrows {
        let mut v = f32::new(ABSENT as f64);
        if t < t_len {
            v = select(t < n, vals[i] * scale, f32::new(MASKED as f64));
            logits[(bh * qrows + i) * t_len + t] = v;
        }
        vals[i] = v;
    }
    // The cube's partial log-sum-exp of each row: its maximum, then its sum of exponentials.
    let mut part = Array::<f32>::new(qrows);
    #[unroll]
    for i in 0..qrows {
        part[i] = vals[i];
    }
    // The reductions reuse the staging memory (`qrows · UNITS ≤ COLS · STRIDE`).
    reduce_rows(&mut part, &mut sm, tid, qrows, true);
    let mut sums = Array::<f32>::new(qrows);
    #[unroll]
    for i in 0..qrows {
        sums[i] = select(
            vals[i] > f32::new(ABSENT as f64),
            f32::exp(vals[i] - part[i]),
            f32::new(0.0),
        );
    }
    reduce_rows(&mut sums, &mut sm, tid, qrows, false);
    if tid == 0 {
        #[unroll]
        for i in 0..qrows {
            let o = ((bh * qrows + i) * blocks + blk) * 2;
            partials[o] = part[i];
            partials[o + 1] = sums[i];
        }
    }
}

#[cube(launch)]
fn landmark_group_max_kernel(
    logits: &Tensor<f32>,
    partials: &Tensor<f32>,
    out: &mut Tensor<f32>,
    sq: usize,
    #[comptime] qrows: usize,
) {
    let t_len = out.shape(1);
    let bh = CUBE_POS_Y as usize;
    let blocks = CUBE_COUNT_X as usize;
    let tid = UNIT_POS as usize;
    let t = CUBE_POS_X as usize * UNITS + tid;
    // Unit `i` combines row `i`'s partials into its log-sum-exp (max `m`, sum `s` at `m`).
    let mut lse = Shared::<[f32]>::new_slice(comptime!(2 * qrows));
    if tid < qrows {
        let p0 = (bh * qrows + tid) * blocks * 2;
        let mut m = f32::new(ABSENT as f64);
        for blk in 0..blocks {
            m = f32::max(m, partials[p0 + blk * 2]);
        }
        let mut s = f32::new(0.0);
        for blk in 0..blocks {
            s += partials[p0 + blk * 2 + 1] * f32::exp(partials[p0 + blk * 2] - m);
        }
        lse[tid * 2] = m;
        lse[tid * 2 + 1] = s;
    }
    sync_cube();
    if t >= t_len {
        terminate!();
    }
    let mut best = f32::new(0.0);
    let mut acc = f32::new(0.0);
    #[unroll]
    for i in 0..qrows {
        acc += f32::exp(logits[(bh * qrows + i) * t_len + t] - lse[i * 2]) / lse[i * 2 + 1];
        // The group's heads are rows `sq` apart: a head's sum is complete at its last row.
        if (i + 1) % sq == 0 {
            best = f32::max(best, acc);
            acc = f32::new(0.0);
        }
    }
    out[bh * t_len + t] = best;
}

/// Launches the landmark scoring (the caller checked the shapes; `q` f32).
///
/// # Shapes
/// - `q`: `[b, hq, sq, dd]` f32, `landmarks`: `[b, h, t, dd]` (any float), `h` dividing `hq`
/// - `sizes`: `[b·h, 2]` int, the row's landmark count first
/// - returns `[b·h, t]` f32
pub fn landmark_scores(
    q: CubeTensor,
    landmarks: CubeTensor,
    sizes: CubeTensor,
    scale: f32,
) -> CubeTensor {
    let q = into_contiguous(q);
    let landmarks = into_contiguous(landmarks);
    let sizes = into_contiguous(sizes);
    let [b, hq, sq, dd] = q.meta.shape().dims::<4>();
    let [_, h, t, _] = landmarks.meta.shape().dims::<4>();
    let qrows = hq / h * sq;
    let client = q.client.clone();
    let alloc = |shape: burn::tensor::Shape| {
        empty_device_contiguous_dtype(client.clone(), q.device.clone(), shape, DType::F32)
    };
    let out = alloc(landmark_scores_shape(landmarks.meta.shape()));
    if b * h * t == 0 {
        return out;
    }
    let blocks = t.div_ceil(UNITS);
    let logits = alloc([b * h * qrows, t].into());
    let partials = alloc([b * h * qrows, blocks, 2].into());
    let grid = CubeCount::Static(blocks as u32, (b * h) as u32, 1);
    let dtypes = [
        dtype_to_storage_type(landmarks.dtype),
        dtype_to_storage_type(sizes.dtype),
    ];
    landmark_logits_kernel::launch(
        &client,
        grid.clone(),
        CubeDim::new_1d(UNITS as u32),
        q.into_tensor_arg(),
        landmarks.into_tensor_arg(),
        sizes.into_tensor_arg(),
        logits.clone().into_tensor_arg(),
        partials.clone().into_tensor_arg(),
        scale,
        qrows,
        dd,
        dtypes,
    );
    landmark_group_max_kernel::launch(
        &client,
        grid,
        CubeDim::new_1d(UNITS as u32),
        logits.into_tensor_arg(),
        partials.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        sq,
        qrows,
    );
    out
}

#[cfg(test)]
mod tests {
    use super::unsupported;

    /// The kernel takes the decode step's groups, and refuses what its shared memory cannot
    /// hold: the query rows count padded to whole 16-column blocks (16 rows of 500 values take
    /// 512 columns each, 49.3 KiB with the staging; 496 take 47.2 KiB).
    #[test]
    fn shared_memory_bounds_the_groups() {
        assert_eq!(unsupported(4, 128), None);
        assert_eq!(unsupported(16, 256), None);
        assert_eq!(unsupported(16, 496), None);
        assert!(unsupported(16, 500).is_some());
        assert!(unsupported(17, 8).is_some());
    }
}
