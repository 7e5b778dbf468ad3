//! Attention read straight from a KIVI-quantized cache (split-K "flash decoding"): keys and
//! values are dequantized in registers as they are read, so a decode step never rebuilds the
//! layer's f16 keys and values, never concatenates them, and reads each KV head once for its
//! whole query group.
//!
//! Two launches:
//! - `partial_kernel`: one unit per (query row, split of `split` keys): the row's query in
//!   registers, then for each key of the split its dot product (keys per channel: the code of
//!   channel `c` sits in the channel's own words), an online softmax in f32 and the weighted
//!   sum of the values (per token: a token's codes are contiguous). It writes the split's
//!   running max `m`, sum `l` and unnormalized output.
//! - `combine_kernel`: one unit per output element, rescaling and summing the splits.
//!
//! Units of one (batch, KV head, split) are adjacent, so the `group · sq` rows that share a
//! KV head read the same words while they are in cache. Every loop over the head dim is
//! unrolled (it is comptime) and a split is at most a few hundred keys, which keeps the
//! kernel inside lavapipe's per-invocation loop budget.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::Shape;
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::{calculate_cube_count_elemwise, prelude::*};

use super::UNITS;
use super::dequantize::code_value;

/// Keys per split of the partial launch.
use crate::shapes::QUANT_ATTENTION_SPLIT as SPLIT;

/// Sizes and strides of one launch (see [`crate::QuantAttnView`]).
#[derive(CubeLaunch, CubeType, Clone, Copy, Debug)]
pub struct QuantAttnArgs {
    /// `batch · q_heads · sq`
    pub rows: usize,
    /// KV heads, and query heads per KV head.
    pub hkv: usize,
    pub group: usize,
    pub sq: usize,
    /// Quantized positions (a multiple of `kgroup`).
    pub qlen: usize,
    /// Full-precision positions after them.
    pub tail: usize,
    /// Key blocks: `qlen / kgroup`.
    pub kblocks: usize,
    /// Tokens per key group.
    pub kgroup: usize,
    /// Words per key group.
    pub kwords: usize,
    /// Value groups per token, channels per value group, words per value group.
    pub vgroups: usize,
    pub vgroup: usize,
    pub vwords: usize,
    pub bits: u32,
    pub split: usize,
    pub splits: usize,
    pub scale: f32,
}

impl QuantAttnArgs {
    pub fn launch_arg(self) -> QuantAttnArgsLaunch {
        QuantAttnArgsLaunch::new(
            self.rows,
            self.hkv,
            self.group,
            self.sq,
            self.qlen,
            self.tail,
            self.kblocks,
            self.kgroup,
            self.kwords,
            self.vgroups,
            self.vgroup,
            self.vwords,
            self.bits,
            self.split,
            self.splits,
            self.scale,
        )
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn partial_kernel<F: Float, B: Int>(
    q: &Tensor<F>,
    kw: &Tensor<u32>,
    ks: &Tensor<F>,
    km: &Tensor<F>,
    vw: &Tensor<u32>,
    vs: &Tensor<F>,
    vm: &Tensor<F>,
    tk: &Tensor<F>,
    tv: &Tensor<F>,
    mask: &Tensor<B>,
    m_out: &mut Tensor<f32>,
    l_out: &mut Tensor<f32>,
    acc_out: &mut Tensor<f32>,
    args: QuantAttnArgs,
    #[comptime] dim: usize,
    #[comptime] causal: bool,
    #[comptime] masked: bool,
    #[define(F, B)] _dtypes: [ElemType; 2],
) {
    let idx = ABSOLUTE_POS;
    if idx >= args.rows * args.splits {
        terminate!();
    }
    // idx = (bkv · splits + s) · (group · sq) + r
    let gs = args.group * args.sq;
    let r = idx % gs;
    let t = idx / gs;
    let s = t % args.splits;
    let bkv = t / args.splits;
    let row = bkv * gs + r;
    let i = r % args.sq;
    let skv = args.qlen + args.tail;
    let batch = bkv / args.hkv;

    let mut qv = Array::<f32>::new(dim);
    let mut acc = Array::<f32>::new(dim);
    #[unroll]
    for c in 0..dim {
        qv[c] = f32::cast_from(q[row * dim + c]) * args.scale;
        acc[c] = f32::new(0.0);
    }
    let mut m = f32::new(-1.0e30);
    let mut l = f32::new(0.0);
    let mut end = skv;
    if causal {
        end = i + skv - args.sq + 1;
    }
    let start = s * args.split;
    let mut stop = start + args.split;
    if end < stop {
        stop = end;
    }
    for j in start..stop {
        let mut visible = true;
        if masked {
            visible = mask[batch * mask.stride(0) + j * mask.stride(1)] == B::from_int(0);
        }
        if visible {
            let mut dot = f32::new(0.0);
            if j < args.qlen {
                // Channel c of this key block is its own group of `kgroup` tokens.
                let group_id = (bkv * args.kblocks + j / args.kgroup) * dim;
                let tt = j % args.kgroup;
                #[unroll]
                for c in 0..dim {
                    let g = group_id + c;
                    let k = code_value::<F>(kw, g * args.kwords, tt, args.bits, km[g], ks[g]);
                    dot += qv[c] * k;
                }
            } else {
                let trow = (bkv * args.tail + j - args.qlen) * dim;
                #[unroll]
                for c in 0..dim {
                    dot += qv[c] * f32::cast_from(tk[trow + c]);
                }
            }
            if dot > m {
                let alpha = f32::exp(m - dot);
                l *= alpha;
                #[unroll]
                for c in 0..dim {
                    acc[c] *= alpha;
                }
                m = dot;
            }
            let p = f32::exp(dot - m);
            l += p;
            if j < args.qlen {
                let vrow = bkv * args.qlen + j;
                #[unroll]
                for c in 0..dim {
                    let g = vrow * args.vgroups + c / args.vgroup;
                    let v = code_value::<F>(
                        vw,
                        g * args.vwords,
                        c % args.vgroup,
                        args.bits,
                        vm[g],
                        vs[g],
                    );
                    acc[c] += p * v;
                }
            } else {
                let trow = (bkv * args.tail + j - args.qlen) * dim;
                #[unroll]
                for c in 0..dim {
                    acc[c] += p * f32::cast_from(tv[trow + c]);
                }
            }
        }
    }
    let part = row * args.splits + s;
    m_out[part] = m;
    l_out[part] = l;
    #[unroll]
    for c in 0..dim {
        acc_out[part * dim + c] = acc[c];
    }
}

#[cube(launch)]
fn combine_kernel<F: Float>(
    m_in: &Tensor<f32>,
    l_in: &Tensor<f32>,
    acc_in: &Tensor<f32>,
    out: &mut Tensor<F>,
    splits: usize,
    dim: usize,
    #[define(F)] _dtype: ElemType,
) {
    let idx = ABSOLUTE_POS;
    if idx >= out.len() {
        terminate!();
    }
    let row = idx / dim;
    let c = idx % dim;
    let base = row * splits;
    // One pass, four splits a round with their reads issued together and the running state
    // rescaled once per round: a round trip to L2 per split (or a pass for the maximum
    // first) made this launch as long as the attention itself at a few dozen splits.
    let whole = splits / 4 * 4;
    let mut mx = f32::new(-1.0e30);
    let mut l = f32::new(0.0);
    let mut acc = f32::new(0.0);
    let mut s = 0usize;
    while s < whole {
        let p = base + s;
        let m0 = m_in[p];
        let m1 = m_in[p + 1];
        let m2 = m_in[p + 2];
        let m3 = m_in[p + 3];
        let l0 = l_in[p];
        let l1 = l_in[p + 1];
        let l2 = l_in[p + 2];
        let l3 = l_in[p + 3];
        let a0 = acc_in[p * dim + c];
        let a1 = acc_in[(p + 1) * dim + c];
        let a2 = acc_in[(p + 2) * dim + c];
        let a3 = acc_in[(p + 3) * dim + c];
        let top = f32::max(mx, f32::max(f32::max(m0, m1), f32::max(m2, m3)));
        let alpha = f32::exp(mx - top);
        let w0 = f32::exp(m0 - top);
        let w1 = f32::exp(m1 - top);
        let w2 = f32::exp(m2 - top);
        let w3 = f32::exp(m3 - top);
        l = l * alpha + w0 * l0 + w1 * l1 + w2 * l2 + w3 * l3;
        acc = acc * alpha + w0 * a0 + w1 * a1 + w2 * a2 + w3 * a3;
        mx = top;
        s += 4;
    }
    while s < splits {
        let part = base + s;
        let mp = m_in[part];
        let top = f32::max(mx, mp);
        let alpha = f32::exp(mx - top);
        let w = f32::exp(mp - top);
        l = l * alpha + w * l_in[part];
        acc = acc * alpha + w * acc_in[part * dim + c];
        mx = top;
        s += 1;
    }
    // A row that sees no key returns zeros (finite, meaningless, as the interface allows).
    let mut y = f32::new(0.0);
    if l > 0.0 {
        y = acc / l;
    }
    out[idx] = F::cast_from(y);
}

/// The packed keys and values and the full-precision tail of one launch.
pub struct QuantAttnInputs {
    /// `[b, hq, sq, d]`
    pub q: CubeTensor,
    /// `[b·hkv·kblocks·d, kwords]` u32, scale and min `[b·hkv·kblocks·d]`; `None` when
    /// `qlen = 0` (full-precision keys only, all in the tail).
    pub k: Option<(CubeTensor, CubeTensor, CubeTensor)>,
    /// `[b·hkv·qlen·vgroups, vwords]` u32, scale and min `[b·hkv·qlen·vgroups]`; `None` when
    /// `qlen = 0`.
    pub v: Option<(CubeTensor, CubeTensor, CubeTensor)>,
    /// `[b, hkv, tail, d]` each, `q`'s dtype (`tail ≥ 1`).
    pub tail: Option<(CubeTensor, CubeTensor)>,
    /// `[b, qlen + tail]`, any strides, bool or integer storage, non-zero = hidden.
    pub mask: Option<CubeTensor>,
}

/// Launches both kernels; returns `[b, hq, sq, d]` in `q`'s dtype. `args.rows`, `splits` and
/// `split` are filled in here.
pub fn quant_attention(
    inputs: QuantAttnInputs,
    mut args: QuantAttnArgs,
    causal: bool,
) -> CubeTensor {
    let q = into_contiguous(inputs.q);
    let [b, hq, sq, d] = q.meta.shape().dims::<4>();
    let client = q.client.clone();
    let device = q.device.clone();
    let dtype = q.dtype;
    let skv = args.qlen + args.tail;
    args.rows = b * hq * sq;
    args.split = SPLIT;
    args.splits = skv.div_ceil(SPLIT).max(1);
    let f32_buf = |shape: Vec<usize>| {
        empty_device_contiguous_dtype(
            client.clone(),
            device.clone(),
            Shape::from(shape),
            burn::tensor::DType::F32,
        )
    };
    let m = f32_buf(vec![args.rows * args.splits]);
    let l = f32_buf(vec![args.rows * args.splits]);
    let acc = f32_buf(vec![args.rows * args.splits * d]);
    let out = empty_device_contiguous_dtype(
        client.clone(),
        device.clone(),
        Shape::new([b, hq, sq, d]),
        dtype,
    );
    if args.rows == 0 {
        return out;
    }
    // Unused inputs get one-element stand-ins (binding a tensor twice is not allowed on every
    // runtime).
    let stand_in = |dtype: burn::tensor::DType| {
        empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::new([1]), dtype)
    };
    let (tk, tv) = match inputs.tail {
        Some((k, v)) => (into_contiguous(k), into_contiguous(v)),
        None => (stand_in(dtype), stand_in(dtype)),
    };
    let masked = inputs.mask.is_some();
    let mask = inputs.mask.unwrap_or_else(|| {
        empty_device_contiguous_dtype(
            client.clone(),
            device.clone(),
            Shape::new([1, 1]),
            burn::tensor::DType::I32,
        )
    });
    let mask_dtype = dtype_to_storage_type(mask.dtype);
    let packed = |p: Option<(CubeTensor, CubeTensor, CubeTensor)>| {
        p.unwrap_or_else(|| {
            (
                stand_in(burn::tensor::DType::U32),
                stand_in(dtype),
                stand_in(dtype),
            )
        })
    };
    let (kw, ks, km) = packed(inputs.k);
    let (vw, vs, vm) = packed(inputs.v);
    let cube_dim = CubeDim::new_1d(64);
    let units = args.rows * args.splits;
    partial_kernel::launch(
        &client,
        calculate_cube_count_elemwise(&client, units, cube_dim),
        cube_dim,
        q.into_tensor_arg(),
        into_contiguous(kw).into_tensor_arg(),
        into_contiguous(ks).into_tensor_arg(),
        into_contiguous(km).into_tensor_arg(),
        into_contiguous(vw).into_tensor_arg(),
        into_contiguous(vs).into_tensor_arg(),
        into_contiguous(vm).into_tensor_arg(),
        tk.into_tensor_arg(),
        tv.into_tensor_arg(),
        mask.into_tensor_arg(),
        m.clone().into_tensor_arg(),
        l.clone().into_tensor_arg(),
        acc.clone().into_tensor_arg(),
        args.launch_arg(),
        d,
        causal,
        masked,
        [dtype_to_storage_type(dtype), mask_dtype],
    );
    combine(m, l, acc, &out, args.rows * d, args.splits, d);
    out
}

/// Launches [`combine_kernel`] over the first `elems` elements of `out` (`[rows, d]`, its own
/// dtype): each row's `splits` partials `m`, `l` (`[rows·splits]` f32) and `acc`
/// (`[rows·splits·d]` f32) rescaled and summed.
pub(crate) fn combine(
    m: CubeTensor,
    l: CubeTensor,
    acc: CubeTensor,
    out: &CubeTensor,
    elems: usize,
    splits: usize,
    d: usize,
) {
    let client = &out.client;
    let cube_dim = CubeDim::new_1d(UNITS);
    combine_kernel::launch(
        client,
        calculate_cube_count_elemwise(client, elems, cube_dim),
        cube_dim,
        m.into_tensor_arg(),
        l.into_tensor_arg(),
        acc.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        splits,
        d,
        dtype_to_storage_type(out.dtype),
    );
}
