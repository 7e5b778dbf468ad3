//! Row-wise log-sum-exp: the kernel against the tensor-op reference on every enabled runtime,
//! the reference against an f64 host computation, gradients, special values and typed errors.

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_cce::{CceError, LseOptions, logsumexp, reference};
use burn_kernels_core::route::launches;
use burn_kernels_testing::{
    Dist, Tolerance, assert_close, assert_close_data, compare::to_f32, float_dtypes, poison_memory,
    random_tensor, random_values, testgen,
};

use crate::kernels;

/// Shapes with the reduced dim: tails, primes, 1, a middle dim, and more rows than one grid
/// dimension holds.
const CASES: &[(&[usize], usize)] = &[
    (&[1, 1], 1),
    (&[5, 1], 1),
    (&[7, 1000], 1),
    (&[13, 4099], 1),
    (&[3, 31, 17], 1),
    (&[1, 257], 1),
    (&[2, 3, 5, 33], 0),
    (&[70_001, 3], 1),
];

fn host_lse(values: &[f32], rows: usize, cols: usize, cap: Option<f32>) -> Vec<f32> {
    (0..rows)
        .map(|r| {
            let row = values[r * cols..(r + 1) * cols].iter().map(|&x| {
                let x = x as f64;
                cap.map_or(x, |c| c as f64 * (x / c as f64).tanh())
            });
            let m = row.clone().fold(f64::NEG_INFINITY, f64::max);
            (m + row.map(|x| (x - m).exp()).sum::<f64>().ln()) as f32
        })
        .collect()
}

/// One case of rank `D` (`shape.len()`).
fn run_case<const D: usize>(
    device: &Device,
    shape: &[usize],
    dim: usize,
    dtype: DType,
    dist: Dist,
    cap: Option<f32>,
    seed: u64,
) {
    let shape: [usize; D] = shape.try_into().expect("the case's rank");
    let x = random_tensor::<D>(shape, dist, seed, dtype, device);
    // The reference sees exactly the values the kernel sees (already rounded to `dtype`).
    let host = x.to_data();
    let x_ref = Tensor::<D>::from_data(host.convert::<f32>(), &Device::flex());
    let expected = reference::logsumexp(x_ref, dim, cap).into_data();
    poison_memory(device, shape.iter().product::<usize>() * 2, dtype);
    let actual =
        kernels(device, || logsumexp(x, dim, LseOptions { softcap: cap })).expect("valid input");
    assert_eq!(actual.dtype(), dtype, "output keeps the input dtype");
    let tol = Tolerance::for_reduction(dtype, shape[dim]);
    assert_close_data(
        &format!("lse {shape:?} dim={dim} {dtype:?} {dist:?} softcap={cap:?}"),
        actual.into_data(),
        expected,
        tol,
    );
}

fn dyn_case(
    device: &Device,
    shape: &[usize],
    dim: usize,
    dtype: DType,
    dist: Dist,
    cap: Option<f32>,
    seed: u64,
) {
    let case = match shape.len() {
        2 => run_case::<2>,
        3 => run_case::<3>,
        4 => run_case::<4>,
        n => panic!("no case of rank {n}"),
    };
    case(device, shape, dim, dtype, dist, cap, seed);
}

fn forward_matches_reference(device: &Device) {
    let mut seed = 1;
    let dtypes = float_dtypes(device);
    // Shows in the CI log which runtime and dtypes the kernel was really checked on.
    eprintln!("lse kernel on {device:?} with {dtypes:?}");
    let before = launches("logsumexp");
    for dtype in dtypes {
        for &(shape, dim) in CASES {
            for dist in [Dist::STANDARD, Dist::PEAKY] {
                seed += 1;
                dyn_case(device, shape, dim, dtype, dist, None, seed);
            }
        }
    }
    // The outputs were read back: the kernel ran (through Dispatch and, where Burn fuses,
    // Fusion) and its CubeBackend implementation counted the launches.
    assert!(
        launches("logsumexp") > before,
        "no logsumexp kernel launch counted"
    );
}

fn softcap_matches_reference(device: &Device) {
    let big = Dist::Uniform {
        lo: -80.0,
        hi: 80.0,
    };
    for dtype in float_dtypes(device) {
        for (i, &(shape, dim)) in CASES.iter().enumerate().take(6) {
            dyn_case(device, shape, dim, dtype, big, Some(30.0), 100 + i as u64);
        }
    }
}

fn large_magnitudes_stay_finite(device: &Device) {
    // f32 values near 1e30 overflow a naive Σexp; the shifted sum must not.
    let values = random_values(
        4 * 300,
        Dist::Uniform {
            lo: -1e30,
            hi: 1e30,
        },
        7,
    );
    let x = Tensor::<2>::from_data(TensorData::new(values.clone(), [4, 300]), device);
    let out = kernel_lse(device, x);
    let expected = host_lse(&values, 4, 300, None);
    assert!(
        out.iter().all(|v| v.is_finite()),
        "non-finite output {out:?}"
    );
    assert_close(
        "large magnitudes",
        &out,
        &expected,
        Tolerance::for_dtype(DType::F32),
    );
}

/// The kernel's log-sum-exp of `x`'s rows (no softcap), read back.
fn kernel_lse(device: &Device, x: Tensor<2>) -> Vec<f32> {
    let out = kernels(device, || logsumexp(x, 1, LseOptions::default())).unwrap();
    to_f32(out.into_data())
}

fn special_values(device: &Device) {
    let inf = f32::INFINITY;
    let rows: [[f32; 4]; 4] = [
        [-inf, -inf, -inf, -inf],
        [-inf, 0.0, -inf, 0.0],
        [1.0, inf, -inf, 2.0],
        [3.0, 3.0, 3.0, 3.0],
    ];
    let x = Tensor::<2>::from_data(rows, device);
    let out = kernel_lse(device, x);
    let expected = [-inf, 2f32.ln(), inf, 3.0 + 4f32.ln()];
    assert_close(
        "special values",
        &out,
        &expected,
        Tolerance::for_dtype(DType::F32),
    );
}

fn grads_match_reference(device: &Device) {
    for (case, cap) in [(0u64, None), (1, Some(5.0f32))] {
        let shape = [9, 3, 131];
        let x = random_tensor::<3>(shape, Dist::PEAKY, 40 + case, DType::F32, device);
        let w = random_tensor::<3>([9, 3, 1], Dist::STANDARD, 50 + case, DType::F32, device);

        let x1 = x.clone().require_grad();
        // On a CubeCL device the kernel runs, with its backward registered by the extension's
        // Autodiff implementation.
        let y = kernels(device, || {
            logsumexp(x1.clone(), 2, LseOptions { softcap: cap })
        })
        .unwrap();
        let g = (y * w.clone()).sum().backward();
        let dx = x1.grad(&g).expect("gradient of x");

        // The reference's gradient is autodiff's own, through plain tensor ops.
        let x2 = x.require_grad();
        let y = reference::logsumexp(x2.clone(), 2, cap);
        let g = (y * w).sum().backward();
        let dx_ref = x2.grad(&g).expect("reference gradient of x");

        assert_close_data(
            &format!("lse grad softcap={cap:?}"),
            dx.into_data(),
            dx_ref.into_data(),
            Tolerance::for_reduction(DType::F32, shape[2]),
        );
    }
}

fn bad_input_gives_typed_errors(device: &Device) {
    let x = random_tensor::<2>([3, 4], Dist::STANDARD, 3, DType::F32, device);
    assert_eq!(
        logsumexp(x.clone(), 2, LseOptions::default()).unwrap_err(),
        CceError::DimOutOfRange { dim: 2, rank: 2 }
    );
    for c in [0.0, -1.0, f32::INFINITY] {
        assert_eq!(
            logsumexp(x.clone(), 1, LseOptions { softcap: Some(c) }).unwrap_err(),
            CceError::InvalidSoftcap(c)
        );
    }
    assert!(matches!(
        logsumexp(x, 1, LseOptions { softcap: Some(f32::NAN) }),
        Err(CceError::InvalidSoftcap(c)) if c.is_nan()
    ));
    let empty = Tensor::<2>::empty([3, 0], device);
    assert_eq!(
        logsumexp(empty, 1, LseOptions::default()).unwrap_err(),
        CceError::EmptyDimension {
            dim: 1,
            shape: vec![3, 0]
        }
    );
}

testgen! {
    backend: [
        forward_matches_reference,
        softcap_matches_reference,
        large_magnitudes_stay_finite,
        special_values,
        bad_input_gives_typed_errors,
    ],
    autodiff: [grads_match_reference],
}

/// The reference itself against f64 arithmetic on the host.
#[test]
fn reference_matches_f64_host() {
    let device = Device::flex();
    for (seed, cap) in [(1u64, None), (2, Some(10.0f32))] {
        let (rows, cols) = (17, 1001);
        let values = random_values(rows * cols, Dist::PEAKY, seed);
        let x = Tensor::<2>::from_data(TensorData::new(values.clone(), [rows, cols]), &device);
        let out = to_f32(reference::logsumexp(x, 1, cap).into_data());
        assert_close(
            "reference vs f64",
            &out,
            &host_lse(&values, rows, cols, cap),
            Tolerance::for_reduction(DType::F32, cols),
        );
    }
}

/// The CPU backend (Flex) runs the same public API through the reference path.
#[test]
fn cpu_backend_runs_the_public_api() {
    let device = Device::flex();
    special_values(&device);
    bad_input_gives_typed_errors(&device);
    grads_match_reference(&device.autodiff());
}
