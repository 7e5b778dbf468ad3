//! The chunked backward's passes over the vocabulary ([`Backward`]): the scoring pass and plan,
//! the vocabulary pass (`G`, dC, and dE where it is carried there), and dE's second pass over
//! row blocks.

use burn::backend::ops::{FloatTensorOps, IntTensorOps};
use burn::tensor::{DType, IntDType, Shape, Slice, TensorData};
use burn_cubecl::{CubeDevice, tensor::CubeTensor};
use std::cell::Cell;
use std::ops::Range;

use super::{Cb, Plan, dims1, plan, regroup, scores, zeros};
use crate::blocks::{BackwardBlocks, DeAccumulation, row_ranges};
use crate::diagnostics::{LAST_PLAN, PlanStats};
use crate::epilogue;
use crate::gemm::{cast, dims2, matmul_to, rows_of, transpose};
use crate::kernels::{accumulate::add_rows, grad::grad_chunk, scatter::add_rows_at};
use crate::live;
use crate::{GemmStrategy, LceParams};

/// A chunk's classifier rows, its ids when gathered, and its first entry's id when natural.
type ChunkRows = (CubeTensor, Option<CubeTensor>, usize);

/// A plan chunk ready to run: its entries' ids on the device when gathered.
enum Part {
    Natural(Range<usize>),
    /// The ids, an int tensor of the targets' dtype (boxed: a tensor handle is large).
    Gathered(Box<CubeTensor>),
}

impl Part {
    fn new(plan: &Plan, targets: &CubeTensor) -> Self {
        match plan {
            Plan::Natural(range) => Part::Natural(range.clone()),
            Plan::Gathered(ids) => Part::Gathered(Box::new(Cb::int_from_data(
                TensorData::new(ids.clone(), [ids.len()]).convert_dtype(targets.dtype),
                &targets.device,
            ))),
        }
    }

    /// The chunk's classifier rows (a view when natural, a gathered copy otherwise), its ids
    /// when gathered, and the first entry's id when natural.
    fn classifier_rows(&self, c: &CubeTensor) -> ChunkRows {
        match self {
            Part::Natural(range) => (rows_of(c.clone(), range.clone()), None, range.start),
            Part::Gathered(ids) => (
                Cb::float_select(c.clone(), 0, (**ids).clone()),
                Some((**ids).clone()),
                0,
            ),
        }
    }
}

/// A zero matrix without row padding. CubeCL's CUDA runtime gives a new 2-D tensor rows pitched
/// to 512 bytes: SmolLM2's bf16 rows of 576 values (1152 bytes) would take 1536, a third more
/// for dE and dC (H100, 2026-11-26). A 1-D allocation is not pitched, and its reshape is a view.
pub(super) fn dense_zeros(
    [rows, cols]: [usize; 2],
    dtype: DType,
    device: &CubeDevice,
) -> CubeTensor {
    Cb::float_reshape(
        zeros([rows * cols], dtype, device),
        Shape::new([rows, cols]),
    )
}

/// The inputs of the backward's passes.
pub(super) struct Backward<'a> {
    pub(super) e: &'a CubeTensor,
    pub(super) c: &'a CubeTensor,
    pub(super) bias: &'a Option<CubeTensor>,
    pub(super) targets: &'a CubeTensor,
    pub(super) lse: &'a CubeTensor,
    pub(super) dout: &'a CubeTensor,
    pub(super) params: &'a LceParams,
    /// Where the Hopper GEMM writes `G` ([`BackwardBlocks::in_gemm`]): its inputs.
    pub(super) in_gemm: Option<epilogue::GradArgs<'a>>,
    /// Whether the Hopper GEMM's adding store still runs (it failed at its first launch).
    pub(super) adds: Cell<bool>,
}

/// Where the vocabulary pass puts each chunk's dE product `G · C_chunk`.
pub(super) enum DeTarget<'a> {
    /// Nowhere: dE takes the second pass ([`DeAccumulation::RowBlocks`]).
    Later,
    /// Stored in f32 in blocks of `rows` rows, each added by its own kernel into dE
    /// ([`DeAccumulation::Direct`]) or its f32 accumulator ([`DeAccumulation::Whole`]).
    Rows(&'a CubeTensor, usize),
    /// Added by the Hopper GEMM into dE and its i8 corrections
    /// ([`DeAccumulation::Compensated`]).
    Compensated(&'a CubeTensor, &'a CubeTensor),
}

/// The corrections of a compensated dE ([`DeAccumulation::Compensated`]): `[n, d]` i8 zeros,
/// unpadded (see [`dense_zeros`]).
pub(super) fn corrections([rows, cols]: [usize; 2], device: &CubeDevice) -> CubeTensor {
    Cb::int_reshape(
        Cb::int_zeros(Shape::new([rows * cols]), device, IntDType::I8),
        Shape::new([rows, cols]),
    )
}

impl Backward<'_> {
    /// `G` of one chunk: the logits of `e_rows` (rows `row0..` of `e`) against `c_chunk`
    /// (entries `ids`, or from `v0` when natural), turned into the loss's gradient. The live
    /// memory is read (`g_step`) while the logits and `G` are both alive, the chunk's peak.
    fn g(
        &self,
        e_rows: CubeTensor,
        c_chunk: &CubeTensor,
        (ids, v0): (Option<CubeTensor>, usize),
        row0: usize,
        gemm: GemmStrategy,
        [logits_step, g_step]: [&'static str; 2],
    ) -> CubeTensor {
        if let Some(args) = &self.in_gemm
            && let Some(g) = epilogue::grad(&e_rows, c_chunk, args, (ids.as_ref(), v0), row0)
        {
            live::sample(&g, g_step);
            return g;
        }
        let p = self.params;
        let logits = matmul_to(
            e_rows,
            transpose(c_chunk.clone()),
            DType::F32,
            gemm,
            p.tf32,
            logits_step,
        );
        let g = grad_chunk(
            logits.clone(),
            self.bias.clone(),
            self.lse.clone(),
            self.dout.clone(),
            self.targets.clone(),
            ids,
            v0,
            row0,
            p.softcap,
            self.e.dtype,
        );
        live::sample(&g, g_step);
        drop(logits);
        g
    }

    /// The scoring pass (when filtering) and the vocabulary plan; whether dE takes the second
    /// pass over row blocks.
    pub(super) fn plan(
        &self,
        blocks: &BackwardBlocks,
        n: usize,
        vocab: usize,
        d: usize,
    ) -> (Vec<Plan>, bool) {
        let p = self.params;
        let scored = p.filter_eps.map(|eps| {
            let chunk = p.chunk_len(n, vocab, d, self.e.dtype);
            let (e, c) = (self.e, self.c);
            (
                scores(
                    e,
                    c,
                    self.bias,
                    self.targets,
                    self.lse,
                    chunk,
                    p.softcap,
                    p.gemm,
                    p.tf32,
                ),
                eps,
            )
        });
        let plan = plan(
            scored.as_ref().map(|(s, eps)| (s.as_slice(), *eps)),
            vocab,
            blocks.chunk,
            p.sort_vocab,
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
            blocks: Some(*blocks),
        };
        log::debug!("burn-cce backward: {stats:?} of {vocab} entries, {blocks:?}");
        LAST_PLAN.replace(Some(stats));
        (plan, two_pass)
    }

    /// The vocabulary pass: per plan chunk, `G`, its dC rows (and db), and `G · C_chunk` put
    /// into `de` ([`DeTarget`]). Returns dC, db, and `false` where a compensated dE could not be
    /// carried (the Hopper GEMM refused or failed the adding store: dE is then incomplete).
    pub(super) fn vocabulary_pass(
        &self,
        plan: &[Plan],
        de: DeTarget,
        mut dc: CubeTensor,
        mut db: Option<CubeTensor>,
    ) -> (CubeTensor, Option<CubeTensor>, bool) {
        let (p, e) = (self.params, self.e);
        let [n, d] = dims2(e);
        let vocab = dims2(self.c)[0];
        let mut carried = true;
        for plan_part in plan {
            let part = Part::new(plan_part, self.targets);
            let (c_chunk, ids, v0) = part.classifier_rows(self.c);
            live::sample(&c_chunk, "classifier rows");
            let g = self.g(e.clone(), &c_chunk, (ids, v0), 0, p.gemm, ["logits", "G"]);
            match de {
                DeTarget::Rows(target, rows_per_block) => {
                    for rows in row_ranges(n, rows_per_block) {
                        let g_rows = rows_of(g.clone(), rows.clone());
                        let product = matmul_to(
                            g_rows,
                            c_chunk.clone(),
                            DType::F32,
                            p.gemm,
                            p.tf32,
                            "dE product",
                        );
                        add_rows(target, product, rows.start);
                    }
                }
                DeTarget::Compensated(sum, fix) if carried => {
                    carried = matches!(
                        epilogue::add_compensated(&g, &c_chunk, sum, fix),
                        epilogue::Added::Yes
                    );
                }
                DeTarget::Compensated(..) | DeTarget::Later => {}
            }
            let dc_chunk = matmul_to(
                transpose(g.clone()),
                e.clone(),
                dc.dtype,
                p.gemm,
                p.tf32,
                "dC chunk",
            );
            let db_chunk = db.as_ref().map(|_| {
                let [_, len] = dims2(&g);
                let g32 = cast(g.clone(), DType::F32);
                live::sample(&g32, "G f32");
                let sum = Cb::float_reshape(Cb::float_sum_dim(g32.clone(), 0), Shape::new([len]));
                live::sample(&sum, "db chunk");
                sum
            });
            match part {
                Part::Natural(range) => {
                    dc = Cb::float_slice_assign(
                        dc,
                        &[Slice::from(range.clone()), Slice::from(0..d)],
                        dc_chunk,
                    );
                    db = db.zip(db_chunk).map(|(db, x)| {
                        Cb::float_slice_assign(db, &[Slice::from(range.clone())], x)
                    });
                }
                Part::Gathered(ids) => {
                    // In place, one unit per value (Burn's select_assign would round-trip all of
                    // a half-precision dC through f32 per chunk; see kernels::scatter).
                    add_rows_at(&dc, dc_chunk, (*ids).clone());
                    if let (Some(db), Some(x)) = (&db, db_chunk) {
                        let len = dims1(&x);
                        let column =
                            |t: CubeTensor, rows| Cb::float_reshape(t, Shape::new([rows, 1]));
                        add_rows_at(&column(db.clone(), vocab), column(x, len), *ids);
                    }
                }
            }
            live::sample(&dc, "dC chunk written");
        }
        (dc, db, carried)
    }

    /// dE's second pass ([`DeAccumulation::RowBlocks`]): per block of rows, `G · C_chunk` of
    /// every kept chunk summed in an f32 accumulator, added into `de` once.
    ///
    /// Its GEMMs take the same kernel as the other passes'. (Until 2026-12-06 they took cubek's
    /// `SimpleTma`, chosen before core had a Hopper kernel: at the Gemma-2 shape with the
    /// paper's filter its `[1184 × 2304] · [2304 × 2016]` products ran at ~90 TFLOP/s, and
    /// loss + gradient took 87.3 ms against 68.9 with the Hopper kernel; H100, same run.)
    pub(super) fn de_pass(&self, plan: &[Plan], blocks: &BackwardBlocks, de: &CubeTensor) {
        let [n, _] = dims2(self.e);
        let parts: Vec<Part> = regroup(plan, blocks.pass2_chunk)
            .iter()
            .map(|p| Part::new(p, self.targets))
            .collect();
        for rows in row_ranges(n, blocks.rows) {
            let block_acc = match self.adds.get() {
                true => self.de_block_added(&parts, rows.clone()),
                false => None,
            };
            if let Some(block_acc) = block_acc.or_else(|| self.de_block(&parts, rows.clone())) {
                add_rows(de, block_acc, rows.start);
            }
        }
    }

    /// The f32 sum `Σ G[rows] · C_chunk` over `parts` of one row block, each product added by
    /// the Hopper GEMM into the block's accumulator; `None` where its adding store failed at
    /// its first launch (the block is then summed again by [`Backward::de_block`]).
    fn de_block_added(&self, parts: &[Part], rows: Range<usize>) -> Option<CubeTensor> {
        let d = dims2(self.e)[1];
        let e_rows = rows_of(self.e.clone(), rows.clone());
        let block_acc = dense_zeros([rows.len(), d], DType::F32, &self.e.device);
        live::sample(&block_acc, "dE pass: accumulator");
        for part in parts {
            let (g, c_chunk) = self.block_g(part, &e_rows, rows.start);
            match epilogue::add_product(&g, &c_chunk, &block_acc) {
                epilogue::Added::Yes => {}
                epilogue::Added::Unsupported => {
                    let product = self.product(g, c_chunk);
                    add_rows(&block_acc, product, 0);
                }
                epilogue::Added::Failed => {
                    self.adds.set(false);
                    return None;
                }
            }
        }
        Some(block_acc)
    }

    /// `G` of `part` for the row block `e_rows` (from token `row0`), and the part's classifier
    /// rows.
    fn block_g(&self, part: &Part, e_rows: &CubeTensor, row0: usize) -> (CubeTensor, CubeTensor) {
        let (c_chunk, ids, v0) = part.classifier_rows(self.c);
        live::sample(&c_chunk, "dE pass: classifier rows");
        let g = self.g(
            e_rows.clone(),
            &c_chunk,
            (ids, v0),
            row0,
            self.params.gemm,
            ["dE pass: logits", "dE pass: G"],
        );
        (g, c_chunk)
    }

    /// `g · c_chunk` in f32, by the chunk GEMMs' kernel.
    fn product(&self, g: CubeTensor, c_chunk: CubeTensor) -> CubeTensor {
        let p = self.params;
        matmul_to(g, c_chunk, DType::F32, p.gemm, p.tf32, "dE pass: product")
    }

    /// As [`Backward::de_block_added`], each product stored and added by its own kernel (the
    /// first product is the accumulator); `None` for no parts.
    fn de_block(&self, parts: &[Part], rows: Range<usize>) -> Option<CubeTensor> {
        let e_rows = rows_of(self.e.clone(), rows.clone());
        let mut block_acc: Option<CubeTensor> = None;
        for part in parts {
            let (g, c_chunk) = self.block_g(part, &e_rows, rows.start);
            let product = self.product(g, c_chunk);
            block_acc = Some(match block_acc {
                None => product,
                Some(block_acc) => {
                    add_rows(&block_acc, product, 0);
                    block_acc
                }
            });
        }
        block_acc
    }
}
