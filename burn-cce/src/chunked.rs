//! Linear cross-entropy on `CubeBackend`: the vocabulary is walked in chunks of `chunk`
//! entries; each chunk's logits (`n × chunk`, f32) come from Burn's autotuned matmul (cubek,
//! on the matrix units, with f32 output from f16/bf16 inputs) and are consumed at once by the
//! CubeCL kernels in [`crate::kernels`]. At most one chunk of logits exists at a time, never
//! `n × V`.
//!
//! Forward: per chunk, fold the logits into running `(max, Σexp)` per token; the target
//! logits come from an indexed dot product.
//!
//! Backward with filtering: a scoring pass recomputes each chunk and records, per vocabulary
//! entry, the largest `|softmax − onehot|` over all tokens. Entries below `filter_eps` are
//! dropped. With `sort_vocab` the remaining entries are gathered into dense chunks (ordered by
//! score); without it, whole natural-order chunks with no remaining entry are skipped. Each
//! processed chunk then recomputes its logits, forms `G` ([`crate::kernels::grad`]), adds
//! `G·C_chunk` into dE and writes `Gᵀ·E` into its dC rows.
//!
//! This trades a fused GEMM-with-epilogue kernel (the paper's) for cubek's tuned GEMM plus a
//! separate epilogue pass over a chunk that stays small (default 32 MiB): the logits make one
//! round trip through memory per chunk, and filtering skips work at entry/chunk granularity.

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
            simple_unit::SimpleUnitSelectionArgs,
        },
    },
    std::InputBinding,
};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::kernels::{grad::grad_chunk, indexed_dot::indexed_dot, lse_chunk::lse_chunk, score};
use crate::{GemmStrategy, LceParams};

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
    if strategy == GemmStrategy::Fixed
        && let Some(out) = fixed_gemm(l.clone(), r.clone(), dtype)
    {
        return float(out);
    }
    match matmul(l, r, None, MatmulStrategy::default(), dtype) {
        Ok(out) => float(out),
        Err(err) => {
            if !WARNED.swap(true, Ordering::Relaxed) {
                log::warn!(
                    "burn-cce: mixed-precision matmul unavailable ({err:?}); casting the inputs"
                );
            }
            lhs.cast(dtype).matmul(rhs.cast(dtype))
        }
    }
}

/// The [`GemmStrategy::Fixed`] kernel for `lhs · rhs`, or `None` where the runtime cannot run
/// it (checked at setup, before anything is launched); the caller then autotunes.
fn fixed_gemm<R: CubeRuntime>(
    lhs: CubeTensor<R>,
    rhs: CubeTensor<R>,
    dtype: DType,
) -> Option<CubeTensor<R>> {
    let [m, k] = lhs.meta.shape().dims::<2>();
    let [_, n] = rhs.meta.shape().dims::<2>();
    let in_dtype = lhs.dtype;
    // Tensor-core tiles only where they are the point: half-precision inputs (f32 would run
    // as TF32) and no dimension smaller than a tile.
    let tensor_cores = matches!(in_dtype, DType::F16 | DType::BF16) && m.min(n).min(k) >= 16;
    let unit = Strategy::SimpleUnit(BlueprintStrategy::Inferred(SimpleUnitSelectionArgs {
        tile_size: TileSizeSelection::MinTileSize,
    }));
    let mma = Strategy::DoubleCyclicMma(BlueprintStrategy::Inferred(DoubleBufferingArgs {
        specialized: false,
        tile_matmul: TileMatmulKind::Mma,
    }));
    let candidates = if tensor_cores {
        vec![mma, unit]
    } else {
        vec![unit]
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
    let [n, _] = e.dims();
    let [vocab, _] = c.dims();
    let device = e.device();
    let m = Tensor::<Cb<R, F, I, BT>, 1>::zeros([n], (&device, DType::F32));
    let s = Tensor::<Cb<R, F, I, BT>, 1>::zeros([n], (&device, DType::F32));
    let (m_p, s_p) = (
        m.clone().into_primitive().tensor(),
        s.clone().into_primitive().tensor(),
    );
    for range in chunks(vocab, params.chunk_len(n, vocab)) {
        let v0 = range.start;
        let logits = matmul_to(
            e.clone(),
            c.clone().slice(range).transpose(),
            DType::F32,
            params.gemm,
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
            );
            let partial = score::score_chunk(
                logits.into_primitive().tensor(),
                bias.clone(),
                lse.clone(),
                targets.clone(),
                v0,
                softcap,
            );
            float::<R, F, I, BT, 2>(partial).max_dim(0).reshape([len])
        })
        .collect();
    let all = Tensor::cat(parts, 0);
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

/// Counts of the backward's vocabulary plan, for logs and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanStats {
    /// Vocabulary entries whose gradient was computed.
    pub entries: usize,
    /// Chunks processed.
    pub chunks: usize,
}

thread_local! {
    static LAST_PLAN: std::cell::Cell<Option<PlanStats>> = const { std::cell::Cell::new(None) };
}

/// The plan of the last chunked backward run on this thread (for benchmarks and logs).
pub fn last_backward_plan() -> Option<PlanStats> {
    LAST_PLAN.with(|last| last.get())
}

/// See [`crate::CceBackend::linear_ce_backward`].
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
    let chunk = params.chunk_len(n, vocab);

    let scored = params.filter_eps.map(|eps| {
        (
            scores(
                &e,
                &c,
                &bias,
                &targets,
                &lse,
                chunk,
                params.softcap,
                params.gemm,
            ),
            eps,
        )
    });
    let plan = plan(
        scored.as_ref().map(|(s, eps)| (s.as_slice(), *eps)),
        vocab,
        chunk,
        params.sort_vocab,
    );
    let stats = PlanStats {
        entries: plan
            .iter()
            .map(|p| match p {
                Plan::Natural(r) => r.len(),
                Plan::Gathered(ids) => ids.len(),
            })
            .sum(),
        chunks: plan.len(),
    };
    log::debug!("burn-cce backward: {stats:?} of {vocab} entries, chunk {chunk}");
    LAST_PLAN.with(|last| last.set(Some(stats)));

    let acc_dtype = if params.accum_fp32 {
        DType::F32
    } else {
        e_dtype
    };
    let mut de = Tensor::<Cb<R, F, I, BT>, 2>::zeros([n, d], (&device, acc_dtype));
    let mut dc = Tensor::<Cb<R, F, I, BT>, 2>::zeros([vocab, d], (&device, c_dtype));
    let mut db = bias
        .as_ref()
        .map(|_| Tensor::<Cb<R, F, I, BT>, 1>::zeros([vocab], (&device, DType::F32)));

    for part in plan {
        let (c_chunk, ids, v0) = match &part {
            Plan::Natural(range) => (c.clone().slice(range.clone()), None, range.start),
            Plan::Gathered(ids) => {
                let ids = Tensor::<Cb<R, F, I, BT>, 1, Int>::from_data(
                    TensorData::new(ids.clone(), [ids.len()]),
                    &device,
                );
                (c.clone().select(0, ids.clone()), Some(ids), 0)
            }
        };
        let logits = matmul_to(
            e.clone(),
            c_chunk.clone().transpose(),
            DType::F32,
            params.gemm,
        );
        let g = float::<R, F, I, BT, 2>(grad_chunk(
            logits.into_primitive().tensor(),
            bias.clone(),
            lse.clone(),
            dout.clone(),
            targets.clone(),
            ids.clone().map(|t| t.into_primitive()),
            v0,
            params.softcap,
            e_dtype,
        ));
        de = de + matmul_to(g.clone(), c_chunk, acc_dtype, params.gemm);
        let dc_chunk = matmul_to(g.clone().transpose(), e.clone(), c_dtype, params.gemm);
        let db_chunk = db.as_ref().map(|_| {
            let len = g.dims()[1];
            g.clone().cast(DType::F32).sum_dim(0).reshape([len])
        });
        match (&part, ids) {
            (Plan::Natural(range), _) => {
                dc = dc.slice_assign([range.clone(), 0..d], dc_chunk);
                db = db
                    .zip(db_chunk)
                    .map(|(db, x)| db.slice_assign([range.clone()], x));
            }
            (Plan::Gathered(_), Some(ids)) => {
                dc = dc.select_assign(0, ids.clone(), dc_chunk, IndexingUpdateOp::Add);
                db = db
                    .zip(db_chunk)
                    .map(|(db, x)| db.select_assign(0, ids, x, IndexingUpdateOp::Add));
            }
            (Plan::Gathered(_), None) => unreachable!("gathered chunks carry their ids"),
        }
    }

    let bias_dtype = bias.as_ref().map(|b| b.dtype);
    (
        de.cast(e_dtype).into_primitive().tensor(),
        dc.into_primitive().tensor(),
        db.zip(bias_dtype)
            .map(|(db, dt)| db.cast(dt).into_primitive().tensor()),
    )
}
