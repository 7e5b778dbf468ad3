//! Cut Cross-Entropy on every enabled runtime, in the style of the official suite: an f32
//! ground truth (the plain path on the CPU), the same plain path in the input dtype on the
//! backend under test ("ref"), and CCE; CCE must be no further from the ground truth than ref
//! is, for the loss, dE, dC and db. Plus direct checks of the backend ops against the tensor-op
//! reference (forward, exact backward, filtered backward and its plan), the fused passes (CUDA),
//! the reductions inside the Hopper GEMM (CUDA) and typed errors.
//!
//! The checks live in the submodules below; the tests are declared here (`testgen!` and the CPU
//! `#[test]`s), so that their names stay `cce::…`.

mod case;
mod errors;
mod fused;
mod hopper;
mod loss;
mod op_checks;
mod ops;

use case::*;
use errors::*;
use fused::*;
use hopper::*;
use loss::*;
use op_checks::*;

use burn::tensor::{DType, Device};
use burn_cce::{
    CceOptions, DeCarry, FilterEps, LceParams,
    diagnostics::{BackwardBlocks, DeAccumulation},
};
use burn_kernels_testing::{Tolerance, assert_close, testgen};

/// The analytic working set of the backward at the benchmark shapes (8192 tokens, bf16,
/// default options but dE carried in f32), with stored logits and with `G` written by the
/// Hopper GEMM (`in_gemm`): the numbers documented in `burn_cce::diagnostics::BackwardBlocks`.
#[test]
fn working_set_at_bench_shapes() {
    let params = LceParams {
        de_carry: DeCarry::F32,
        ..CceOptions::default().params(DType::BF16)
    };
    let n = 8192;
    // (V, D, in_gemm, chunk, dE rows, second-pass chunk, working bytes)
    let shapes = [
        (256_000, 2304, false, 672, 1184, 2016, 33_030_144),
        (49_152, 576, false, 256, 2048, 512, 12_582_912),
        (256_000, 2304, true, 1728, 2048, 1728, 36_274_176),
        (49_152, 576, true, 256, 1171, 512, 4_489_216),
    ];
    for (v, d, in_gemm, chunk, rows, pass2_chunk, working) in shapes {
        let blocks = BackwardBlocks::new(&params, n, v, d, DType::BF16, in_gemm);
        let name = format!("V={v} D={d} in_gemm={in_gemm}");
        assert_eq!(
            blocks,
            BackwardBlocks {
                chunk,
                de: DeAccumulation::RowBlocks,
                rows,
                pass2_chunk,
                in_gemm,
                gathered: false,
            },
            "{name}"
        );
        let bytes = blocks.working_bytes(n, d, DType::BF16, false);
        let bound = 2 * (n + v) * d;
        println!(
            "{name}: working set {bytes} B, peak {} B = {:.4}× dE + dC ({bound} B)",
            bound + bytes,
            (bound + bytes) as f64 / bound as f64
        );
        assert_eq!(bytes, working, "{name}");
        // Gemma-2: within the 1.05× of dE + dC.
        if v == 256_000 {
            assert!((bound + bytes) as f64 <= 1.05 * bound as f64, "{name}");
        }
        // Filled for an H100's 132 SMs: only the in-GEMM row blocks change, to fewer rows.
        let filled = blocks.filled(n, d, DType::BF16, 132);
        if in_gemm {
            assert!(filled.rows <= blocks.rows, "{name}: {filled:?}");
            assert!(
                filled.working_bytes(n, d, DType::BF16, false) <= bytes,
                "{name}"
            );
        } else {
            assert_eq!(filled, blocks, "{name}");
        }
    }
    // Gemma-2 on an H100: 5 blocks of 1664 rows (117 tiles per GEMM: one wave each) rather
    // than 4 of 2048 (144 tiles: two waves).
    let gemma = BackwardBlocks::new(&params, n, 256_000, 2304, DType::BF16, true);
    let filled = gemma.filled(n, 2304, DType::BF16, 132);
    assert_eq!(
        (filled.rows, filled.pass2_chunk),
        (1664, 5184),
        "{filled:?}"
    );
}

/// The compensated carry's blocks ([`DeCarry::Compensated`]): at Gemma-2's shape with `G` in the
/// Hopper GEMM, dE carried in the vocabulary pass in chunks of 1856 entries (1536 gathered, with
/// the paper's filter), within 1.05× of dE + dC, narrowed to whole waves on an H100; where it
/// cannot run (stored logits, f16) the f32 carry. The default ([`DeCarry::Auto`]) carries
/// compensated at Gemma-2's shape in the Hopper GEMM (the same blocks), and in f32 (a second
/// pass over row blocks) out of it and at SmolLM2's shape, where the chunks would be narrow.
#[test]
fn compensated_carry_at_bench_shapes() {
    let n = 8192;
    let (v, d) = (256_000, 2304);
    let bound = 2 * (n + v) * d;
    let auto = CceOptions::default().params(DType::BF16);
    let exact = CceOptions {
        de_carry: DeCarry::Compensated,
        ..CceOptions::default()
    }
    .params(DType::BF16);
    let paper = CceOptions {
        filter_eps: FilterEps::Paper,
        de_carry: DeCarry::Compensated,
        ..CceOptions::default()
    }
    .params(DType::BF16);
    // (params, chunk, gathered, working bytes): corrections n·d = 18 874 368, then `G`
    // (2·n per entry), dC rows (2·d) and gathered classifier rows (2·d).
    let cases = [
        (exact, 1856, false, 18_874_368 + 1856 * (2 * n + 2 * d)),
        (paper, 1536, true, 18_874_368 + 1536 * (2 * n + 4 * d)),
    ];
    for (params, chunk, gathered, working) in cases {
        let blocks = BackwardBlocks::new(&params, n, v, d, DType::BF16, true);
        let name = format!("{params:?}");
        assert_eq!(blocks.de, DeAccumulation::Compensated, "{name}");
        assert_eq!((blocks.chunk, blocks.gathered), (chunk, gathered), "{name}");
        let bytes = blocks.working_bytes(n, d, DType::BF16, false);
        assert_eq!(bytes, working, "{name}");
        assert!((bound + bytes) as f64 <= 1.05 * bound as f64, "{name}");
        // Filled for an H100's 132 SMs: natural chunks of 1792 entries (dC's `[chunk, 2304]`
        // in one wave of 126 tiles; 1856 takes 135, two waves); the gathered 1536 stays.
        let filled = blocks.filled(n, d, DType::BF16, 132);
        let waved = if gathered { 1536 } else { 1792 };
        assert_eq!((filled.chunk, filled.pass2_chunk), (waved, waved), "{name}");
        assert!(
            filled.working_bytes(n, d, DType::BF16, false) <= bytes,
            "{name}"
        );
    }
    let carry = |params, dtype, in_gemm, v| BackwardBlocks::new(params, n, v, d, dtype, in_gemm).de;
    assert_eq!(
        carry(&exact, DType::BF16, false, v),
        DeAccumulation::RowBlocks
    );
    assert_eq!(
        carry(&exact, DType::F16, true, v),
        DeAccumulation::RowBlocks
    );
    // The default: compensated at Gemma-2's shape in the Hopper GEMM, with the blocks asked
    // for by name; in f32 out of it, and at SmolLM2's shape (chunks of 32 entries).
    let auto_gemma = BackwardBlocks::new(&auto, n, v, d, DType::BF16, true);
    let named = BackwardBlocks::new(&exact, n, v, d, DType::BF16, true);
    assert_eq!(auto_gemma.de, DeAccumulation::Compensated);
    assert_eq!(
        (auto_gemma.chunk, auto_gemma.rows, auto_gemma.pass2_chunk),
        (named.chunk, named.rows, named.pass2_chunk)
    );
    assert_eq!(
        carry(&auto, DType::BF16, false, v),
        DeAccumulation::RowBlocks
    );
    assert_eq!(carry(&auto, DType::F16, true, v), DeAccumulation::RowBlocks);
    let auto_smollm = BackwardBlocks::new(&auto, n, 49_152, 576, DType::BF16, true);
    assert_eq!(auto_smollm.de, DeAccumulation::RowBlocks);
    let smollm = BackwardBlocks::new(&exact, n, 49_152, 576, DType::BF16, true);
    assert_eq!(smollm.de, DeAccumulation::Compensated);
}

/// The CPU reference path (Flex) runs the same checks without a GPU runtime.
#[test]
fn cpu_loss_and_gradients() {
    let device = Device::flex().autodiff();
    for case in cases() {
        run(&device, &case, DType::F32);
    }
}

#[test]
fn cpu_all_ignored_and_errors() {
    all_ignored(&Device::flex().autodiff());
    typed_errors(&Device::flex());
}

#[test]
fn plain_ce_matches_host_f64() {
    // The oracle itself against a direct f64 computation on a tiny case.
    let case = Case {
        softcap: Some(3.0),
        bias: true,
        ignore: 0.3,
        ..Case::new([2, 3], 5, 7, 21)
    };
    let x = inputs(&case);
    let out = plain(&case, &x, DType::F32, &Device::flex().autodiff());
    let (n, d, v) = (case.tokens(), case.d, case.v);
    let mut total = 0f64;
    let mut valid = 0usize;
    for i in 0..n {
        if x.targets[i] == IGNORE {
            continue;
        }
        let logits: Vec<f64> = (0..v)
            .map(|j| {
                let dot: f64 = (0..d)
                    .map(|k| x.e[i * d + k] as f64 * x.c[j * d + k] as f64)
                    .sum();
                let raw = dot + x.bias.as_ref().unwrap()[j] as f64;
                3.0 * (raw / 3.0).tanh()
            })
            .collect();
        let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + logits.iter().map(|l| (l - m).exp()).sum::<f64>().ln();
        total += lse - logits[x.targets[i] as usize];
        valid += 1;
    }
    let expected = (total / valid as f64) as f32;
    assert_close(
        "plain CE vs f64",
        &out.loss,
        &[expected],
        Tolerance::for_reduction(DType::F32, v),
    );
}

testgen! {
    backend: [
        forward_matches_reference,
        backward_matches_reference,
        blocked_backward_matches_single_pass,
        live_peak_brackets_the_working_set,
        typed_errors,
        unfused_backend_matches_dispatch,
        fused_ops_match_reference,
        fused_filter_per_tile,
        fused_training_ops_match_reference,
        hopper_reductions_match_reference,
    ],
    autodiff: [loss_and_gradients, all_ignored, fused_loss_and_gradients],
}
