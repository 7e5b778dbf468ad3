//! The attention kernel on the matrix units (CUDA tensor cores through CubeCL's cmma).
//!
//! One cube per `(batch·q_head, tile of 16·PLANES queries)`, one plane (warp) per 16 query
//! rows. The plane's Q fragments (i8) and its output accumulators (f32) stay in registers for
//! the whole KV loop. For each tile of [`BKV`] keys:
//! 1. the cube loads the K tile (i8) and the V tile (already rounded to the PV grid, f16/bf16)
//!    into shared memory with 16-byte vector loads;
//! 2. each plane computes its `16 × BKV` block of `Q·Kᵀ` with i8·i8→i32 cmma into its own
//!    shared-memory rows;
//! 3. all 32 lanes of the plane run the online softmax, two lanes per row (one per half of the
//!    tile, combined with a shuffle), dequantizing with the folded scales (plus `ΔS`), and
//!    write `P̃ = exp(s − m)·p_scale` rounded to the PV grid;
//! 4. the plane accumulates `P̃·V` with f16/bf16 cmma into its register accumulators.
//!
//! The running maximum `m` used for `P̃` only moves when the tile's maximum exceeds it by
//! more than `tau` (0 for FP8 PV, whose grid saturates at 448; 8 for f16/bf16, where
//! `P̃ ≤ e⁸` loses nothing): rescaling the register accumulators goes through shared memory,
//! so skipping it is what keeps the loop on the matrix units. Rows that need it are rescaled
//! by `exp(m_old − m_new)` exactly as in the online softmax.
//!
//! Shared-memory reads by rows are skewed by lane (`(i + lane) mod 32`) so that 32 lanes
//! reading 32 rows hit 32 banks. Q and K tiles are stored chunk-major (`[d/16][rows][16]`)
//! so every cmma load starts on a 256-byte boundary, as the WMMA loads require. FP8 E4M3
//! values are exactly representable in f16, so the FP8 mode runs on the f16 units with E4M3
//! numerics (CubeCL 0.10's CUDA cmma has no e4m3 shape); its f32 accumulator is exact, so the
//! two-level accumulation the hardware FP8 path needs is not required here.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::DType;
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::prelude::*;

use super::common::grid;
use super::{AttnArgs, MatrixLaunch};
use crate::{Grid, SagePlan};

/// Keys per tile.
pub const BKV: usize = 64;
/// Planes (warps) per cube; each owns 16 query rows.
pub const PLANES: usize = 4;
/// i8 elements per vector load of K.
const K_VEC: usize = 16;
/// f16/bf16 elements per vector load of V.
const V_VEC: usize = 8;

/// A PV grid as the bit-level rounding needs it.
#[derive(CubeLaunch, CubeType, Clone, Copy, Debug)]
pub struct RoundArgs {
    /// Mantissa bits of f32 dropped: `23 − mantissa`.
    pub drop: u32,
    /// Smallest normal value of the grid, `2^min_exp`.
    pub min_normal: f32,
    /// Spacing of the subnormal values, `2^(min_exp − mantissa)`, and its inverse; both 0
    /// when that spacing is below f32's normal range (bf16), where the subnormals flush to 0
    /// (a division by a flushed step would give NaN).
    pub sub_step: f32,
    pub inv_sub_step: f32,
    /// Largest value (saturation).
    pub max: f32,
}

impl RoundArgs {
    pub fn new(grid: Grid) -> Self {
        let sub = grid.min_exp - grid.mantissa as i32;
        Self {
            drop: 23 - grid.mantissa,
            min_normal: 2f32.powi(grid.min_exp),
            sub_step: if sub >= -126 { 2f32.powi(sub) } else { 0.0 },
            inv_sub_step: if sub >= -126 { 2f32.powi(-sub) } else { 0.0 },
            max: grid.max,
        }
    }

    pub(super) fn launch_arg(self) -> RoundArgsLaunch {
        RoundArgsLaunch::new(
            self.drop,
            self.min_normal,
            self.sub_step,
            self.inv_sub_step,
            self.max,
        )
    }
}

/// `x` rounded to the grid, ties away from zero, saturating: [`crate::Grid::round`] with bit
/// operations instead of logarithms. Adding half a unit in the last kept place to the f32 bits
/// and truncating rounds the magnitude half-up, carries into the exponent included.
#[cube]
pub fn round_bits(x: f32, g: &RoundArgs) -> f32 {
    let a = f32::abs(x);
    let bits = u32::reinterpret(a);
    let keep = u32::MAX - ((1u32 << g.drop) - 1);
    let normal = f32::reinterpret((bits + (1u32 << (g.drop - 1))) & keep);
    let sub = f32::floor(a * g.inv_sub_step + 0.5) * g.sub_step;
    let r = f32::min(select(a >= g.min_normal, normal, sub), g.max);
    if x < 0.0 { -r } else { r }
}

/// `V` (or `V / v_scale`) rounded to the PV grid and stored in the PV dtype, once, so the
/// attention kernel only copies tiles.
#[cube(launch)]
fn round_v_kernel<V: Float, P: Float>(
    v: &Tensor<V>,
    out: &mut Tensor<P>,
    g: RoundArgs,
    #[comptime] round: bool,
    #[define(V, P)] _dtypes: [ElemType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        let mut x = f32::cast_from(v[i]);
        if round {
            x = round_bits(x, &g);
        }
        out[i] = P::cast_from(x);
    }
}

#[cube(launch)]
// `a = a * b` on indexed shared memory and register arrays, as written for CubeCL 0.10.
#[allow(
    clippy::too_many_arguments,
    clippy::manual_div_ceil,
    clippy::assign_op_pattern,
    unused_assignments
)]
fn attn_cmma_kernel<F: Float, P: Float, NK: Size, NV: Size>(
    qi: &Tensor<i8>,
    ki: &Tensor<Vector<i8, NK>>,
    qs: &Tensor<f32>,
    ks: &Tensor<f32>,
    ds: &Tensor<f32>,
    v: &Tensor<Vector<P, NV>>,
    post: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    args: AttnArgs,
    g: RoundArgs,
    tau: f32,
    #[comptime] dim: usize,
    #[comptime] planes: usize,
    #[comptime] causal: bool,
    #[comptime] has_ds: bool,
    #[comptime] write_lse: bool,
    #[define(F, P)] _dtypes: [ElemType; 2],
) {
    let bq = planes * 16;
    let bkv = comptime!(BKV);
    let chunks = dim / 16;
    let kvec = comptime!(K_VEC);
    let vvec = comptime!(V_VEC);
    let stride_kv = comptime!(BKV as u32);
    let q_tiles = (args.sq + bq - 1) / bq;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    // Spare cubes of a two-dimensional grid (see `grid`) have no tile.
    if cube >= (args.rows / args.sq) * q_tiles {
        terminate!();
    }
    let bh = cube / q_tiles;
    let q0 = (cube % q_tiles) * bq;
    let bhk = (bh / args.hq) * (args.hq / args.group) + (bh % args.hq) / args.group;
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let tid = plane * 32 + lane;
    let threads = planes * 32;
    let offset = args.skv - args.sq;

    let mut q_sm = Shared::<[i8]>::new_aligned_slice(bq * dim, 128usize);
    let mut k_sm = Shared::<[Vector<i8, NK>]>::new_aligned_slice(bkv * dim / kvec, 128usize);
    let mut v_sm = Shared::<[Vector<P, NV>]>::new_aligned_slice(bkv * dim / vvec, 128usize);
    let mut s_sm = Shared::<[i32]>::new_aligned_slice(bq * bkv, 128usize);
    let mut p_sm = Shared::<[P]>::new_aligned_slice(bq * bkv, 128usize);
    let mut o_sm = Shared::<[f32]>::new_aligned_slice(planes * 256, 128usize);
    let mut ks_sm = Shared::<[f32]>::new_slice(bkv);

    // Q tile, chunk-major; rows past the end are zero.
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
    for kk in 0..chunks {
        let a_off = kk * bq * 16 + plane * 256;
        qf.push(cmma::Matrix::<i8>::from_slice(
            cmma::MatrixIdent::A,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::RowMajor,
            q_sm.slice(a_off, a_off + 256),
            16u32,
        ));
    }
    let mut of = Sequence::<cmma::Matrix<f32>>::new();
    #[unroll]
    for _t in 0..chunks {
        of.push(cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::Undefined,
            f32::new(0.0),
        ));
    }

    // B fragments are loaded from vectorized shared memory, which `from_slice` does not take.
    let mut kb = unsafe {
        cmma::Matrix::<i8>::uninitialized(
            cmma::MatrixIdent::B,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::ColMajor,
        )
    };
    let mut vb = unsafe {
        cmma::Matrix::<P>::uninitialized(
            cmma::MatrixIdent::B,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::RowMajor,
        )
    };

    // Lanes r and r + 16 of each plane share query row `my_row`, one half of each tile each.
    let r = lane % 16;
    let half = lane / 16;
    let my_row = q0 + plane * 16 + r;
    let owner = my_row < args.sq;
    let mut qscale = f32::new(0.0);
    if owner {
        let qg = (my_row / args.q_block) * args.q_inter + (my_row % args.q_block) % args.q_inter;
        qscale = qs[bh * args.q_groups + qg] * args.scale;
    }
    // Rows past the end read row `sq − 1`'s ΔS (their results are not written).
    let ds_row =
        (bh * args.mean_blocks + select(owner, my_row, args.sq - 1) / args.mean_block) * args.skv;
    let mut m = f32::new(-1.0e30);
    let mut l = f32::new(0.0);

    let mut last = q0 + bq;
    if last > args.sq {
        last = args.sq;
    }
    let mut kv_end = args.skv;
    if causal {
        kv_end = last + offset;
    }
    let row_base = (plane * 16 + r) * bkv;
    let s_plane = plane * 16 * bkv;
    let o_plane = plane * 256;

    // The next tile's K, V and K scales are loaded into registers while the current tile is
    // computed (the global-load latency hides behind the matrix work), then stored to shared
    // memory at the top of the next iteration.
    let k_vecs = dim / kvec;
    let k_regs = comptime!(BKV * (dim / K_VEC) / (planes * 32));
    let v_regs = comptime!(BKV * (dim / V_VEC) / (planes * 32));
    let mut kr = Array::<Vector<i8, NK>>::new(k_regs);
    let mut vr = Array::<Vector<P, NV>>::new(v_regs);
    let mut sc = f32::new(0.0);
    load_tile::<P, NK, NV>(
        ki, ks, v, &args, &mut kr, &mut vr, &mut sc, bhk, 0usize, tid, dim, planes,
    );

    let mut kv0 = 0usize;
    while kv0 < kv_end {
        sync_cube();
        // K: vector `cv` of key `rr` goes to chunk-major position `[cv][rr]` (16 i8 each).
        #[unroll]
        for i in 0..k_regs {
            let e = tid + i * threads;
            k_sm[(e % k_vecs) * bkv + e / k_vecs] = kr[i];
        }
        #[unroll]
        for i in 0..v_regs {
            v_sm[tid + i * threads] = vr[i];
        }
        if tid < bkv {
            ks_sm[tid] = sc;
        }
        sync_cube();
        if kv0 + bkv < kv_end {
            load_tile::<P, NK, NV>(
                ki,
                ks,
                v,
                &args,
                &mut kr,
                &mut vr,
                &mut sc,
                bhk,
                kv0 + bkv,
                tid,
                dim,
                planes,
            );
        }

        // S = Q·Kᵀ for this plane's 16 rows.
        #[unroll]
        for n in 0..bkv / 16 {
            let acc = cmma::Matrix::<i32>::from_value(
                cmma::MatrixIdent::Accumulator,
                16usize,
                16usize,
                16usize,
                cmma::MatrixLayout::Undefined,
                i32::new(0),
            );
            #[unroll]
            for kk in 0..chunks {
                let b_off = (kk * bkv * 16 + n * 256) / kvec;
                cmma::load(&mut kb, k_sm.slice(b_off, b_off + 256 / kvec), 16u32);
                cmma::execute::<i8, i8, i32, i32, cmma::Plane>(qf.index(kk), &kb, &acc, &acc);
            }
            let s_off = s_plane + n * 16;
            cmma::store(
                s_sm.slice_mut(s_off, s_off + 15 * bkv + 16),
                &acc,
                stride_kv,
                cmma::MatrixLayout::RowMajor,
            );
        }
        sync_plane();

        // Online softmax; only tiles that cross the end of the keys or the causal diagonal of
        // the cube's first row need per-key masks.
        let mut full = kv0 + bkv <= args.skv;
        if causal {
            full = full && kv0 + bkv <= q0 + offset + 1;
        }
        let mut alpha = f32::new(1.0);
        let mut need = false;
        let mut sum = f32::new(0.0);
        if full {
            let st = softmax_tile::<P>(
                &s_sm, &mut p_sm, &ks_sm, ds, &args, &g, tau, m, row_base, ds_row, kv0, my_row,
                owner, qscale, lane, false, causal, has_ds,
            );
            m = st.m;
            alpha = st.alpha;
            need = st.need;
            sum = st.sum;
        } else {
            let st = softmax_tile::<P>(
                &s_sm, &mut p_sm, &ks_sm, ds, &args, &g, tau, m, row_base, ds_row, kv0, my_row,
                owner, qscale, lane, true, causal, has_ds,
            );
            m = st.m;
            alpha = st.alpha;
            need = st.need;
            sum = st.sum;
        }
        l = l * alpha + sum;

        // Rescale the accumulators of the rows whose maximum moved, one 16×16 block at a time
        // through the plane's staging area; row `i`'s factor comes from lane `i`.
        if plane_any(need) {
            #[unroll]
            for t in 0..chunks {
                cmma::store(
                    o_sm.slice_mut(o_plane, o_plane + 256),
                    of.index(t),
                    16u32,
                    cmma::MatrixLayout::RowMajor,
                );
                sync_plane();
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
        sync_plane();

        // O += P̃·V on the matrix units.
        let mut pf = Sequence::<cmma::Matrix<P>>::new();
        #[unroll]
        for kk in 0..bkv / 16 {
            let a_off = s_plane + kk * 16;
            pf.push(cmma::Matrix::<P>::from_slice(
                cmma::MatrixIdent::A,
                16usize,
                16usize,
                16usize,
                cmma::MatrixLayout::RowMajor,
                p_sm.slice(a_off, a_off + 15 * bkv + 16),
                stride_kv,
            ));
        }
        #[unroll]
        for t in 0..chunks {
            #[unroll]
            for kk in 0..bkv / 16 {
                let b_off = (kk * 16 * dim + t * 16) / vvec;
                cmma::load(
                    &mut vb,
                    v_sm.slice(b_off, b_off + (15 * dim + 16) / vvec),
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
        kv0 += bkv;
    }

    // Epilogue: each 16×16 block through the staging area, divided by its row's sum.
    if write_lse && owner && half == 0 {
        lse[bh * args.sq + my_row] = m + f32::ln(l);
    }
    #[unroll]
    for t in 0..chunks {
        cmma::store(
            o_sm.slice_mut(o_plane, o_plane + 256),
            of.index(t),
            16u32,
            cmma::MatrixLayout::RowMajor,
        );
        sync_plane();
        #[unroll]
        for i in 0..8usize {
            let e = lane + i * 32;
            let rr = e / 16;
            let lr = plane_shuffle(l, rr as u32);
            let row = q0 + plane * 16 + rr;
            let c = t * 16 + e % 16;
            if row < args.sq {
                out[(bh * args.sq + row) * dim + c] =
                    F::cast_from(o_sm[o_plane + e] * post[bhk * dim + c] / lr);
            }
        }
        sync_plane();
    }
}

/// Loads the K vectors, V vectors and K scales of the tile at `kv0` that unit `tid` stores
/// (zeros past the end of the keys).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_tile<P: Float, NK: Size, NV: Size>(
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

/// What one tile's softmax leaves: the maximum `P̃` is now relative to, the factor the
/// accumulators need, whether any needs it, and the tile's row sum of `exp(s − m)`.
#[derive(CubeType, Clone, Copy)]
struct Step {
    m: f32,
    alpha: f32,
    need: bool,
    sum: f32,
}

/// One tile's online softmax for row `my_row`: lane `r + 16·half` covers keys
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
    row_base: usize,
    ds_row: usize,
    kv0: usize,
    my_row: usize,
    owner: bool,
    qscale: f32,
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
        let mut s = f32::cast_from(s_sm[row_base + j]) * qscale * ks_sm[j];
        if has_ds {
            // Keys past the end are masked below; clamping keeps the read in bounds.
            s += ds[ds_row + select(key < args.skv, key, args.skv - 1)] * args.scale;
        }
        if masked {
            let mut valid = owner && key < args.skv;
            if causal {
                valid = valid && key <= my_row + args.skv - args.sq;
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
        p_sm[row_base + j] = P::cast_from(round_bits(p * args.p_scale, g));
    }
    Step {
        m: m_out,
        alpha,
        need,
        sum: part_sum + plane_shuffle_xor(part_sum, 16u32),
    }
}

/// The PV-grid copy of `v` in `dtype` (f16/bf16), rounded when `round`.
fn round_v(v: CubeTensor, dtype: DType, g: RoundArgs, round: bool) -> CubeTensor {
    let v = into_contiguous(v);
    let client = v.client.clone();
    let out = empty_device_contiguous_dtype(
        client.clone(),
        v.device.clone(),
        v.meta.shape().clone(),
        dtype,
    );
    let n = v.meta.num_elements();
    let dtypes = [dtype_to_storage_type(v.dtype), dtype_to_storage_type(dtype)];
    round_v_kernel::launch(
        &client,
        grid(&client, n.div_ceil(256)),
        CubeDim::new_1d(256),
        v.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        g.launch_arg(),
        round,
        dtypes,
    );
    out
}

/// Launches the matrix-unit kernel. Quantized Q/K must be i8.
#[allow(clippy::too_many_arguments)]
pub fn launch(
    qi: CubeTensor,
    ki: CubeTensor,
    qs: CubeTensor,
    ks: CubeTensor,
    ds: Option<CubeTensor>,
    v: CubeTensor,
    post: CubeTensor,
    args: AttnArgs,
    plan: &SagePlan,
) -> (CubeTensor, Option<CubeTensor>) {
    let client = qi.client.clone();
    let [b, hq, sq, d] = qi.meta.shape().dims::<4>();
    let ml = MatrixLaunch::new(&qi, &qs, ds, plan);
    // V in FP16 mode is already in the PV format unless the input is f32.
    let v = if !ml.fp8 && v.dtype == ml.pv_dtype {
        into_contiguous(v)
    } else {
        round_v(v, ml.pv_dtype, ml.g, ml.fp8 || plan.dtype == DType::F32)
    };
    let dtypes = [
        dtype_to_storage_type(plan.dtype),
        dtype_to_storage_type(ml.pv_dtype),
    ];
    let cubes = b * hq * sq.div_ceil(PLANES * 16);
    attn_cmma_kernel::launch(
        &client,
        grid(&client, cubes),
        CubeDim::new_2d(32, PLANES as u32),
        K_VEC,
        V_VEC,
        into_contiguous(qi).into_tensor_arg(),
        into_contiguous(ki).into_tensor_arg(),
        qs.into_tensor_arg(),
        ks.into_tensor_arg(),
        ml.ds.clone().into_tensor_arg(),
        v.into_tensor_arg(),
        into_contiguous(post).into_tensor_arg(),
        ml.out.clone().into_tensor_arg(),
        ml.lse.clone().into_tensor_arg(),
        args.launch_arg(),
        ml.g.launch_arg(),
        ml.tau,
        d,
        PLANES,
        plan.opts.causal,
        ml.has_ds,
        ml.write_lse,
        dtypes,
    );
    ml.outputs()
}
