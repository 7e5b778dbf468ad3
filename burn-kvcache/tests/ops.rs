//! The four ops: kernels against the tensor-op reference (random seeded inputs, awkward
//! sizes, poisoned outputs) on every enabled runtime; the quantization error bound and the
//! merge invariants on the CPU reference too; typed errors.
//!
//! The checks live in the submodules below; the tests are declared here (`on_all!`, the CPU
//! `#[test]`), so that their names stay `ops::…`.

mod common;
mod minicache;
mod quantization;
#[cfg(feature = "cube")]
mod unfused;

use burn_kvcache::{KvCacheError, merge, quantize, restore};

use common::*;
use minicache::*;
use quantization::*;
#[cfg(feature = "cube")]
use unfused::*;

on_all!(
    merge_matches_reference,
    restore_matches_reference,
    quantize_matches_reference,
    quant_error_bound,
    merge_invariants;
    kernels only: [unfused_matches_dispatch],
);

#[test]
fn typed_errors() {
    let x = cpu(vec![0.0; 6], [2, 3]);
    let y = cpu(vec![0.0; 4], [2, 2]);
    let err = |t: f32, g: f32| merge(x.clone(), x.clone(), t, g).unwrap_err();
    assert_eq!(err(1.5, 0.05), KvCacheError::InvalidInterpolation(1.5));
    assert_eq!(err(-0.1, 0.05), KvCacheError::InvalidInterpolation(-0.1));
    assert_eq!(err(0.6, -0.01), KvCacheError::InvalidGamma(-0.01));
    assert!(matches!(err(0.6, f32::NAN), KvCacheError::InvalidGamma(_)));
    assert!(matches!(
        merge(x.clone(), y.clone(), 0.5, 0.0),
        Err(KvCacheError::ShapeMismatch { .. })
    ));
    assert!(matches!(
        restore(x.clone(), cpu(vec![1.0; 3], [3]), None),
        Err(KvCacheError::ShapeMismatch { .. })
    ));
    assert_eq!(
        quantize(x.clone(), 3, 32).unwrap_err(),
        KvCacheError::InvalidBits(3)
    );
    assert_eq!(
        quantize(x.clone(), 8, 32).unwrap_err(),
        KvCacheError::InvalidBits(8)
    );
    assert_eq!(quantize(x, 4, 0).unwrap_err(), KvCacheError::ZeroGroupSize);
}
