//! The forward's, the scoring pass's and the backward's work inside core's Hopper GEMM (CUDA,
//! sm90 — the machines the CUDA tests run on): the log-sum-exp, the filtered and the exact
//! backward (`G` written from the tile, dE's products added into f32 blocks or carried
//! compensated) against the reference, with the epilogues' launches counted, so that a fallback
//! to stored logits fails.

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_cce::diagnostics::{DeAccumulation, last_backward_plan};
use burn_cce::{
    DeCarry, HOPPER_ADD_LAUNCHES, HOPPER_COMPENSATED_LAUNCHES, HOPPER_GRAD_LAUNCHES,
    HOPPER_LSE_LAUNCHES, HOPPER_SCORE_LAUNCHES, LceParams, REDUCTION_CHUNK,
};
use burn_kernels_core::route::stream_launches;
use burn_kernels_testing::{Dist, is_cuda, random_values};

use super::case::*;
use super::op_checks::{check_backward, check_blocked, check_forward};
use super::ops::{backward_op, eps_in_gap, host, host_scores, op_inputs, params};

pub(super) fn hopper_reductions_match_reference(device: &Device) {
    if !is_cuda(device) {
        eprintln!("hopper_reductions_match_reference: a CUDA (sm90) test; nothing to check here");
        return;
    }
    let cases = [
        // Two chunks (the second 232 columns: a ragged tile), bias and soft cap, 201 tokens
        // (a ragged tile of rows), automatic backward blocks: its gathered chunks have any
        // length, so `G`'s padded rows feed the dE and dC GEMMs.
        Case {
            bias: true,
            softcap: Some(4.0),
            chunk: None,
            ..Case::new([3, 67], 128, REDUCTION_CHUNK + 232, 61)
        },
        // 18 tokens, one ragged tile of a 517-entry vocabulary, 96-entry backward chunks.
        Case::new([2, 9], 64, 517, 62),
    ];
    for dtype in [DType::BF16, DType::F16] {
        for case in &cases {
            let chunks = case.v.div_ceil(REDUCTION_CHUNK) as u64;
            let name = format!("{case:?} {dtype:?}");
            let before = stream_launches(HOPPER_LSE_LAUNCHES);
            check_forward(case, dtype, device);
            assert_eq!(
                stream_launches(HOPPER_LSE_LAUNCHES) - before,
                chunks,
                "{name}: log-sum-exp reductions"
            );
            let before = stream_launches(HOPPER_SCORE_LAUNCHES);
            let grads = stream_launches(HOPPER_GRAD_LAUNCHES);
            check_backward(case, true, dtype, device);
            assert_eq!(
                stream_launches(HOPPER_SCORE_LAUNCHES) - before,
                chunks,
                "{name}: score reductions"
            );
            assert_grad_launches(&name, grads);
            // The exact backward: natural chunks, ids from `v0`.
            let grads = stream_launches(HOPPER_GRAD_LAUNCHES);
            check_backward(case, false, dtype, device);
            assert_grad_launches(&name, grads);
        }
        // dE in a second pass over blocks of 13 rows (a 3-row tail), each chunk's product added
        // into the block's f32 accumulator by the GEMM; gathered (bias, soft cap), natural
        // (unsorted) and exact plans.
        let base = Case {
            chunk: Some(32),
            ..Case::new([3, 53], 128, 1013, 63)
        };
        let blocked = [
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
                filter: burn_cce::FilterEps::Off,
                ..base.clone()
            },
        ];
        for case in &blocked {
            let name = format!("{case:?} {dtype:?}");
            let adds = stream_launches(HOPPER_ADD_LAUNCHES);
            check_blocked(case, 13, dtype, device);
            assert!(
                stream_launches(HOPPER_ADD_LAUNCHES) > adds,
                "{name}: dE products added by the GEMM"
            );
            // The same plans with dE carried compensated in the vocabulary pass.
            check_compensated(case, dtype, device);
        }
    }
}

/// dE carried compensated ([`DeCarry::Compensated`]: bf16 dE and i8 corrections updated by the
/// GEMM per chunk, here 32 chunks of 32 entries) against the reference, with one compensated
/// store per chunk counted; and against the f32 carry on the same plan: the two are roundings
/// to bf16 of sums within ~2⁻¹² of each other, so no value may differ by more than one bf16
/// step (`2⁻⁷` of its size), which carrying dE in bf16 alone (about `√32 / 2` steps off on
/// the exact plan) fails. f16 is
/// carried in f32 (its exponent range is too narrow for the corrections).
fn check_compensated(case: &Case, dtype: DType, device: &Device) {
    let compensated = Case {
        carry: DeCarry::Compensated,
        ..case.clone()
    };
    let name = format!("{compensated:?} {dtype:?}");
    let before = stream_launches(HOPPER_COMPENSATED_LAUNCHES);
    let filtered = case.filter != burn_cce::FilterEps::Off;
    check_backward(&compensated, filtered, dtype, device);
    let plan = last_backward_plan().expect("a plan was recorded");
    let blocks = plan.blocks.expect("the plan's blocks");
    let launched = stream_launches(HOPPER_COMPENSATED_LAUNCHES) - before;
    if dtype != DType::BF16 {
        assert_ne!(blocks.de, DeAccumulation::Compensated, "{name}");
        assert_eq!(launched, 0, "{name}");
        return;
    }
    assert_eq!(blocks.de, DeAccumulation::Compensated, "{name}");
    assert_eq!(plan.de_row_blocks, 0, "{name}: no second pass");
    assert_eq!(
        launched, plan.chunks as u64,
        "{name}: one compensated store per chunk"
    );
    assert!(plan.chunks > 1, "{name}: chunks to carry dE across");

    let n = case.tokens();
    let (scores, lse_ref) = host_scores(&op_inputs(case, dtype, device).1, case.softcap);
    let eps = filtered.then(|| eps_in_gap(&scores));
    let dout = random_values(n, Dist::Uniform { lo: 0.5, hi: 1.5 }, case.seed + 9);
    let run = |carry: DeCarry| {
        let (dev, _) = op_inputs(case, dtype, device);
        let lse = Tensor::<1>::from_data(lse_ref.to_data(), (device, DType::F32));
        let dout = Tensor::<1>::from_data(TensorData::new(dout.clone(), [n]), (device, DType::F32));
        let p = LceParams {
            de_carry: carry,
            ..params(case, eps)
        };
        let (de, dc, _) = backward_op(&dev, &lse, &dout, p);
        (host(de), host(dc))
    };
    let (de_pair, dc_pair) = run(DeCarry::Compensated);
    let (de_f32, dc_f32) = run(DeCarry::F32);
    assert_eq!(dc_pair, dc_f32, "{name}: dC from the same chunk GEMMs");
    // Values far below the typical size (sums that cancel) are measured against an eighth of
    // the root mean square: their error is relative to the partial sums, not to themselves.
    let rms = (de_f32.iter().map(|x| x * x).sum::<f32>() / de_f32.len() as f32).sqrt();
    let worst = de_pair
        .iter()
        .zip(&de_f32)
        .map(|(a, b)| (a - b).abs() / (a.abs().max(b.abs()).max(rms / 8.0) * 2f32.powi(-7)))
        .fold(0f32, f32::max);
    assert!(
        worst <= 1.0,
        "{name}: dE compensated vs f32 carry differs by {worst} bf16 steps"
    );
    assert!(
        de_pair.iter().all(|x| x.is_finite()),
        "{name}: every dE written"
    );
}

/// Every `G` of the last backward came from the Hopper GEMM: at least one per plan chunk, and
/// one per chunk and row block of dE's second pass.
fn assert_grad_launches(name: &str, before: u64) {
    let plan = last_backward_plan().expect("a plan was recorded");
    let blocks = plan.blocks.expect("the plan's blocks");
    assert!(blocks.in_gemm, "{name}: G in the GEMM ({blocks:?})");
    let launched = stream_launches(HOPPER_GRAD_LAUNCHES) - before;
    let least = match blocks.de {
        DeAccumulation::RowBlocks => plan.chunks + plan.de_row_blocks,
        _ => plan.chunks,
    };
    assert!(
        launched >= least as u64,
        "{name}: {launched} G launches for {plan:?}"
    );
}
