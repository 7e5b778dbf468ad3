//! The forward's, the scoring pass's and the backward's work inside core's Hopper GEMM (CUDA,
//! sm90 — the machines the CUDA tests run on): the log-sum-exp, the filtered and the exact
//! backward (`G` written from the tile, dE's products added into f32 blocks) against the
//! reference, with the epilogues' launches counted, so that a fallback to stored logits fails.

use burn::tensor::{DType, Device};
use burn_cce::diagnostics::{DeAccumulation, last_backward_plan};
use burn_cce::{
    HOPPER_ADD_LAUNCHES, HOPPER_GRAD_LAUNCHES, HOPPER_LSE_LAUNCHES, HOPPER_SCORE_LAUNCHES,
    REDUCTION_CHUNK,
};
use burn_kernels_core::route::stream_launches;
use burn_kernels_testing::is_cuda;

use super::case::*;
use super::op_checks::{check_backward, check_blocked, check_forward};

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
        }
    }
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
