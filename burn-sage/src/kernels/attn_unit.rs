//! The portable attention kernel: one unit per query row, keys in order, online softmax in
//! f32, `QKᵀ` as integer dot products, `P̃` and `V` rounded to the PV format in f32
//! arithmetic. It runs on any runtime (lavapipe included) and checks the numerics of the
//! pipeline; the matrix-unit kernel ([`super::attn_cmma`]) is the fast path.
//!
//! Every loop over the head dim is unrolled (it is comptime), so the loop over keys is the
//! kernel's only loop: lavapipe ends all loops of an invocation after 65 535 iterations in total
//! (see [`super::LOOP_BUDGET`]), which per-channel loops exhausted after `65 535 / (2·dim + 1)`
//! keys.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::Shape;
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::{calculate_cube_count_elemwise, prelude::*};

use super::common::round_grid;
use super::{AttnArgs, dummy, lse_shape};

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn attn_unit_kernel<F: Float, I: Int, V: Float>(
    qi: &Tensor<I>,
    ki: &Tensor<I>,
    qs: &Tensor<f32>,
    ks: &Tensor<f32>,
    ds: &Tensor<f32>,
    v: &Tensor<V>,
    post: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    args: AttnArgs,
    #[comptime] dim: usize,
    #[comptime] causal: bool,
    #[comptime] has_ds: bool,
    #[comptime] write_lse: bool,
    #[define(F, I, V)] _dtypes: [ElemType; 3],
) {
    let idx = ABSOLUTE_POS;
    if idx >= args.rows {
        terminate!();
    }
    let bh = idx / args.sq;
    let i = idx % args.sq;
    let bhk = (bh / args.hq) * (args.hq / args.group) + (bh % args.hq) / args.group;
    let qg = (i / args.q_block) * args.q_inter + (i % args.q_block) % args.q_inter;
    let qscale = qs[bh * args.q_groups + qg];

    let mut acc = Array::<f32>::new(dim);
    #[unroll]
    for c in 0..dim {
        acc[c] = f32::new(0.0);
    }
    let mut m = f32::new(-1.0e30);
    let mut l = f32::new(0.0);
    let mut kv_end = args.skv;
    if causal {
        kv_end = i + (args.skv - args.sq) + 1;
    }
    for j in 0..kv_end {
        let krow = (bhk * args.skv + j) * dim;
        let mut dot = i32::new(0);
        #[unroll]
        for c in 0..dim {
            dot += i32::cast_from(qi[idx * dim + c]) * i32::cast_from(ki[krow + c]);
        }
        let kg = (j / args.k_block) * args.k_inter + (j % args.k_block) % args.k_inter;
        let mut s = f32::cast_from(dot) * qscale * ks[bhk * args.k_groups + kg];
        if has_ds {
            s += ds[(bh * args.mean_blocks + i / args.mean_block) * args.skv + j];
        }
        s *= args.scale;
        if s > m {
            let alpha = f32::exp(m - s);
            l *= alpha;
            #[unroll]
            for c in 0..dim {
                acc[c] *= alpha;
            }
            m = s;
        }
        let p = f32::exp(s - m);
        l += p;
        let pq = round_grid(p * args.p_scale, args.mantissa, args.min_exp, args.grid_max);
        #[unroll]
        for c in 0..dim {
            let vq = round_grid(
                f32::cast_from(v[krow + c]),
                args.mantissa,
                args.min_exp,
                args.grid_max,
            );
            acc[c] += pq * vq;
        }
    }
    #[unroll]
    for c in 0..dim {
        out[idx * dim + c] = F::cast_from(acc[c] * post[bhk * dim + c] / l);
    }
    if write_lse {
        lse[idx] = m + f32::ln(l);
    }
}

/// Launches the portable kernel. Inputs as [`super::attention`] documents.
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
    out_dtype: burn::tensor::DType,
    dim: usize,
    causal: bool,
    write_lse: bool,
) -> (CubeTensor, Option<CubeTensor>) {
    let client = qi.client.clone();
    let device = qi.device.clone();
    let [b, hq, sq, d] = qi.meta.shape().dims::<4>();
    let out = empty_device_contiguous_dtype(
        client.clone(),
        device.clone(),
        Shape::new([b, hq, sq, d]),
        out_dtype,
    );
    let lse = if write_lse {
        empty_device_contiguous_dtype(
            client.clone(),
            device.clone(),
            lse_shape(qi.meta.shape()),
            burn::tensor::DType::F32,
        )
    } else {
        dummy(&qs)
    };
    let has_ds = ds.is_some();
    let ds = ds.map(into_contiguous).unwrap_or_else(|| dummy(&qs));
    let dtypes = [
        dtype_to_storage_type(out_dtype),
        dtype_to_storage_type(qi.dtype),
        dtype_to_storage_type(v.dtype),
    ];
    let cube_dim = CubeDim::new_1d(64);
    let cube_count = calculate_cube_count_elemwise(&client, args.rows, cube_dim);
    attn_unit_kernel::launch(
        &client,
        cube_count,
        cube_dim,
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
        dim,
        causal,
        has_ds,
        write_lse,
        dtypes,
    );
    (out, write_lse.then_some(lse))
}
