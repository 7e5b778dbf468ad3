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
use burn_cubecl::{kernel::into_contiguous, tensor::CubeTensor};
use cubecl::{calculate_cube_count_elemwise, prelude::*};

use super::common::{keys_end, kv_head, round_grid};
use super::{AttnArgs, MatrixLaunch, QuantizedInputs};
use crate::SagePlan;

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
    let bhk = kv_head(&args, bh);
    let qg = (i / args.q_block) * args.q_inter + (i % args.q_block) % args.q_inter;
    let qscale = qs[bh * args.q_groups + qg];

    let mut acc = Array::<f32>::new(dim);
    #[unroll]
    for c in 0..dim {
        acc[c] = f32::new(0.0);
    }
    let mut m = f32::new(-1.0e30);
    let mut l = f32::new(0.0);
    for j in 0..keys_end(&args, i, 1usize, causal) {
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

/// Launches the portable kernel on the [`QuantizedInputs`].
pub(crate) fn launch(
    x: QuantizedInputs,
    args: AttnArgs,
    plan: &SagePlan,
) -> (CubeTensor, Option<CubeTensor>) {
    let client = x.qi.client.clone();
    let ml = MatrixLaunch::new(&x.qi, &x.qs, x.ds, plan);
    let dtypes = [
        dtype_to_storage_type(plan.dtype),
        dtype_to_storage_type(x.qi.dtype),
        dtype_to_storage_type(x.v.dtype),
    ];
    let cube_dim = CubeDim::new_1d(64);
    let cube_count = calculate_cube_count_elemwise(&client, args.rows, cube_dim);
    attn_unit_kernel::launch(
        &client,
        cube_count,
        cube_dim,
        x.qi.into_tensor_arg(),
        x.ki.into_tensor_arg(),
        x.qs.into_tensor_arg(),
        x.ks.into_tensor_arg(),
        ml.ds.clone().into_tensor_arg(),
        into_contiguous(x.v).into_tensor_arg(),
        into_contiguous(x.post).into_tensor_arg(),
        ml.out.clone().into_tensor_arg(),
        ml.lse.clone().into_tensor_arg(),
        args.launch_arg(),
        plan.head_dim,
        plan.opts.causal,
        ml.has_ds,
        ml.write_lse,
        dtypes,
    );
    ml.outputs()
}
