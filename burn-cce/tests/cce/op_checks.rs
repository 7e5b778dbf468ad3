//! The backend ops (forward, exact and filtered backward, its blocks and live memory) against
//! the tensor-op reference, and the unfused backend against `Dispatch`.

use burn::backend::Dispatch;
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_cce::{
    CceKernels, DeCarry, FilterEps, LceParams,
    diagnostics::{DeAccumulation, last_backward_plan},
    reference,
};
use burn_cce::{HOPPER_LSE_LAUNCHES, REDUCTION_CHUNK};
use burn_kernels_core::gemm::hopper::tile_width;
use burn_kernels_core::route::{launches, stream_launches};
use burn_kernels_testing::{
    Dist, compare::to_f32, float_dtypes, poison_memory, random_tensor, random_values,
};

use super::case::*;
use super::loss::*;
use super::ops::*;

pub(super) fn forward_matches_reference(device: &Device) {
    let before = launches("linear_ce_forward");
    for dtype in float_dtypes(device) {
        for (k, case) in cases().into_iter().enumerate() {
            if runs(device, k, dtype) {
                check_forward(&case, dtype, device);
            }
        }
    }
    // The outputs were read back: the chunked forward ran on CubeBackend (through Dispatch
    // and, where Burn fuses, Fusion).
    assert!(
        launches("linear_ce_forward") > before,
        "no linear_ce_forward launch counted"
    );
}

/// The forward op on `case` in `dtype` against the reference.
pub(super) fn check_forward(case: &Case, dtype: DType, device: &Device) {
    let (dev, cpu) = op_inputs(case, dtype, device);
    let p = params(case, None);
    poison_memory(device, case.tokens() * case.v * 2, DType::F32);
    let (lse, tl) = forward_op(&dev, p);
    let (lse_ref, tl_ref) =
        reference::linear_ce_forward(cpu.e, cpu.c, cpu.bias, cpu.targets, case.softcap);
    let name = format!("{case:?} {dtype:?}");
    let (lse, tl) = (host(lse), host(tl));
    assert_forward_close(&name, (&lse, &tl), (lse_ref, tl_ref), case, device);
}

pub(super) fn backward_matches_reference(device: &Device) {
    for dtype in float_dtypes(device) {
        for (k, case) in cases().into_iter().enumerate() {
            if !runs(device, k, dtype) {
                continue;
            }
            let started = std::time::Instant::now();
            // Odd cases filter at an eps between score levels.
            check_backward(&case, k % 2 == 1, dtype, device);
            eprintln!(
                "backward_matches_reference: case {k} {dtype:?} ok [{:.1} s]",
                started.elapsed().as_secs_f64()
            );
        }
    }
}

/// The backward op on `case` in `dtype` against the reference, exact or (`filtered`) at an eps
/// between the host's score levels: the kernels must then drop exactly the entries (sorted) or
/// chunks (unsorted) the host scores say, and nothing else.
pub(super) fn check_backward(case: &Case, filtered: bool, dtype: DType, device: &Device) {
    let (dev, cpu) = op_inputs(case, dtype, device);
    let n = case.tokens();
    let (scores, lse_ref) = host_scores(&cpu, case.softcap);
    let dout = random_values(n, Dist::Uniform { lo: 0.5, hi: 1.5 }, case.seed + 9);
    let eps = filtered.then(|| eps_in_gap(&scores));
    let lse_dev = Tensor::<1>::from_data(lse_ref.to_data(), (device, DType::F32));
    let dout_dev = Tensor::<1>::from_data(TensorData::new(dout.clone(), [n]), (device, DType::F32));
    poison_memory(device, n * case.v * 2, DType::F32);
    let (de, dc, db) = backward_op(&dev, &lse_dev, &dout_dev, params(case, eps));
    // Read back first: under Burn's fusion the op runs when its outputs are read, and records
    // its plan then.
    let (de, dc, db) = (host(de), host(dc), db.map(host));
    let stats = last_backward_plan().expect("a plan was recorded");
    // The chunks it ran with (wider where the Hopper GEMM writes `G`; see `BackwardBlocks`).
    let chunk = stats.blocks.expect("the plan's blocks").chunk;
    let keep = kept_entries(&scores, eps, case.sort, chunk);
    if eps.is_some() {
        assert_eq!(
            stats.entries,
            keep.iter().filter(|&&k| k).count(),
            "{case:?} {dtype:?}: entries processed at eps {eps:?}"
        );
    }
    // The reference with the dropped vocabulary columns' gradient removed: dC rows and db
    // entries of dropped entries are 0, dE lacks their contribution.
    let name = format!("{case:?} {dtype:?} eps={eps:?}");
    let masked = MaskedCheck {
        case,
        cpu: &cpu,
        lse: lse_ref,
        dout: &dout,
        keep: &keep,
        dtype,
    };
    masked.assert_matches(&name, (&de, &dc, db.as_ref()), device);
}

/// dE accumulated in blocks of rows — a second pass over regrouped vocabulary chunks with f32
/// accumulation, or row-blocked products added into dE — against one block of all rows (the
/// single pass, as before blocks existed) and the masked reference: awkward sizes, 32-entry
/// vocabulary chunks (a 21-entry tail, pairs regrouped in the second pass) and 13 row blocks
/// (a 3-row tail).
pub(super) fn blocked_backward_matches_single_pass(device: &Device) {
    let base = Case {
        chunk: Some(32),
        ..Case::new([3, 53], 150, 1013, 31)
    };
    let cases = [
        Case {
            bias: true,
            softcap: Some(5.0),
            ..base.clone()
        },
        Case {
            sort: false,
            ..base.clone()
        },
        Case {
            filter: FilterEps::Off,
            bias: true,
            ..base.clone()
        },
        Case {
            accum: false,
            ..base.clone()
        },
    ];
    const ROWS: usize = 13;
    for dtype in float_dtypes(device) {
        for (k, case) in cases.iter().enumerate() {
            // On wgpu 16-bit dtypes run the base case (see `runs`).
            if !runs(device, k, dtype) {
                continue;
            }
            check_blocked(case, ROWS, dtype, device);
        }
    }
}

/// The backward of `case` in `dtype` with dE in blocks of `rows` rows against one block of all
/// rows and the masked reference (see [`blocked_backward_matches_single_pass`]).
pub(super) fn check_blocked(case: &Case, rows: usize, dtype: DType, device: &Device) {
    let n = case.tokens();
    let (scores, lse_ref) = host_scores(&op_inputs(case, dtype, device).1, case.softcap);
    let eps = (case.filter != FilterEps::Off).then(|| eps_in_gap(&scores));
    let dout = random_values(n, Dist::Uniform { lo: 0.5, hi: 1.5 }, case.seed + 9);
    let name = format!("{case:?} {dtype:?} eps={eps:?}");
    let run = |rows: usize| {
        let (dev, _) = op_inputs(case, dtype, device);
        let lse = Tensor::<1>::from_data(lse_ref.to_data(), (device, DType::F32));
        let dout = Tensor::<1>::from_data(TensorData::new(dout.clone(), [n]), (device, DType::F32));
        let p = LceParams {
            de_block_rows: Some(rows),
            ..params(case, eps)
        };
        poison_memory(device, n * case.v * 2, DType::F32);
        let (de, dc, db) = backward_op(&dev, &lse, &dout, p);
        // Read back before the plan: under fusion the op runs when read.
        let (de, dc, db) = (host(de), host(dc), db.map(host));
        let stats = last_backward_plan().expect("a plan was recorded");
        let blocks = stats.blocks.expect("the plan's blocks");
        (de, dc, db, stats, blocks)
    };
    let (de, dc, db, stats, blocks) = run(rows);
    let (de_one, dc_one, db_one, stats_one, _) = run(usize::MAX);
    assert!(stats.chunks > 2, "{name}: several vocabulary chunks");
    if case.accum && dtype != DType::F32 {
        assert_eq!(blocks.de, DeAccumulation::RowBlocks, "{name}");
        // With stored logits the second pass's chunks are regrouped (its memory allows it
        // here); `G` in the GEMM leaves a smaller envelope at these tiny sizes.
        assert!(
            blocks.in_gemm || blocks.pass2_chunk > blocks.chunk,
            "{name}: the second pass regroups chunks ({blocks:?})"
        );
        assert_eq!(stats.de_row_blocks, n.div_ceil(rows), "{name}");
    } else {
        assert_eq!(blocks.de, DeAccumulation::Direct, "{name}");
        assert_eq!(stats.de_row_blocks, 0, "{name}");
    }
    assert_eq!(stats_one.de_row_blocks, 0, "{name}: one block");
    assert_eq!(stats.entries, stats_one.entries, "{name}: same plan");
    // dC and db come from the same chunk GEMMs either way.
    assert_eq!(dc, dc_one, "dC {name}");
    assert_eq!(db, db_one, "db {name}");
    // dE: the same f32 sums in another order, rounded once (or once per chunk).
    let de_extra = de_roundings(case, dtype);
    assert_product_close(
        &format!("dE blocked vs one block {name}"),
        &de,
        &de_one,
        case.v,
        (dtype, de_extra),
        device,
    );

    let cpu = op_inputs(case, dtype, device).1;
    let keep = kept_entries(&scores, eps, case.sort, blocks.chunk);
    let masked = MaskedCheck {
        case,
        cpu: &cpu,
        lse: lse_ref.clone(),
        dout: &dout,
        keep: &keep,
        dtype,
    };
    masked.assert_matches(&name, (&de, &dc, db.as_ref()), device);
}

/// The live-memory peak the chunked path reports (`track_live_peak`) brackets what it must
/// hold: the forward at least its logits block (`pass_chunk_bytes`) and at most that plus
/// `O(n + V)` vectors; the backward at least dE + dC, at most dE + dC plus the designed
/// working set (`BackwardBlocks::working_bytes`) and `O(n + V)` vectors.
pub(super) fn live_peak_brackets_the_working_set(device: &Device) {
    for dtype in float_dtypes(device) {
        let case = Case {
            chunk: Some(512),
            ..Case::new([3, 347], 128, 4099, 41)
        };
        let (n, v, d, s) = (case.tokens(), case.v, case.d, dtype.size());
        // Vectors of n or V entries (lse, scores and their parts, ids): small beside the
        // blocks below.
        let small = 16 * 4 * (n + v);
        let name = format!("{dtype:?}");

        let pass_chunk = 640;
        let p = LceParams {
            chunk_bytes: None,
            pass_chunk_bytes: Some(4 * n * pass_chunk),
            ..params(&case, None)
        };
        let (dev, _) = op_inputs(&case, dtype, device);
        let forward = || forward_op(&dev, p).0;
        // Tracked after a first call: compilation and autotuning stay out, as in benchmarks.
        // (`track_live_peak` synchronizes the device first: the deferred first call runs
        // before the tracking starts.)
        let mut lse = Some(forward());
        let reductions = stream_launches(HOPPER_LSE_LAUNCHES);
        let peak = burn_cce::track_live_peak(device, || lse = Some(forward()))
            .expect("the chunked forward reads the pool")
            .bytes as usize;
        if stream_launches(HOPPER_LSE_LAUNCHES) > reductions {
            // Reduced inside the Hopper GEMM (CUDA, 16-bit): no logits block, only each column
            // tile's (max, Σexp) per token, in the tiles the kernel chooses for the chunk.
            let len = v.min(REDUCTION_CHUNK);
            let sums = 2 * len.div_ceil(tile_width(len)) * n * 4;
            assert!(
                (sums..sums + small).contains(&peak),
                "forward {name}: live peak {peak} B, tile sums {sums} B"
            );
        } else {
            let block = 4 * n * pass_chunk;
            assert!(
                (block..block + small).contains(&peak),
                "forward {name}: live peak {peak} B, logits block {block} B"
            );
        }

        let dout = Tensor::<1>::full([n], 1.0 / n as f32, (device, DType::F32));
        let lse = lse.expect("the forward ran");
        // The automatic carry (f32), and the compensated one (bf16 on the Hopper GEMM;
        // elsewhere the f32 carry again), whose corrections are part of the working set.
        for carry in [DeCarry::Auto, DeCarry::Compensated] {
            let p = LceParams {
                de_carry: carry,
                ..params(&case, Some(1e-4))
            };
            // The outputs are kept until the device has synchronized (inside
            // `track_live_peak`), so that the deferred op runs whatever the fusion stream does
            // with dropped outputs.
            let backward = || backward_op(&dev, &lse, &dout, p);
            let mut _grads = Some(backward());
            let live = burn_cce::track_live_peak(device, || _grads = Some(backward()))
                .expect("the chunked backward reads the pool");
            let peak = live.bytes as usize;
            let blocks = last_backward_plan()
                .and_then(|plan| plan.blocks)
                .expect("the plan's blocks");
            let grads = s * (n + v) * d;
            let working = blocks.working_bytes(n, d, dtype, false);
            println!(
                "{name} {carry:?}: backward live peak {peak} B (after \"{}\") = dE + dC {grads} \
                 B + {} B (designed working set {working} B, {:?})",
                live.step,
                peak.saturating_sub(grads),
                blocks.de
            );
            assert!(
                (grads..grads + working + small).contains(&peak),
                "backward {name}: live peak {peak} B, dE + dC {grads} B, working set {working} \
                 B ({blocks:?})"
            );
        }
    }
}

/// The extension called on the unfused `CubeBackend` directly (outside Burn's `Dispatch` and
/// `Fusion`) gives exactly the `Dispatch` (fused) results: the same kernels on the same inputs,
/// for the forward and the filtered backward with a bias and softcap, and the row-wise
/// log-sum-exp.
#[cfg(feature = "cube")]
pub(super) fn unfused_backend_matches_dispatch(device: &Device) {
    use burn_cubecl::CubeBackend;
    use burn_kernels_testing::unfused::{float as unfused, int, read_float};

    let case = Case {
        bias: true,
        softcap: Some(4.0),
        chunk: Some(64),
        ..Case::new([2, 37], 48, 301, 51)
    };
    let n = case.tokens();
    for dtype in float_dtypes(device) {
        let name = format!("{dtype:?}");
        let (x, _) = op_inputs(&case, dtype, device);
        let bias = x.bias.as_ref().expect("the case has a bias");
        let p = params(&case, Some(1e-4));

        let (lse, tl) = forward_op(&x, p);
        let (lse_u, tl_u) = <CubeBackend as CceKernels>::linear_ce_forward_bias(
            unfused(&x.e, device),
            unfused(&x.c, device),
            unfused(bias, device),
            int(&x.targets, device),
            p,
        );
        assert_eq!(to_f32(read_float(lse_u)), host(lse.clone()), "lse {name}");
        assert_eq!(to_f32(read_float(tl_u)), host(tl), "target logit {name}");

        let dout = Tensor::<1>::from_data(
            TensorData::new(
                random_values(n, Dist::Uniform { lo: 0.5, hi: 1.5 }, 52),
                [n],
            ),
            (device, DType::F32),
        );
        let (de, dc, db) = backward_op(&x, &lse, &dout, p);
        let (de_u, dc_u, db_u) = <CubeBackend as CceKernels>::linear_ce_backward_bias(
            unfused(&x.e, device),
            unfused(&x.c, device),
            unfused(bias, device),
            int(&x.targets, device),
            unfused(&lse, device),
            unfused(&dout, device),
            p,
        );
        assert_eq!(to_f32(read_float(de_u)), host(de), "dE {name}");
        assert_eq!(to_f32(read_float(dc_u)), host(dc), "dC {name}");
        assert_eq!(to_f32(read_float(db_u)), host(db.expect("db")), "db {name}");

        let logits = random_tensor::<2>([7, 333], Dist::PEAKY, 53, dtype, device);
        let via_dispatch = Tensor::<1>::from_dispatch(Dispatch::logsumexp_rows(
            logits.clone().into_dispatch(),
            Some(3.0),
        ));
        let direct = CubeBackend::logsumexp_rows(unfused(&logits, device), Some(3.0));
        assert_eq!(
            to_f32(read_float(direct)),
            host(via_dispatch),
            "logsumexp {name}"
        );
    }
}
