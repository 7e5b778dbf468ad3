//! Sage attention: the kernels against the tensor-op reference (same quantization) on every
//! enabled runtime, accuracy against exact attention (the paper's metrics), special values,
//! and typed errors.
//!
//! The checks live in the modules under `sage/`; the tests are declared here (`testgen!` and the
//! CPU `#[test]`s), so that their names stay as they were.

// Without a CubeCL runtime feature only the CPU tests run; the kernel tests are unused.
#![cfg_attr(not(feature = "cube"), allow(dead_code, unused_imports))]

#[path = "sage/accuracy.rs"]
mod accuracy;
#[path = "sage/attention.rs"]
mod attention;
#[path = "sage/common.rs"]
mod common;
#[path = "sage/fast_exp.rs"]
mod fast_exp;
#[path = "sage/quantize.rs"]
mod quantize;
#[path = "sage/routing.rs"]
mod routing;
#[path = "sage/transpose.rs"]
mod transpose;

use accuracy::*;
use attention::*;
use common::*;
use fast_exp::*;
use quantize::*;
use routing::*;
use transpose::*;

use burn::tensor::{DType, Device, Tensor};
use burn_kernels_testing::testgen;
use burn_sage::{
    GroupLayout, SageError, SageOptions, Unsupported, plan, sage_attention, sage_kernel,
};

testgen! {
    backend: [
        quantize_matches_reference,
        exp2_poly_matches_exp2,
        v_transposed_matches_host,
        shared_stages_match_reference,
        attention_matches_reference,
        attention_matches_reference_long,
        cmma_kernel_matches_reference,
        wgmma_kernel_matches_reference,
        tuned_kernel_matches_reference,
        accuracy_vs_exact,
        large_magnitudes_stay_finite,
        unfused_matches_dispatch,
    ],
    autodiff: [autodiff_runs_reference],
}

#[test]
fn cpu_reference_accuracy() {
    accuracy_table(&Device::flex(), &[(1, 2, 1, 257, 257, 64, true)]);
}

#[test]
fn cpu_large_magnitudes() {
    large_magnitudes_stay_finite(&Device::flex());
}

/// The CPU runs no kernel; the public API says so.
#[test]
fn cpu_runs_no_kernel() {
    let s = [1, 2, 5, 64];
    let p = plan(&s, &s, &s, [DType::F32; 3], &SageOptions::default()).expect("valid");
    assert_eq!(
        sage_kernel(&Device::flex(), &p),
        Err(Unsupported::NoKernels)
    );
}

#[test]
fn bad_input_gives_typed_errors() {
    let dev = Device::flex();
    let t = |s: [usize; 4]| Tensor::<4>::ones(s, &dev);
    let ok = SageOptions::default();
    let err = |q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, o: &SageOptions| {
        sage_attention(q, k, v, o).expect_err("must be rejected")
    };
    let r3 = Tensor::<3>::ones([2, 3, 64], &dev);
    assert_eq!(
        sage_attention(r3.clone(), r3.clone(), r3, &ok).expect_err("rank 3"),
        SageError::Rank { name: "q", rank: 3 }
    );
    assert!(matches!(
        err(t([1, 2, 5, 64]), t([1, 2, 5, 32]), t([1, 2, 5, 32]), &ok),
        SageError::HeadDimMismatch { .. }
    ));
    assert!(matches!(
        err(t([1, 3, 5, 64]), t([1, 2, 5, 64]), t([1, 2, 5, 64]), &ok),
        SageError::KvHeadsNotDividing {
            q_heads: 3,
            kv_heads: 2
        }
    ));
    assert!(matches!(
        err(t([1, 2, 5, 64]), t([2, 2, 5, 64]), t([2, 2, 5, 64]), &ok),
        SageError::BatchMismatch { .. }
    ));
    assert!(matches!(
        err(t([1, 2, 5, 64]), t([1, 2, 5, 64]), t([1, 2, 6, 64]), &ok),
        SageError::KvShapeMismatch { .. }
    ));
    let causal = SageOptions { causal: true, ..ok };
    assert!(matches!(
        err(
            t([1, 2, 9, 64]),
            t([1, 2, 5, 64]),
            t([1, 2, 5, 64]),
            &causal
        ),
        SageError::CausalQueryLongerThanKeys {
            q_len: 9,
            kv_len: 5
        }
    ));
    let bad_scale = SageOptions {
        scale: Some(f32::NAN),
        ..ok
    };
    assert!(matches!(
        err(
            t([1, 2, 5, 64]),
            t([1, 2, 5, 64]),
            t([1, 2, 5, 64]),
            &bad_scale
        ),
        SageError::InvalidScale(_)
    ));
    assert!(matches!(
        err(t([1, 2, 0, 64]), t([1, 2, 5, 64]), t([1, 2, 5, 64]), &ok),
        SageError::Empty { .. }
    ));
    let s = [1, 2, 5, 64];
    assert!(matches!(
        plan(&s, &s, &s, [DType::F32, DType::F16, DType::F32], &ok),
        Err(SageError::DtypeMismatch { .. })
    ));
    assert!(matches!(
        plan(&s, &s, &s, [DType::I32, DType::I32, DType::I32], &ok),
        Err(SageError::DtypeMismatch { .. })
    ));
}

#[test]
fn group_layouts_cover_every_row_once() {
    for qk in QUANTS {
        for layout in [qk.q_layout(), qk.k_layout()] {
            let GroupLayout { block, interleave } = layout;
            assert_eq!(block % interleave, 0);
            for rows in [1, 15, 16, 17, 64, 129] {
                let mut sizes = vec![0; layout.groups(rows)];
                for r in 0..rows {
                    sizes[layout.group_of(r)] += 1;
                }
                assert!(
                    sizes.iter().all(|&n| n <= block / interleave),
                    "{layout:?} {rows}"
                );
                assert_eq!(sizes.iter().sum::<usize>(), rows);
            }
        }
    }
}
