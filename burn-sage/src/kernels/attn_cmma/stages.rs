//! The stages of [`super::attn_cmma_kernel`], in the order the kernel runs them: Q fragments
//! and accumulators, loading the next K/V tile into registers and storing the current one to
//! shared memory, `Q·Kᵀ` on the matrix units, the online softmax of a tile, rescaling the
//! accumulators, `P̃·V`, and the output.

use cubecl::prelude::*;

use super::super::AttnArgs;
use super::super::pv_grid::{RoundArgs, round_bits};
use super::{BKV, K_VEC, V_VEC};

/// Stores the cube's Q tile to shared memory chunk-major (rows past the end are zero) and
/// returns the plane's i8 A fragments, one per 16 channels.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn q_fragments(
    qi: &Tensor<i8>,
    args: &AttnArgs,
    bh: usize,
    q0: usize,
    tid: usize,
    plane: usize,
    #[comptime] dim: usize,
    #[comptime] planes: usize,
) -> Sequence<cmma::Matrix<i8>> {
    let bq = planes * 16;
    let threads = planes * 32;
    let mut q_sm = Shared::<[i8]>::new_aligned_slice(bq * dim, 128usize);
    let mut e = tid;
    while e < bq * dim {
        let r = e / dim;
        let c = e % dim;
        let row = q0 + r;
        let mut x = i8::new(0);
        if row < args.sq {
            x = qi[(bh * args.sq + row) * dim + c];
        }
        q_sm[(c / 16) * bq * 16 + r * 16 + c % 16] = x;
        e += threads;
    }
    sync_cube();

    let mut qf = Sequence::<cmma::Matrix<i8>>::new();
    #[unroll]
    for kk in 0..dim / 16 {
        let a_off = kk * bq * 16 + plane * 256;
        qf.push(a_fragment::<i8>(q_sm.slice(a_off, a_off + 256), 16u32));
    }
    qf
}

/// The plane's f32 output accumulators, one 16×16 block per 16 channels, at zero.
#[cube]
pub(super) fn zero_accumulators(#[comptime] dim: usize) -> Sequence<cmma::Matrix<f32>> {
    let mut of = Sequence::<cmma::Matrix<f32>>::new();
    #[unroll]
    for _t in 0..dim / 16 {
        of.push(zero_accumulator::<f32>());
    }
    of
}

/// What a lane knows of its query row: lanes `r` and `r + 16` of a plane share row
/// `q0 + plane·16 + r`.
#[derive(CubeType, Clone, Copy)]
pub(super) struct RowState {
    /// The query row (may be past the end, see `owner`).
    pub row: usize,
    /// Whether the row exists (`row < sq`); other rows' results are not written.
    pub owner: bool,
    /// The row's Q scale times the softmax scale (0 for rows past the end).
    pub qscale: f32,
    /// Where the row's `ΔS` starts (rows past the end read row `sq − 1`'s).
    pub ds_row: usize,
    /// Where the row's scores start in the cube's score tile.
    pub row_base: usize,
}

/// The [`RowState`] of lane `lane` of plane `plane` in the cube whose first row is `q0`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn row_state(
    qs: &Tensor<f32>,
    args: &AttnArgs,
    bh: usize,
    q0: usize,
    plane: usize,
    lane: usize,
) -> RowState {
    let local = plane * 16 + lane % 16;
    let row = q0 + local;
    let owner = row < args.sq;
    let mut qscale = f32::new(0.0);
    if owner {
        let qg = (row / args.q_block) * args.q_inter + (row % args.q_block) % args.q_inter;
        qscale = qs[bh * args.q_groups + qg] * args.scale;
    }
    let ds_row =
        (bh * args.mean_blocks + select(owner, row, args.sq - 1) / args.mean_block) * args.skv;
    RowState {
        row,
        owner,
        qscale,
        ds_row,
        row_base: local * BKV,
    }
}

/// Loads the K vectors, V vectors and K scales of the tile at `kv0` that unit `tid` stores
/// (zeros past the end of the keys).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_tile<P: Float, NK: Size, NV: Size>(
    ki: &Tensor<Vector<i8, NK>>,
    ks: &Tensor<f32>,
    v: &Tensor<Vector<P, NV>>,
    args: &AttnArgs,
    kr: &mut Array<Vector<i8, NK>>,
    vr: &mut Array<Vector<P, NV>>,
    sc: &mut f32,
    bhk: usize,
    kv0: usize,
    tid: usize,
    #[comptime] dim: usize,
    #[comptime] planes: usize,
) {
    let threads = planes * 32;
    let k_vecs = dim / K_VEC;
    let v_vecs = dim / V_VEC;
    #[unroll]
    for i in 0..comptime!(BKV * (dim / K_VEC) / (planes * 32)) {
        let e = tid + i * threads;
        let key = kv0 + e / k_vecs;
        let mut x = Vector::<i8, NK>::new(i8::new(0));
        if key < args.skv {
            x = ki[(bhk * args.skv + key) * k_vecs + e % k_vecs];
        }
        kr[i] = x;
    }
    #[unroll]
    for i in 0..comptime!(BKV * (dim / V_VEC) / (planes * 32)) {
        let e = tid + i * threads;
        let key = kv0 + e / v_vecs;
        let mut y = Vector::<P, NV>::new(P::new(0.0));
        if key < args.skv {
            y = v[(bhk * args.skv + kv0) * v_vecs + e];
        }
        vr[i] = y;
    }
    if tid < BKV {
        let key = kv0 + tid;
        let mut x = f32::new(0.0);
        if key < args.skv {
            let kg = (key / args.k_block) * args.k_inter + (key % args.k_block) % args.k_inter;
            x = ks[bhk * args.k_groups + kg];
        }
        *sc = x;
    }
}

/// Stores the registers [`load_tile`] filled to shared memory: K vector `cv` of key `rr` at
/// chunk-major position `[cv][rr]` (16 i8 each), V row-major, the K scales.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn store_tile<P: Float, NK: Size, NV: Size>(
    k_sm: &mut Shared<[Vector<i8, NK>]>,
    v_sm: &mut Shared<[Vector<P, NV>]>,
    ks_sm: &mut Shared<[f32]>,
    kr: &Array<Vector<i8, NK>>,
    vr: &Array<Vector<P, NV>>,
    sc: f32,
    tid: usize,
    #[comptime] dim: usize,
    #[comptime] planes: usize,
) {
    let threads = planes * 32;
    let k_vecs = dim / K_VEC;
    #[unroll]
    for i in 0..comptime!(BKV * (dim / K_VEC) / (planes * 32)) {
        let e = tid + i * threads;
        k_sm[(e % k_vecs) * BKV + e / k_vecs] = kr[i];
    }
    #[unroll]
    for i in 0..comptime!(BKV * (dim / V_VEC) / (planes * 32)) {
        v_sm[tid + i * threads] = vr[i];
    }
    if tid < BKV {
        ks_sm[tid] = sc;
    }
}

/// A 16×16×16 A fragment loaded from the row-major rows of `src`, `stride` apart.
#[cube]
fn a_fragment<T: Numeric>(src: &[T], stride: u32) -> cmma::Matrix<T> {
    cmma::Matrix::<T>::from_slice(
        cmma::MatrixIdent::A,
        16usize,
        16usize,
        16usize,
        cmma::MatrixLayout::RowMajor,
        src,
        stride,
    )
}

/// A 16×16×16 B fragment in `layout`, to be loaded before use: B tiles come from vectorized
/// shared memory, which `from_slice` does not take.
#[cube]
fn b_fragment<T: Numeric>(layout: cmma::MatrixLayout) -> cmma::Matrix<T> {
    unsafe {
        cmma::Matrix::<T>::uninitialized(cmma::MatrixIdent::B, 16usize, 16usize, 16usize, layout)
    }
}

/// A 16×16 accumulator fragment at zero.
#[cube]
fn zero_accumulator<T: Numeric>() -> cmma::Matrix<T> {
    cmma::Matrix::<T>::from_value(
        cmma::MatrixIdent::Accumulator,
        16usize,
        16usize,
        16usize,
        cmma::MatrixLayout::Undefined,
        T::from_int(0),
    )
}

/// `S = Q·Kᵀ` for the plane's 16 rows and the tile's keys, i8·i8→i32 on the matrix units,
/// stored to the plane's rows of `s_sm`.
#[cube]
pub(super) fn scores_tile<NK: Size>(
    qf: &Sequence<cmma::Matrix<i8>>,
    k_sm: &Shared<[Vector<i8, NK>]>,
    s_sm: &mut Shared<[i32]>,
    s_plane: usize,
    #[comptime] dim: usize,
) {
    let mut kb = b_fragment::<i8>(cmma::MatrixLayout::ColMajor);
    #[unroll]
    for n in 0..BKV / 16 {
        let acc = zero_accumulator::<i32>();
        #[unroll]
        for kk in 0..dim / 16 {
            let b_off = (kk * BKV * 16 + n * 256) / K_VEC;
            cmma::load(&mut kb, k_sm.slice(b_off, b_off + 256 / K_VEC), 16u32);
            cmma::execute::<i8, i8, i32, i32, cmma::Plane>(qf.index(kk), &kb, &acc, &acc);
        }
        let s_off = s_plane + n * 16;
        cmma::store(
            s_sm.slice_mut(s_off, s_off + 15 * BKV + 16),
            &acc,
            comptime!(BKV as u32),
            cmma::MatrixLayout::RowMajor,
        );
    }
}

/// What one tile's softmax leaves: the maximum `P̃` is now relative to, the factor the
/// accumulators need, whether any needs it, and the tile's row sum of `exp(s − m)`.
#[derive(CubeType, Clone, Copy)]
pub(super) struct Step {
    pub m: f32,
    pub alpha: f32,
    pub need: bool,
    pub sum: f32,
}

/// One tile's online softmax ([`softmax_tile`]), with per-key masks only where the tile is not
/// `full` (it crosses the end of the keys or the causal diagonal).
#[cube]
#[allow(clippy::too_many_arguments)]
#[allow(unused_assignments)]
pub(super) fn online_softmax<P: Float>(
    s_sm: &Shared<[i32]>,
    p_sm: &mut Shared<[P]>,
    ks_sm: &Shared<[f32]>,
    ds: &Tensor<f32>,
    args: &AttnArgs,
    g: &RoundArgs,
    tau: f32,
    m: f32,
    row: &RowState,
    kv0: usize,
    lane: usize,
    full: bool,
    #[comptime] causal: bool,
    #[comptime] has_ds: bool,
) -> Step {
    let mut m_out = m;
    let mut alpha = f32::new(1.0);
    let mut need = false;
    let mut sum = f32::new(0.0);
    if full {
        let st = softmax_tile::<P>(
            s_sm, p_sm, ks_sm, ds, args, g, tau, m, row, kv0, lane, false, causal, has_ds,
        );
        m_out = st.m;
        alpha = st.alpha;
        need = st.need;
        sum = st.sum;
    } else {
        let st = softmax_tile::<P>(
            s_sm, p_sm, ks_sm, ds, args, g, tau, m, row, kv0, lane, true, causal, has_ds,
        );
        m_out = st.m;
        alpha = st.alpha;
        need = st.need;
        sum = st.sum;
    }
    Step {
        m: m_out,
        alpha,
        need,
        sum,
    }
}

/// One tile's online softmax for the lane's row: lane `r + 16·half` covers keys
/// `half·32 .. half·32 + 32`, read with a per-lane skew so the 32 lanes hit 32 banks; the two
/// halves combine with a shuffle. Writes `P̃` (rounded to the PV grid) to `p_sm`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn softmax_tile<P: Float>(
    s_sm: &Shared<[i32]>,
    p_sm: &mut Shared<[P]>,
    ks_sm: &Shared<[f32]>,
    ds: &Tensor<f32>,
    args: &AttnArgs,
    g: &RoundArgs,
    tau: f32,
    m: f32,
    row: &RowState,
    kv0: usize,
    lane: usize,
    #[comptime] masked: bool,
    #[comptime] causal: bool,
    #[comptime] has_ds: bool,
) -> Step {
    let half = lane / 16;
    let mut sv = Array::<f32>::new(32usize);
    let mut part_max = f32::new(-1.0e30);
    #[unroll]
    for i in 0..32usize {
        let j = half * 32 + (i + lane) % 32;
        let key = kv0 + j;
        let mut s = f32::cast_from(s_sm[row.row_base + j]) * row.qscale * ks_sm[j];
        if has_ds {
            // Keys past the end are masked below; clamping keeps the read in bounds.
            s += ds[row.ds_row + select(key < args.skv, key, args.skv - 1)] * args.scale;
        }
        if masked {
            let mut valid = row.owner && key < args.skv;
            if causal {
                valid = valid && key <= row.row + args.skv - args.sq;
            }
            s = select(valid, s, f32::new(-1.0e30));
        }
        sv[i] = s;
        part_max = f32::max(part_max, s);
    }
    let tile_max = f32::max(part_max, plane_shuffle_xor(part_max, 16u32));
    let m_new = f32::max(m, tile_max);
    let need = m_new > m + tau;
    let mut alpha = f32::new(1.0);
    let mut m_out = m;
    if need {
        alpha = f32::exp(m - m_new);
        m_out = m_new;
    }
    let mut part_sum = f32::new(0.0);
    #[unroll]
    for i in 0..32usize {
        let j = half * 32 + (i + lane) % 32;
        // Masked scores sit at -1e30, far enough below any maximum for exp to give 0.
        let mut p = f32::exp(sv[i] - m_out);
        if masked {
            p = select(sv[i] > f32::new(-1.0e29), p, f32::new(0.0));
        }
        part_sum += p;
        p_sm[row.row_base + j] = P::cast_from(round_bits(p * args.p_scale, g));
    }
    Step {
        m: m_out,
        alpha,
        need,
        sum: part_sum + plane_shuffle_xor(part_sum, 16u32),
    }
}

/// Stores the 16×16 accumulator block `m` row-major into the plane's staging area at
/// `o_plane`, and syncs the plane so that every lane may read any of its elements.
#[cube]
fn stage_block(m: &cmma::Matrix<f32>, o_sm: &mut Shared<[f32]>, o_plane: usize) {
    cmma::store(
        o_sm.slice_mut(o_plane, o_plane + 256),
        m,
        16u32,
        cmma::MatrixLayout::RowMajor,
    );
    sync_plane();
}

/// Multiplies the rows of the plane's accumulators by `alpha` (row `i`'s factor comes from
/// lane `i`), one 16×16 block at a time through the plane's staging area at `o_plane`.
#[cube]
// `a = a * b` on indexed shared memory, as written for CubeCL 0.10.
#[allow(clippy::assign_op_pattern)]
pub(super) fn rescale_accumulators(
    of: &mut Sequence<cmma::Matrix<f32>>,
    o_sm: &mut Shared<[f32]>,
    alpha: f32,
    o_plane: usize,
    lane: usize,
    #[comptime] dim: usize,
) {
    #[unroll]
    for t in 0..dim / 16 {
        stage_block(of.index(t), o_sm, o_plane);
        #[unroll]
        for i in 0..8usize {
            let e = lane + i * 32;
            let a = plane_shuffle(alpha, (e / 16) as u32);
            o_sm[o_plane + e] = o_sm[o_plane + e] * a;
        }
        sync_plane();
        cmma::load_with_layout(
            of.index_mut(t),
            o_sm.slice(o_plane, o_plane + 256),
            16u32,
            cmma::MatrixLayout::RowMajor,
        );
        sync_plane();
    }
}

/// `O += P̃·V` on the matrix units: the plane's `P̃` rows as A fragments, V from shared memory.
#[cube]
pub(super) fn accumulate_pv<P: Float, NV: Size>(
    of: &mut Sequence<cmma::Matrix<f32>>,
    p_sm: &Shared<[P]>,
    v_sm: &Shared<[Vector<P, NV>]>,
    s_plane: usize,
    #[comptime] dim: usize,
) {
    let mut vb = b_fragment::<P>(cmma::MatrixLayout::RowMajor);
    let mut pf = Sequence::<cmma::Matrix<P>>::new();
    #[unroll]
    for kk in 0..BKV / 16 {
        let a_off = s_plane + kk * 16;
        pf.push(a_fragment::<P>(
            p_sm.slice(a_off, a_off + 15 * BKV + 16),
            comptime!(BKV as u32),
        ));
    }
    #[unroll]
    for t in 0..dim / 16 {
        #[unroll]
        for kk in 0..BKV / 16 {
            let b_off = (kk * 16 * dim + t * 16) / V_VEC;
            cmma::load(
                &mut vb,
                v_sm.slice(b_off, b_off + (15 * dim + 16) / V_VEC),
                comptime!(dim as u32),
            );
            cmma::execute::<P, P, f32, f32, cmma::Plane>(
                pf.index(kk),
                &vb,
                of.index(t),
                of.index(t),
            );
        }
    }
}

/// Writes the plane's 16 output rows (first row `row0`): each 16×16 block through the staging
/// area, divided by its row's sum `l` (row `i`'s from lane `i`), times V's smoothing `post`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn write_output<F: Float>(
    of: &Sequence<cmma::Matrix<f32>>,
    o_sm: &mut Shared<[f32]>,
    out: &mut Tensor<F>,
    post: &Tensor<f32>,
    args: &AttnArgs,
    l: f32,
    bh: usize,
    bhk: usize,
    row0: usize,
    o_plane: usize,
    lane: usize,
    #[comptime] dim: usize,
) {
    #[unroll]
    for t in 0..dim / 16 {
        stage_block(of.index(t), o_sm, o_plane);
        #[unroll]
        for i in 0..8usize {
            let e = lane + i * 32;
            let rr = e / 16;
            let lr = plane_shuffle(l, rr as u32);
            let row = row0 + rr;
            let c = t * 16 + e % 16;
            if row < args.sq {
                out[(bh * args.sq + row) * dim + c] =
                    F::cast_from(o_sm[o_plane + e] * post[bhk * dim + c] / lr);
            }
        }
        sync_plane();
    }
}
