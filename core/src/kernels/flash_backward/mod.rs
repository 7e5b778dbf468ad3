//! A FlashAttention-2 style attention backward for f16/bf16 operands on the matrix units
//! (`mma.m16n8k16`, f32 accumulation), for head dim 64: two launches that recompute the
//! probabilities from the forward's log-sum-exp and never write a `seq²` tensor.
//!
//! - [`dkdv`]: owned by the keys, `dK` and `dV` (the query heads of a group summed in
//!   registers);
//! - [`dq`]: owned by the queries, `dQ`;
//! - before them, `Δ = rowsum(dO ⊙ O)` in f32 (one unit per query row).
//!
//! Both walks compute `S` and `dP` again (seven products a tile in all, as FlashAttention-2
//! without atomics); every fragment of `P` and `dS` goes from one product's accumulators
//! straight into the next product's A operand. Shared tiles are stored twice where a product
//! walks their rows (row-major for `A·Bᵀ`, channel-major for `A·B`), padded by [`PAD`] words a
//! row against bank conflicts.
//!
//! Why: cubek 0.4.0-pre.1's fused backward took 3.5 ms a layer for SmolLM2's attention at
//! batch 8 × 1024 in bf16 on an H200 (`ncu`, 2026-11-29), 104 of a 219 ms training step.

mod dkdv;
mod dq;
mod stages;

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::ir::{ElemType, FloatKind, features::MmaConfig};
use cubecl::{calculate_cube_count_elemwise, prelude::*};

use super::{UNITS, row_grid};

/// Rows a cube owns (keys in [`dkdv`], queries in [`dq`]) and rows of the tiles it walks.
pub(crate) const TILE: usize = 64;
/// Planes (warps) a cube: 16 owned rows each.
const PLANES: usize = TILE / 16;
/// Units a cube.
pub(crate) const THREADS: usize = PLANES * 32;
/// Padding of a shared-memory row, in 32-bit words: the 8 rows one fragment load touches start
/// 4 banks apart.
pub(crate) const PAD: usize = 4;
/// The head dim the kernels are built for.
pub const HEAD_DIM: usize = 64;

/// The scalars both walks take.
#[derive(CubeLaunch, CubeType, Clone, Copy, Debug)]
pub struct FlashArgs {
    /// `batch · q_heads`.
    pub heads: usize,
    pub hq: usize,
    pub hkv: usize,
    pub sq: usize,
    pub skv: usize,
    /// `skv − sq` with a causal mask (bottom-right), else 0.
    pub offset: usize,
    pub scale: f32,
}

/// Why the kernels do not take a problem.
pub fn unsupported(
    client: &Client,
    dtype: DType,
    [q, k, v]: [&Shape; 3],
    causal: bool,
) -> Option<String> {
    let elem = match dtype {
        DType::F16 => ElemType::Float(FloatKind::F16),
        DType::BF16 => ElemType::Float(FloatKind::BF16),
        other => return Some(format!("{other:?} operands (f16/bf16 only)")),
    };
    let mma = MmaConfig {
        a_type: elem,
        b_type: elem,
        cd_type: ElemType::Float(FloatKind::F32),
        m: 16,
        n: 8,
        k: 16,
    };
    if !client.properties().features.matmul.mma.contains(&mma) {
        return Some(format!("no {dtype:?} 16×8×16 manual MMA on this runtime"));
    }
    if q[3] != HEAD_DIM || k[3] != HEAD_DIM || v[3] != HEAD_DIM {
        return Some(format!(
            "head dims {} / {} (built for {HEAD_DIM})",
            q[3], v[3]
        ));
    }
    if causal && q[2] > k[2] {
        return Some(format!(
            "a causal mask with more queries ({}) than keys ({})",
            q[2], k[2]
        ));
    }
    None
}

#[cube(launch)]
fn delta_kernel<F: Float>(
    out: &Tensor<F>,
    dout: &Tensor<F>,
    delta: &mut Tensor<f32>,
    #[comptime] dim: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = ABSOLUTE_POS;
    if row >= delta.len() {
        terminate!();
    }
    let mut sum = f32::new(0.0);
    #[unroll]
    for c in 0..dim {
        sum += f32::cast_from(out[row * dim + c]) * f32::cast_from(dout[row * dim + c]);
    }
    delta[row] = sum;
}

/// `(dQ, dK, dV)` of attention from its inputs, output `out`, the forward's log-sum-exp of the
/// scaled scores `lse` and the output's gradient `dout`; `None` (nothing launched) where
/// [`unsupported`] says why not.
///
/// # Shapes
/// - `q`, `out`, `dout`: `[batch, q_heads, sq, 64]`; `k`, `v`: `[batch, kv_heads, skv, 64]`
///   (`q_heads` a multiple of `kv_heads`); `lse`: `[batch, q_heads, sq]` f32
/// - returns the gradients in the operands' shapes and dtype
#[allow(clippy::too_many_arguments)]
pub fn flash_backward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    out: CubeTensor,
    lse: CubeTensor,
    dout: CubeTensor,
    causal: bool,
    scale: f64,
) -> Option<(CubeTensor, CubeTensor, CubeTensor)> {
    let client = q.client.clone();
    let dtype = q.dtype;
    let (qs, ks) = (q.meta.shape().clone(), k.meta.shape().clone());
    let mixed = [&k, &v, &out, &dout].iter().any(|t| t.dtype != dtype) || lse.dtype != DType::F32;
    let why = match mixed {
        true => Some("operands of different dtypes (or a log-sum-exp not in f32)".to_string()),
        false => unsupported(&client, dtype, [&qs, &ks, v.meta.shape()], causal),
    };
    if let Some(why) = why {
        log::debug!("flash attention backward declined: {why}");
        return None;
    }
    let [b, hq, sq, d] = qs.dims::<4>();
    let [_, hkv, skv, _] = ks.dims::<4>();
    let [q, k, v, out, dout] = [q, k, v, out, dout].map(into_contiguous);
    let lse = into_contiguous(lse);
    let device = q.device.clone();
    let alloc = |shape: Shape, dtype| {
        empty_device_contiguous_dtype(client.clone(), device.clone(), shape, dtype)
    };
    let delta = alloc(Shape::new([b, hq, sq]), DType::F32);
    let rows = b * hq * sq;
    let cube_dim = CubeDim::new_1d(UNITS);
    let storage = dtype_to_storage_type(dtype);
    delta_kernel::launch(
        &client,
        calculate_cube_count_elemwise(&client, rows.max(1), cube_dim),
        cube_dim,
        out.into_tensor_arg(),
        dout.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        d,
        storage,
    );
    let args = FlashArgs {
        heads: b * hq,
        hq,
        hkv,
        sq,
        skv,
        offset: if causal { skv - sq } else { 0 },
        scale: scale as f32,
    };
    let launch_args = || {
        FlashArgsLaunch::new(
            args.heads,
            args.hq,
            args.hkv,
            args.sq,
            args.skv,
            args.offset,
            args.scale,
        )
    };
    let (dq, dk, dv) = (alloc(qs, dtype), alloc(ks.clone(), dtype), alloc(ks, dtype));
    let planes = CubeDim::new_2d(32, PLANES as u32);
    // SAFETY: rows are read only below their lengths (zeros past them), shared tiles within
    // their declared sizes, and the outputs written only for rows below their lengths.
    unsafe {
        dkdv::flash_dkdv_kernel::launch_unchecked(
            &client,
            row_grid(&client, b * hkv * skv.div_ceil(TILE)),
            planes,
            2,
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            dk.clone().into_tensor_arg(),
            dv.clone().into_tensor_arg(),
            launch_args(),
            d,
            causal,
            storage,
        );
        dq::flash_dq_kernel::launch_unchecked(
            &client,
            row_grid(&client, b * hq * sq.div_ceil(TILE)),
            planes,
            2,
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            dout.into_tensor_arg(),
            lse.into_tensor_arg(),
            delta.into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            launch_args(),
            d,
            causal,
            storage,
        );
    }
    Some((dq, dk, dv))
}
