//! The logits' gradient of a linear cross-entropy written straight from the Hopper GEMM's tile
//! ([`Epilogue::Grad`]): burn-cce's backward forms `G = (softmax − onehot) · dout · cap'` of a
//! vocabulary chunk from the logits in registers and stores `G` in the inputs' dtype, instead
//! of storing the chunk's f32 logits and reading them back in a separate kernel (6 bytes of
//! memory per entry, and two more passes over them, became 2).

use burn::tensor::{DType, Shape};
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use cubecl::prelude::*;
use cubecl::wgmma::{Accumulator, WARPGROUP_M};
use cubecl::zspace::{Strides, metadata::Metadata};

use super::epilogue::{LogitOptions, logit, verified};
use super::{Epilogue, HopperTile, WG, launch, plan};

/// The per-token inputs of [`hopper_grad`].
#[derive(Clone, Copy, Debug)]
pub struct GradInputs<'a> {
    /// `[tokens]` f32: each token's log-sum-exp.
    pub lse: &'a CubeTensor,
    /// `[tokens]` f32: the gradient of the loss with respect to each token's loss.
    pub dout: &'a CubeTensor,
    /// `[tokens]`, an integer dtype: each token's target id.
    pub targets: &'a CubeTensor,
    /// `[n]`, the targets' dtype: the vocabulary id of each column (a gathered chunk); `None`:
    /// column `col` is id `v0 + col`.
    pub ids: Option<&'a CubeTensor>,
    /// The token of the product's row 0 (`row0 + m ≤ tokens`).
    pub row0: usize,
}

/// The logits' gradient of a linear cross-entropy,
/// `G[r, c] = (exp(x − lse[t]) − [targets[t] = id]) · dout[t] · cap'(x)` of the logit
/// `x = lhs · rhs (+ bias[id], soft-capped)` at token `t = row0 + r` and vocabulary id
/// `id = ids[c]` (or `v0 + c`), where `cap'` is the soft cap's slope (1 without one): one launch
/// of the Hopper kernel with [`Epilogue::Grad`], which stores `G` instead of the logits.
///
/// # Shapes
/// - `lhs`: `[m, k]`, `rhs`: `[k, n]`, both f16 or both bf16 (as [`super::hopper_gemm`])
/// - returns `G`: `[m, n]` in the operands' dtype, its rows padded to 16 bytes (a multiple of 8
///   elements apart: an operand the Hopper kernel reads by TMA)
///
/// # Errors
/// Where the kernel cannot run the product ([`super::unsupported`]), the bias, `lse` or `dout`
/// is not f32, `ids` is not of the targets' dtype or has not `n` entries, or the tokens do not
/// cover `row0 + m`; and where this kernel (tile and dtype) failed to launch on the device
/// (checked at its first launch in the process).
pub fn hopper_grad(
    lhs: &CubeTensor,
    rhs: &CubeTensor,
    options: LogitOptions,
    inputs: GradInputs,
) -> Result<CubeTensor, String> {
    options.check()?;
    let plan = plan(&lhs.client, lhs, rhs)?;
    let (m, n) = (plan.m, plan.n);
    let tokens = |t: &CubeTensor| t.meta.shape().num_elements();
    for (name, t) in [("log-sum-exp", inputs.lse), ("dout", inputs.dout)] {
        if t.dtype != DType::F32 {
            return Err(format!("a {:?} {name} (f32 only)", t.dtype));
        }
    }
    let covered = [inputs.lse, inputs.dout, inputs.targets]
        .iter()
        .all(|t| tokens(t) >= inputs.row0 + m);
    if !covered {
        return Err(format!(
            "per-token inputs shorter than rows {}..{}",
            inputs.row0,
            inputs.row0 + m
        ));
    }
    if let Some(ids) = inputs.ids
        && (ids.dtype != inputs.targets.dtype || tokens(ids) != n)
    {
        return Err(format!(
            "{} {:?} ids for {n} columns of {:?} targets",
            tokens(ids),
            ids.dtype,
            inputs.targets.dtype
        ));
    }
    // Rows 16 bytes apart (an even stride, so the kernel stores two columns at a time).
    let stride = n.next_multiple_of(16 / lhs.dtype.size());
    let storage = empty_device_contiguous_dtype(
        lhs.client.clone(),
        lhs.device.clone(),
        Shape::new([m * stride]),
        lhs.dtype,
    );
    let out = CubeTensor::new(
        lhs.client.clone(),
        storage.handle,
        Metadata::new([m, n], Strides::new(&[stride, 1])),
        lhs.device.clone(),
        lhs.dtype,
    );
    let epilogue = Epilogue::Grad {
        bias: options.bias.is_some(),
        softcap: options.softcap.is_some(),
        gathered: inputs.ids.is_some(),
    };
    let mut reduction = options.reduction(epilogue, lhs, &out);
    // Not written: the gradient goes to `out` (the kernel's stored output).
    reduction.out = super::placeholder(lhs, DType::F32);
    reduction.lse = into_contiguous(inputs.lse.clone());
    reduction.dout = into_contiguous(inputs.dout.clone());
    reduction.targets = into_contiguous(inputs.targets.clone());
    if let Some(ids) = inputs.ids {
        reduction.ids = into_contiguous(ids.clone());
    } else {
        reduction.ids = reduction.targets.clone();
    }
    reduction.row0 = inputs.row0;
    let tile = HopperTile {
        epilogue,
        ..plan.tile
    };
    let target = (out.clone(), lhs.dtype);
    verified((tile, lhs.dtype), out, || {
        launch(lhs, rhs, &plan, target, 1, reduction)
    })
}

/// The gradient of one value: `(exp(x − lse) − [target = id]) · scale · cap'(x)`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn grad_of(
    raw: f32,
    vocab_id: u32,
    lse: f32,
    scale: f32,
    target: u32,
    bias: &Tensor<f32>,
    softcap: f32,
    #[comptime] has_bias: bool,
    #[comptime] has_softcap: bool,
) -> f32 {
    let x = logit(raw, bias, vocab_id, softcap, has_bias, false);
    let mut capped = x;
    let mut slope = f32::new(1.0);
    if has_softcap {
        let t = f32::tanh(x / softcap);
        capped = softcap * t;
        slope = 1.0 - t * t;
    }
    let mut g = f32::exp(capped - lse);
    if target == vocab_id {
        g -= 1.0;
    }
    g * scale * slope
}

/// The vocabulary id of column `col` (below `n`).
#[cube]
fn vocab_id<I: Numeric>(col: u32, v0: u32, ids: &Tensor<I>, #[comptime] gathered: bool) -> u32 {
    let mut id = v0 + col;
    if gathered {
        id = u32::cast_from(ids[col as usize]);
    }
    id
}

/// [`Epilogue::Grad`] of one consumer warpgroup's 64 rows (from `rows0`, `m` in all, token
/// `token0 + row`) and the tile's columns (from `col0`, `n` in all, ids from `v0` or `ids`): two
/// adjacent columns per store into `out` (rows `out_stride` apart, even); the second column of
/// the pair at an odd `n`'s end is written 0 (it lies in the row's padding).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn write_grad<O: Float, N2: Size, I: Numeric>(
    acc: &Accumulator<f32>,
    unit: u32,
    rows0: u32,
    m: u32,
    token0: u32,
    col0: u32,
    n: u32,
    v0: u32,
    bias: &Tensor<f32>,
    lse: &Tensor<f32>,
    dout: &Tensor<f32>,
    targets: &Tensor<I>,
    ids: &Tensor<I>,
    softcap: f32,
    out: &mut Tensor<Vector<O, N2>>,
    out_stride: u32,
    #[comptime] epilogue: Epilogue,
    #[comptime] bn: usize,
) {
    let (has_bias, has_softcap, gathered) =
        comptime![(epilogue.bias(), epilogue.softcap(), epilogue.gathered())];
    // The unit's two rows ("a" and "b", 8 apart) and their tokens' inputs, read once.
    let (r, _) = acc.position_of_nth(unit, 0u32);
    let row_a = rows0 + r;
    let row_b = row_a + 8;
    let mut lse_a = f32::new(0.0);
    let mut scale_a = f32::new(0.0);
    let mut target_a = 0u32;
    if row_a < m {
        let t = (token0 + row_a) as usize;
        lse_a = lse[t];
        scale_a = dout[t];
        target_a = u32::cast_from(targets[t]);
    }
    let mut lse_b = f32::new(0.0);
    let mut scale_b = f32::new(0.0);
    let mut target_b = 0u32;
    if row_b < m {
        let t = (token0 + row_b) as usize;
        lse_b = lse[t];
        scale_b = dout[t];
        target_b = u32::cast_from(targets[t]);
    }
    // Values `2j` and `2j + 1` are adjacent columns of one row: row a where `j` is even.
    #[unroll]
    for j in 0..comptime![WARPGROUP_M * bn / (2 * WG as usize)] {
        let (r, col) = acc.position_of_nth(unit, 2 * j as u32);
        let row = rows0 + r;
        let col = col0 + col;
        if row < m && col < n {
            let mut l = lse_a;
            let mut scale = scale_a;
            let mut target = target_a;
            if j % 2 == 1 {
                l = lse_b;
                scale = scale_b;
                target = target_b;
            }
            let id = vocab_id::<I>(col, v0, ids, gathered);
            let g0 = grad_of(
                acc.get(2 * j),
                id,
                l,
                scale,
                target,
                bias,
                softcap,
                has_bias,
                has_softcap,
            );
            let mut g1 = f32::new(0.0);
            if col + 1 < n {
                let id = vocab_id::<I>(col + 1, v0, ids, gathered);
                g1 = grad_of(
                    acc.get(2 * j + 1),
                    id,
                    l,
                    scale,
                    target,
                    bias,
                    softcap,
                    has_bias,
                    has_softcap,
                );
            }
            let mut v = Vector::<O, N2>::empty();
            v.insert(0usize, O::cast_from(g0));
            v.insert(1usize, O::cast_from(g1));
            out[(row as usize * out_stride as usize + col as usize) / 2] = v;
        }
    }
}
