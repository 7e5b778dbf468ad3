//! The forward's and the scoring pass's reductions inside core's Hopper GEMM (CUDA, sm90 — the
//! machines the CUDA tests run on): the log-sum-exp and the filtered backward against the
//! reference, with the reductions' launches counted, so that a fallback to stored logits fails.

use burn::tensor::{DType, Device};
use burn_cce::{HOPPER_LSE_LAUNCHES, HOPPER_SCORE_LAUNCHES, REDUCTION_CHUNK};
use burn_kernels_core::route::stream_launches;
use burn_kernels_testing::is_cuda;

use super::case::*;
use super::op_checks::{check_backward, check_forward};

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
            check_backward(case, true, dtype, device);
            assert_eq!(
                stream_launches(HOPPER_SCORE_LAUNCHES) - before,
                chunks,
                "{name}: score reductions"
            );
        }
    }
}
