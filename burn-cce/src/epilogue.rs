//! The forward's and the scoring pass's chunk reductions inside core's Hopper GEMM: the
//! log-sum-exp and the filter scores of a chunk reduced from the logit tile in registers
//! (`burn_kernels_core::gemm::hopper::{hopper_row_lse, hopper_column_scores}`), so those passes
//! write no logit. Where the chunk GEMMs take the Hopper kernel ([`GemmStrategy::Fixed`] with
//! it as the default kernel, or [`GemmStrategy::Kernel`] naming it) and it takes the operands;
//! elsewhere the passes store f32 logits and reduce them with [`crate::kernels`]' kernels.
//! The backward's `G` comes from the same GEMM ([`grad`], `hopper_grad`), and dE's second pass
//! adds its products into f32 blocks there ([`add_product`], `hopper_gemm_add`): the exact
//! default at Gemma-2's shape went from 148.6 to 94.4 ms with the wider blocks this allows
//! (`bench/results/2026-12-06/nvidia-h100-s55.md`). Where `G` cannot come from the GEMM the
//! chunk's logits are stored after all, beyond the blocks' designed working set (logged).
//!
//! Measured (Gemma-2 shape, bf16, loss + gradient with the paper's filter at the automatic
//! blocks, H100, 2026-12-06): before, the two reductions' own kernels took 6.3 + 3.4 ms a call
//! beside the logits' f32 stores inside the GEMMs, and the call 68.9 ms; with the reductions
//! inside the GEMM (and `G`'s padded rows) it took 56.2 ms, Apple's CCE 59.7 in the same run
//! (`bench/results/2026-12-06/nvidia-h100-s54.md`).

use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, Shape};
use burn_cubecl::{CubeBackend, tensor::CubeTensor};
use burn_kernels_core::gemm::{
    GemmKernel,
    hopper::{
        GradInputs, LogitOptions, hopper_column_scores, hopper_gemm_add,
        hopper_gemm_add_compensated, hopper_grad, hopper_row_lse, unsupported,
    },
};

use crate::GemmStrategy;
use crate::gemm::{cast, classifier_t, dims2};
use crate::kernels::lse_chunk::merge_tiles;

type Cb = CubeBackend;

/// Columns of a chunk: the reductions hold `O(n · chunk / 64)` values, never the logits, so the
/// chunks are long (8 MiB of partial sums at 8192 tokens).
pub const REDUCTION_CHUNK: usize = 32 * 1024;

/// Launch counters ([`burn_kernels_core::route::stream_launches`]) of the two reductions.
pub const HOPPER_LSE_LAUNCHES: &str = "cce-hopper-lse";
/// See [`HOPPER_LSE_LAUNCHES`].
pub const HOPPER_SCORE_LAUNCHES: &str = "cce-hopper-scores";
/// Launch counter of the backward's `G` written by the Hopper GEMM ([`grad`]).
pub const HOPPER_GRAD_LAUNCHES: &str = "cce-hopper-grad";
/// Launch counter of dE products added into an f32 accumulator by the Hopper GEMM
/// ([`add_product`]).
pub const HOPPER_ADD_LAUNCHES: &str = "cce-hopper-add";
/// Launch counter of dE products added into dE and its corrections by the Hopper GEMM
/// ([`add_compensated`]).
pub const HOPPER_COMPENSATED_LAUNCHES: &str = "cce-hopper-compensated";

/// Whether chunk GEMMs by `gemm` take the Hopper kernel and it takes `e · c_chunkᵀ`.
pub fn applies(gemm: GemmStrategy, e: &CubeTensor, c: &CubeTensor) -> bool {
    let [vocab, _] = dims2(c);
    let [n, _] = dims2(e);
    gemm.kernel() == Some(GemmKernel::Wgmma)
        && n >= burn_kernels_core::gemm::FIXED_MIN_ROWS
        && vocab > 0
        && unsupported(
            &e.client,
            e,
            &classifier_t(c, 0..vocab.min(REDUCTION_CHUNK)),
        )
        .is_none()
}

/// The reduction's output, or `None` with a log line where core refused or failed it.
fn ran(name: &str, out: Result<CubeTensor, String>) -> Option<CubeTensor> {
    out.map_err(|why| log::info!("burn-cce: {name} on the Hopper GEMM unavailable ({why})"))
        .ok()
}

/// The bias in f32, as the reductions read it.
pub(crate) fn bias_f32(bias: &Option<CubeTensor>) -> Option<CubeTensor> {
    bias.clone().map(|b| cast(b, DType::F32))
}

/// Folds the log-sum-exp of the vocabulary's chunks into `m` and `s` (`[n]` f32, empty:
/// `s = 0`), in order, until one cannot run here; returns how many entries were folded (the
/// caller folds the rest).
pub fn fold_lse(
    e: &CubeTensor,
    c: &CubeTensor,
    bias: &Option<CubeTensor>,
    softcap: Option<f32>,
    [m, s]: [&CubeTensor; 2],
) -> usize {
    let [vocab, _] = dims2(c);
    let bias = bias_f32(bias);
    for v0 in (0..vocab).step_by(REDUCTION_CHUNK) {
        let c_t = classifier_t(c, v0..(v0 + REDUCTION_CHUNK).min(vocab));
        let options = LogitOptions {
            bias: bias.as_ref(),
            v0,
            softcap,
        };
        let Some(partials) = ran("the log-sum-exp", hopper_row_lse(e, &c_t, options)) else {
            return v0;
        };
        burn_kernels_core::route::count_launch(HOPPER_LSE_LAUNCHES);
        crate::live::sample(&partials, "forward: tile sums");
        merge_tiles(partials, m, s);
    }
    vocab
}

/// The filter score of every vocabulary entry (`[V]` f32), or `None` where the reduction did
/// not run.
pub fn scores(
    e: &CubeTensor,
    c: &CubeTensor,
    bias: &Option<CubeTensor>,
    softcap: Option<f32>,
    lse: &CubeTensor,
    targets: &CubeTensor,
) -> Option<CubeTensor> {
    let [vocab, _] = dims2(c);
    let bias = bias_f32(bias);
    let mut parts = Vec::new();
    for v0 in (0..vocab).step_by(REDUCTION_CHUNK) {
        let len = REDUCTION_CHUNK.min(vocab - v0);
        let c_t = classifier_t(c, v0..v0 + len);
        let options = LogitOptions {
            bias: bias.as_ref(),
            v0,
            softcap,
        };
        let partial = ran(
            "the filter scores",
            hopper_column_scores(e, &c_t, options, lse, targets),
        )?;
        burn_kernels_core::route::count_launch(HOPPER_SCORE_LAUNCHES);
        crate::live::sample(&partial, "scores");
        parts.push(Cb::float_reshape(
            Cb::float_max_dim(partial, 0),
            Shape::new([len]),
        ));
    }
    Some(Cb::float_cat(parts, 0))
}

/// The per-token inputs and options of [`grad`], fixed for one backward.
pub(crate) struct GradArgs<'a> {
    /// `[V]` f32 ([`bias_f32`]).
    pub bias: Option<&'a CubeTensor>,
    pub softcap: Option<f32>,
    pub lse: &'a CubeTensor,
    pub dout: &'a CubeTensor,
    pub targets: &'a CubeTensor,
}

/// `G` of one chunk written by the Hopper GEMM from the logits `e_rows · c_chunkᵀ` (rows from
/// token `row0`; columns ids `ids`, or from `v0`), in `e_rows`' dtype with rows padded to 16
/// bytes (as [`crate::kernels::grad::row_stride`]); `None`, logged, where it cannot run.
pub(crate) fn grad(
    e_rows: &CubeTensor,
    c_chunk: &CubeTensor,
    args: &GradArgs,
    (ids, v0): (Option<&CubeTensor>, usize),
    row0: usize,
) -> Option<CubeTensor> {
    let options = LogitOptions {
        bias: args.bias,
        v0,
        softcap: args.softcap,
    };
    let inputs = GradInputs {
        lse: args.lse,
        dout: args.dout,
        targets: args.targets,
        ids,
        row0,
    };
    let c_t = Cb::float_transpose(c_chunk.clone());
    let g = ran("G", hopper_grad(e_rows, &c_t, options, inputs))?;
    burn_kernels_core::route::count_launch(HOPPER_GRAD_LAUNCHES);
    Some(g)
}

/// What became of [`add_product`].
pub(crate) enum Added {
    /// Added into the accumulator.
    Yes,
    /// The kernel does not take these operands: nothing was launched.
    Unsupported,
    /// The launch failed (at this kernel's first launch): the accumulator holds no valid sum.
    Failed,
}

/// `acc += g · c_chunk` (`[rows, len] · [len, D]` into contiguous f32 `[rows, D]`) by the
/// Hopper GEMM's adding store: no f32 product and no separate addition.
pub(crate) fn add_product(g: &CubeTensor, c_chunk: &CubeTensor, acc: &CubeTensor) -> Added {
    if let Some(why) = unsupported(&g.client, g, c_chunk) {
        log::debug!("burn-cce: dE product added by its own kernel ({why})");
        return Added::Unsupported;
    }
    match hopper_gemm_add(g, c_chunk, acc) {
        Ok(()) => {
            burn_kernels_core::route::count_launch(HOPPER_ADD_LAUNCHES);
            Added::Yes
        }
        Err(why) => {
            log::info!("burn-cce: the Hopper GEMM's adding store unavailable ({why})");
            Added::Failed
        }
    }
}

/// `de += g · c_chunk` (`[rows, len] · [len, D]`) carried compensated in `de` (bf16) and its i8
/// corrections `fix` (both contiguous `[rows, D]`), by the Hopper GEMM's compensated store.
pub(crate) fn add_compensated(
    g: &CubeTensor,
    c_chunk: &CubeTensor,
    de: &CubeTensor,
    fix: &CubeTensor,
) -> Added {
    if let Some(why) = unsupported(&g.client, g, c_chunk) {
        log::info!("burn-cce: dE not carried compensated ({why})");
        return Added::Unsupported;
    }
    match hopper_gemm_add_compensated(g, c_chunk, de, fix) {
        Ok(()) => {
            burn_kernels_core::route::count_launch(HOPPER_COMPENSATED_LAUNCHES);
            Added::Yes
        }
        Err(why) => {
            log::info!("burn-cce: the Hopper GEMM's compensated store unavailable ({why})");
            Added::Failed
        }
    }
}
