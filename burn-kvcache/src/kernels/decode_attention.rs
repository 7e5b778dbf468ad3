//! Split-K attention over full-precision keys and values for a few query rows per KV head
//! (decode steps, speculative verification), one cube per split:
//!
//! - `split_kernel`: cube `(x, y)` owns split `x` of KV head `y`. Its `planes` planes take the
//!   split's keys `chunk` at a time, interleaved (plane `p` reads chunks `p`, `p + planes`, …).
//!   A plane's lanes hold interleaved channels (`lane`, `lane + lanes`, …) of every query row
//!   of the head's group, so a key or value row is one coalesced read and a dot product is a
//!   per-lane partial and a `plane_sum`.
//! - A chunk is branch-free: its keys and values are all read before any is used, every row's
//!   scores of the chunk are reduced together (independent `plane_sum`s the compiler can
//!   overlap), then one online-softmax update per row and chunk. Hidden keys (past the split,
//!   masked, or after the query when causal) get no weight, and hidden positions are never
//!   multiplied into the sums (a static cache's unwritten rows may hold anything).
//! - The cube's planes merge their partial softmax states through shared memory. With one
//!   split per KV head the cube writes the normalized output itself (one launch); otherwise it
//!   writes the split's running max, sum and unnormalized output, and `combine_kernel` of
//!   [`super::quant_attention`] finishes.
//! - The query, keys, values and the key mask are read through their strides (no contiguous
//!   copies of the swapped-head views a layer hands over), and the mask in its own storage
//!   (Burn's bool dtype: `u8` or `u32`, non-zero = hidden), so a step converts nothing.
//!
//! Runs where planes have one known size that divides the head dim; [`supported`] says so,
//! and the caller uses the one-unit-per-split kernel of [`super::quant_attention`] elsewhere.
//! With `lanes = 1` (planes of one unit) it needs no plane ops, which is how its tests run
//! it on runtimes without them.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::{ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor};
use cubecl::ir::features::Plane;
use cubecl::prelude::*;

use super::quant_attention::combine;

/// Planes per cube unless `BURN_KERNELS_DECODE_PLANES` says otherwise.
const PLANES: usize = 4;
/// Most keys a plane reads ahead of their use.
const MAX_CHUNK: usize = 16;
/// Planes a launch aims for (a few per SM of a large GPU).
const TARGET_PLANES: usize = 1024;
/// Most registers of query and output a lane may hold (`2 · rows · dim / lanes`).
const MAX_REGS: usize = 128;
/// Most f32 registers a lane spends on a chunk: its keys and values (`chunk · dim / lanes`
/// each) and every row's scores (`rows · chunk`).
const CHUNK_REGS: usize = 128;
/// Most f32 values of the planes' merge in shared memory (24 KiB, under every runtime's
/// 32 KiB).
const SHARED_FLOATS: usize = 6144;
/// The score of a hidden key (finite: a row that sees nothing keeps finite sums).
const HIDDEN: f64 = -1.0e30;

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

/// The compile-time shape of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Plan {
    dim: usize,
    lanes: usize,
    rows: usize,
    chunk: usize,
    planes: usize,
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn split_kernel<F: Float, B: Int>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    mask: &Tensor<B>,
    m_out: &mut Tensor<f32>,
    l_out: &mut Tensor<f32>,
    acc_out: &mut Tensor<f32>,
    out: &mut Tensor<F>,
    args: DecodeArgs,
    #[comptime] plan: Plan,
    #[comptime] causal: bool,
    #[comptime] masked: bool,
    #[comptime] direct: bool,
    #[define(F, B)] _dtypes: [ElemType; 2],
) {
    let dim = comptime!(plan.dim);
    let lanes = comptime!(plan.lanes);
    let rows = comptime!(plan.rows);
    let chunk = comptime!(plan.chunk);
    let planes = comptime!(plan.planes);
    let per = comptime!(dim / lanes);
    let s = CUBE_POS_X as usize;
    let bkv = CUBE_POS_Y as usize;
    let plane = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
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
        m[r] = f32::new(HIDDEN);
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
    let mb = batch * mask.stride(0);
    let mut j0 = start + plane * chunk;
    while j0 < stop {
        let mut kk = Array::<f32>::new(comptime!(chunk * per));
        let mut vv = Array::<f32>::new(comptime!(chunk * per));
        let mut open = Array::<u32>::new(chunk);
        #[unroll]
        for u in 0..chunk {
            let j = j0 + u;
            let mut visible = j < stop;
            let jc = select(visible, j, stop - 1);
            if masked {
                visible = visible && mask[mb + jc * mask.stride(1)] == B::from_int(0);
            }
            open[u] = select(visible, 1u32, 0u32);
            #[unroll]
            for e in 0..per {
                let c = lane + e * lanes;
                let kx = f32::cast_from(k[kb + jc * k.stride(2) + c * k.stride(3)]);
                let vx = f32::cast_from(v[vb + jc * v.stride(2) + c * v.stride(3)]);
                kk[u * per + e] = select(visible, kx, f32::new(0.0));
                vv[u * per + e] = select(visible, vx, f32::new(0.0));
            }
        }
        let scores = chunk_scores(&qv, &kk, per, lanes, rows, chunk);
        #[unroll]
        for r in 0..rows {
            // Key `j` is seen by row `r` when open and, causally, not after its query.
            let mut top = m[r];
            let mut seen = Array::<u32>::new(chunk);
            #[unroll]
            for u in 0..chunk {
                let mut ok = open[u] == 1;
                if causal {
                    ok = ok && j0 + u + args.sq <= r % args.sq + args.skv;
                }
                seen[u] = select(ok, 1u32, 0u32);
                top = f32::max(top, select(ok, scores[r * chunk + u], f32::new(HIDDEN)));
            }
            let alpha = f32::exp(m[r] - top);
            let mut sum = l[r] * alpha;
            #[unroll]
            for e in 0..per {
                acc[r * per + e] *= alpha;
            }
            #[unroll]
            for u in 0..chunk {
                let ok = seen[u] == 1;
                let p = select(ok, f32::exp(scores[r * chunk + u] - top), f32::new(0.0));
                sum += p;
                #[unroll]
                for e in 0..per {
                    acc[r * per + e] += select(ok, p * vv[u * per + e], f32::new(0.0));
                }
            }
            l[r] = sum;
            m[r] = top;
        }
        j0 += comptime!(planes * chunk);
    }
    finish::<F>(
        &m,
        &l,
        &acc,
        m_out,
        l_out,
        acc_out,
        out,
        bkv,
        s,
        args.splits,
        plane,
        lane,
        plan,
        direct,
    );
}

/// Every row's scaled score of each key of a chunk: `[rows, chunk]`, in every lane.
#[cube]
fn chunk_scores(
    qv: &Array<f32>,
    kk: &Array<f32>,
    #[comptime] per: usize,
    #[comptime] lanes: usize,
    #[comptime] rows: usize,
    #[comptime] chunk: usize,
) -> Array<f32> {
    let mut scores = Array::<f32>::new(comptime!(rows * chunk));
    #[unroll]
    for r in 0..rows {
        #[unroll]
        for u in 0..chunk {
            let mut part = f32::new(0.0);
            #[unroll]
            for e in 0..per {
                part += qv[r * per + e] * kk[u * per + e];
            }
            if comptime!(lanes == 1) {
                scores[r * chunk + u] = part;
            } else {
                scores[r * chunk + u] = plane_sum(part);
            }
        }
    }
    scores
}

/// Merges the cube's planes (through shared memory when there are several) and writes the
/// split's partial state, or with `direct` (one split) the normalized output.
#[cube]
#[allow(clippy::too_many_arguments)]
fn finish<F: Float>(
    m: &Array<f32>,
    l: &Array<f32>,
    acc: &Array<f32>,
    m_out: &mut Tensor<f32>,
    l_out: &mut Tensor<f32>,
    acc_out: &mut Tensor<f32>,
    out: &mut Tensor<F>,
    bkv: usize,
    s: usize,
    splits: usize,
    plane: usize,
    lane: usize,
    #[comptime] plan: Plan,
    #[comptime] direct: bool,
) {
    let dim = comptime!(plan.dim);
    let lanes = comptime!(plan.lanes);
    let rows = comptime!(plan.rows);
    let planes = comptime!(plan.planes);
    let per = comptime!(dim / lanes);
    if comptime!(planes == 1) {
        #[unroll]
        for r in 0..rows {
            #[unroll]
            for e in 0..per {
                let c = lane + e * lanes;
                let row = bkv * rows + r;
                write::<F>(
                    m_out,
                    l_out,
                    acc_out,
                    out,
                    row,
                    c,
                    s,
                    splits,
                    m[r],
                    l[r],
                    acc[r * per + e],
                    dim,
                    direct,
                );
            }
        }
    } else {
        let mut sm = Shared::<[f32]>::new_slice(comptime!(planes * rows));
        let mut sl = Shared::<[f32]>::new_slice(comptime!(planes * rows));
        let mut sa = Shared::<[f32]>::new_slice(comptime!(planes * rows * dim));
        #[unroll]
        for r in 0..rows {
            if lane == 0 {
                sm[plane * rows + r] = m[r];
                sl[plane * rows + r] = l[r];
            }
            #[unroll]
            for e in 0..per {
                sa[(plane * rows + r) * dim + lane + e * lanes] = acc[r * per + e];
            }
        }
        sync_cube();
        let units = comptime!(planes * lanes);
        let mut i = plane * lanes + lane;
        while i < comptime!(rows * dim) {
            let r = i / dim;
            let c = i % dim;
            let mut top = f32::new(HIDDEN);
            #[unroll]
            for y in 0..planes {
                top = f32::max(top, sm[y * rows + r]);
            }
            let mut sum = f32::new(0.0);
            let mut a = f32::new(0.0);
            #[unroll]
            for y in 0..planes {
                let w = f32::exp(sm[y * rows + r] - top);
                sum += w * sl[y * rows + r];
                a += w * sa[(y * rows + r) * dim + c];
            }
            let row = bkv * rows + r;
            write::<F>(
                m_out, l_out, acc_out, out, row, c, s, splits, top, sum, a, dim, direct,
            );
            i += units;
        }
    }
}

/// Channel `c` of output row `row`: normalized into `out` with `direct`, else split `s`'s
/// partial state (its max and sum written once, by channel 0).
#[cube]
#[allow(clippy::too_many_arguments)]
fn write<F: Float>(
    m_out: &mut Tensor<f32>,
    l_out: &mut Tensor<f32>,
    acc_out: &mut Tensor<f32>,
    out: &mut Tensor<F>,
    row: usize,
    c: usize,
    s: usize,
    splits: usize,
    m: f32,
    l: f32,
    a: f32,
    #[comptime] dim: usize,
    #[comptime] direct: bool,
) {
    if direct {
        // A row that sees no key returns zeros (finite, meaningless, as the interface allows).
        let y = select(l > f32::new(0.0), a / l, f32::new(0.0));
        out[row * dim + c] = F::cast_from(y);
    } else {
        let part = row * splits + s;
        if c == 0 {
            m_out[part] = m;
            l_out[part] = l;
        }
        acc_out[part * dim + c] = a;
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

/// How a launch is laid out: the plane size (from [`supported`], or 1: planes of one unit,
/// which need no plane ops; each unit then holds every channel of its rows, which is meant
/// for testing the kernel on runtimes without plane ops, such as wgpu on lavapipe), and
/// optionally the planes per cube and the keys per split (`None`: the defaults, or the
/// `BURN_KERNELS_DECODE_PLANES` / `BURN_KERNELS_DECODE_SPLIT` variables for measuring
/// settings against each other on a device).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeLayout {
    pub lanes: usize,
    /// A power of two ≤ 32, halved until the planes' merge fits shared memory.
    pub planes: Option<usize>,
    pub split: Option<usize>,
}

impl DecodeLayout {
    /// The defaults for planes of `lanes` units.
    pub fn new(lanes: usize) -> Self {
        Self {
            lanes,
            planes: None,
            split: None,
        }
    }

    /// The launch's compile-time shape: the largest power-of-two chunk within [`CHUNK_REGS`]
    /// (at most [`MAX_CHUNK`]; 4 with one lane), and the planes, halved until their merge
    /// fits [`SHARED_FLOATS`].
    fn plan(&self, dim: usize, rows: usize) -> Plan {
        let lanes = self.lanes;
        let per = dim / lanes;
        let mut chunk = MAX_CHUNK;
        while chunk > 1 && (2 * per + rows) * chunk > CHUNK_REGS {
            chunk /= 2;
        }
        if lanes == 1 {
            // Without plane ops (tests on such runtimes): chunks of several keys still.
            chunk = 4;
        }
        let mut planes = self
            .planes
            .or_else(|| knob("BURN_KERNELS_DECODE_PLANES"))
            .filter(|p| p.is_power_of_two() && *p <= 32)
            .unwrap_or(PLANES);
        while planes > 1 && planes * rows * (dim + 2) > SHARED_FLOATS {
            planes /= 2;
        }
        Plan {
            dim,
            lanes,
            rows,
            chunk,
            planes,
        }
    }

    /// Keys per split for `skv` keys over `bkv` KV heads: whole passes of the cube (`planes ·
    /// chunk` keys), more where the planes would outnumber [`TARGET_PLANES`].
    fn split_len(&self, skv: usize, bkv: usize, plan: &Plan) -> usize {
        if let Some(fixed) = self
            .split
            .or_else(|| knob("BURN_KERNELS_DECODE_SPLIT"))
            .filter(|v| *v > 0)
        {
            return fixed;
        }
        let pass = plan.planes * plan.chunk;
        let cubes = (TARGET_PLANES / plan.planes).max(1);
        (skv * bkv).div_ceil(cubes).max(pass).next_multiple_of(pass)
    }
}

/// A positive integer from `BURN_KERNELS_DECODE_PLANES` or (any other `name`)
/// `BURN_KERNELS_DECODE_SPLIT`, read once per process (no lock on the launch path).
fn knob(name: &'static str) -> Option<usize> {
    use std::sync::OnceLock;
    static PLANES: OnceLock<Option<usize>> = OnceLock::new();
    static SPLIT: OnceLock<Option<usize>> = OnceLock::new();
    let cell = match name {
        "BURN_KERNELS_DECODE_PLANES" => &PLANES,
        _ => &SPLIT,
    };
    *cell.get_or_init(|| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|v| *v > 0)
    })
}

/// Attention of `q` `[b, hq, sq, d]` over `k`, `v` `[b, hkv, skv, d]` (any strides, `q`'s
/// dtype) with an optional `[b, skv]` key mask (any strides, any integer or bool storage,
/// non-zero = hidden), laid out as `layout` says. Returns `[b, hq, sq, d]` contiguous.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    mask: Option<CubeTensor>,
    scale: f32,
    causal: bool,
    layout: DecodeLayout,
) -> CubeTensor {
    let [b, hq, sq, d] = q.meta.shape().dims::<4>();
    let [_, hkv, skv, _] = k.meta.shape().dims::<4>();
    let client = q.client.clone();
    let device = q.device.clone();
    let dtype = q.dtype;
    let group = hq / hkv;
    let rows = group * sq;
    let buf = |shape: Vec<usize>, dtype: DType| {
        empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::from(shape), dtype)
    };
    let out = buf(vec![b, hq, sq, d], dtype);
    if b * hq * sq == 0 {
        return out;
    }
    let bkv = b * hkv;
    let plan = layout.plan(d, rows);
    let split = layout.split_len(skv.max(1), bkv, &plan);
    let splits = skv.div_ceil(split).max(1);
    let direct = splits == 1;
    let parts = match direct {
        true => 1,
        false => bkv * rows * splits,
    };
    let (m, l, acc) = (
        buf(vec![parts], DType::F32),
        buf(vec![parts], DType::F32),
        buf(vec![parts * d], DType::F32),
    );
    let masked = mask.is_some();
    let mask = mask.unwrap_or_else(|| buf(vec![1, 1], DType::I32));
    let mask_dtype = dtype_to_storage_type(mask.dtype);
    split_kernel::launch(
        &client,
        CubeCount::Static(splits as u32, bkv as u32, 1),
        CubeDim::new_2d(plan.lanes as u32, plan.planes as u32),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        mask.into_tensor_arg(),
        m.clone().into_tensor_arg(),
        l.clone().into_tensor_arg(),
        acc.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        DecodeArgsLaunch::new(hkv, group, sq, skv, split, splits, scale),
        plan,
        causal,
        masked,
        direct,
        [dtype_to_storage_type(dtype), mask_dtype],
    );
    if !direct {
        combine(m, l, acc, &out, b * hq * sq * d, splits, d);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(lanes: usize, planes: usize) -> DecodeLayout {
        DecodeLayout {
            lanes,
            planes: Some(planes),
            split: None,
        }
    }

    #[test]
    fn plans_fit_their_register_and_shared_budgets() {
        // SmolLM2 decode (3 query rows per KV head, 64 channels over 32 lanes): 16-key chunks.
        let p = layout(32, 4).plan(64, 3);
        assert_eq!((p.chunk, p.planes), (16, 4));
        // A 5-token verification block (15 rows): 4-key chunks.
        assert_eq!(layout(32, 4).plan(64, 15).chunk, 4);
        // Llama-3-8B decode (4 rows, 128 channels): 8-key chunks.
        assert_eq!(layout(32, 4).plan(128, 4).chunk, 8);
        // Planes halve until their merge fits shared memory: 32 rows of 128 channels → 1.
        assert_eq!(layout(32, 32).plan(128, 32).planes, 1);
        assert_eq!(layout(32, 32).plan(64, 3).planes, 16);
        // One lane: 4-key chunks whatever the registers.
        assert_eq!(layout(1, 2).plan(64, 15).chunk, 4);
        for rows in 1..=32 {
            for dim in [32, 64, 128] {
                let p = layout(32, 4).plan(dim, rows);
                assert!(p.chunk.is_power_of_two());
                assert!(p.planes * rows * (dim + 2) <= SHARED_FLOATS || p.planes == 1);
            }
        }
    }

    #[test]
    fn splits_are_whole_passes_unless_forced() {
        let l = layout(32, 4);
        let p = l.plan(64, 3);
        // SmolLM2 at batch 1 (3 KV heads), 576 keys: one pass of 64 keys per split.
        assert_eq!(l.split_len(576, 3, &p), 64);
        // Llama-3-8B at batch 1 (8 KV heads), 128K keys: 256 cubes' worth.
        let p8 = l.plan(128, 4);
        let s = l.split_len(131_072, 8, &p8);
        assert_eq!(s % (p8.planes * p8.chunk), 0);
        assert_eq!((131_072usize * 8).div_ceil(s), 256);
        let forced = DecodeLayout {
            split: Some(5),
            ..l
        };
        assert_eq!(forced.split_len(576, 3, &p), 5);
    }
}
