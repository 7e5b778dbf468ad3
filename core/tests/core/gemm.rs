//! Core's fixed-kernel GEMM (`gemm::matmul`, `gemm::linear`) against f64 products of the stored
//! values, forward and gradients, on awkward sizes and transposed views; on CUDA also at the
//! SmolLM2 training shapes where Burn's autotuned bf16 matmul failed on an H200 (2026-11-28).

use super::projections::f32s;
use burn::tensor::{DType, Device, Tensor};
use burn_kernels_core::gemm;
use burn_kernels_core::route::{cube_device, launches, require_kernels};
use burn_kernels_testing::{
    Dist, assert_product_close, compare::to_f32, float_dtypes, poison_memory, random_tensor,
};

/// `a · b` of host copies in f64, rounded to f32: `a` `[m, k]`, `b` `[k, n]`, both row-major.
fn host_product(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    f32s(&super::projections::host_product(a, b, m, k, n))
}

/// Row-major host copy of the transpose of a `[rows, cols]` row-major matrix.
fn host_transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols)
        .flat_map(|c| (0..rows).map(move |r| x[r * cols + c]))
        .collect()
}

fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
}

/// `f` with kernels required where the device runs them and the dtype takes the kernel.
fn kernel_call<T>(device: &Device, dtype: DType, f: impl FnOnce() -> T) -> T {
    if cube_device(device).is_some() && is_half(dtype) {
        require_kernels(f)
    } else {
        f()
    }
}

/// `[k, n]` operand, stored as given or as the transposed view of a `[n, k]` tensor.
fn operand(k: usize, n: usize, transposed: bool, seed: u64, dtype: DType, d: &Device) -> Tensor<2> {
    if transposed {
        random_tensor::<2>([n, k], Dist::STANDARD, seed, dtype, d).transpose()
    } else {
        random_tensor::<2>([k, n], Dist::STANDARD, seed, dtype, d)
    }
}

/// Seeded `a` `[m, k]` and `b` `[k, n]` (a transposed view where `transposed`), their f64 host
/// product, and `m · n` NaN-poisoned elements of the device's memory for the output to land in.
fn product_case(
    [m, k, n]: [usize; 3],
    transposed: bool,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> (Tensor<2>, Tensor<2>, Vec<f32>) {
    let a = random_tensor::<2>([m, k], Dist::STANDARD, seed, dtype, device);
    let b = operand(k, n, transposed, seed + 1, dtype, device);
    let want = host_product(&to_f32(a.to_data()), &to_f32(b.to_data()), m, k, n);
    poison_memory(device, m * n, dtype);
    (a, b, want)
}

/// One row, one column and one inner element; primes; sizes below a tensor-core tile (the
/// unit kernel) and above it with tails; `b` contiguous and as a transposed view. Outputs land
/// in NaN-poisoned memory.
pub fn gemm_matches_host_products(device: &Device) {
    let before = launches("gemm");
    let mut half_calls = 0;
    let cases = [
        [1, 1, 1],
        [7, 13, 5],
        [37, 97, 45],
        [130, 64, 96],
        [33, 129, 17],
    ];
    for dtype in float_dtypes(device) {
        for (i, [m, k, n]) in cases.into_iter().enumerate() {
            for transposed in [false, true] {
                let seed = 300 + 4 * i as u64 + 2 * transposed as u64;
                let (a, b, want) = product_case([m, k, n], transposed, seed, dtype, device);
                let got = kernel_call(device, dtype, || gemm::matmul(a, b));
                half_calls += is_half(dtype) as u64;
                assert_eq!((got.dims(), got.dtype()), ([m, n], dtype));
                let name = format!("gemm {dtype:?} [{m}×{k}]·[{k}×{n}] transposed b {transposed}");
                assert_product_close(&name, &to_f32(got.into_data()), &want, dtype, k, device);
            }
        }
        // The 3-D projection: rows of every batch element.
        let x = random_tensor::<3>([2, 3, 19], Dist::STANDARD, 390, dtype, device);
        let w = random_tensor::<2>([19, 11], Dist::STANDARD, 391, dtype, device);
        let want = host_product(&to_f32(x.to_data()), &to_f32(w.to_data()), 6, 19, 11);
        let got = kernel_call(device, dtype, || gemm::linear(x, w));
        half_calls += is_half(dtype) as u64;
        assert_eq!(got.dims(), [2, 3, 11]);
        let name = format!("linear {dtype:?} [2×3×19]·[19×11]");
        assert_product_close(&name, &to_f32(got.into_data()), &want, dtype, 19, device);
    }
    if cube_device(device).is_some() {
        // At least: the autodiff test may launch it concurrently.
        let launched = launches("gemm") - before;
        assert!(
            launched >= half_calls,
            "{launched} launches for {half_calls} f16/bf16 calls"
        );
    }
}

/// [`gemm::GemmKernels::gemm`] on batches of matrices against per-batch f64 host products: one
/// element; primes with the right operand as a transposed view. f16/bf16 inputs (the kernel's
/// fast path), outputs in NaN-poisoned memory.
pub fn batched_gemm_matches_host(device: &Device) {
    use burn::backend::Dispatch;
    use burn_kernels_core::gemm::GemmKernels;
    let before = launches("gemm");
    let mut calls = 0;
    for dtype in float_dtypes(device).into_iter().filter(|d| is_half(*d)) {
        for (i, [batch, m, k, n]) in [[1, 1, 1, 1], [3, 37, 29, 11], [2, 70, 64, 33]]
            .into_iter()
            .enumerate()
        {
            let seed = 500 + 4 * i as u64;
            let a = random_tensor::<3>([batch, m, k], Dist::STANDARD, seed, dtype, device);
            let b = random_tensor::<3>([batch, n, k], Dist::STANDARD, seed + 1, dtype, device)
                .swap_dims(1, 2);
            let (ha, hb) = (to_f32(a.to_data()), to_f32(b.to_data()));
            let want: Vec<f32> = (0..batch)
                .flat_map(|e| {
                    let (sa, sb) = (&ha[e * m * k..][..m * k], &hb[e * k * n..][..k * n]);
                    host_product(sa, sb, m, k, n)
                })
                .collect();
            poison_memory(device, batch * m * n, dtype);
            let got = Tensor::<3>::from_dispatch(Dispatch::gemm(
                a.clone().into_dispatch(),
                b.clone().into_dispatch(),
            ));
            calls += 1;
            assert_eq!((got.dims(), got.dtype()), ([batch, m, n], dtype));
            let name = format!("gemm {dtype:?} [{batch}×{m}×{k}]·[{k}×{n}]ᵀ");
            assert_product_close(&name, &to_f32(got.into_data()), &want, dtype, k, device);
        }
    }
    let launched = launches("gemm") - before;
    assert!(launched >= calls, "{launched} launches for {calls} calls");
}

/// `[dA, dB]` of `sum(gemm(a, b) ⊙ g)`.
fn gradients(a: Tensor<2>, b: Tensor<2>, g: Tensor<2>) -> [Vec<f32>; 2] {
    let (a, b) = (a.require_grad(), b.require_grad());
    let loss = (gemm::matmul(a.clone(), b.clone()).cast(DType::F32) * g.cast(DType::F32)).sum();
    let grads = loss.backward();
    let grad = |t: &Tensor<2>| {
        let grad = t.grad(&grads).expect("a gradient for both inputs");
        to_f32(grad.cast(DType::F32).into_data())
    };
    [grad(&a), grad(&b)]
}

/// On an autodiff device: the gradients of both operands, against host products of the
/// upstream gradient (exact in the dtype) with the other operand.
pub fn gemm_gradients_match_host(device: &Device) {
    let before = launches("gemm");
    for dtype in float_dtypes(device) {
        for (i, [m, k, n]) in [[1, 3, 2], [37, 97, 45], [64, 48, 80]]
            .into_iter()
            .enumerate()
        {
            let seed = 400 + 3 * i as u64;
            let a = random_tensor::<2>([m, k], Dist::STANDARD, seed, dtype, device);
            let b = operand(k, n, i == 1, seed + 1, dtype, device);
            let g = random_tensor::<2>([m, n], Dist::STANDARD, seed + 2, dtype, device);
            let (ha, hb, hg) = (
                to_f32(a.to_data()),
                to_f32(b.to_data()),
                to_f32(g.to_data()),
            );
            let want_a = host_product(&hg, &host_transpose(&hb, k, n), m, n, k);
            let want_b = host_product(&host_transpose(&ha, m, k), &hg, k, m, n);
            let [da, db] = kernel_call(device, dtype, || gradients(a, b, g));
            let name = format!("{dtype:?} [{m}×{k}]·[{k}×{n}]");
            assert_product_close(&format!("dA {name}"), &da, &want_a, dtype, n, device);
            assert_product_close(&format!("dB {name}"), &db, &want_b, dtype, m, device);
        }
    }
    let half = float_dtypes(device).into_iter().any(is_half);
    if cube_device(device).is_some() && half {
        assert!(
            launches("gemm") > before,
            "the gradients ran the GEMM kernel"
        );
    }
}

/// bf16 and f16 at the SmolLM2-135M training shapes where Burn's autotuned matmul failed on an
/// H200 (a row-major `lhs` with `m ≥ 4n`: the forward of the K/V and down projections and the
/// input gradient of the Q/K/V ones), forward and gradients, against Burn's f32 matmul of the
/// same (exactly representable) values with TF32 off.
#[cfg(feature = "cuda")]
pub fn gemm_runs_at_training_shapes(device: &Device) {
    for dtype in float_dtypes(device).into_iter().filter(|&d| is_half(d)) {
        for (i, [m, k, n]) in [[2312, 576, 192], [4104, 576, 576], [2312, 1536, 576]]
            .into_iter()
            .enumerate()
        {
            let seed = 500 + 3 * i as u64;
            let a = random_tensor::<2>([m, k], Dist::STANDARD, seed, dtype, device);
            let b = random_tensor::<2>([k, n], Dist::STANDARD, seed + 1, dtype, device);
            let g = random_tensor::<2>([m, n], Dist::STANDARD, seed + 2, dtype, device);
            let f32_product = |x: &Tensor<2>, y: Tensor<2>| {
                to_f32(
                    x.clone()
                        .cast(DType::F32)
                        .matmul(y.cast(DType::F32))
                        .into_data(),
                )
            };
            let want = f32_product(&a, b.clone());
            let want_da = f32_product(&g, b.clone().transpose());
            let want_db = f32_product(&a.clone().transpose(), g.clone());
            let got = require_kernels(|| gemm::matmul(a.clone(), b.clone()));
            let name = format!("{dtype:?} [{m}×{k}]·[{k}×{n}]");
            let check = |what: &str, got: &[f32], want: &[f32], len| {
                assert_product_close(what, got, want, dtype, len, device)
            };
            check(&name, &to_f32(got.into_data()), &want, k);
            let ad = device.clone().autodiff();
            let on = |t: &Tensor<2>| Tensor::<2>::from_data(t.to_data(), &ad);
            let [da, db] = require_kernels(|| gradients(on(&a), on(&b), on(&g)));
            check(&format!("dA {name}"), &da, &want_da, n);
            check(&format!("dB {name}"), &db, &want_db, m);
        }
    }
}

/// This crate's Hopper kernel ([`gemm::GemmKernel::Wgmma`]: warpgroup MMA fed by TMA), through
/// `gemm::matmul` and its gradients, against f64 host products: tails in M, N and K (TMA's zero
/// fill), both layouts of each operand (a transposed `b` is K-major, the weight gradient's `aᵀ`
/// MN-major), split K (a long K with one output tile; the SmolLM2 K/V projection's 19 tiles),
/// no split (33 × 3 tiles). Every call must have run the kernel (counted once its launch was
/// checked, so a refused launch that fell back to cubek's kernel fails here), down to
/// [`gemm::FIXED_MIN_ROWS`] rows; below it (15 rows, one row: decode batches) the product must
/// go to Burn's matmul instead, still correct. A K of 67 runs whichever the layout allows
/// (Burn's allocator may pad the rows to an address TMA can read). Outputs land in
/// NaN-poisoned memory. Launches are counted on this test's stream: the other GEMM tests run
/// beside it, and while it sets the default kernel theirs may take the Hopper kernel too.
#[cfg(feature = "cuda")]
pub fn hopper_gemm_matches_host(device: &Device) {
    use burn_kernels_core::gemm::{GemmKernel, default_kernel, launch::WGMMA_LAUNCHES};
    use burn_kernels_core::route::stream_launches;
    let before_default = default_kernel();
    gemm::set_default_kernel(GemmKernel::Wgmma);
    let cases: [([usize; 3], Option<bool>); 10] = [
        ([16, 16, 16], Some(true)),
        ([gemm::FIXED_MIN_ROWS - 1, 64, 72], Some(false)),
        ([131, 64, 72], Some(true)),
        ([200, 584, 328], Some(true)),
        ([64, 8192, 96], Some(true)),
        ([2312, 576, 192], Some(true)),
        ([4104, 576, 576], Some(true)),
        ([300, 1536, 1544], Some(true)),
        ([37, 67, 45], None),
        ([1, 64, 64], Some(false)),
    ];
    for dtype in [DType::BF16, DType::F16] {
        for (i, ([m, k, n], runs)) in cases.into_iter().enumerate() {
            for transposed in [false, true] {
                let seed = 700 + 4 * i as u64 + 2 * transposed as u64;
                let (a, b, want) = product_case([m, k, n], transposed, seed, dtype, device);
                let before = stream_launches(WGMMA_LAUNCHES);
                let got = to_f32(gemm::matmul(a, b).into_data());
                let ran = stream_launches(WGMMA_LAUNCHES) - before;
                let name = format!("wgmma {dtype:?} [{m}×{k}]·[{k}×{n}] transposed b {transposed}");
                if let Some(runs) = runs {
                    assert_eq!(ran, runs as u64, "{name}: Hopper kernel launches");
                }
                assert_product_close(&name, &got, &want, dtype, k, device);
            }
        }
        // Gradients: dA = g · bᵀ (a K-major transposed `b`), dB = aᵀ · g (an MN-major `aᵀ`).
        let ad = device.clone().autodiff();
        let [m, k, n] = [200, 584, 328];
        let a = random_tensor::<2>([m, k], Dist::STANDARD, 790, dtype, &ad);
        let b = random_tensor::<2>([k, n], Dist::STANDARD, 791, dtype, &ad);
        let g = random_tensor::<2>([m, n], Dist::STANDARD, 792, dtype, &ad);
        let (ha, hb, hg) = (
            to_f32(a.to_data()),
            to_f32(b.to_data()),
            to_f32(g.to_data()),
        );
        let before = stream_launches(WGMMA_LAUNCHES);
        let [da, db] = gradients(a, b, g);
        let ran = stream_launches(WGMMA_LAUNCHES) - before;
        assert_eq!(
            ran, 3,
            "wgmma {dtype:?}: forward, dA and dB on the Hopper kernel"
        );
        let want_a = host_product(&hg, &host_transpose(&hb, k, n), m, n, k);
        let want_b = host_product(&host_transpose(&ha, m, k), &hg, k, m, n);
        assert_product_close(
            &format!("wgmma dA {dtype:?}"),
            &da,
            &want_a,
            dtype,
            n,
            device,
        );
        assert_product_close(
            &format!("wgmma dB {dtype:?}"),
            &db,
            &want_b,
            dtype,
            m,
            device,
        );
    }
    gemm::set_default_kernel(before_default);
}

/// The Hopper kernel's adding store ([`gemm::hopper::hopper_gemm_add`]): two products added into
/// a seeded f32 accumulator (not zeros, so a store that overwrites fails) against the f64 host
/// sums, at tails in M, N and K, a transposed `b`, and a long K over one tile (split K: the
/// partial sums are added by the second kernel), every element within f32's tolerance.
#[cfg(feature = "cuda")]
pub fn hopper_gemm_add_accumulates(device: &Device) {
    use burn_kernels_testing::unfused::{float, read_float};
    for dtype in [DType::BF16, DType::F16] {
        for (i, ([m, k, n], transposed)) in ADD_CASES.into_iter().enumerate() {
            let seed = 900 + 8 * i as u64;
            let name = format!("wgmma add {dtype:?} [{m}×{k}]·[{k}×{n}] transposed b {transposed}");
            let acc0 = random_tensor::<1>([m * n], Dist::STANDARD, seed, DType::F32, device);
            let mut want = to_f32(acc0.to_data());
            let acc = dense(&acc0, [m, n], device);
            for p in 0..2u64 {
                let a = random_tensor::<2>([m, k], Dist::STANDARD, seed + 1 + 2 * p, dtype, device);
                let b = operand(k, n, transposed, seed + 2 + 2 * p, dtype, device);
                let prod = host_product(&to_f32(a.to_data()), &to_f32(b.to_data()), m, k, n);
                want.iter_mut().zip(prod).for_each(|(w, x)| *w += x);
                gemm::hopper::hopper_gemm_add(&float(&a, device), &float(&b, device), &acc)
                    .unwrap_or_else(|why| panic!("{name}: {why}"));
            }
            let got = to_f32(read_float(acc));
            // Exact 16-bit inputs, f32 sums of 2K terms and the accumulator's own value.
            let tol = burn_kernels_testing::Tolerance::for_reduction(DType::F32, 2 * k + 1);
            burn_kernels_testing::assert_close(&name, &got, &want, tol);
        }
    }
    // An accumulator of another shape or dtype, or with pitched rows, is refused, not written.
    let [a, b] = refusal_operands(device);
    let wrong = float(
        &random_tensor::<2>([128, 32], Dist::STANDARD, 3, DType::F32, device),
        device,
    );
    assert!(gemm::hopper::hopper_gemm_add(&a, &b, &wrong).is_err());
    let half = float(
        &random_tensor::<2>([128, 64], Dist::STANDARD, 3, DType::BF16, device),
        device,
    );
    assert!(gemm::hopper::hopper_gemm_add(&a, &b, &half).is_err());
    // A view of 64 of 72 columns: rows 72 apart (a `from_data` of a sliced tensor would copy it
    // into a fresh allocation, which CUDA may or may not pitch).
    let wide = random_tensor::<1>([128 * 72], Dist::STANDARD, 4, DType::F32, device);
    let strided = {
        use burn::backend::ops::FloatTensorOps;
        burn_cubecl::CubeBackend::float_slice(
            dense(&wide, [128, 72], device),
            &[
                burn::tensor::Slice::from(0..128),
                burn::tensor::Slice::from(0..64),
            ],
        )
    };
    assert_eq!(
        strided.meta.strides()[0],
        72,
        "the view keeps its parent's rows"
    );
    assert!(gemm::hopper::hopper_gemm_add(&a, &b, &strided).is_err());
}

/// The adding GEMMs' problems `[m, k, n]` and whether `b` is transposed: tails in M, N and K, and
/// a long K over one tile.
#[cfg(feature = "cuda")]
const ADD_CASES: [([usize; 3], bool); 4] = [
    ([131, 64, 72], false),
    ([200, 584, 330], true),
    ([64, 8192, 96], true),
    ([131, 200, 144], false),
];

/// Valid bf16 operands `[128, 64]` and `[64, 64]` beside which the adding GEMMs' refused
/// accumulators are tried.
#[cfg(feature = "cuda")]
fn refusal_operands(
    device: &Device,
) -> [burn::backend::tensor::FloatTensor<burn_cubecl::CubeBackend>; 2] {
    use burn_kernels_testing::unfused::float;
    [([128, 64], 1), ([64, 64], 2)].map(|(shape, seed)| {
        float(
            &random_tensor::<2>(shape, Dist::STANDARD, seed, DType::BF16, device),
            device,
        )
    })
}

/// `flat`'s values as an unfused `[rows, cols]` CubeCL tensor without row padding: a new 2-D
/// CUDA allocation has its rows pitched (to 512 bytes), which the adding stores refuse; the
/// reshape of a 1-D one is a view.
#[cfg(feature = "cuda")]
fn dense(
    flat: &Tensor<1>,
    [rows, cols]: [usize; 2],
    device: &Device,
) -> burn::backend::tensor::FloatTensor<burn_cubecl::CubeBackend> {
    use burn::backend::ops::FloatTensorOps;
    burn_cubecl::CubeBackend::float_reshape(
        burn_kernels_testing::unfused::float(flat, device),
        burn::tensor::Shape::new([rows, cols]),
    )
}

/// The value of a compensated pair: `hi + fix · |hi| · 2⁻¹⁵`.
#[cfg(feature = "cuda")]
fn decoded(hi: &[f32], fix: &[i8]) -> Vec<f64> {
    hi.iter()
        .zip(fix)
        .map(|(&h, &q)| h as f64 + q as f64 * (h.abs() as f64 / 32768.0))
        .collect()
}

/// The Hopper kernel's compensated adding store
/// ([`gemm::hopper::hopper_gemm_add_compensated`]): a dozen products added into a 16-bit sum
/// and its i8 corrections, both seeded (a valid pair, not zeros: a store that ignores either
/// fails), against the f64 host sums, at tails in M, N and K, a transposed `b`, and a long K
/// (never split). The pair's value must stay within `products · max|partial sum| · 2⁻¹⁶` of the
/// exact sum (bf16: about 2⁻¹⁶ of the sum per addition), far below what adding in bf16 alone
/// loses (`2⁻⁹` of the sum per addition); the 16-bit sum itself is that value rounded to its
/// dtype. Every [`gemm::hopper::CompensatedStore`] that fits a case runs it (prefetched: `n` a
/// multiple of 16; wide: of 8), and the default's choice once more.
#[cfg(feature = "cuda")]
pub fn hopper_gemm_add_compensated_keeps_the_bits(device: &Device) {
    use gemm::hopper::CompensatedStore;
    for ([m, k, n], transposed) in ADD_CASES {
        let fitting = [
            (CompensatedStore::Persistent, n % 16 == 0),
            (CompensatedStore::Prefetched, n % 16 == 0),
            (CompensatedStore::Wide, n % 8 == 0),
            (CompensatedStore::Pairwise, true),
        ];
        for (store, fits) in fitting {
            compensated_case(device, [m, k, n], transposed, Some(store), fits, PRODUCTS);
        }
        compensated_case(device, [m, k, n], transposed, None, true, PRODUCTS);
    }
    compensated_refusals(device);
}

/// Products added by each case of [`hopper_gemm_add_compensated_keeps_the_bits`].
#[cfg(feature = "cuda")]
const PRODUCTS: u64 = 12;

/// The persistent compensated store ([`gemm::hopper::CompensatedStore::Persistent`]) where its
/// cubes (one an SM: 132 on an H100) walk several tiles each, the ring and the
/// pair's shared memory carried from tile to tile: 9 × 31 = 279 tiles of K = 72 (two stages,
/// one partial, of a four-stage ring: its parities flip unevenly) and 9 × 17 = 153 tiles of
/// K = 328 (six stages), tails in M and N, two products each (the second added into what the
/// first left); the prefetched one-tile kernel on the same case alongside.
#[cfg(feature = "cuda")]
pub fn hopper_gemm_add_compensated_walks_tiles(device: &Device) {
    use gemm::hopper::CompensatedStore;
    for [m, k, n] in [[1031, 72, 3856], [1031, 328, 2064]] {
        for store in [CompensatedStore::Persistent, CompensatedStore::Prefetched] {
            compensated_case(device, [m, k, n], false, Some(store), true, 2);
        }
    }
}

/// One case of [`hopper_gemm_add_compensated_keeps_the_bits`] with `store` (`None`: the
/// default's choice); where it does not `fit`, the store must be refused.
#[cfg(feature = "cuda")]
fn compensated_case(
    device: &Device,
    [m, k, n]: [usize; 3],
    transposed: bool,
    store: Option<gemm::hopper::CompensatedStore>,
    fits: bool,
    products: u64,
) {
    use burn::backend::ops::IntTensorOps;
    use burn::tensor::{Shape, TensorData};
    use burn_cubecl::CubeBackend;
    use burn_kernels_testing::unfused::{float, read_float, read_int};
    {
        let dtype = DType::BF16;
        let seed = 950 + (m + 3 * n) as u64;
        let name = format!(
            "wgmma compensated add ({store:?}) [{m}×{k}]·[{k}×{n}] transposed b {transposed}"
        );
        let hi0 = random_tensor::<1>([m * n], Dist::STANDARD, seed, dtype, device);
        let fix0: Vec<i8> =
            random_tensor::<1>([m * n], Dist::STANDARD, seed + 1, DType::F32, device)
                .into_data()
                .try_to_vec::<f32>()
                .expect("f32")
                .iter()
                .map(|x| (x * 40.0).clamp(-127.0, 127.0) as i8)
                .collect();
        let mut want = decoded(&to_f32(hi0.to_data()), &fix0);
        let sum = dense(&hi0, [m, n], device);
        let cube = burn_kernels_testing::unfused::cube_device(device);
        let fix = CubeBackend::int_reshape(
            CubeBackend::int_from_data(TensorData::new(fix0, [m * n]), &cube),
            Shape::new([m, n]),
        );
        let mut largest = want.iter().fold(0f64, |a, w| a.max(w.abs()));
        for p in 0..products {
            let a = random_tensor::<2>([m, k], Dist::STANDARD, seed + 2 + 2 * p, dtype, device);
            let b = operand(k, n, transposed, seed + 3 + 2 * p, dtype, device);
            let prod = host_product(&to_f32(a.to_data()), &to_f32(b.to_data()), m, k, n);
            want.iter_mut().zip(prod).for_each(|(w, x)| *w += x as f64);
            largest = want.iter().fold(largest, |a, w| a.max(w.abs()));
            let (a, b) = (float(&a, device), float(&b, device));
            let added = match store {
                Some(store) => {
                    gemm::hopper::hopper_gemm_add_compensated_with(&a, &b, &sum, &fix, store)
                }
                None => gemm::hopper::hopper_gemm_add_compensated(&a, &b, &sum, &fix),
            };
            if !fits {
                assert!(added.is_err(), "{name}: a store that does not fit ran");
                return;
            }
            added.unwrap_or_else(|why| panic!("{name}: {why}"));
        }
        let hi = to_f32(read_float(sum));
        let fix = read_int(fix).try_to_vec::<i8>().expect("i8 corrections");
        let got = decoded(&hi, &fix);
        let pair_tol = products as f64 * largest / 65536.0;
        for (j, ((g, w), h)) in got.iter().zip(&want).zip(&hi).enumerate() {
            assert!(
                (g - w).abs() <= pair_tol,
                "{name}: value {j}: pair {g} vs exact {w} (tolerance {pair_tol})"
            );
            // bf16 keeps 8 significant bits: the sum is the pair rounded to them.
            assert!(
                (*h as f64 - w).abs() <= w.abs() / 256.0 + pair_tol,
                "{name}: value {j}: sum {h} vs exact {w}"
            );
        }
    }
}

/// The compensated adding store's refusals: a sum of another dtype, or corrections of another
/// shape, are refused, not written.
#[cfg(feature = "cuda")]
fn compensated_refusals(device: &Device) {
    use burn::backend::ops::IntTensorOps;
    use burn::tensor::{Shape, TensorData};
    use burn_cubecl::CubeBackend;
    let [a, b] = refusal_operands(device);
    let cube = burn_kernels_testing::unfused::cube_device(device);
    let fix = |len: usize| {
        CubeBackend::int_reshape(
            CubeBackend::int_from_data(TensorData::new(vec![0i8; 128 * len], [128 * len]), &cube),
            Shape::new([128, len]),
        )
    };
    let f32_sum = dense(
        &random_tensor::<1>([128 * 64], Dist::STANDARD, 3, DType::F32, device),
        [128, 64],
        device,
    );
    assert!(gemm::hopper::hopper_gemm_add_compensated(&a, &b, &f32_sum, &fix(64)).is_err());
    let sum = dense(
        &random_tensor::<1>([128 * 64], Dist::STANDARD, 3, DType::BF16, device),
        [128, 64],
        device,
    );
    assert!(gemm::hopper::hopper_gemm_add_compensated(&a, &b, &sum, &fix(32)).is_err());
    // The refusals are for the reasons above: these operands are accepted.
    gemm::hopper::hopper_gemm_add_compensated(&a, &b, &sum, &fix(64)).expect("a valid pair");
}
