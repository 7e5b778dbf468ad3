//! Linear cross-entropy on `CubeBackend`: the vocabulary is walked in chunks; each chunk's
//! logits (f32) come from a cubek GEMM (on the matrix units, with f32 output from f16/bf16
//! inputs) and are consumed at once by the CubeCL kernels in [`crate::kernels`]. At most one
//! chunk of logits exists at a time, never `n × V`.
//!
//! Forward: per chunk, fold the logits into running `(max, Σexp)` per token; the target
//! logits come from an indexed dot product.
//!
//! Backward with filtering: a scoring pass recomputes each chunk and records, per vocabulary
//! entry, the largest `|softmax − onehot|` over all tokens. Entries below `filter_eps` are
//! dropped. With `sort_vocab` the remaining entries are gathered into dense chunks (ordered by
//! score); without it, whole natural-order chunks with no remaining entry are skipped. Each
//! processed chunk then recomputes its logits, forms `G` ([`crate::kernels::grad`]) and writes
//! `Gᵀ·E` into its dC rows. dE is accumulated in place ([`DeAccumulation`]): in the same pass
//! when it is accumulated in its own dtype or the f32 accumulator is small, otherwise in a
//! second pass over blocks of rows, each block's f32 accumulator summed over the kept chunks
//! and rounded into dE once (the same f32 accumulation as one `N × D` accumulator).
//!
//! # Memory
//!
//! Beside the inputs, the backward holds dE and dC (the lower bound) plus one chunk's working
//! set, sized by [`BackwardBlocks`] to about 3% of the bound (automatic `chunk_bytes`), and
//! `O(N + V)` vectors. With 8192 tokens in bf16, loss + gradient, default options:
//!
//! | shape | dE + dC | before (single pass, f32 dE + its product) | now |
//! |---|---:|---:|---:|
//! | Gemma-2, V = 256000, D = 2304 | 1 217 396 736 B | 1 352 138 752 B (1.111×) | 1 253 523 456 B (1.030×) |
//! | SmolLM2, V = 49152, D = 576 | 66 060 288 B | 127 008 768 B (1.923×) | 78 938 112 B (1.195×) |
//!
//! "Before" held an f32 dE accumulator (`4·N·D`), the f32 product `G·C_chunk` added into it
//! (`4·N·D`), and a 32 MiB chunk's logits, `G` and classifier rows. SmolLM2's working set is
//! set by the floor on the chunk (2²¹ logits), which keeps its GEMMs filling the GPU. The
//! memory pool reserves whole pages, so its growth can exceed these live bytes: on an 80 GB
//! H100, CubeCL's default pools put a 1.18 GB dC on a page of ~1.33 GB.
//!
//! Measured with [`crate::track_live_peak`] (NVIDIA H100, 2026-11-26): 1254 MB at the Gemma-2
//! shape and 79 MB at SmolLM2's, the designed figures to within 0.5 MB. The forward and the
//! scoring pass run before dE and dC exist; their logits blocks (see
//! [`crate::LceParams::chunk_len`]) are at most the gradients' size and do not raise the peak.
//!
//! This trades a fused GEMM-with-epilogue kernel (the paper's) for cubek's tuned GEMM plus a
//! separate epilogue pass over a small chunk: the logits make one round trip through memory
//! per chunk, and filtering skips work at entry/chunk granularity.

use burn::tensor::{
    DType, IndexingUpdateOp, Int, Shape, Tensor, TensorData, TensorPrimitive, ops::FloatTensor,
    ops::IntTensor,
};
use burn_cubecl::{
    BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement,
    kernel::matmul::{MatmulStrategy, matmul},
    ops::numeric::empty_device_contiguous_dtype,
    tensor::CubeTensor,
};
use cubek::{
    matmul::{
        components::tile::TileMatmulKind,
        definition::{MatmulElems, MatmulGlobalElems},
        launch::{Strategy, launch_ref},
        routines::{
            BlueprintStrategy, TileSizeSelection, double_buffering::DoubleBufferingArgs,
            ordered_double_buffering::OrderedSelectionArgs, simple::SimpleArgs,
            simple_unit::SimpleUnitSelectionArgs,
        },
    },
    std::InputBinding,
};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::kernels::{
    accumulate::add_rows, grad::grad_chunk, indexed_dot::indexed_dot, lse_chunk::lse_chunk, score,
};
use crate::{GemmKernel, GemmStrategy, LceParams, live};

type Cb<R, F, I, BT> = CubeBackend<R, F, I, BT>;
type Pair<B> = (FloatTensor<B>, FloatTensor<B>);

fn float<R, F, I, BT, const D: usize>(t: FloatTensor<Cb<R, F, I, BT>>) -> Tensor<Cb<R, F, I, BT>, D>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// `lhs · rhs` with the output in `dtype` (f32 accumulation inside the GEMM), by the kernel
/// `strategy` selects. Falls back to casting the inputs when the runtime's matmul rejects the
/// mixed-precision setup.
fn matmul_to<R, F, I, BT>(
    lhs: Tensor<Cb<R, F, I, BT>, 2>,
    rhs: Tensor<Cb<R, F, I, BT>, 2>,
    dtype: DType,
    strategy: GemmStrategy,
    tf32: bool,
    step: &'static str,
) -> Tensor<Cb<R, F, I, BT>, 2>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    static WARNED: AtomicBool = AtomicBool::new(false);
    let (l, r) = (
        lhs.clone().into_primitive().tensor(),
        rhs.clone().into_primitive().tensor(),
    );
    let kernel = match strategy {
        GemmStrategy::Fixed => Some(GemmKernel::DEFAULT),
        GemmStrategy::Kernel(kernel) => Some(kernel),
        GemmStrategy::Autotune => None,
    };
    // Each exit reads the live memory with the inputs still held (see `crate::live`).
    if let Some(kernel) = kernel
        && let Some(out) = fixed_gemm(l.clone(), r.clone(), dtype, kernel, tf32)
    {
        live::sample(&out, step);
        return float(out);
    }
    let out = match matmul(l, r, None, MatmulStrategy::default(), dtype) {
        Ok(out) => float(out),
        Err(err) => {
            if !WARNED.swap(true, Ordering::Relaxed) {
                log::warn!(
                    "burn-cce: mixed-precision matmul unavailable ({err:?}); casting the inputs"
                );
            }
            lhs.clone().cast(dtype).matmul(rhs.clone().cast(dtype))
        }
    };
    mark(&out, step);
    out
}

/// Reads the live memory into [`crate::live`]'s peak (when tracking) with `t` allocated.
fn mark<R, F, I, BT, const D: usize>(t: &Tensor<Cb<R, F, I, BT>, D>, step: &'static str)
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    // The untracked path pays one thread-local read, not a tensor handle clone.
    if live::tracking() {
        live::sample(&t.clone().into_primitive().tensor(), step);
    }
}

/// cubek's launch strategy for `kernel`.
fn cubek_strategy(kernel: GemmKernel) -> Strategy {
    let simple = |multi_rows| SimpleArgs {
        multi_rows,
        tile_matmul: TileMatmulKind::Mma,
    };
    let double = |specialized| DoubleBufferingArgs {
        specialized,
        tile_matmul: TileMatmulKind::Mma,
    };
    let ordered = |row_count| OrderedSelectionArgs {
        partition_k: Some(2),
        row_count: Some(row_count),
        rows_per_plane: Some(2),
        tile_matmul: TileMatmulKind::Mma,
    };
    use BlueprintStrategy::Inferred;
    match kernel {
        GemmKernel::DoubleCyclic => Strategy::DoubleCyclicMma(Inferred(double(false))),
        GemmKernel::DoubleCyclicSpecialized => Strategy::DoubleCyclicMma(Inferred(double(true))),
        GemmKernel::SimpleCyclic => Strategy::SimpleCyclicMma(Inferred(simple(false))),
        GemmKernel::SimpleCyclicMultiRow => Strategy::SimpleCyclicMma(Inferred(simple(true))),
        GemmKernel::OrderedDouble4 => Strategy::OrderedDoubleMma(Inferred(ordered(4))),
        GemmKernel::OrderedDouble8 => Strategy::OrderedDoubleMma(Inferred(ordered(8))),
        GemmKernel::SpecializedCyclic => Strategy::SpecializedCyclicMma(Inferred(().into())),
        GemmKernel::SimpleTma => Strategy::SimpleTmaMma(Inferred(simple(false))),
        GemmKernel::SimpleTmaMultiRow => Strategy::SimpleTmaMma(Inferred(simple(true))),
        GemmKernel::SpecializedTma => Strategy::SpecializedTmaMma(Inferred(().into())),
    }
}

/// `kernel` (or the unit kernel) for `lhs · rhs`, or `None` where the runtime cannot run either
/// (checked at setup, before anything is launched); the caller then autotunes.
fn fixed_gemm<R: CubeRuntime>(
    lhs: CubeTensor<R>,
    rhs: CubeTensor<R>,
    dtype: DType,
    kernel: GemmKernel,
    tf32: bool,
) -> Option<CubeTensor<R>> {
    let [m, k] = lhs.meta.shape().dims::<2>();
    let [_, n] = rhs.meta.shape().dims::<2>();
    let in_dtype = lhs.dtype;
    // Tensor-core tiles for half-precision inputs, and for f32 where TF32 is allowed; no
    // dimension smaller than a tile.
    let tensor_cores = (matches!(in_dtype, DType::F16 | DType::BF16)
        || (tf32 && in_dtype == DType::F32))
        && m.min(n).min(k) >= 16;
    let unit = Strategy::SimpleUnit(BlueprintStrategy::Inferred(SimpleUnitSelectionArgs {
        tile_size: TileSizeSelection::MinTileSize,
    }));
    let mma = cubek_strategy(kernel);
    // A kernel the device cannot run (TMA before Hopper, on Vulkan) falls back to the
    // portable double-buffered one, then to the unit kernel.
    let candidates = match (tensor_cores, kernel == GemmKernel::DoubleCyclic) {
        (true, true) => vec![mma, unit],
        (true, false) => vec![mma, cubek_strategy(GemmKernel::DoubleCyclic), unit],
        (false, _) => vec![unit],
    };
    let out = empty_device_contiguous_dtype(
        lhs.client.clone(),
        lhs.device.clone(),
        Shape::new([m, n]),
        dtype,
    );
    let client = lhs.client.clone();
    for strategy in candidates {
        let mut elems = MatmulElems::from_globals(&MatmulGlobalElems {
            lhs: in_dtype.into(),
            rhs: in_dtype.into(),
            out: dtype.into(),
        });
        match launch_ref(
            &strategy,
            &client,
            InputBinding::new(lhs.clone().binding(), in_dtype.into()),
            InputBinding::new(rhs.clone().binding(), in_dtype.into()),
            out.clone().binding(),
            &mut elems,
        ) {
            Ok(()) => return Some(out),
            Err(err) => log::debug!("burn-cce: {strategy} unavailable here ({err:?})"),
        }
    }
    None
}

fn chunks(vocab: usize, chunk: usize) -> impl Iterator<Item = Range<usize>> {
    (0..vocab)
        .step_by(chunk)
        .map(move |v0| v0..(v0 + chunk).min(vocab))
}

/// See [`crate::CceBackend::linear_ce_forward`].
pub fn forward<R, F, I, BT>(
    e: FloatTensor<Cb<R, F, I, BT>>,
    c: FloatTensor<Cb<R, F, I, BT>>,
    bias: Option<FloatTensor<Cb<R, F, I, BT>>>,
    targets: IntTensor<Cb<R, F, I, BT>>,
    params: &LceParams,
) -> Pair<Cb<R, F, I, BT>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let e = float::<R, F, I, BT, 2>(e);
    let c = float::<R, F, I, BT, 2>(c);
    let [n, d] = e.dims();
    let [vocab, _] = c.dims();
    let device = e.device();
    let chunk = params.chunk_len(n, vocab, d, e.dtype());
    let m = Tensor::<Cb<R, F, I, BT>, 1>::zeros([n], (&device, DType::F32));
    let s = Tensor::<Cb<R, F, I, BT>, 1>::zeros([n], (&device, DType::F32));
    mark(&s, "forward state");
    let (m_p, s_p) = (
        m.clone().into_primitive().tensor(),
        s.clone().into_primitive().tensor(),
    );
    for range in chunks(vocab, chunk) {
        let v0 = range.start;
        let logits = matmul_to(
            e.clone(),
            c.clone().slice(range).transpose(),
            DType::F32,
            params.gemm,
            params.tf32,
            "forward logits",
        );
        lse_chunk(
            logits.into_primitive().tensor(),
            bias.clone(),
            &m_p,
            &s_p,
            v0,
            params.softcap,
        );
    }
    let lse = m + s.log();
    let target_logit = indexed_dot(
        e.into_primitive().tensor(),
        c.into_primitive().tensor(),
        bias,
        targets,
        params.softcap,
    );
    live::sample(&target_logit, "target logits");
    (lse.into_primitive().tensor(), target_logit)
}

/// The vocabulary chunks the backward processes.
enum Plan {
    /// Contiguous entries.
    Natural(Range<usize>),
    /// Gathered entries (filtered, sorted by score).
    Gathered(Vec<i64>),
}

/// Scoring pass: the largest `|softmax − onehot|` of every vocabulary entry over all tokens,
/// read back to the host once.
#[allow(clippy::too_many_arguments)]
fn scores<R, F, I, BT>(
    e: &Tensor<Cb<R, F, I, BT>, 2>,
    c: &Tensor<Cb<R, F, I, BT>, 2>,
    bias: &Option<FloatTensor<Cb<R, F, I, BT>>>,
    targets: &IntTensor<Cb<R, F, I, BT>>,
    lse: &FloatTensor<Cb<R, F, I, BT>>,
    chunk: usize,
    softcap: Option<f32>,
    gemm: GemmStrategy,
    tf32: bool,
) -> Vec<f32>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let [n, _] = e.dims();
    let [vocab, _] = c.dims();
    let parts: Vec<Tensor<Cb<R, F, I, BT>, 1>> = chunks(vocab, chunk)
        .map(|range| {
            let v0 = range.start;
            let len = range.len();
            let logits = matmul_to(
                e.clone(),
                c.clone().slice(range).transpose(),
                DType::F32,
                gemm,
                tf32,
                "scores: logits",
            );
            let logits = logits.into_primitive().tensor();
            let partial = score::score_chunk(
                logits.clone(),
                bias.clone(),
                lse.clone(),
                targets.clone(),
                v0,
                softcap,
            );
            live::sample(&partial, "scores");
            drop(logits);
            let partial = float::<R, F, I, BT, 2>(partial);
            let best = partial.clone().max_dim(0).reshape([len]);
            mark(&best, "scores (max)");
            best
        })
        .collect();
    let all = Tensor::cat(parts.clone(), 0);
    mark(&all, "scores (all)");
    drop(parts);
    debug_assert_eq!(all.dims()[0], vocab, "one score per entry ({n} tokens)");
    all.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("scores are f32")
}

fn plan(scores: Option<(&[f32], f32)>, vocab: usize, chunk: usize, sort: bool) -> Vec<Plan> {
    let Some((scores, eps)) = scores else {
        return chunks(vocab, chunk).map(Plan::Natural).collect();
    };
    // NaN scores are kept: a NaN must reach the gradient, not be filtered away.
    let keep = |s: f32| s.is_nan() || s >= eps;
    if sort {
        let mut ids: Vec<usize> = (0..vocab).filter(|&v| keep(scores[v])).collect();
        ids.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        ids.chunks(chunk)
            .map(|ids| Plan::Gathered(ids.iter().map(|&v| v as i64).collect()))
            .collect()
    } else {
        chunks(vocab, chunk)
            .filter(|range| scores[range.clone()].iter().any(|&s| keep(s)))
            .map(Plan::Natural)
            .collect()
    }
}

/// Merges the plan's chunks into chunks of up to `len` entries for the second pass: gathered
/// ids in the same order, adjacent natural ranges. The entries are exactly the plan's.
fn regroup(plan: &[Plan], len: usize) -> Vec<Plan> {
    let mut out: Vec<Plan> = Vec::new();
    for part in plan {
        match part {
            Plan::Natural(range) => {
                if let Some(Plan::Natural(last)) = out.last_mut()
                    && last.end == range.start
                    && last.len() + range.len() <= len
                {
                    last.end = range.end;
                } else {
                    out.push(Plan::Natural(range.clone()));
                }
            }
            Plan::Gathered(ids) => {
                for &id in ids {
                    match out.last_mut() {
                        Some(Plan::Gathered(last)) if last.len() < len => last.push(id),
                        _ => out.push(Plan::Gathered(vec![id])),
                    }
                }
            }
        }
    }
    out
}

/// A chunk's classifier rows, its ids when gathered, and its first entry's id when natural.
type ChunkRows<B> = (Tensor<B, 2>, Option<IntTensor<B>>, usize);

/// A plan chunk ready to run: its entries' ids on the device when gathered.
enum Part<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> {
    Natural(Range<usize>),
    Gathered(Tensor<Cb<R, F, I, BT>, 1, Int>),
}

impl<R, F, I, BT> Part<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn new(plan: &Plan, device: &burn::tensor::Device<Cb<R, F, I, BT>>) -> Self {
        match plan {
            Plan::Natural(range) => Part::Natural(range.clone()),
            Plan::Gathered(ids) => Part::Gathered(Tensor::from_data(
                TensorData::new(ids.clone(), [ids.len()]),
                device,
            )),
        }
    }

    /// The chunk's classifier rows (a view when natural, a gathered copy otherwise), its ids
    /// when gathered, and the first entry's id when natural.
    fn classifier_rows(&self, c: &Tensor<Cb<R, F, I, BT>, 2>) -> ChunkRows<Cb<R, F, I, BT>> {
        match self {
            Part::Natural(range) => (c.clone().slice(range.clone()), None, range.start),
            Part::Gathered(ids) => (
                c.clone().select(0, ids.clone()),
                Some(ids.clone().into_primitive()),
                0,
            ),
        }
    }
}

/// How the backward accumulates dE; see [`BackwardBlocks`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeAccumulation {
    /// In dE itself, in its dtype (`accum_fp32` off, or f32 inputs): per chunk, the f32
    /// products `G[rows]·C_chunk` are added in place and rounded once.
    Direct,
    /// In one f32 accumulator for all of dE (`N·D·4` bytes), rounded to dE's dtype at the end.
    Whole,
    /// In a second pass over the kept vocabulary, one block of `rows` rows at a time, each
    /// block's f32 accumulator rounded into dE once: one more logits GEMM over the kept
    /// entries, but only `rows·D·4` bytes of accumulator.
    RowBlocks,
}

/// Block sizes of the chunked backward for `n` tokens, `V` entries, hidden size `D` and input
/// dtype size `s` (bytes).
///
/// The vocabulary pass walks the plan in chunks of `chunk` entries over all `n` rows, holding
/// one chunk's f32 logits (`4·n·chunk` bytes), its `G` in the input dtype (`s·n·chunk`) and
/// its gathered classifier rows (`s·chunk·D`): `S = (4 + s)·n·chunk + s·chunk·D`. dE's f32
/// blocks are sized to stay within `S`: products of `rows` rows no larger than the logits, and
/// with [`DeAccumulation::RowBlocks`] a second pass over chunks of `pass2_chunk` entries (the
/// kept chunks regrouped, about `D` entries, for GEMMs that are neither narrow nor deep) with
/// `rows` such that accumulator, logits or product, `G` and classifier rows fit `S`.
/// [`BackwardBlocks::working_bytes`] is the resulting peak beside dE and dC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackwardBlocks {
    /// Vocabulary entries per chunk of the plan (see [`crate::LceParams::grad_chunk_len`]).
    pub chunk: usize,
    /// How dE is accumulated.
    pub de: DeAccumulation,
    /// Rows per f32 block: of each product `G[rows]·C_chunk` ([`DeAccumulation::Direct`],
    /// [`DeAccumulation::Whole`]), or of each accumulator block
    /// ([`DeAccumulation::RowBlocks`]).
    pub rows: usize,
    /// Entries per chunk of the second pass ([`DeAccumulation::RowBlocks`]).
    pub pass2_chunk: usize,
}

/// Splits `n` rows into equal blocks of at most `max` rows, a multiple of 32 where that stays
/// within `max` (full GEMM tiles).
fn balanced_rows(n: usize, max: usize) -> usize {
    let n = n.max(1);
    let max = max.clamp(1, n);
    let even = n.div_ceil(n.div_ceil(max));
    let aligned = even.next_multiple_of(32);
    if aligned <= max { aligned } else { even }
}

fn row_ranges(n: usize, rows: usize) -> impl Iterator<Item = Range<usize>> {
    (0..n)
        .step_by(rows.max(1))
        .map(move |r0| r0..(r0 + rows.max(1)).min(n))
}

impl BackwardBlocks {
    /// The blocks for `n` tokens, `vocab` entries, hidden size `d` and inputs of `dtype`.
    ///
    /// At the benchmark shapes (8192 tokens, bf16, automatic sizes):
    /// - Gemma-2 (V = 256000, D = 2304): chunks of 672 entries; dE in a second pass over 7
    ///   blocks of 1184 rows and chunks of 2016 entries; working set 36 126 720 bytes, 2.97% of
    ///   dE + dC (1 217 396 736 bytes): peak 1 253 523 456 bytes, 1.030×.
    /// - SmolLM2 (V = 49152, D = 576): chunks of 256 entries (the 2²¹-logit floor); second pass
    ///   over 4 blocks of 2048 rows and chunks of 512 entries; working set 12 877 824 bytes,
    ///   19.5% of dE + dC (66 060 288 bytes): peak 78 938 112 bytes, 1.195×.
    pub fn new(params: &LceParams, n: usize, vocab: usize, d: usize, dtype: DType) -> Self {
        let s = dtype.size();
        let chunk = params.grad_chunk_len(n, vocab, d, dtype);
        let rows_n = n.max(1);
        let logits = 4 * rows_n * chunk;
        // Products no larger than the logits block, which is freed by then.
        let product_rows = balanced_rows(rows_n, logits / (4 * d.max(1)));
        let blocks = |de, rows, pass2_chunk| Self {
            chunk,
            de,
            rows,
            pass2_chunk,
        };
        if !params.accum_fp32 || s >= 4 {
            let rows = params
                .de_block_rows
                .map_or(product_rows, |r| r.clamp(1, rows_n));
            return blocks(DeAccumulation::Direct, rows, chunk);
        }
        let whole = blocks(DeAccumulation::Whole, product_rows, chunk);
        let pass1 = Self::pass1_bytes(rows_n, chunk, d, s);
        let fit = |c2: usize| {
            let per_row = 4 * d + s * c2 + 4 * c2.max(d);
            pass1.saturating_sub(s * c2 * d) / per_row
        };
        // Second-pass chunks of about D entries: the logits GEMM [rows, c2] and the product
        // GEMM [rows, D] then have about as many output tiles.
        let widest = ((d as f64 / chunk as f64).round() as usize).max(1);
        match params.de_block_rows {
            Some(r) if r >= n => whole,
            Some(r) => {
                let k = (1..=widest)
                    .rev()
                    .find(|&k| fit(chunk * k) >= r)
                    .unwrap_or(1);
                blocks(DeAccumulation::RowBlocks, r.max(1), chunk * k)
            }
            None if 4 * rows_n * d <= logits => whole,
            None => {
                let min_rows = rows_n.min(32);
                let k = (1..=widest)
                    .rev()
                    .find(|&k| fit(chunk * k) >= min_rows)
                    .unwrap_or(1);
                let rows = balanced_rows(rows_n, fit(chunk * k).max(min_rows));
                if rows >= rows_n {
                    whole
                } else {
                    blocks(DeAccumulation::RowBlocks, rows, chunk * k)
                }
            }
        }
    }

    /// The vocabulary pass's working set while a chunk's `G` is formed: f32 logits, `G` and
    /// the gathered classifier rows.
    fn pass1_bytes(n: usize, chunk: usize, d: usize, s: usize) -> usize {
        (4 + s) * n * chunk + s * chunk * d
    }

    /// Bytes the backward holds at its peak besides its inputs, dE and dC, and the `O(n + V)`
    /// vectors (log-sum-exp, scores, ids), for `n` tokens, hidden size `d` and inputs of
    /// `dtype`, with or without a bias. Gathered chunks are assumed (a natural chunk's
    /// classifier rows are a view).
    pub fn working_bytes(&self, n: usize, d: usize, dtype: DType, bias: bool) -> usize {
        let s = dtype.size();
        let (c, rows) = (self.chunk, self.rows);
        let g = s * n * c;
        let classifier = s * c * d;
        let at_grad = Self::pass1_bytes(n, c, d, s);
        // After G is formed (the logits are freed): dE products (or the second pass), the dC
        // rows, and with a bias G's f32 copy for db.
        let product = match self.de {
            DeAccumulation::RowBlocks => 0,
            _ => 4 * rows * d,
        };
        let mut after = product.max(classifier);
        if bias {
            after = after.max(4 * n * c);
        }
        let pass1 = at_grad.max(g + classifier + after);
        match self.de {
            DeAccumulation::Direct => pass1,
            // The accumulator lives through the pass, then beside the rounded dE.
            DeAccumulation::Whole => 4 * n * d + pass1,
            DeAccumulation::RowBlocks => {
                let c2 = self.pass2_chunk;
                let pass2 = 4 * rows * d + s * c2 * d + s * rows * c2 + 4 * rows * c2.max(d);
                pass1.max(pass2)
            }
        }
    }
}

/// Counts of the backward's vocabulary plan, for logs and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanStats {
    /// Vocabulary entries whose gradient was computed.
    pub entries: usize,
    /// Chunks processed.
    pub chunks: usize,
    /// Row blocks of dE's second pass (0: dE was accumulated in the vocabulary pass).
    pub de_row_blocks: usize,
}

thread_local! {
    static LAST_PLAN: std::cell::Cell<Option<PlanStats>> = const { std::cell::Cell::new(None) };
    static PHASES: std::cell::Cell<Option<BackwardPhases>> = const { std::cell::Cell::new(None) };
}

/// The plan of the last chunked backward run on this thread (for benchmarks and logs).
pub fn last_backward_plan() -> Option<PlanStats> {
    LAST_PLAN.with(|last| last.get())
}

/// Wall time of the chunked backward's passes, ms, each ended by a device synchronization.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BackwardPhases {
    /// The scoring pass (recomputed logits, per-entry scores read back, the plan).
    pub scoring_ms: f64,
    /// The vocabulary pass: dC, and dE where it is accumulated there.
    pub vocabulary_ms: f64,
    /// dE's second pass over row blocks ([`DeAccumulation::RowBlocks`]), else 0.
    pub de_pass_ms: f64,
}

/// Runs `run` with the chunked backward timing its passes (it synchronizes the device between
/// them, which the untimed backward does not) and returns the last backward's phases, if one
/// ran. For benchmarks.
pub fn time_backward_phases(run: impl FnOnce()) -> Option<BackwardPhases> {
    PHASES.with(|p| p.set(Some(BackwardPhases::default())));
    run();
    PHASES
        .with(|p| p.take())
        .filter(|p| p.scoring_ms + p.vocabulary_ms > 0.0)
}

/// Marks the end of a backward pass when phases are timed: synchronizes `device` and records
/// the time since the previous mark in the field `pick` selects.
struct PhaseClock(Option<std::time::Instant>);

impl PhaseClock {
    fn start<B: burn::tensor::backend::Backend>(device: &B::Device) -> Self {
        let on = PHASES.with(|p| p.get()).is_some();
        Self(on.then(|| {
            let _ = B::sync(device);
            std::time::Instant::now()
        }))
    }

    fn lap<B: burn::tensor::backend::Backend>(
        &mut self,
        device: &B::Device,
        pick: fn(&mut BackwardPhases) -> &mut f64,
    ) {
        if let Some(t0) = self.0 {
            let _ = B::sync(device);
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            PHASES.with(|p| {
                p.set(p.get().map(|mut ph| {
                    *pick(&mut ph) = ms;
                    ph
                }))
            });
            self.0 = Some(std::time::Instant::now());
        }
    }
}

fn prim<R, F, I, BT>(t: &Tensor<Cb<R, F, I, BT>, 2>) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    t.clone().into_primitive().tensor()
}

/// A zero matrix without row padding. CubeCL's CUDA runtime gives a new 2-D tensor rows pitched
/// to 512 bytes: SmolLM2's bf16 rows of 576 values (1152 bytes) would take 1536, a third more
/// for dE and dC (H100, 2026-11-26). A 1-D allocation is not pitched, and its reshape is a view.
fn dense_zeros<R, F, I, BT>(
    [rows, cols]: [usize; 2],
    dtype: DType,
    device: &burn::tensor::Device<Cb<R, F, I, BT>>,
) -> Tensor<Cb<R, F, I, BT>, 2>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    Tensor::<Cb<R, F, I, BT>, 1>::zeros([rows * cols], (device, dtype)).reshape([rows, cols])
}

/// See [`crate::CceBackend::linear_ce_backward`]; the passes and their memory are described in
/// the module docs and [`BackwardBlocks`].
#[allow(clippy::too_many_arguments)]
pub fn backward<R, F, I, BT>(
    e: FloatTensor<Cb<R, F, I, BT>>,
    c: FloatTensor<Cb<R, F, I, BT>>,
    bias: Option<FloatTensor<Cb<R, F, I, BT>>>,
    targets: IntTensor<Cb<R, F, I, BT>>,
    lse: FloatTensor<Cb<R, F, I, BT>>,
    dout: FloatTensor<Cb<R, F, I, BT>>,
    params: &LceParams,
) -> crate::LceGrads<Cb<R, F, I, BT>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let e = float::<R, F, I, BT, 2>(e);
    let c = float::<R, F, I, BT, 2>(c);
    let [n, d] = e.dims();
    let [vocab, _] = c.dims();
    let device = e.device();
    let (e_dtype, c_dtype) = (e.dtype(), c.dtype());
    let blocks = BackwardBlocks::new(params, n, vocab, d, e_dtype);
    let mut clock = PhaseClock::start::<Cb<R, F, I, BT>>(&device);

    let scored = params.filter_eps.map(|eps| {
        (
            scores(
                &e,
                &c,
                &bias,
                &targets,
                &lse,
                params.chunk_len(n, vocab, d, e_dtype),
                params.softcap,
                params.gemm,
                params.tf32,
            ),
            eps,
        )
    });
    let plan = plan(
        scored.as_ref().map(|(s, eps)| (s.as_slice(), *eps)),
        vocab,
        blocks.chunk,
        params.sort_vocab,
    );
    let two_pass = blocks.de == DeAccumulation::RowBlocks && !plan.is_empty();
    let stats = PlanStats {
        entries: plan
            .iter()
            .map(|p| match p {
                Plan::Natural(r) => r.len(),
                Plan::Gathered(ids) => ids.len(),
            })
            .sum(),
        chunks: plan.len(),
        de_row_blocks: if two_pass { n.div_ceil(blocks.rows) } else { 0 },
    };
    log::debug!("burn-cce backward: {stats:?} of {vocab} entries, {blocks:?}");
    LAST_PLAN.with(|last| last.set(Some(stats)));
    clock.lap::<Cb<R, F, I, BT>>(&device, |p| &mut p.scoring_ms);

    // dE is allocated once and written in place: no `N × D` temporaries beside it, except the
    // f32 accumulator of `DeAccumulation::Whole`, which is kept only when it is small.
    let (de, acc) = match blocks.de {
        DeAccumulation::Whole => (
            None,
            Some(dense_zeros::<R, F, I, BT>([n, d], DType::F32, &device)),
        ),
        _ => (
            Some(dense_zeros::<R, F, I, BT>([n, d], e_dtype, &device)),
            None,
        ),
    };
    if let Some(t) = de.as_ref().or(acc.as_ref()) {
        mark(t, "dE");
    }
    let mut dc = dense_zeros::<R, F, I, BT>([vocab, d], c_dtype, &device);
    let mut db = bias
        .as_ref()
        .map(|_| Tensor::<Cb<R, F, I, BT>, 1>::zeros([vocab], (&device, DType::F32)));
    mark(&dc, "gradients");
    // The vocabulary pass's dE target, when dE is accumulated there.
    let de_target = match blocks.de {
        DeAccumulation::Direct => de.clone(),
        DeAccumulation::Whole => acc.clone(),
        DeAccumulation::RowBlocks => None,
    };

    for plan_part in &plan {
        let part = Part::<R, F, I, BT>::new(plan_part, &device);
        let (c_chunk, ids, v0) = part.classifier_rows(&c);
        mark(&c_chunk, "classifier rows");
        let logits = matmul_to(
            e.clone(),
            c_chunk.clone().transpose(),
            DType::F32,
            params.gemm,
            params.tf32,
            "logits",
        );
        let g = float::<R, F, I, BT, 2>(grad_chunk(
            logits.clone().into_primitive().tensor(),
            bias.clone(),
            lse.clone(),
            dout.clone(),
            targets.clone(),
            ids,
            v0,
            0,
            params.softcap,
            e_dtype,
        ));
        mark(&g, "G");
        drop(logits);
        if let Some(target) = &de_target {
            for rows in row_ranges(n, blocks.rows) {
                let product = matmul_to(
                    g.clone().slice(rows.clone()),
                    c_chunk.clone(),
                    DType::F32,
                    params.gemm,
                    params.tf32,
                    "dE product",
                );
                add_rows(&prim(target), prim(&product), rows.start);
            }
        }
        let dc_chunk = matmul_to(
            g.clone().transpose(),
            e.clone(),
            c_dtype,
            params.gemm,
            params.tf32,
            "dC chunk",
        );
        let db_chunk = db.as_ref().map(|_| {
            let len = g.dims()[1];
            let g32 = g.clone().cast(DType::F32);
            mark(&g32, "G f32");
            let sum = g32.clone().sum_dim(0).reshape([len]);
            mark(&sum, "db chunk");
            sum
        });
        match part {
            Part::Natural(range) => {
                dc = dc.slice_assign([range.clone(), 0..d], dc_chunk);
                db = db
                    .zip(db_chunk)
                    .map(|(db, x)| db.slice_assign([range.clone()], x));
            }
            Part::Gathered(ids) => {
                dc = dc.select_assign(0, ids.clone(), dc_chunk, IndexingUpdateOp::Add);
                db = db
                    .zip(db_chunk)
                    .map(|(db, x)| db.select_assign(0, ids, x, IndexingUpdateOp::Add));
            }
        }
        mark(&dc, "dC chunk written");
    }
    clock.lap::<Cb<R, F, I, BT>>(&device, |p| &mut p.vocabulary_ms);

    if two_pass && let Some(de) = &de {
        let parts: Vec<Part<R, F, I, BT>> = regroup(&plan, blocks.pass2_chunk)
            .iter()
            .map(|p| Part::new(p, &device))
            .collect();
        for rows in row_ranges(n, blocks.rows) {
            let e_rows = e.clone().slice(rows.clone());
            let mut block_acc: Option<Tensor<Cb<R, F, I, BT>, 2>> = None;
            for part in &parts {
                let (c_chunk, ids, v0) = part.classifier_rows(&c);
                mark(&c_chunk, "dE pass: classifier rows");
                let logits = matmul_to(
                    e_rows.clone(),
                    c_chunk.clone().transpose(),
                    DType::F32,
                    params.gemm,
                    params.tf32,
                    "dE pass: logits",
                );
                let g = float::<R, F, I, BT, 2>(grad_chunk(
                    logits.clone().into_primitive().tensor(),
                    bias.clone(),
                    lse.clone(),
                    dout.clone(),
                    targets.clone(),
                    ids,
                    v0,
                    rows.start,
                    params.softcap,
                    e_dtype,
                ));
                mark(&g, "dE pass: G");
                drop(logits);
                let product = matmul_to(
                    g,
                    c_chunk,
                    DType::F32,
                    params.gemm,
                    params.tf32,
                    "dE pass: product",
                );
                block_acc = Some(match block_acc {
                    None => product,
                    Some(block_acc) => {
                        add_rows(&prim(&block_acc), prim(&product), 0);
                        block_acc
                    }
                });
            }
            if let Some(block_acc) = block_acc {
                add_rows(&prim(de), prim(&block_acc), rows.start);
            }
        }
    }

    clock.lap::<Cb<R, F, I, BT>>(&device, |p| &mut p.de_pass_ms);
    let de = match (de, acc) {
        (Some(de), _) => de,
        (None, Some(acc)) => {
            let de = acc.clone().cast(e_dtype);
            mark(&de, "dE rounded");
            de
        }
        (None, None) => unreachable!("dE or its accumulator is allocated"),
    };
    let bias_dtype = bias.as_ref().map(|b| b.dtype);
    (
        de.into_primitive().tensor(),
        dc.into_primitive().tensor(),
        db.zip(bias_dtype)
            .map(|(db, dt)| db.cast(dt).into_primitive().tensor()),
    )
}
