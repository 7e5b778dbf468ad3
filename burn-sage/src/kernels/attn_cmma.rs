//! The attention kernel on the matrix units (CUDA tensor cores through CubeCL's cmma).
//!
//! One cube per `(batch·q_head, tile of 16·PLANES queries)`, one plane (warp) per 16 query
//! rows. For each tile of [`BKV`] keys:
//! 1. the cube loads the K tile (i8) and the V tile (rounded to the PV grid, as f16/bf16)
//!    into shared memory;
//! 2. each plane computes its `16 × BKV` block of `Q·Kᵀ` with i8·i8→i32 cmma;
//! 3. one lane per query row dequantizes (q scale · k scale · softmax scale, plus `ΔS`),
//!    masks, runs the online softmax in f32 and writes `P̃ = exp(s − m)·p_scale` rounded to
//!    the PV grid;
//! 4. the plane rescales its f32 output block by `exp(m_old − m_new)` and accumulates
//!    `P̃·V` with f16/bf16 cmma into it (f32 accumulation).
//!
//! Q and K tiles are stored chunk-major in shared memory (`[d/16][rows][16]`) so that every
//! cmma load starts on a 256-byte boundary, as the WMMA loads require. FP8 E4M3 values are
//! exactly representable in f16, so the FP8 mode runs on the f16 units with E4M3 numerics
//! (CubeCL 0.10's CUDA cmma has no e4m3 shape); its f32 accumulator is exact, so the
//! two-level accumulation the hardware FP8 path needs is not required here.

use burn::tensor::{DType, Shape};
use burn_cubecl::{
    CubeRuntime, kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype,
    tensor::CubeTensor,
};
use cubecl::prelude::*;

use super::common::{grid, round_grid};
use super::{AttnArgs, dummy};
use crate::{PvPrecision, SagePlan};

/// Keys per tile.
pub const BKV: usize = 64;
/// Planes (warps) per cube; each owns 16 query rows.
pub const PLANES: usize = 4;

#[cube(launch)]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
fn attn_cmma_kernel<F: Float, P: Float, V: Float>(
    qi: &Tensor<i8>,
    ki: &Tensor<i8>,
    qs: &Tensor<f32>,
    ks: &Tensor<f32>,
    ds: &Tensor<f32>,
    v: &Tensor<V>,
    post: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    args: AttnArgs,
    #[comptime] dim: usize,
    #[comptime] planes: usize,
    #[comptime] causal: bool,
    #[comptime] has_ds: bool,
    #[comptime] write_lse: bool,
    #[comptime] round_v: bool,
    #[define(F, P, V)] _dtypes: [StorageType; 3],
) {
    let bq = planes * 16;
    let bkv = comptime!(BKV);
    let chunks = dim / 16;
    let stride_kv = comptime!(BKV as u32);
    let q_tiles = (args.sq + bq - 1) / bq;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let bh = cube / q_tiles;
    let q0 = (cube % q_tiles) * bq;
    let bhk = (bh / args.hq) * (args.hq / args.group) + (bh % args.hq) / args.group;
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let tid = plane * 32 + lane;
    let threads = planes * 32;
    let offset = args.skv - args.sq;

    let mut q_sm = SharedMemory::<i8>::new_aligned(bq * dim, 128usize);
    let mut k_sm = SharedMemory::<i8>::new_aligned(bkv * dim, 128usize);
    let mut v_sm = SharedMemory::<P>::new_aligned(bkv * dim, 128usize);
    let mut s_sm = SharedMemory::<i32>::new_aligned(bq * bkv, 128usize);
    let mut p_sm = SharedMemory::<P>::new_aligned(bq * bkv, 128usize);
    let mut o_sm = SharedMemory::<f32>::new_aligned(bq * dim, 128usize);
    let mut ks_sm = SharedMemory::<f32>::new(bkv);
    let mut alpha_sm = SharedMemory::<f32>::new(bq);

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
        o_sm[e] = f32::new(0.0);
        e += threads;
    }

    // Lane r < 16 of each plane owns query row `my_row`.
    let my_row = q0 + plane * 16 + lane;
    let owner = lane < 16 && my_row < args.sq;
    let mut qscale = f32::new(0.0);
    if owner {
        let qg = (my_row / args.q_block) * args.q_inter + (my_row % args.q_block) % args.q_inter;
        qscale = qs[bh * args.q_groups + qg] * args.scale;
    }
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

    let mut kv0 = 0usize;
    while kv0 < kv_end {
        sync_cube();
        let mut e = tid;
        while e < bkv * dim {
            let r = e / dim;
            let c = e % dim;
            let key = kv0 + r;
            let mut x = i8::new(0);
            let mut y = P::new(0.0);
            if key < args.skv {
                let g = (bhk * args.skv + key) * dim + c;
                x = ki[g];
                let mut val = f32::cast_from(v[g]);
                if round_v {
                    val = round_grid(val, args.mantissa, args.min_exp, args.grid_max);
                }
                y = P::cast_from(val);
            }
            k_sm[(c / 16) * bkv * 16 + r * 16 + c % 16] = x;
            v_sm[e] = y;
            e += threads;
        }
        if tid < bkv {
            let key = kv0 + tid;
            let mut sc = f32::new(0.0);
            if key < args.skv {
                let kg = (key / args.k_block) * args.k_inter + (key % args.k_block) % args.k_inter;
                sc = ks[bhk * args.k_groups + kg];
            }
            ks_sm[tid] = sc;
        }
        sync_cube();

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
                let a_off = kk * bq * 16 + plane * 256;
                let a = cmma::Matrix::<i8>::from_slice(
                    cmma::MatrixIdent::A,
                    16usize,
                    16usize,
                    16usize,
                    cmma::MatrixLayout::RowMajor,
                    &q_sm.slice(a_off, a_off + 256),
                    16u32,
                );
                let b_off = kk * bkv * 16 + n * 256;
                let b = cmma::Matrix::<i8>::from_slice(
                    cmma::MatrixIdent::B,
                    16usize,
                    16usize,
                    16usize,
                    cmma::MatrixLayout::ColMajor,
                    &k_sm.slice(b_off, b_off + 256),
                    16u32,
                );
                cmma::execute::<i8, i8, i32, i32>(&a, &b, &acc, &acc);
            }
            let s_off = plane * 16 * bkv + n * 16;
            cmma::store(
                &mut s_sm.slice_mut(s_off, s_off + 15 * bkv + 16),
                &acc,
                stride_kv,
                cmma::MatrixLayout::RowMajor,
            );
        }
        sync_cube();

        // Online softmax, one lane per row.
        if lane < 16 {
            let base = (plane * 16 + lane) * bkv;
            if owner {
                let mut tile_max = f32::new(-1.0e30);
                for j in 0..bkv {
                    let key = kv0 + j;
                    let mut valid = key < args.skv;
                    if causal {
                        valid = valid && key <= my_row + offset;
                    }
                    if valid {
                        let mut s = f32::cast_from(s_sm[base + j]) * qscale * ks_sm[j];
                        if has_ds {
                            s += ds[(bh * args.mean_blocks + my_row / args.mean_block) * args.skv
                                + key]
                                * args.scale;
                        }
                        tile_max = f32::max(tile_max, s);
                    }
                }
                let m_new = f32::max(m, tile_max);
                let alpha = f32::exp(m - m_new);
                let mut sum = f32::new(0.0);
                for j in 0..bkv {
                    let key = kv0 + j;
                    let mut valid = key < args.skv;
                    if causal {
                        valid = valid && key <= my_row + offset;
                    }
                    let mut pq = f32::new(0.0);
                    if valid {
                        let mut s = f32::cast_from(s_sm[base + j]) * qscale * ks_sm[j];
                        if has_ds {
                            s += ds[(bh * args.mean_blocks + my_row / args.mean_block) * args.skv
                                + key]
                                * args.scale;
                        }
                        let p = f32::exp(s - m_new);
                        sum += p;
                        pq = round_grid(
                            p * args.p_scale,
                            args.mantissa,
                            args.min_exp,
                            args.grid_max,
                        );
                    }
                    p_sm[base + j] = P::cast_from(pq);
                }
                l = l * alpha + sum;
                m = m_new;
                alpha_sm[plane * 16 + lane] = alpha;
            } else {
                for j in 0..bkv {
                    p_sm[base + j] = P::new(0.0);
                }
                alpha_sm[plane * 16 + lane] = f32::new(1.0);
            }
        }
        sync_cube();

        accumulate_pv::<P>(&mut o_sm, &p_sm, &v_sm, &alpha_sm, plane, lane, dim, bkv);
        kv0 += bkv;
    }
    sync_cube();

    // Epilogue: the row sums go through shared memory to every lane of the plane.
    if lane < 16 {
        alpha_sm[plane * 16 + lane] = l;
        if write_lse && owner {
            lse[bh * args.sq + my_row] = m + f32::ln(l);
        }
    }
    sync_cube();
    let o_base = plane * 16 * dim;
    let mut e = lane;
    while e < 16 * dim {
        let r = e / dim;
        let c = e % dim;
        let row = q0 + plane * 16 + r;
        if row < args.sq {
            out[(bh * args.sq + row) * dim + c] =
                F::cast_from(o_sm[o_base + e] * post[bhk * dim + c] / alpha_sm[plane * 16 + r]);
        }
        e += 32usize;
    }
}

/// `O = O·alpha + P̃·V` for one plane's 16 rows: the rescale by the lanes, then the product on
/// the matrix units, accumulated in f32 in shared memory.
#[cube]
#[allow(clippy::too_many_arguments)]
fn accumulate_pv<P: Float>(
    o_sm: &mut SharedMemory<f32>,
    p_sm: &SharedMemory<P>,
    v_sm: &SharedMemory<P>,
    alpha_sm: &SharedMemory<f32>,
    plane: usize,
    lane: usize,
    #[comptime] dim: usize,
    #[comptime] bkv: usize,
) {
    let o_base = plane * 16 * dim;
    let mut e = lane;
    while e < 16 * dim {
        let idx = o_base + e;
        o_sm[idx] = o_sm[idx] * alpha_sm[plane * 16 + e / dim];
        e += 32;
    }
    sync_cube();
    #[unroll]
    for t in 0..dim / 16 {
        let c_off = o_base + t * 16;
        let acc = cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::Undefined,
            f32::new(0.0),
        );
        cmma::load_with_layout(
            &acc,
            &o_sm.slice(c_off, c_off + 15 * dim + 16),
            comptime!(dim as u32),
            cmma::MatrixLayout::RowMajor,
        );
        #[unroll]
        for kk in 0..bkv / 16 {
            let a_off = plane * 16 * bkv + kk * 16;
            let a = cmma::Matrix::<P>::from_slice(
                cmma::MatrixIdent::A,
                16usize,
                16usize,
                16usize,
                cmma::MatrixLayout::RowMajor,
                &p_sm.slice(a_off, a_off + 15 * bkv + 16),
                comptime!(bkv as u32),
            );
            let b_off = kk * 16 * dim + t * 16;
            let b = cmma::Matrix::<P>::from_slice(
                cmma::MatrixIdent::B,
                16usize,
                16usize,
                16usize,
                cmma::MatrixLayout::RowMajor,
                &v_sm.slice(b_off, b_off + 15 * dim + 16),
                comptime!(dim as u32),
            );
            cmma::execute::<P, P, f32, f32>(&a, &b, &acc, &acc);
        }
        cmma::store(
            &mut o_sm.slice_mut(c_off, c_off + 15 * dim + 16),
            &acc,
            comptime!(dim as u32),
            cmma::MatrixLayout::RowMajor,
        );
    }
}

/// Launches the matrix-unit kernel. Quantized Q/K must be i8.
#[allow(clippy::too_many_arguments)]
pub fn launch<R: CubeRuntime>(
    qi: CubeTensor<R>,
    ki: CubeTensor<R>,
    qs: CubeTensor<R>,
    ks: CubeTensor<R>,
    ds: Option<CubeTensor<R>>,
    v: CubeTensor<R>,
    post: CubeTensor<R>,
    args: AttnArgs,
    plan: &SagePlan,
) -> (CubeTensor<R>, Option<CubeTensor<R>>) {
    let client = qi.client.clone();
    let device = qi.device.clone();
    let [b, hq, sq, d] = qi.meta.shape().dims::<4>();
    let out = empty_device_contiguous_dtype::<R>(
        client.clone(),
        device.clone(),
        Shape::new([b, hq, sq, d]),
        plan.dtype,
    );
    let write_lse = plan.opts.return_lse;
    let lse = if write_lse {
        empty_device_contiguous_dtype::<R>(
            client.clone(),
            device.clone(),
            Shape::new([b, hq, sq]),
            DType::F32,
        )
    } else {
        dummy(&qs)
    };
    let has_ds = ds.is_some();
    let ds = ds.map(into_contiguous).unwrap_or_else(|| dummy(&qs));
    let pv_dtype = if plan.dtype == DType::BF16 {
        DType::BF16
    } else {
        DType::F16
    };
    // V in FP16 mode is already in the PV format unless the input is f32.
    let round_v = plan.opts.pv == PvPrecision::Fp8E4m3 || plan.dtype == DType::F32;
    let dtypes = [plan.dtype.into(), pv_dtype.into(), v.dtype.into()];
    let cubes = b * hq * sq.div_ceil(PLANES * 16);
    attn_cmma_kernel::launch::<R>(
        &client,
        grid(&client, cubes),
        CubeDim::new_2d(32, PLANES as u32),
        qi.into_tensor_arg(),
        ki.into_tensor_arg(),
        qs.into_tensor_arg(),
        ks.into_tensor_arg(),
        ds.into_tensor_arg(),
        into_contiguous(v).into_tensor_arg(),
        into_contiguous(post).into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        args.launch_arg(),
        d,
        PLANES,
        plan.opts.causal,
        has_ds,
        write_lse,
        round_v,
        dtypes,
    );
    (out, write_lse.then_some(lse))
}
