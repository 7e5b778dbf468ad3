//! Fused linear cross-entropy passes ([`crate::PassKernels::Fused`]): the logits are computed
//! tile by tile on the matrix units (`mma.m16n8k16`, f16/bf16 operands, f32 accumulators) and
//! consumed in registers and shared memory; no launch writes a logit.
//!
//! - [`forward`]: each token's log-sum-exp (one launch over token blocks × vocabulary
//!   segments, one small launch merging the segments);
//! - [`backward`]: dE from a walk owned by blocks of tokens, dC from a walk owned by blocks of
//!   vocabulary entries (FlashAttention-2's split of dQ and dK/dV): each gradient is summed in
//!   f32 registers over the whole walk and written once in the operands' dtype, so the backward
//!   holds dE and dC and `O(N)` vectors, nothing else. Both walks recompute the logits: four
//!   `N·V·D` products in all, against three with atomics into f32 buffers (`2×` dE + dC);
//! - for training, [`forward_grad()`] (one walk owned by blocks of tokens: the log-sum-exp, the
//!   target logit and dE for a unit loss gradient, the softmax taken online) and
//!   [`backward_dc`] (dE scaled by the loss gradient in place, the dC walk): the dE walk and
//!   the log-sum-exp share their logits, three `N·V·D` products in all.
//!
//! A cube is 8 planes over `TILE` owned rows. The backward keeps in shared memory the owned
//! tile, two walked tiles (the next one filled by Hopper's bulk copies while the cube computes on
//! the current one: sm90 and later) and the gradient tile, through which the planes also trade
//! partial logits: 227 KB at `D = 576`, all an H100 gives a cube. The forward holds the owned
//! tile's fragments in registers instead and keeps two walked tiles and a 16 KB trading buffer.
//! The backward's f32 accumulators are `D / 4` registers a lane, which bounds `D` at 576; larger
//! hidden sizes take the chunked passes.

mod backward;
mod copies;
mod forward;
mod forward_grad;
pub mod stages;

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, FloatDType, Shape};
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use burn_kernels_core::kernels::flash::manual_mma_unsupported;
use burn_kernels_core::route::count_launch;
use cubecl::features::Tma;
use cubecl::prelude::*;

use super::{elementwise_grid, row_grid};
use crate::{LceParams, PassKernels};

/// Rows a cube owns, and rows of the tiles it walks.
pub const TILE: usize = 64;
/// Planes (warps) a cube.
const PLANES: usize = 8;
/// Units a cube.
pub(crate) const THREADS: usize = PLANES * 32;
/// Padding of a row of a walked tile, in 32-bit words: the 8 rows one fragment load touches
/// start 4 banks apart. (Tiles the units store are swizzled instead: `stages::chunk_at`.)
pub(crate) const PAD: usize = 4;
/// `Vector<f32, 2>`s of the forward's buffer through which the planes of a logits block trade
/// partial sums: 8 a lane of each plane. (The backward trades through its gradient tile.)
pub(crate) const XCHG: usize = PLANES * 8 * 32;
/// The largest hidden size: `D / 4` f32 accumulators a lane.
pub const MAX_DIM: usize = 576;
/// Cubes the forward aims at (token blocks × vocabulary segments): a few waves on 132 SMs.
const FORWARD_CUBES: usize = 528;

/// The scalars the fused kernels take.
#[derive(CubeLaunch, CubeType, Clone, Copy, Debug)]
pub struct FusedArgs {
    /// Tokens (rows of `E`).
    pub tokens: usize,
    /// Vocabulary entries (rows of `C`).
    pub vocab: usize,
    /// The soft-capping constant (read only with a cap).
    pub softcap: f32,
    /// The gradient filter's threshold (read only with a filter): a tile whose every
    /// `|softmax − onehot|` is below it adds nothing to the gradients.
    pub filter_eps: f32,
}

/// Whether a pass may try the fused kernels: asked for ([`PassKernels::Fused`] or
/// [`PassKernels::Auto`]), and no bias, which they do not implement; a log line where asked
/// for but not taken.
pub(crate) fn wanted(params: &LceParams, bias: bool, pass: &str) -> bool {
    if !matches!(params.passes, PassKernels::Fused | PassKernels::Auto) {
        return false;
    }
    if bias {
        declined(pass, "a bias");
    }
    !bias
}

/// Logs that `pass` declined the fused kernels for `why`: at info level the first time a
/// process meets this pass and reason, at debug level after that (a training loop would
/// otherwise log the same line every step).
fn declined(pass: &str, why: &str) {
    static SEEN: std::sync::Mutex<std::collections::BTreeSet<String>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let first = SEEN
        .lock()
        .map(|mut seen| seen.insert(format!("{pass}: {why}")))
        .unwrap_or(true);
    if first {
        log::info!("fused CCE {pass} declined ({why}): chunked passes");
    } else {
        log::debug!("fused CCE {pass} declined ({why}): chunked passes");
    }
}

/// Bytes of shared memory a cube of the backward uses at hidden size `d` (the forward uses
/// less).
pub fn shared_bytes(d: usize) -> usize {
    // The owned tile (swizzled), two padded walked tiles, the gradient tile (swizzled), three
    // f32/u32 vectors, two 8-byte barriers and the planes' filter flags: 232 240 bytes at
    // d = 576, of an H100's 232 448.
    2 * TILE * d + 2 * TILE * (2 * d + 4 * PAD) + 2 * TILE * TILE + 12 * TILE + 16 + 4 * PLANES
}

/// Why the fused kernels never take inputs of `dtype` with hidden size `d`, whatever the
/// device; `None` where they may ([`unsupported`] adds the device's checks). The autodiff loss
/// asks it before choosing the training path.
pub fn inputs_unsupported(dtype: DType, d: usize) -> Option<String> {
    if !matches!(dtype, DType::BF16 | DType::F16) {
        return Some(format!("{dtype:?} inputs (f16 or bf16)"));
    }
    if d == 0 || !d.is_multiple_of(64) || d > MAX_DIM {
        return Some(format!(
            "hidden size {d} (a multiple of 64 up to {MAX_DIM})"
        ));
    }
    None
}

/// Why the fused kernels do not take `n` tokens of hidden size `d` in `dtype` against a
/// vocabulary of `vocab` entries on `client`'s runtime; `None` where they do. (A bias and the
/// gradient filter are the caller's to check.)
pub fn unsupported(
    client: &Client,
    dtype: DType,
    n: usize,
    vocab: usize,
    d: usize,
) -> Option<String> {
    if let Some(why) = manual_mma_unsupported(client, dtype) {
        return Some(why);
    }
    if !client.properties().features.tma.contains(Tma::Base) {
        return Some("no bulk copies (TMA, sm90 and later)".to_string());
    }
    if let Some(why) = inputs_unsupported(dtype, d) {
        return Some(why);
    }
    if n == 0 || vocab == 0 {
        return Some("no tokens or no vocabulary".to_string());
    }
    let (need, have) = (
        shared_bytes(d),
        client.properties().hardware.max_shared_memory_size,
    );
    if need > have {
        return Some(format!(
            "{need} bytes of shared memory a cube (the device has {have})"
        ));
    }
    None
}

/// `e` and `c` as the kernels read them (contiguous, 16-byte aligned starts: they read 8
/// values at a time), or `None` with a log line for `pass` where [`unsupported`], a dtype
/// mismatch, `more` or the alignment says no. Also `n`, `V` and `D`.
fn operands(
    e: CubeTensor,
    c: CubeTensor,
    pass: &str,
    more: Option<String>,
) -> Option<(CubeTensor, CubeTensor, [usize; 3])> {
    let [n, d] = e.meta.shape().dims::<2>();
    let vocab = c.meta.shape().dims::<2>()[0];
    let (e, c) = (into_contiguous(e), into_contiguous(c));
    let start = |t: &CubeTensor| t.handle.offset_start.unwrap_or(0);
    let why = unsupported(&e.client, e.dtype, n, vocab, d)
        .or_else(|| (c.dtype != e.dtype).then(|| "operands of different dtypes".to_string()))
        .or(more)
        .or_else(|| {
            (!start(&e).is_multiple_of(16) || !start(&c).is_multiple_of(16))
                .then(|| "an operand's start is not 16-byte aligned".to_string())
        });
    if let Some(why) = why {
        declined(pass, &why);
        return None;
    }
    Some((e, c, [n, vocab, d]))
}

fn args(n: usize, vocab: usize, softcap: Option<f32>, filter_eps: Option<f32>) -> FusedArgsLaunch {
    FusedArgsLaunch::new(n, vocab, softcap.unwrap_or(1.0), filter_eps.unwrap_or(0.0))
}

fn empty(like: &CubeTensor, shape: Shape, dtype: DType) -> CubeTensor {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype)
}

/// Each token's log-sum-exp of the (soft-capped) logits `E·Cᵀ`, f32; `None` (nothing launched)
/// where [`unsupported`] says why not or an operand's start is not 16-byte aligned.
///
/// # Shapes
/// - `e`: `[n, D]`, `c`: `[V, D]`, one 16-bit dtype
/// - returns `[n]` f32
pub fn forward(e: CubeTensor, c: CubeTensor, softcap: Option<f32>) -> Option<CubeTensor> {
    let (e, c, [n, vocab, d]) = operands(e, c, "forward", None)?;
    let client = e.client.clone();
    let storage = dtype_to_storage_type(e.dtype);
    let tiles = n.div_ceil(TILE);
    let vocab_tiles = vocab.div_ceil(TILE);
    let segments = FORWARD_CUBES.div_ceil(tiles).clamp(1, vocab_tiles);
    let segment = vocab_tiles.div_ceil(segments) * TILE;
    let segments = vocab.div_ceil(segment);
    let part_max = empty(&e, Shape::new([segments, n]), DType::F32);
    let part_sum = empty(&e, Shape::new([segments, n]), DType::F32);
    let lse = empty(&e, Shape::new([n]), DType::F32);
    count_launch("cce_fused_forward");
    // SAFETY: rows are read only below their counts (zeros past them), shared tiles within
    // their declared sizes, and the partials written only for tokens below `n` and segments
    // below `segments`.
    unsafe {
        forward::cce_lse_kernel::launch_unchecked(
            &client,
            row_grid(&client, tiles * segments),
            CubeDim::new_2d(32, PLANES as u32),
            2,
            8,
            e.into_tensor_arg(),
            c.into_tensor_arg(),
            part_max.clone().into_tensor_arg(),
            part_sum.clone().into_tensor_arg(),
            args(n, vocab, softcap, None),
            segment,
            d,
            softcap.is_some(),
            storage,
        );
    }
    let (count, dim) = elementwise_grid(&client, n);
    forward::cce_lse_merge_kernel::launch(
        &client,
        count,
        dim,
        part_max.into_tensor_arg(),
        part_sum.into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        n,
        segments,
    );
    Some(lse)
}

/// The targets' dtype, if the backward kernels cannot read it (they take i32 and i64).
fn targets_unsupported(targets: &CubeTensor) -> Option<String> {
    (!matches!(targets.dtype, DType::I32 | DType::I64))
        .then(|| format!("{:?} targets (i32/i64)", targets.dtype))
}

/// One gradient walk ([`backward::cce_grad_kernel`]): cubes own `TILE` rows of `x` (`owned`
/// rows; vocabulary entries with `vocab_owned`) and walk every row of `y`, writing `out`.
#[allow(clippy::too_many_arguments)]
fn grad_walk(
    [x, y, out]: [&CubeTensor; 3],
    [targets, lse, dout]: [&CubeTensor; 3],
    owned: usize,
    vocab_owned: bool,
    [n, vocab, d]: [usize; 3],
    softcap: Option<f32>,
    filter_eps: Option<f32>,
) {
    let client = x.client.clone();
    let dtypes = [
        dtype_to_storage_type(x.dtype),
        dtype_to_storage_type(targets.dtype),
    ];
    // SAFETY: rows are read only below their counts (zeros past them), shared tiles within
    // their declared sizes, and the output written only for owned rows below `owned`.
    unsafe {
        backward::cce_grad_kernel::launch_unchecked(
            &client,
            row_grid(&client, owned.div_ceil(TILE)),
            CubeDim::new_2d(32, PLANES as u32),
            2,
            8,
            x.clone().into_tensor_arg(),
            y.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            targets.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            args(n, vocab, softcap, filter_eps),
            d,
            vocab_owned,
            softcap.is_some(),
            filter_eps.is_some(),
            dtypes,
        );
    }
}

/// `(dE, dC)` of `Σᵢ dout[i]·lossᵢ` (no bias), written in the operands' dtype from f32
/// accumulators; `None` (nothing launched) where [`unsupported`] says why not or an operand's
/// start is not 16-byte aligned.
///
/// With `filter_eps` (the paper's gradient filter, per tile as in Apple's kernels): a tile of
/// `TILE` tokens × `TILE` entries whose every `|softmax − onehot|` is below it is left out of
/// both gradients (its logits are still computed, its products `G·Y` are not).
///
/// # Shapes
/// - `e`: `[n, D]`, `c`: `[V, D]`, one 16-bit dtype; `targets`: `[n]` (i32 or i64, in
///   `[0, V)`); `lse`, `dout`: `[n]` f32
/// - returns `dE [n, D]` and `dC [V, D]`
pub fn backward(
    e: CubeTensor,
    c: CubeTensor,
    targets: CubeTensor,
    lse: CubeTensor,
    dout: CubeTensor,
    softcap: Option<f32>,
    filter_eps: Option<f32>,
) -> Option<(CubeTensor, CubeTensor)> {
    let why = targets_unsupported(&targets);
    let (e, c, dims) = operands(e, c, "backward", why)?;
    let [n, vocab, d] = dims;
    let [targets, lse, dout] = [targets, lse, dout].map(into_contiguous);
    let de = empty(&e, Shape::new([n, d]), e.dtype);
    let dc = empty(&e, Shape::new([vocab, d]), e.dtype);
    count_launch("cce_fused_backward");
    let token_data = [&targets, &lse, &dout];
    grad_walk(
        [&e, &c, &de],
        token_data,
        n,
        false,
        dims,
        softcap,
        filter_eps,
    );
    grad_walk(
        [&c, &e, &dc],
        token_data,
        vocab,
        true,
        dims,
        softcap,
        filter_eps,
    );
    Some((de, dc))
}

/// The training forward: each token's log-sum-exp, its (soft-capped) target logit, both f32,
/// and `∂ lossᵢ / ∂Eᵢ` (dE for a unit loss gradient, in the operands' dtype), from one walk
/// owned by blocks of tokens (module `forward_grad`); [`backward_dc`] finishes
/// the gradients. `None` (nothing launched) where [`unsupported`] says why not, the targets
/// are not i32/i64 or an operand's start is not 16-byte aligned: the same inputs make
/// [`backward_dc`] decline too.
///
/// # Shapes
/// - `e`: `[n, D]`, `c`: `[V, D]`, one 16-bit dtype; `targets`: `[n]` in `[0, V)`
/// - returns `lse [n]`, `target_logit [n]`, `dE₁ [n, D]`
pub fn forward_grad(
    e: CubeTensor,
    c: CubeTensor,
    targets: CubeTensor,
    softcap: Option<f32>,
) -> Option<(CubeTensor, CubeTensor, CubeTensor)> {
    let why = targets_unsupported(&targets);
    let (e, c, [n, vocab, d]) = operands(e, c, "training forward", why)?;
    let client = e.client.clone();
    let targets = into_contiguous(targets);
    let lse = empty(&e, Shape::new([n]), DType::F32);
    let target_logit = empty(&e, Shape::new([n]), DType::F32);
    let de = empty(&e, Shape::new([n, d]), e.dtype);
    let dtypes = [
        dtype_to_storage_type(e.dtype),
        dtype_to_storage_type(targets.dtype),
    ];
    count_launch("cce_fused_forward_grad");
    // SAFETY: rows are read only below their counts (zeros past them), shared tiles within
    // their declared sizes, outputs written only for tokens below `n`, and the classifier's
    // rows only at targets in `[0, V)`.
    unsafe {
        forward_grad::cce_lse_grad_kernel::launch_unchecked(
            &client,
            row_grid(&client, n.div_ceil(TILE)),
            CubeDim::new_2d(32, PLANES as u32),
            2,
            8,
            e.into_tensor_arg(),
            c.clone().into_tensor_arg(),
            c.into_tensor_arg(),
            targets.into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            target_logit.clone().into_tensor_arg(),
            de.clone().into_tensor_arg(),
            args(n, vocab, softcap, None),
            d,
            softcap.is_some(),
            dtypes,
        );
    }
    Some((lse, target_logit, de))
}

/// `(dE, dC)` of `Σᵢ dout[i]·lossᵢ` (no bias) from [`forward_grad()`]'s `de_unit`: dE is
/// `de_unit` scaled by `dout` row by row (in place where no other handle shares it), dC one
/// walk owned by blocks of vocabulary entries, as in [`backward()`] (the gradient filter applies
/// to dC only: dE was summed before any tile's softmax was known). `None` (nothing launched)
/// where [`forward_grad()`] declines the same inputs.
///
/// # Shapes
/// As [`backward()`], and `de_unit`: `[n, D]` in the operands' dtype.
#[allow(clippy::too_many_arguments)]
pub fn backward_dc(
    e: CubeTensor,
    c: CubeTensor,
    targets: CubeTensor,
    lse: CubeTensor,
    dout: CubeTensor,
    de_unit: CubeTensor,
    softcap: Option<f32>,
    filter_eps: Option<f32>,
) -> Option<(CubeTensor, CubeTensor)> {
    let why = targets_unsupported(&targets);
    let (e, c, dims) = operands(e, c, "training backward", why)?;
    let [n, vocab, d] = dims;
    let client = e.client.clone();
    let [targets, lse, dout] = [targets, lse, dout].map(into_contiguous);
    let dc = empty(&e, Shape::new([vocab, d]), e.dtype);
    count_launch("cce_fused_backward_dc");
    grad_walk(
        [&c, &e, &dc],
        [&targets, &lse, &dout],
        vocab,
        true,
        dims,
        softcap,
        filter_eps,
    );
    if !(de_unit.can_mut() && de_unit.is_contiguous()) {
        // Another handle shares dE₁ (or it is a view): scale into a new tensor.
        log::debug!("fused CCE: dE₁ is shared, scaled into a new tensor");
        type Cb = burn_cubecl::CubeBackend;
        let dtype = de_unit.dtype;
        let de = Cb::float_cast(de_unit, FloatDType::F32);
        let de = Cb::float_mul(de, Cb::float_reshape(dout, Shape::new([n, 1])));
        return Some((Cb::float_cast(de, FloatDType::from(dtype)), dc));
    }
    let de = de_unit;
    let (count, dim) = elementwise_grid(&client, n * d);
    forward_grad::scale_rows_kernel::launch(
        &client,
        count,
        dim,
        de.clone().into_tensor_arg(),
        dout.into_tensor_arg(),
        n * d,
        d,
        dtype_to_storage_type(de.dtype),
    );
    Some((de, dc))
}
