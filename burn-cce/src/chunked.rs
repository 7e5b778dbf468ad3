//! Linear cross-entropy on `CubeBackend`: the vocabulary is walked in chunks; each chunk's
//! logits (f32) come from a GEMM (core's Hopper kernel or cubek's; on the matrix units, with f32
//! output from f16/bf16 inputs) and are consumed at once by the CubeCL kernels in
//! [`crate::kernels`]. At most one chunk of logits exists at a time, never `n × V`.
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
//! when it is accumulated in its own dtype or the f32 accumulator is small; where the Hopper
//! GEMM runs the chunks (bf16) and it is asked for, carried compensated in the same pass (dE
//! plus an i8 correction per value, [`crate::DeCarry::Compensated`]); otherwise in a second
//! pass over blocks of rows, each block's f32 accumulator summed over the kept chunks and
//! rounded into dE once (the same f32 accumulation as one `N × D` accumulator).
//!
//! # Memory
//!
//! Beside the inputs, the backward holds dE and dC (the lower bound) plus one chunk's working
//! set, sized by [`BackwardBlocks`] to about 3% of the bound (automatic `chunk_bytes`), and
//! `O(N + V)` vectors. With 8192 tokens in bf16, loss + gradient, default options:
//!
//! | shape | dE + dC | before (single pass, f32 dE + its product) | now |
//! |---|---:|---:|---:|
//! | Gemma-2, V = 256000, D = 2304 | 1 217 396 736 B | 1 352 138 752 B (1.111×) | 1 250 426 880 B (1.027×) |
//! | Gemma-2, `G` in the Hopper GEMM, f32 carry (default) | 1 217 396 736 B | | 1 253 670 912 B (1.030×) |
//! | Gemma-2, `G` in the Hopper GEMM, compensated carry (opt-in) | 1 217 396 736 B | | 1 275 232 256 B (1.048×) |
//! | SmolLM2, V = 49152, D = 576 | 66 060 288 B | 127 008 768 B (1.923×) | 78 643 200 B (1.190×) |
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
//! Where the chunk GEMMs take core's Hopper kernel (f16/bf16 on sm90, aligned operands), the
//! forward's log-sum-exp and the scoring pass's filter scores are reduced inside that GEMM
//! ([`crate::epilogue`]): those two passes write no logit. The backward's passes there take
//! `G` straight from that GEMM's tile (in the inputs' dtype), and dE's second pass adds each
//! chunk's product into its f32 block inside the GEMM ([`BackwardBlocks::in_gemm`]): no f32
//! logits and no f32 product are stored, so the chunks are 2.6× wider at the same memory and
//! the second pass's chunks 3× wider ([`BackwardBlocks::filled`]). With bf16 inputs and
//! [`crate::DeCarry::Compensated`] the second pass goes: dE is carried compensated in the
//! vocabulary pass, each chunk's product added by the GEMM's compensated store into dE and its
//! corrections (4 full-vocabulary products in all instead of 5; not the default, see
//! [`crate::DeCarry::Auto`]). Elsewhere each chunk's f32
//! logits are stored and `G` formed from them by its own kernel. Filtering skips work at
//! entry/chunk granularity.
//!
//! [`forward`] and [`backward`] take unfused `CubeTensor`s and use `CubeBackend`'s primitive
//! ops besides the kernels ([`crate::CceKernels`]'s `CubeBackend` implementation calls them).
//! Under Burn's fusion each call is one custom operation of the fused stream, executed when an
//! output is read or the device synchronizes, on the device's thread for the caller's stream:
//! [`last_backward_plan`], [`time_backward_phases`] and the live-memory readings are kept per
//! stream, not per thread, for that reason.

use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, FloatDType, Shape, read_sync};
use burn_cubecl::{CubeBackend, CubeDevice, tensor::CubeTensor};
use std::cell::Cell;
use std::ops::Range;

pub use crate::blocks::{BackwardBlocks, DeAccumulation};
use crate::diagnostics::PhaseClock;
use crate::epilogue;
use crate::gemm::{cast, classifier_t, dims2, matmul_to};
use crate::kernels::fused;
use crate::kernels::{indexed_dot::indexed_dot, lse_chunk::lse_chunk, score};
use crate::live;
use crate::{DeCarry, GemmStrategy, LceParams};

mod passes;
use passes::{Backward, DeTarget, corrections, dense_zeros};

type Cb = CubeBackend;

fn zeros<const D: usize>(shape: [usize; D], dtype: DType, device: &CubeDevice) -> CubeTensor {
    Cb::float_zeros(Shape::new(shape), device, FloatDType::from(dtype))
}

fn chunks(vocab: usize, chunk: usize) -> impl Iterator<Item = Range<usize>> {
    (0..vocab)
        .step_by(chunk)
        .map(move |v0| v0..(v0 + chunk).min(vocab))
}

/// See [`crate::CceKernels::linear_ce_forward`]; `bias` as in
/// [`crate::CceKernels::linear_ce_forward_bias`].
///
/// # Shapes
/// - `e`: `[n, D]`, `c`: `[V, D]`, `bias`: `[V]`, `targets`: `[n]`
/// - returns `(lse [n], target_logit [n])`, f32
pub fn forward(
    e: CubeTensor,
    c: CubeTensor,
    bias: Option<CubeTensor>,
    targets: CubeTensor,
    params: &LceParams,
) -> (CubeTensor, CubeTensor) {
    if fused::wanted(params, bias.is_some(), "forward")
        && let Some(lse) = fused::forward(e.clone(), c.clone(), params.softcap)
    {
        live::sample(&lse, "forward state");
        let target_logit = indexed_dot(e, c, None, targets, params.softcap);
        return (lse, target_logit);
    }
    let [n, d] = dims2(&e);
    let [vocab, _] = dims2(&c);
    let device = e.device.clone();
    let chunk = params.chunk_len(n, vocab, d, e.dtype);
    let m = zeros([n], DType::F32, &device);
    let s = zeros([n], DType::F32, &device);
    live::sample(&s, "forward state");
    // Entries folded inside the Hopper GEMM; the rest by stored logits.
    let folded = match epilogue::applies(params.gemm, &e, &c) {
        true => epilogue::fold_lse(&e, &c, &bias, params.softcap, [&m, &s]),
        false => 0,
    };
    for range in chunks(vocab - folded, chunk) {
        let range = folded + range.start..folded + range.end;
        let v0 = range.start;
        let logits = matmul_to(
            e.clone(),
            classifier_t(&c, range),
            DType::F32,
            params.gemm,
            params.tf32,
            "forward logits",
        );
        lse_chunk(logits, bias.clone(), &m, &s, v0, params.softcap);
    }
    let lse = Cb::float_add(m, Cb::float_log(s));
    let target_logit = indexed_dot(e, c, bias, targets, params.softcap);
    live::sample(&target_logit, "target logits");
    (lse, target_logit)
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
fn scores(
    e: &CubeTensor,
    c: &CubeTensor,
    bias: &Option<CubeTensor>,
    targets: &CubeTensor,
    lse: &CubeTensor,
    chunk: usize,
    softcap: Option<f32>,
    gemm: GemmStrategy,
    tf32: bool,
) -> Vec<f32> {
    let [n, _] = dims2(e);
    let [vocab, _] = dims2(c);
    let reduced = epilogue::applies(gemm, e, c)
        .then(|| epilogue::scores(e, c, bias, softcap, lse, targets))
        .flatten();
    if let Some(all) = reduced {
        live::sample(&all, "scores (all)");
        return read_sync(Cb::float_into_data(all))
            .expect("read the scores back")
            .try_into_vec_as::<f32>()
            .expect("scores are f32");
    }
    let parts: Vec<CubeTensor> = chunks(vocab, chunk)
        .map(|range| {
            let v0 = range.start;
            let len = range.len();
            let logits = matmul_to(
                e.clone(),
                classifier_t(c, range),
                DType::F32,
                gemm,
                tf32,
                "scores: logits",
            );
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
            let best = Cb::float_reshape(Cb::float_max_dim(partial, 0), Shape::new([len]));
            live::sample(&best, "scores (max)");
            best
        })
        .collect();
    let all = Cb::float_cat(parts.clone(), 0);
    live::sample(&all, "scores (all)");
    drop(parts);
    debug_assert_eq!(dims1(&all), vocab, "one score per entry ({n} tokens)");
    read_sync(Cb::float_into_data(all))
        .expect("read the scores back")
        .try_into_vec_as::<f32>()
        .expect("scores are f32")
}

fn dims1(t: &CubeTensor) -> usize {
    t.meta.shape()[0]
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

/// See [`crate::CceKernels::linear_ce_backward`] (`bias`: see
/// [`crate::CceKernels::linear_ce_backward_bias`]; `db` is returned with a bias); the passes and
/// their memory are described in the module docs and [`BackwardBlocks`].
#[allow(clippy::too_many_arguments)]
pub fn backward(
    e: CubeTensor,
    c: CubeTensor,
    bias: Option<CubeTensor>,
    targets: CubeTensor,
    lse: CubeTensor,
    dout: CubeTensor,
    params: &LceParams,
) -> (CubeTensor, CubeTensor, Option<CubeTensor>) {
    if fused::wanted(params, bias.is_some(), "backward")
        && let Some((de, dc)) = fused::backward(
            e.clone(),
            c.clone(),
            targets.clone(),
            lse.clone(),
            dout.clone(),
            params.softcap,
            params.filter_eps,
        )
    {
        live::sample(&dc, "gradients");
        return (de, dc, None);
    }
    let [n, d] = dims2(&e);
    let [vocab, _] = dims2(&c);
    let device = e.device.clone();
    let (e_dtype, c_dtype) = (e.dtype, c.dtype);
    // `G` from the Hopper GEMM's epilogue where the chunk GEMMs take that kernel.
    let in_gemm = epilogue::applies(params.gemm, &e, &c);
    let bias32 = in_gemm.then(|| epilogue::bias_f32(&bias)).flatten();
    let sms = e.client.properties().hardware.num_streaming_multiprocessors;
    let fill = |b: BackwardBlocks| b.filled(n, d, e_dtype, sms.unwrap_or(0) as usize);
    let blocks = fill(BackwardBlocks::new(params, n, vocab, d, e_dtype, in_gemm));
    if params.de_carry == DeCarry::Compensated && blocks.de != DeAccumulation::Compensated {
        log::info!(
            "burn-cce: dE carried in f32, not compensated ({e_dtype:?} inputs, Hopper GEMM: \
             {in_gemm}, accum_fp32: {}, de_block_rows: {:?})",
            params.accum_fp32,
            params.de_block_rows
        );
    }
    let mut clock = PhaseClock::start(&device);
    let pass = Backward {
        e: &e,
        c: &c,
        bias: &bias,
        targets: &targets,
        lse: &lse,
        dout: &dout,
        params,
        in_gemm: in_gemm.then_some(epilogue::GradArgs {
            bias: bias32.as_ref(),
            softcap: params.softcap,
            lse: &lse,
            dout: &dout,
            targets: &targets,
        }),
        adds: Cell::new(in_gemm),
    };
    let (plan, two_pass) = pass.plan(&blocks, n, vocab, d);
    clock.lap(&device, |p| &mut p.scoring_ms);

    // dE is allocated once and written in place: no `N × D` temporaries beside it, except the
    // f32 accumulator of `DeAccumulation::Whole`, which is kept only when it is small, and the
    // i8 corrections of `DeAccumulation::Compensated`.
    let (mut de, acc) = match blocks.de {
        DeAccumulation::Whole => (None, Some(dense_zeros([n, d], DType::F32, &device))),
        _ => (Some(dense_zeros([n, d], e_dtype, &device)), None),
    };
    if let Some(t) = de.as_ref().or(acc.as_ref()) {
        live::sample(t, "dE");
    }
    let fix = (blocks.de == DeAccumulation::Compensated).then(|| corrections([n, d], &device));
    let dc = dense_zeros([vocab, d], c_dtype, &device);
    let db = bias.as_ref().map(|_| zeros([vocab], DType::F32, &device));
    live::sample(&dc, "gradients");
    // Where the vocabulary pass puts dE's products.
    let de_target = match (blocks.de, &de, &acc, &fix) {
        (DeAccumulation::Direct, Some(de), _, _) => DeTarget::Rows(de, blocks.rows),
        (DeAccumulation::Whole, _, Some(acc), _) => DeTarget::Rows(acc, blocks.rows),
        (DeAccumulation::Compensated, Some(de), _, Some(fix)) => DeTarget::Compensated(de, fix),
        _ => DeTarget::Later,
    };
    if let Some(fix) = &fix {
        live::sample(fix, "dE corrections");
    }
    let (dc, db, carried) = pass.vocabulary_pass(&plan, de_target, dc, db);
    clock.lap(&device, |p| &mut p.vocabulary_ms);
    drop(fix);

    if two_pass && let Some(de) = &de {
        pass.de_pass(&plan, &blocks, de);
    } else if !carried && !plan.is_empty() {
        // The compensated store was refused or failed (logged): dE again, in f32 row blocks.
        let f32_carry = LceParams {
            de_carry: DeCarry::F32,
            ..*params
        };
        let again = fill(BackwardBlocks::new(
            &f32_carry, n, vocab, d, e_dtype, in_gemm,
        ));
        let fresh = dense_zeros([n, d], e_dtype, &device);
        pass.de_pass(&plan, &again, &fresh);
        de = Some(fresh);
    }
    clock.lap(&device, |p| &mut p.de_pass_ms);
    let de = match (de, acc) {
        (Some(de), _) => de,
        (None, Some(acc)) => {
            let de = cast(acc.clone(), e_dtype);
            live::sample(&de, "dE rounded");
            de
        }
        (None, None) => unreachable!("dE or its accumulator is allocated"),
    };
    let bias_dtype = bias.as_ref().map(|b| b.dtype);
    (de, dc, db.zip(bias_dtype).map(|(db, dt)| cast(db, dt)))
}
