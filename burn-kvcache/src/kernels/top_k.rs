//! ShadowKV's selection on the device: the positions of each row's `k` largest scores, in
//! ascending order, one cube per row.
//!
//! Stages (each a `#[cube]` function below):
//! 1. [`kth_key`]: the `k`-th largest score's order key, found bit by bit from the top (32
//!    rounds of "how many keys are ≥ this prefix", each a strided count over the row and a
//!    cube-wide sum in shared memory). No atomics, so it runs wherever CubeCL does.
//! 2. [`scan_counts`]: each unit owns a contiguous segment of the row; the counts of keys
//!    above the threshold and equal to it are scanned across the units, so every unit knows
//!    where its selections start in the output and how many ties it may take (the lowest
//!    positions win ties).
//! 3. The units write their selections in order, then the slots past `k` repeat the first
//!    selected position (what the host selection pads with).

use burn::backend::cubecl::dtype_to_storage_type;
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::prelude::*;

use crate::shapes::top_k_shape;

/// Units per cube (one cube per row).
const UNITS: usize = 256;

/// Largest cube count per grid dimension on every runtime (WebGPU's limit).
const MAX_CUBES_X: usize = 65_535;

/// A key whose unsigned order is the float order (for non-NaN floats).
#[cube]
fn order_key(x: f32) -> u32 {
    let bits = u32::reinterpret(x);
    let negative = bits >= 0x8000_0000u32;
    select(negative, bits ^ 0xFFFF_FFFFu32, bits | 0x8000_0000u32)
}

/// The sum (or with `min`, the minimum) of every unit's `part`, seen by every unit (`sm`
/// holds `UNITS` words, free again on return).
#[cube]
fn cube_reduce(part: u32, sm: &mut Shared<[u32]>, tid: usize, #[comptime] min: bool) -> u32 {
    sm[tid] = part;
    sync_cube();
    let mut stride = comptime!(UNITS / 2).runtime();
    while stride > 0 {
        if tid < stride {
            let other = sm[tid + stride];
            if min {
                sm[tid] = u32::min(sm[tid], other);
            } else {
                sm[tid] += other;
            }
        }
        sync_cube();
        stride /= 2;
    }
    let total = sm[0];
    sync_cube();
    total
}

/// The order key of the `k`-th largest of `scores[base .. base + n]` (`1 ≤ k ≤ n`): the
/// largest key `t` with at least `k` keys `≥ t`.
#[cube]
fn kth_key(
    scores: &Tensor<f32>,
    base: usize,
    n: usize,
    k: u32,
    sm: &mut Shared<[u32]>,
    tid: usize,
) -> u32 {
    let mut prefix = 0u32;
    for bit in 0..32u32 {
        let candidate = prefix | (1u32 << (31u32 - bit));
        let mut count = 0u32;
        let mut i = tid;
        while i < n {
            count += select(order_key(scores[base + i]) >= candidate, 1u32, 0u32);
            i += UNITS;
        }
        if cube_reduce(count, sm, tid, false) >= k {
            prefix = candidate;
        }
    }
    prefix
}

/// Inclusive prefix sums over the units of the two counts `sm[..UNITS]` and
/// `sm[UNITS..2·UNITS]` (Hillis-Steele, in place).
#[cube]
fn scan_counts(sm: &mut Shared<[u32]>, tid: usize) {
    let mut offset = 1usize;
    while offset < UNITS {
        let mut above = 0u32;
        let mut equal = 0u32;
        if tid >= offset {
            above = sm[tid - offset];
            equal = sm[UNITS + tid - offset];
        }
        sync_cube();
        sm[tid] += above;
        sm[UNITS + tid] += equal;
        sync_cube();
        offset *= 2;
    }
}

/// One cube per row `r` of `scores` `[rows, cols]`: `out[r]` `[kk]` gets the positions of
/// the `k` largest of the row's first `n` scores, ascending, then the first of them repeated
/// (`(n, k) = sizes[r]`, `k` capped by `n` and `kk`; a row with `k = 0` gets zeros).
#[cube(launch)]
fn top_k_kernel<I: Int>(
    scores: &Tensor<f32>,
    sizes: &Tensor<I>,
    out: &mut Tensor<I>,
    #[define(I)] _dtype: ElemType,
) {
    let row = CUBE_POS_Y as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize;
    let rows = scores.shape(0);
    if row >= rows {
        terminate!();
    }
    let tid = UNIT_POS_X as usize;
    let cols = scores.shape(1);
    let kk = out.shape(1);
    let n = usize::min(usize::cast_from(sizes[row * 2]), cols);
    let k = usize::min(usize::min(usize::cast_from(sizes[row * 2 + 1]), n), kk);
    let base = row * cols;
    let obase = row * kk;
    let mut sm = Shared::<[u32]>::new_slice(comptime!(2 * UNITS));

    let mut first = 0usize;
    if k > 0 {
        let threshold = kth_key(scores, base, n, u32::cast_from(k), &mut sm, tid);
        // Stage 2: each unit's segment, its counts above and at the threshold, scanned.
        // (A `div_ceil` call does not expand in a kernel.)
        #[allow(clippy::manual_div_ceil)]
        let seg = (n + UNITS - 1) / UNITS;
        let start = usize::min(tid * seg, n);
        let end = usize::min(start + seg, n);
        let mut above = 0u32;
        let mut equal = 0u32;
        for i in start..end {
            let key = order_key(scores[base + i]);
            above += select(key > threshold, 1u32, 0u32);
            equal += select(key == threshold, 1u32, 0u32);
        }
        sm[tid] = above;
        sm[UNITS + tid] = equal;
        sync_cube();
        scan_counts(&mut sm, tid);
        let ties = u32::cast_from(k) - sm[UNITS - 1];
        let above_before = sm[tid] - above;
        let equal_before = sm[UNITS + tid] - equal;
        sync_cube();
        // Ties go to the lowest positions: this unit takes what the units before left.
        let mut take = 0u32;
        if equal_before < ties {
            take = u32::min(ties - equal_before, equal);
        }
        let mut pos = usize::cast_from(above_before + u32::min(equal_before, ties));
        // Stage 3: this unit's selections, in order; the lowest one for the padding.
        let mut lowest = n;
        for i in start..end {
            let key = order_key(scores[base + i]);
            let tie = key == threshold && take > 0;
            if key > threshold || tie {
                out[obase + pos] = I::cast_from(i);
                pos += 1;
                lowest = usize::min(lowest, i);
            }
            if tie {
                take -= 1;
            }
        }
        // The row's lowest selected position: the minimum over the units.
        first = usize::cast_from(cube_reduce(u32::cast_from(lowest), &mut sm, tid, true));
    }
    let mut slot = k + tid;
    while slot < kk {
        out[obase + slot] = I::cast_from(first);
        slot += UNITS;
    }
}

/// Launches the per-row top-k.
///
/// # Shapes
/// - `scores`: `[rows, cols]` f32 (no NaN)
/// - `sizes`: `[rows, 2]` int: `(n, k)` per row, the row's valid length and how many to keep
/// - returns `[rows, kk]` in `sizes`' int dtype: the positions (`< n`) of the `k` largest of
///   the first `n` scores in ascending order (ties to the lowest positions), then the first of
///   them repeated; zeros where `k = 0`
pub fn top_k(scores: CubeTensor, sizes: CubeTensor, kk: usize) -> CubeTensor {
    let scores = into_contiguous(scores);
    let sizes = into_contiguous(sizes);
    let rows = scores.meta.shape()[0];
    let client = scores.client.clone();
    let out = empty_device_contiguous_dtype(
        client.clone(),
        scores.device.clone(),
        top_k_shape(scores.meta.shape(), &kk),
        sizes.dtype,
    );
    if rows == 0 || kk == 0 {
        return out;
    }
    let x = rows.min(MAX_CUBES_X);
    let cube_count = CubeCount::Static(x as u32, rows.div_ceil(x) as u32, 1);
    top_k_kernel::launch(
        &client,
        cube_count,
        CubeDim::new_1d(UNITS as u32),
        scores.into_tensor_arg(),
        sizes.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        dtype_to_storage_type(sizes.dtype),
    );
    out
}
