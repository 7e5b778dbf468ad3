//! Edge cases: every target ignored, and typed errors for bad input.

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_cce::{CceError, CceOptions, FilterEps, Reduction, linear_cross_entropy};
use burn_kernels_testing::compare::to_f32;

use super::case::*;

pub(super) fn all_ignored(device: &Device) {
    for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
        let e = Tensor::<3>::ones([2, 5, 8], device).require_grad();
        let c = Tensor::<2>::ones([11, 8], device).require_grad();
        let t = Tensor::<2, Int>::full([2, 5], IGNORE, device);
        let opts = CceOptions {
            reduction,
            ..Default::default()
        };
        let loss = linear_cross_entropy(e, c, t, None, &opts).unwrap().loss;
        let v = to_f32(loss.into_data());
        let len = if reduction == Reduction::None { 10 } else { 1 };
        assert_eq!(
            v,
            vec![0.0; len],
            "{reduction:?}: every token ignored gives 0"
        );
    }
    // With shift and one position per sequence, every target falls off the end.
    let e = Tensor::<3>::ones([3, 1, 8], device);
    let c = Tensor::<2>::ones([11, 8], device);
    let t = Tensor::<2, Int>::from_ints([[1], [2], [3]], device);
    let opts = CceOptions {
        shift: true,
        ..Default::default()
    };
    let loss = linear_cross_entropy(e, c, t, None, &opts).unwrap().loss;
    assert_eq!(to_f32(loss.into_data()), vec![0.0]);
}

pub(super) fn typed_errors(device: &Device) {
    let e = || Tensor::<3>::ones([2, 3, 8], device);
    let c = || Tensor::<2>::ones([10, 8], device);
    let t = |v: i64| {
        Tensor::<2, Int>::from_data(TensorData::new(vec![1, 2, 3, 4, v, 5], [2, 3]), device)
    };
    let o = CceOptions::default();
    let err = |r: Result<_, CceError>| r.expect_err("an error");
    assert_eq!(
        err(linear_cross_entropy(e(), c(), t(10), None, &o)),
        CceError::TargetOutOfRange {
            position: 4,
            value: 10,
            vocab: 10
        }
    );
    assert_eq!(
        err(linear_cross_entropy(e(), c(), t(-1), None, &o)),
        CceError::TargetOutOfRange {
            position: 4,
            value: -1,
            vocab: 10
        }
    );
    assert_eq!(
        err(linear_cross_entropy(
            e(),
            Tensor::<2>::ones([10, 7], device),
            t(0),
            None,
            &o
        )),
        CceError::HiddenSizeMismatch {
            embeddings: 8,
            classifier: 7
        }
    );
    assert!(matches!(
        err(linear_cross_entropy(
            e(),
            c(),
            Tensor::<2, Int>::zeros([3, 2], device),
            None,
            &o
        )),
        CceError::TargetShapeMismatch { .. }
    ));
    assert!(matches!(
        err(linear_cross_entropy(
            e(),
            c(),
            t(0),
            Some(Tensor::<1>::ones([9], device)),
            &o
        )),
        CceError::BiasShapeMismatch { .. }
    ));
    let bad_cap = CceOptions {
        softcap: Some(0.0),
        ..o
    };
    assert_eq!(
        err(linear_cross_entropy(e(), c(), t(0), None, &bad_cap)),
        CceError::InvalidSoftcap(0.0)
    );
    let bad_eps = CceOptions {
        filter_eps: FilterEps::Value(f32::NAN),
        ..o
    };
    assert!(matches!(
        err(linear_cross_entropy(e(), c(), t(0), None, &bad_eps)),
        CceError::InvalidFilterEps(_)
    ));
    assert_eq!(
        err(linear_cross_entropy(
            e(),
            Tensor::<2>::ones([0, 8], device),
            t(0),
            None,
            &o
        )),
        CceError::EmptyVocabulary
    );
}
