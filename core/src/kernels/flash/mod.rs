//! FlashAttention-2 style attention for f16/bf16 operands on the matrix units
//! (`mma.m16n8k16`, f32 accumulation), for head dim 64: a forward that keeps one log-sum-exp per
//! query, and a backward of two launches that recompute the probabilities from it. No launch
//! writes a `seq²` tensor.
//!
//! - `forward`: owned by the queries, `O` and the log-sum-exp (online softmax);
//! - `dq`: owned by the queries, `dQ`, and first `Δ = rowsum(dO ⊙ O)` in f32 from the
//!   register fragments, which it writes for the next launch;
//! - `dkdv`: owned by the keys, `dK` and `dV` (the query heads of a group summed in
//!   registers).
//!
//! Each walk masks only the tiles that need it (a tail, or a causal diagonal): a tile whose
//! every query sees every key skips the per-element test. A key-padding mask (`[batch, skv]`,
//! as batched prompts of different lengths need) is tested on every tile.
//!
//! The backward walks compute `S` and `dP` again (seven products a tile in all, as
//! FlashAttention-2 without atomics); every fragment of `P` and `dS` goes from one product's
//! accumulators straight into the next product's A operand. Each shared tile is stored once,
//! row-major, padded by `PAD` words a row against bank conflicts; B fragments come from it by
//! `ldmatrix.x4` (`A·Bᵀ`) or `ldmatrix.x4.trans` (`A·B`), four 8 × 8 matrices an instruction.
//!
//! Operands are read in place through their strides ([`Rows`]): a model's
//! `[batch, seq, heads, dim]` projections viewed as `[batch, heads, seq, dim]` need no copy.
//! Outputs are written token-major (`[batch, seq, heads, dim]` buffers) and returned as
//! `[batch, heads, seq, dim]` views, so the model's merge of the heads is a view too.
//!
//! Why: cubek 0.4.0-pre.1's fused backward took 3.5 ms a layer for SmolLM2's attention at
//! batch 8 × 1024 in bf16 on an H200 (`ncu`, 2026-11-29), 104 of a 219 ms training step; its
//! forward took 0.54 ms a layer at 8 × 2048 (16.2 of a 159.5 ms step's GPU time, `ncu`,
//! 2026-11-29), and each layer copied its Q/K/V, output and gradients between the two layouts
//! (11.8 ms of the step).

mod dkdv;
mod dq;
mod forward;
pub mod stages;

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::{BoolTensorOps, FloatTensorOps};
use burn::tensor::{DType, FloatDType, Shape};
use burn_cubecl::{
    CubeBackend, kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype,
    tensor::CubeTensor,
};
use cubecl::ir::{ElemType, FloatKind, features::MmaConfig};
use cubecl::prelude::*;

use super::row_grid;

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

/// Where the rows of a `[batch, heads, seq, dim]` operand are: the element strides of its batch,
/// head and row (its channels are adjacent).
#[derive(CubeLaunch, CubeType, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows {
    pub batch: usize,
    pub head: usize,
    pub row: usize,
}

impl Rows {
    /// The strides of `t` where the kernels read it in place: adjacent channels, even strides
    /// and a 4-byte aligned start (rows are read in pairs of 16-bit elements).
    fn of(t: &CubeTensor) -> Option<Rows> {
        let (shape, strides) = (t.meta.shape(), t.meta.strides());
        if shape.num_dims() != 4 || strides.len() != 4 || strides[3] != 1 {
            return None;
        }
        // A dimension of size 1 is never stepped over, whatever its stride.
        let [batch, head, row] = [0, 1, 2].map(|i| if shape[i] == 1 { 0 } else { strides[i] });
        let even = [batch, head, row].iter().all(|x| x % 2 == 0);
        let offset = t.handle.offset_start.unwrap_or(0);
        (even && offset.is_multiple_of(4)).then_some(Rows { batch, head, row })
    }

    /// A `[batch, seq, heads, dim]` buffer's rows.
    fn token_major(seq: usize, heads: usize, dim: usize) -> Rows {
        Rows {
            batch: seq * heads * dim,
            head: dim,
            row: heads * dim,
        }
    }

    fn launch(self) -> RowsLaunch {
        RowsLaunch::new(self.batch, self.head, self.row)
    }
}

/// `t` and its [`Rows`], copied to a contiguous layout first where the kernels cannot read it in
/// place; `None` where even the copy cannot be read (a start not 4-byte aligned).
fn readable(t: CubeTensor) -> Option<(CubeTensor, Rows)> {
    if let Some(rows) = Rows::of(&t) {
        return Some((t, rows));
    }
    let t = into_contiguous(t);
    Rows::of(&t).map(|rows| (t, rows))
}

/// [`readable`] of every operand, or why not.
fn readable_all<const N: usize>(ts: [CubeTensor; N]) -> Result<[(CubeTensor, Rows); N], String> {
    let read: Vec<_> = ts.into_iter().filter_map(readable).collect();
    read.try_into()
        .map_err(|_| "an operand whose start is not 4-byte aligned".to_string())
}

/// An uninitialised `[batch, seq, heads, dim]` buffer, viewed as `[batch, heads, seq, dim]`, and
/// its [`Rows`].
fn token_major(like: &CubeTensor, [b, h, s, d]: [usize; 4], dtype: DType) -> (CubeTensor, Rows) {
    let t = empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::new([b, s, h, d]),
        dtype,
    );
    (
        CubeBackend::float_swap_dims(t, 1, 2),
        Rows::token_major(s, h, d),
    )
}

/// The key-padding mask as the kernels read it: one f32 a key (nonzero = hidden), contiguous
/// `[batch, skv]`; without a mask a one-element placeholder (never read). Why not, where the
/// mask's shape is not `[batch, skv]`.
fn key_padding(
    pad: Option<CubeTensor>,
    like: &CubeTensor,
    batch: usize,
    skv: usize,
) -> Result<(CubeTensor, bool), String> {
    let Some(pad) = pad else {
        let none = empty_device_contiguous_dtype(
            like.client.clone(),
            like.device.clone(),
            Shape::new([1]),
            DType::F32,
        );
        return Ok((none, false));
    };
    let dims = pad.meta.shape().clone();
    if dims.num_dims() != 2 || dims[0] != batch || dims[1] != skv {
        return Err(format!(
            "a key-padding mask of shape {dims:?} (expected [{batch}, {skv}])"
        ));
    }
    let pad = CubeBackend::bool_into_float(pad, FloatDType::F32);
    Ok((into_contiguous(pad), true))
}

/// Why `client`'s runtime cannot run `mma.m16n8k16` on `dtype` operands with f32 accumulators
/// (the products of these kernels, and of burn-cce's fused passes); `None` where it can.
pub fn manual_mma_unsupported(client: &Client, dtype: DType) -> Option<String> {
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
    (!client.properties().features.matmul.mma.contains(&mma))
        .then(|| format!("no {dtype:?} 16×8×16 manual MMA on this runtime"))
}

/// Why the kernels do not take a problem.
pub fn unsupported(
    client: &Client,
    dtype: DType,
    [q, k, v]: [&Shape; 3],
    causal: bool,
) -> Option<String> {
    if let Some(why) = manual_mma_unsupported(client, dtype) {
        return Some(why);
    }
    if q[3] != HEAD_DIM || k[3] != HEAD_DIM || v[3] != HEAD_DIM {
        return Some(format!(
            "head dims {} / {} (built for {HEAD_DIM})",
            q[3], v[3]
        ));
    }
    if [q, k, v].iter().any(|s| s.dims::<4>().contains(&0)) {
        return Some("an empty operand".to_string());
    }
    if causal && q[2] > k[2] {
        return Some(format!(
            "a causal mask with more queries ({}) than keys ({})",
            q[2], k[2]
        ));
    }
    None
}

fn flash_args(
    b: usize,
    hq: usize,
    hkv: usize,
    sq: usize,
    skv: usize,
    causal: bool,
    scale: f64,
) -> FlashArgsLaunch {
    FlashArgsLaunch::new(
        b * hq,
        hq,
        hkv,
        sq,
        skv,
        if causal { skv - sq } else { 0 },
        scale as f32,
    )
}

/// The output of attention and each query's log-sum-exp of the scaled scores (natural log), as
/// [`flash_backward`] takes it; `None` (nothing launched) where [`unsupported`] says why not.
/// `pad`, a key-padding mask (`true` = no query sees the key), hides keys beside the causal
/// mask; a query that sees no key gets a zero output.
///
/// # Shapes
/// - `q`: `[batch, q_heads, sq, 64]`; `k`, `v`: `[batch, kv_heads, skv, 64]` (`q_heads` a
///   multiple of `kv_heads`), any strides with adjacent channels; `pad`: `[batch, skv]` bool
/// - returns the output, `[batch, q_heads, sq, 64]` in `q`'s dtype (a view of a
///   `[batch, sq, q_heads, 64]` buffer), and the log-sum-exp, `[batch, q_heads, sq]` f32
pub fn flash_forward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    pad: Option<CubeTensor>,
    causal: bool,
    scale: f64,
) -> Option<(CubeTensor, CubeTensor)> {
    let client = q.client.clone();
    let dtype = q.dtype;
    let (qs, ks) = (q.meta.shape().clone(), k.meta.shape().clone());
    let why = match [&k, &v].iter().any(|t| t.dtype != dtype) {
        true => Some("operands of different dtypes".to_string()),
        false => unsupported(&client, dtype, [&qs, &ks, v.meta.shape()], causal),
    };
    if let Some(why) = why {
        log::debug!("flash attention forward declined: {why}");
        return None;
    }
    let [b, hq, sq, d] = qs.dims::<4>();
    let [_, hkv, skv, _] = ks.dims::<4>();
    let read = readable_all([q, k, v])
        .and_then(|read| key_padding(pad, &read[0].0, b, skv).map(|pad| (read, pad)));
    let ([(q, q_rows), (k, k_rows), (v, v_rows)], (pad, padded)) = match read {
        Ok(read) => read,
        Err(why) => {
            log::debug!("flash attention forward declined: {why}");
            return None;
        }
    };
    let (out, out_rows) = token_major(&q, [b, hq, sq, d], dtype);
    let lse = empty_device_contiguous_dtype(
        client.clone(),
        q.device.clone(),
        Shape::new([b, hq, sq]),
        DType::F32,
    );
    // SAFETY: rows are read only below their lengths (zeros past them), shared tiles within
    // their declared sizes, and the outputs written only for rows below their lengths.
    unsafe {
        forward::flash_forward_kernel::launch_unchecked(
            &client,
            row_grid(&client, b * hq * sq.div_ceil(TILE)),
            CubeDim::new_2d(32, PLANES as u32),
            2,
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            pad.into_tensor_arg(),
            flash_args(b, hq, hkv, sq, skv, causal, scale),
            q_rows.launch(),
            k_rows.launch(),
            v_rows.launch(),
            out_rows.launch(),
            d,
            causal,
            padded,
            dtype_to_storage_type(dtype),
        );
    }
    Some((out, lse))
}

/// `(dQ, dK, dV)` of attention from its inputs, output `out`, the forward's log-sum-exp of the
/// scaled scores `lse` and the output's gradient `dout`; `None` (nothing launched) where
/// [`unsupported`] says why not.
///
/// # Shapes
/// - `q`, `out`, `dout`: `[batch, q_heads, sq, 64]`; `k`, `v`: `[batch, kv_heads, skv, 64]`
///   (`q_heads` a multiple of `kv_heads`), any strides with adjacent channels; `lse`:
///   `[batch, q_heads, sq]` f32; `pad` (the forward's key-padding mask): `[batch, skv]` bool
/// - returns the gradients in the operands' shapes and dtype (views of token-major buffers)
#[allow(clippy::too_many_arguments)]
pub fn flash_backward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    out: CubeTensor,
    lse: CubeTensor,
    dout: CubeTensor,
    pad: Option<CubeTensor>,
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
    let [
        (q, q_rows),
        (k, k_rows),
        (v, v_rows),
        (out, out_rows),
        (dout, do_rows),
    ] = match readable_all([q, k, v, out, dout]) {
        Ok(read) => read,
        Err(why) => {
            log::debug!("flash attention backward declined: {why}");
            return None;
        }
    };
    let (pad, padded) = match key_padding(pad, &q, b, skv) {
        Ok(pad) => pad,
        Err(why) => {
            log::debug!("flash attention backward declined: {why}");
            return None;
        }
    };
    let lse = into_contiguous(lse);
    let delta = empty_device_contiguous_dtype(
        client.clone(),
        q.device.clone(),
        Shape::new([b, hq, sq]),
        DType::F32,
    );
    let storage = dtype_to_storage_type(dtype);
    let (dq, dq_rows) = token_major(&q, [b, hq, sq, d], dtype);
    let (dk, dkv_rows) = token_major(&q, [b, hkv, skv, d], dtype);
    let (dv, _) = token_major(&q, [b, hkv, skv, d], dtype);
    let planes = CubeDim::new_2d(32, PLANES as u32);
    // SAFETY: rows are read only below their lengths (zeros past them), shared tiles within
    // their declared sizes, and the outputs written only for rows below their lengths.
    unsafe {
        dq::flash_dq_kernel::launch_unchecked(
            &client,
            row_grid(&client, b * hq * sq.div_ceil(TILE)),
            planes,
            2,
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            out.into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            pad.clone().into_tensor_arg(),
            flash_args(b, hq, hkv, sq, skv, causal, scale),
            q_rows.launch(),
            k_rows.launch(),
            v_rows.launch(),
            do_rows.launch(),
            out_rows.launch(),
            dq_rows.launch(),
            d,
            causal,
            padded,
            storage,
        );
        dkdv::flash_dkdv_kernel::launch_unchecked(
            &client,
            row_grid(&client, b * hkv * skv.div_ceil(TILE)),
            planes,
            2,
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            dout.into_tensor_arg(),
            lse.into_tensor_arg(),
            delta.into_tensor_arg(),
            dk.clone().into_tensor_arg(),
            dv.clone().into_tensor_arg(),
            pad.into_tensor_arg(),
            flash_args(b, hq, hkv, sq, skv, causal, scale),
            q_rows.launch(),
            k_rows.launch(),
            v_rows.launch(),
            do_rows.launch(),
            dkv_rows.launch(),
            d,
            causal,
            padded,
            storage,
        );
    }
    Some((dq, dk, dv))
}
