//! The block-verification kernel: one cube per sequence walks the positions of its block and the
//! surviving drafts, as [`crate::verify_block`] does on the host.
//!
//! Per position, every unit computes the same scalar decisions (identical inputs: shared memory
//! and read-only global memory), so control flow stays uniform and the barriers inside the
//! reductions are reached by the whole cube. `V`-sized work is split into one contiguous chunk
//! of columns per unit; per-column state lives in a scratch buffer (`rows` rows of `V` per
//! sequence) that only the owning unit touches (see [`super::cube`]).
//!
//! Scratch rows of a sequence: row 0 is the work row (SpecInfer's residual chain, the final
//! residual, the bonus row). Importance sampling adds two candidate slots of `K` rows each
//! (`K - 1` selection rows and `q~` in the last row) and `K - 1` rows of reserve-rule estimates.

use cubecl::prelude::*;

use super::cube::{has_mass, ratio_capped, sample_row};
use super::importance::decide_importance;
use super::rows::{
    Pos, copy_target, owned_value, q_at, residual_step, row_sum, sample_residual, spectr_reach,
    spectr_rho,
};

/// [`crate::Scheme::SingleDraft`] and [`crate::Scheme::SpecInfer`] (same plan).
pub const SCHEME_SPECINFER: u32 = 0;
/// [`crate::Scheme::SpecTr`].
pub const SCHEME_SPECTR: u32 = 1;
/// [`crate::Scheme::SequentialImportance`].
pub const SCHEME_IS: u32 = 2;

/// Status bit: a probability row used by the walk was not normalisable (zero or non-finite
/// sum, or a negative entry).
pub const STATUS_BAD_ROW: u32 = 1;
/// Status bit: a drafted token was outside the vocabulary or had zero draft probability.
pub const STATUS_BAD_TOKEN: u32 = 2;

/// SpecInfer / single-draft SD: draft `i` against the residual chain `p_i`, `u[i]` for its test,
/// `u[m + 1]` for the final residual. The chain is only advanced past rejected drafts.
#[allow(clippy::too_many_arguments)]
#[cube]
fn decide_specinfer(
    target: &Tensor<f32>,
    draft: &Tensor<f32>,
    uniforms: &Tensor<f32>,
    scratch: &mut Tensor<f32>,
    pos: &Pos,
    qb: &Array<usize>,
    qn: &Array<f32>,
    xs: &Array<u32>,
    red: &mut Shared<[f32]>,
    idx: &mut Shared<[u32]>,
    scal: &mut Shared<[f32]>,
) -> (bool, u32) {
    let w = pos.row(0);
    copy_target(target, scratch, pos);
    let mut accepted = false;
    let mut token = 0u32;
    let mut i = 0usize;
    while i < pos.m && !accepted {
        let x = xs[i] as usize;
        let pk = owned_value(&*scratch, pos, w, x, scal);
        let mut thr = f32::new(0.0);
        if x < pos.v {
            thr = ratio_capped(pk, q_at(draft, qb, qn, i, x));
        }
        if uniforms[pos.ubase + i] < thr {
            accepted = true;
            token = x as u32;
        } else {
            residual_step(draft, scratch, pos, qb, qn, i, w, red);
            i += 1;
        }
    }
    if !accepted {
        let u = uniforms[pos.ubase + pos.m + 1];
        token = sample_row(&*scratch, w, pos.lo, pos.hi, u, red, idx, scal);
    }
    (accepted, token)
}

/// SpecTr: draft `i` accepted with `min(1, p / (rho q_i))` using `u[i]`; the derived residual
/// `max(p - sum_k P_k min(q_k, p / rho), 0)` with `u[m + 1]`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn decide_spectr(
    target: &Tensor<f32>,
    draft: &Tensor<f32>,
    uniforms: &Tensor<f32>,
    scratch: &mut Tensor<f32>,
    pos: &Pos,
    qb: &Array<usize>,
    qn: &Array<f32>,
    xs: &Array<u32>,
    red: &mut Shared<[f32]>,
    idx: &mut Shared<[u32]>,
    scal: &mut Shared<[f32]>,
    #[comptime] k_max: usize,
) -> (bool, u32) {
    let rho = spectr_rho(target, draft, pos, qb, qn, red, k_max);
    let mut accepted = false;
    let mut token = 0u32;
    let mut i = 0usize;
    while i < pos.m && !accepted {
        let x = xs[i] as usize;
        let mut thr = f32::new(0.0);
        if x < pos.v {
            thr = ratio_capped(pos.p(target, x), rho * q_at(draft, qb, qn, i, x));
        }
        if uniforms[pos.ubase + i] < thr {
            accepted = true;
            token = x as u32;
        }
        i += 1;
    }
    if !accepted {
        let mut reaches = Array::<f32>::new(k_max);
        spectr_reach(target, draft, pos, qb, qn, rho, &mut reaches, red);
        let w = pos.row(0);
        let mut part = f32::new(0.0);
        let mut y = pos.lo;
        while y < pos.hi {
            let p = pos.p(target, y);
            let mut from_drafts = f32::new(0.0);
            for i in 0..pos.m {
                from_drafts += reaches[i] * min(q_at(draft, qb, qn, i, y), p / rho);
            }
            let r = max(p - from_drafts, f32::new(0.0));
            scratch[w + y] = r;
            part += r;
            y += 1;
        }
        token = sample_residual(target, uniforms, scratch, pos, part, red, idx, scal);
    }
    (accepted, token)
}

/// Verifies one block per cube (sequence `b`); see the module docs and
/// [`super::verify_blocks`] for the layout of the tensors. The sizes come as scalars because
/// `draft` and `drafts` are placeholders when `L = 0`.
// `div_ceil` is not available inside kernels.
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
#[cube(launch)]
pub fn verify_blocks_kernel<I: Numeric>(
    target: &Tensor<f32>,
    draft: &Tensor<f32>,
    drafts: &Tensor<I>,
    uniforms: &Tensor<f32>,
    scratch: &mut Tensor<f32>,
    tokens: &mut Tensor<I>,
    accepted: &mut Tensor<I>,
    survivors: &mut Tensor<I>,
    status: &mut Tensor<I>,
    batch: usize,
    k_all: usize,
    l: usize,
    v: usize,
    #[comptime] scheme: u32,
    #[comptime] k_max: usize,
    #[comptime] units: usize,
    #[comptime] rows: usize,
    #[define(I)] _dtype: ElemType,
) {
    let b = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    // The whole cube leaves together, so the barriers below stay uniform.
    if b >= batch {
        terminate!();
    }
    let unit = UNIT_POS_X as usize;
    let dim = CUBE_DIM_X as usize;
    let chunk = (v + dim - 1) / dim;
    let lo = min(unit * chunk, v);
    let hi = min(lo + chunk, v);
    let srow = b * rows * v;

    let mut red = Shared::<[f32]>::new_slice(units);
    let mut idx = Shared::<[u32]>::new_slice(units + 2);
    let mut scal = Shared::<[f32]>::new_slice(1usize);

    // Survivors (draft indices, ascending), and per survivor its row offset, row sum and token.
    let mut surv = Array::<u32>::new(k_max);
    let mut qb = Array::<usize>::new(k_max);
    let mut qn = Array::<f32>::new(k_max);
    let mut xs = Array::<u32>::new(k_max);
    for k in 0..k_all {
        surv[k] = k as u32;
    }
    let mut m = k_all;
    let mut flags = 0u32;
    let mut done = false;
    let mut j = 0usize;
    let row_stride = (l + 1) * (k_all + 2);

    while j < l && !done {
        let s0 = surv[0] as usize;
        let tbase = ((b * k_all + s0) * (l + 1) + j) * v;
        let sp = row_sum(target, tbase, lo, hi, &mut red);
        if !has_mass(sp) {
            flags |= STATUS_BAD_ROW;
        }
        flags |= load_drafts(
            draft,
            drafts,
            &surv,
            &mut qb,
            &mut qn,
            &mut xs,
            &mut red,
            b * k_all,
            l,
            j,
            v,
            lo,
            hi,
            m,
        );
        let pos = Pos {
            v,
            lo,
            hi,
            tbase,
            sp,
            srow,
            ubase: b * row_stride + j * (k_all + 2),
            m,
        };
        let (ok, token) = if comptime!(scheme == SCHEME_SPECTR) {
            decide_spectr(
                target, draft, uniforms, scratch, &pos, &qb, &qn, &xs, &mut red, &mut idx,
                &mut scal, k_max,
            )
        } else if comptime!(scheme == SCHEME_IS) {
            decide_importance(
                target, draft, uniforms, scratch, &pos, &qb, &qn, &xs, &mut red, &mut idx,
                &mut scal, k_max,
            )
        } else {
            decide_specinfer(
                target, draft, uniforms, scratch, &pos, &qb, &qn, &xs, &mut red, &mut idx,
                &mut scal,
            )
        };
        if unit == 0 {
            tokens[b * (l + 1) + j] = I::cast_from(token);
        }
        if ok {
            // Keep the survivors that drafted the accepted token.
            let mut kept = 0usize;
            for i in 0..m {
                if xs[i] == token {
                    surv[kept] = surv[i];
                    kept += 1;
                }
            }
            m = kept;
            j += 1;
        } else {
            done = true;
        }
    }

    if !done {
        // Bonus token from p_{L+1} of the first survivor, with u[L][0].
        let s0 = surv[0] as usize;
        let tbase = ((b * k_all + s0) * (l + 1) + l) * v;
        let sp = row_sum(target, tbase, lo, hi, &mut red);
        if !has_mass(sp) {
            flags |= STATUS_BAD_ROW;
        }
        let pos = Pos {
            v,
            lo,
            hi,
            tbase,
            sp,
            srow,
            ubase: b * row_stride + l * (k_all + 2),
            m,
        };
        copy_target(target, scratch, &pos);
        let u = uniforms[pos.ubase];
        let token = sample_row(&*scratch, srow, lo, hi, u, &mut red, &mut idx, &mut scal);
        if unit == 0 {
            tokens[b * (l + 1) + l] = I::cast_from(token);
        }
    }

    if unit == 0 {
        write_block(
            tokens, accepted, survivors, status, &surv, b, k_all, l, j, m, flags,
        );
    }
}

/// Loads the rows and tokens of the `m` surviving drafts `surv` of sequence `b` (`first` =
/// `b · K`) at position `j`: each row's offset into `draft` (`qb`) and sum (`qn`, reduced
/// through `red` by the whole cube), and its token (`xs`; an invalid token becomes `V`: never
/// accepted, never read). Returns the status flags the rows and tokens raise.
#[allow(clippy::too_many_arguments)]
#[cube]
fn load_drafts<I: Numeric>(
    draft: &Tensor<f32>,
    drafts: &Tensor<I>,
    surv: &Array<u32>,
    qb: &mut Array<usize>,
    qn: &mut Array<f32>,
    xs: &mut Array<u32>,
    red: &mut Shared<[f32]>,
    first: usize,
    l: usize,
    j: usize,
    v: usize,
    lo: usize,
    hi: usize,
    m: usize,
) -> u32 {
    let mut flags = 0u32;
    for i in 0..m {
        let k = surv[i] as usize;
        let base = ((first + k) * l + j) * v;
        let sq = row_sum(draft, base, lo, hi, red);
        if !has_mass(sq) {
            flags |= STATUS_BAD_ROW;
        }
        qb[i] = base;
        qn[i] = sq;
        let raw = i32::cast_from(drafts[(first + k) * l + j]);
        let mut x = v as u32;
        if raw >= 0 && (raw as usize) < v {
            x = raw as u32;
        }
        // Invalid token, or zero draft probability (NaN counts as invalid too).
        let bad = x == v as u32 || draft[base + min(x as usize, v - 1)] <= 0.0;
        if bad || draft[base + min(x as usize, v - 1)].is_nan() {
            flags |= STATUS_BAD_TOKEN;
        }
        xs[i] = x;
    }
    flags
}

/// Writes sequence `b`'s outcome (one unit): `j + 1` emitted tokens are in place, the rest of
/// its `L + 1` are padded with -1; the accepted count, the survivor mask and the status flags.
#[allow(clippy::too_many_arguments)]
#[cube]
fn write_block<I: Numeric>(
    tokens: &mut Tensor<I>,
    accepted: &mut Tensor<I>,
    survivors: &mut Tensor<I>,
    status: &mut Tensor<I>,
    surv: &Array<u32>,
    b: usize,
    k_all: usize,
    l: usize,
    j: usize,
    m: usize,
    flags: u32,
) {
    let pad = -1i32;
    let mut t = j + 1;
    while t <= l {
        tokens[b * (l + 1) + t] = I::cast_from(pad);
        t += 1;
    }
    accepted[b] = I::cast_from(j);
    for k in 0..k_all {
        survivors[b * k_all + k] = I::cast_from(0u32);
    }
    for i in 0..m {
        survivors[b * k_all + surv[i] as usize] = I::cast_from(1u32);
    }
    status[b] = I::cast_from(flags);
}
