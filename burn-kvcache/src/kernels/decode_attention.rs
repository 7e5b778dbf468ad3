//! Split-K attention over full-precision keys and values for a few query rows per KV head
//! (decode steps, speculative verification), one plane per split:
//!
//! - `split_kernel`: the cube `(lanes, PLANES)` holds `PLANES` planes; plane `y` of cube `x`
//!   owns split `x · PLANES + y` of KV head `CUBE_POS_Y`. Its lanes hold interleaved channels
//!   (`lane`, `lane + lanes`, ...) of every query row of the head's group, so each load of a key
//!   or value row is one coalesced read, a dot product is a per-lane partial and a `plane_sum`,
//!   and the online softmax runs in registers (identical in every lane). Keys are read
//!   `CHUNK` at a time before any is used, to keep several reads in flight. It writes each
//!   split's running max, sum and unnormalized output, as the quantized read's partial kernel
//!   does, and `combine_kernel` of [`super::quant_attention`] finishes.
//! - The query, keys and values are read through their strides (no contiguous copies of the
//!   swapped-head views a layer hands over).
//!
//! Runs where planes have one known size that divides the head dim; [`supported`] says so,
//! and the caller uses the one-unit-per-split kernel of [`super::quant_attention`] elsewhere.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::ir::features::Plane;
use cubecl::prelude::*;

use super::quant_attention::combine;

/// Planes (splits) per cube.
const PLANES: u32 = 4;
/// Keys read ahead of their use.
const CHUNK: usize = 4;
/// Fewest keys per split; more where the splits would outnumber [`TARGET_PLANES`].
const MIN_SPLIT: usize = 16;
/// Planes a launch aims for (a few per SM of a large GPU).
const TARGET_PLANES: usize = 1024;
/// Most registers of query and output a lane may hold (`2 · rows · dim / lanes`).
const MAX_REGS: usize = 128;

/// Sizes of one launch.
#[derive(CubeLaunch, CubeType, Clone, Copy, Debug)]
pub struct DecodeArgs {
    pub hkv: usize,
    pub group: usize,
    pub sq: usize,
    pub skv: usize,
    pub split: usize,
    pub splits: usize,
    pub scale: f32,
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn split_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    mask: &Tensor<i32>,
    m_out: &mut Tensor<f32>,
    l_out: &mut Tensor<f32>,
    acc_out: &mut Tensor<f32>,
    args: DecodeArgs,
    #[comptime] dim: usize,
    #[comptime] lanes: usize,
    #[comptime] rows: usize,
    #[comptime] causal: bool,
    #[comptime] masked: bool,
    #[define(F)] _dtype: ElemType,
) {
    let s = (CUBE_POS_X * PLANES + UNIT_POS_Y) as usize;
    if s >= args.splits {
        terminate!();
    }
    let per = comptime!(dim / lanes);
    let lane = UNIT_POS_X as usize;
    let bkv = CUBE_POS_Y as usize;
    let batch = bkv / args.hkv;
    let kvh = bkv % args.hkv;

    let qv = load_queries::<F>(
        q,
        batch,
        kvh * args.group,
        lane,
        args.sq,
        args.scale,
        dim,
        lanes,
        rows,
    );
    let mut acc = Array::<f32>::new(comptime!(rows * per));
    let mut m = Array::<f32>::new(rows);
    let mut l = Array::<f32>::new(rows);
    #[unroll]
    for r in 0..rows {
        m[r] = f32::new(-1.0e30);
        l[r] = f32::new(0.0);
        #[unroll]
        for e in 0..per {
            acc[r * per + e] = f32::new(0.0);
        }
    }

    let start = s * args.split;
    let mut stop = start + args.split;
    if args.skv < stop {
        stop = args.skv;
    }
    let kb = batch * k.stride(0) + kvh * k.stride(1);
    let vb = batch * v.stride(0) + kvh * v.stride(1);
    let mut j0 = start;
    while j0 < stop {
        // Read CHUNK key and value rows (the last one again past the split's end).
        let mut kk = Array::<f32>::new(comptime!(CHUNK * per));
        let mut vv = Array::<f32>::new(comptime!(CHUNK * per));
        #[unroll]
        for u in 0..CHUNK {
            let mut j = j0 + u;
            if j >= stop {
                j = stop - 1;
            }
            #[unroll]
            for e in 0..per {
                let c = lane + e * lanes;
                kk[u * per + e] = f32::cast_from(k[kb + j * k.stride(2) + c * k.stride(3)]);
                vv[u * per + e] = f32::cast_from(v[vb + j * v.stride(2) + c * v.stride(3)]);
            }
        }
        #[unroll]
        for u in 0..CHUNK {
            let j = j0 + u;
            let mut visible = j < stop;
            if masked && visible {
                visible = mask[batch * args.skv + j] == 0;
            }
            // Uniform over the plane: every lane has the same `j`.
            if visible {
                #[unroll]
                for r in 0..rows {
                    let mut part = f32::new(0.0);
                    #[unroll]
                    for e in 0..per {
                        part += qv[r * per + e] * kk[u * per + e];
                    }
                    let dot = plane_sum(part);
                    let mut seen = true;
                    if causal {
                        seen = j + args.sq <= r % args.sq + args.skv;
                    }
                    if seen {
                        let mut mr = m[r];
                        if dot > mr {
                            let alpha = f32::exp(mr - dot);
                            l[r] *= alpha;
                            #[unroll]
                            for e in 0..per {
                                acc[r * per + e] *= alpha;
                            }
                            mr = dot;
                            m[r] = dot;
                        }
                        let p = f32::exp(dot - mr);
                        l[r] += p;
                        #[unroll]
                        for e in 0..per {
                            acc[r * per + e] += p * vv[u * per + e];
                        }
                    }
                }
            }
        }
        j0 += CHUNK;
    }

    #[unroll]
    for r in 0..rows {
        let part = (bkv * rows + r) * args.splits + s;
        if lane == 0 {
            m_out[part] = m[r];
            l_out[part] = l[r];
        }
        #[unroll]
        for e in 0..per {
            acc_out[part * dim + lane + e * lanes] = acc[r * per + e];
        }
    }
}

/// The group's query rows (row `r` = head `first_head + r / sq`, position `r % sq`), this
/// lane's channels, scaled.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_queries<F: Float>(
    q: &Tensor<F>,
    batch: usize,
    first_head: usize,
    lane: usize,
    sq: usize,
    scale: f32,
    #[comptime] dim: usize,
    #[comptime] lanes: usize,
    #[comptime] rows: usize,
) -> Array<f32> {
    let per = comptime!(dim / lanes);
    let mut qv = Array::<f32>::new(comptime!(rows * per));
    #[unroll]
    for r in 0..rows {
        let head = first_head + r / sq;
        let base = batch * q.stride(0) + head * q.stride(1) + (r % sq) * q.stride(2);
        #[unroll]
        for e in 0..per {
            let c = lane + e * lanes;
            qv[r * per + e] = f32::cast_from(q[base + c * q.stride(3)]) * scale;
        }
    }
    qv
}

/// The plane size this kernel would run with on `client`, when it can run there for rows of
/// `dim` channels and `rows` query rows per KV head.
pub fn supported(client: &cubecl::client::Client, dim: usize, rows: usize) -> Option<usize> {
    let props = client.properties();
    let lanes = props.hardware.plane_size_max as usize;
    let fits = props.features.plane.contains(Plane::Ops)
        && props.hardware.plane_size_min as usize == lanes
        && lanes > 0
        && dim.is_multiple_of(lanes)
        && 2 * rows * dim / lanes <= MAX_REGS;
    fits.then_some(lanes)
}

/// Keys per split for `skv` keys over `bkv` KV heads: at least [`MIN_SPLIT`], more where the
/// splits would outnumber [`TARGET_PLANES`].
fn split_len(skv: usize, bkv: usize) -> usize {
    if let Some(fixed) = forced_split() {
        return fixed;
    }
    let even = (skv * bkv).div_ceil(TARGET_PLANES);
    even.max(MIN_SPLIT).next_multiple_of(CHUNK)
}

/// A split length forced by `BURN_KERNELS_DECODE_SPLIT` (a multiple of [`CHUNK`]), for
/// measuring split lengths against each other on a device; unset, [`split_len`] decides.
fn forced_split() -> Option<usize> {
    use std::sync::OnceLock;
    static SPLIT: OnceLock<Option<usize>> = OnceLock::new();
    *SPLIT.get_or_init(|| {
        std::env::var("BURN_KERNELS_DECODE_SPLIT")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|v| *v > 0 && v.is_multiple_of(CHUNK))
    })
}

/// Attention of `q` `[b, hq, sq, d]` over `k`, `v` `[b, hkv, skv, d]` (any strides, `q`'s
/// dtype) with an optional `[b, skv]` i32 key mask (non-zero = hidden); `lanes` from
/// [`supported`]. Returns `[b, hq, sq, d]` contiguous.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    mask: Option<CubeTensor>,
    scale: f32,
    causal: bool,
    lanes: usize,
) -> CubeTensor {
    let [b, hq, sq, d] = q.meta.shape().dims::<4>();
    let [_, hkv, skv, _] = k.meta.shape().dims::<4>();
    let client = q.client.clone();
    let device = q.device.clone();
    let dtype = q.dtype;
    let group = hq / hkv;
    let rows = group * sq;
    let out = empty_device_contiguous_dtype(
        client.clone(),
        device.clone(),
        Shape::new([b, hq, sq, d]),
        dtype,
    );
    if b * hq * sq == 0 {
        return out;
    }
    let bkv = b * hkv;
    let split = split_len(skv.max(1), bkv);
    let splits = skv.div_ceil(split).max(1);
    let f32_buf = |n: usize| {
        empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::new([n]), DType::F32)
    };
    let parts = bkv * rows * splits;
    let (m, l, acc) = (f32_buf(parts), f32_buf(parts), f32_buf(parts * d));
    let masked = mask.is_some();
    let mask = mask.map(into_contiguous).unwrap_or_else(|| {
        empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::new([1]), DType::I32)
    });
    split_kernel::launch(
        &client,
        CubeCount::Static((splits as u32).div_ceil(PLANES), bkv as u32, 1),
        CubeDim::new_2d(lanes as u32, PLANES),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        mask.into_tensor_arg(),
        m.clone().into_tensor_arg(),
        l.clone().into_tensor_arg(),
        acc.clone().into_tensor_arg(),
        DecodeArgsLaunch::new(hkv, group, sq, skv, split, splits, scale),
        d,
        lanes,
        rows,
        causal,
        masked,
        dtype_to_storage_type(dtype),
    );
    combine(m, l, acc, &out, b * hq * sq * d, splits, d);
    out
}
