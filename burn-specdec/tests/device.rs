//! The device kernel [`verify_blocks`] against the host [`verify_block`] on the same rows and
//! the same uniforms, on every enabled runtime (Vulkan via lavapipe, CUDA).
//!
//! Agreement is asserted exactly on every sequence. The device computes in f32, the host in
//! f64, so a decision may only differ when a uniform lies within rounding distance of its
//! threshold; the uniforms are therefore drawn so that none is within [`MARGIN`] of one: at
//! each position the host's decision is recomputed with every used uniform moved by
//! `±MARGIN`, and a uniform whose move changes the decision is redrawn. Unused uniforms
//! (beyond `K_j + 2`, and after the block ends) are NaN, so reading one would show.
//!
//! Importance sampling can also differ when its plan is decided by rounding: two of the host's
//! candidate selection rules accept within 1e-6 of each other (below f32 resolution) but decide
//! differently. A sweep tolerates at most 1 such sequence per 1000, and only where a test-side
//! copy of the host's candidates (checked against the host's selection law) shows the tie.

// Without a CubeCL runtime feature there is no device verifier to test.
#![cfg_attr(not(feature = "cube"), allow(dead_code, unused_imports))]

use std::collections::HashMap;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_kernels_core::route::{launches, require_kernels};
use burn_kernels_testing::{poison_memory, testgen};
use burn_specdec::device::{
    DeviceBlockOutcome, IS_MAX_VOCAB, OP_NAME, PAD_TOKEN, STATUS_BAD_TOKEN, verify_blocks,
};
use burn_specdec::schemes::importance::{Candidate, for_each_candidate};
use burn_specdec::{
    BlockOutcome, Result, Scheme, SpecDecError, Verifier, inverse_cdf, uniforms_per_token,
    verify_block,
};
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

mod host;
mod inputs;
use host::*;
use inputs::*;

/// Distance every used uniform keeps from its threshold (f32 rounding of the thresholds is
/// ~1e-7 relative).
const MARGIN: f64 = 2e-6;
/// Importance-sampling candidates whose acceptances are this close (relative) are a tie for
/// the f32 device: it may keep either.
const CANDIDATE_TIE: f64 = 1e-6;
/// Near-tie disagreements tolerated per 1000 sequences of a sweep (rounded up).
const NEAR_TIES_PER_MILLE: usize = 1;
/// Uniforms are multiples of 2^-24: exact in f32, and exactly what the scripted host RNG
/// yields.
const GRID: f64 = (1u64 << 24) as f64;

/// [`verify_blocks`] with kernels required: on a CubeCL device the call must reach the kernel
/// (it panics instead of returning [`SpecDecError::NoDeviceKernel`]).
fn verify(
    scheme: Scheme,
    target: Tensor<4>,
    draft: Tensor<4>,
    drafts: Tensor<3, Int>,
    uniforms: Tensor<3>,
) -> Result<DeviceBlockOutcome> {
    require_kernels(|| verify_blocks(scheme, target, draft, drafts, uniforms))
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Style {
    /// Dirichlet(1) rows.
    Flat,
    /// Near one-hot rows (`exp(6 z)`, z standard normal).
    Peaky,
    /// Dirichlet(1) rows with half of the entries zero.
    Sparse,
    /// Every draft row equals the target row of the same prefix.
    QEqualsP,
    /// Target on even tokens, drafts on odd tokens (V ≥ 2).
    Disjoint,
}

fn ints(t: TensorData) -> Vec<i64> {
    t.try_into_vec_as::<i64>().expect("ints")
}

fn flat3(x: &[Vec<Vec<f32>>]) -> impl Iterator<Item = f32> + '_ {
    x.iter().flatten().flatten().copied()
}

/// The input tensors of a batch of `cases` (vocabulary `v`, `k` drafts of length `l`).
fn batch_tensors(
    device: &Device,
    [v, k, l]: [usize; 3],
    cases: &[(Seq, Vec<f32>, BlockOutcome)],
) -> (Tensor<4>, Tensor<4>, Tensor<3, Int>, Tensor<3>) {
    let batch = cases.len();
    let target: Vec<f32> = cases.iter().flat_map(|c| flat3(&c.0.target)).collect();
    let draft: Vec<f32> = cases.iter().flat_map(|c| flat3(&c.0.draft)).collect();
    let drafts: Vec<i32> = cases
        .iter()
        .flat_map(|c| c.0.drafts.iter().flatten().map(|&x| x as i32))
        .collect();
    let uniforms: Vec<f32> = cases.iter().flat_map(|c| c.1.iter().copied()).collect();
    let stride = uniforms_per_token(k);
    (
        Tensor::<4>::from_data(TensorData::new(target, [batch, k, l + 1, v]), device),
        Tensor::<4>::from_data(TensorData::new(draft, [batch, k, l, v]), device),
        Tensor::<3, Int>::from_data(TensorData::new(drafts, [batch, k, l]), device),
        Tensor::<3>::from_data(TensorData::new(uniforms, [batch, l + 1, stride]), device),
    )
}

/// Runs `B = cases.len()` sequences in one launch and compares every output element; records
/// each sequence that differs anywhere.
#[allow(clippy::too_many_arguments)]
fn run_batch(
    device: &Device,
    scheme: Scheme,
    v: usize,
    k: usize,
    l: usize,
    cases: &[(Seq, Vec<f32>, BlockOutcome)],
    label: &str,
    tally: &mut Tally,
) {
    let batch = cases.len();
    tally.sequences += batch;
    let (target, draft, drafts, uniforms) = batch_tensors(device, [v, k, l], cases);
    // NaN bits in the pool that the (4-byte int) outputs come from: an unwritten element reads
    // as a huge integer, never as a token, count or mask value.
    for elems in [batch * (l + 1), batch * k, batch] {
        poison_memory(device, elems, DType::F32);
    }
    let before = launches(OP_NAME);
    let out = verify(scheme, target, draft, drafts, uniforms).expect("valid launch");
    let tokens = ints(out.tokens.into_data());
    let accepted = ints(out.accepted.into_data());
    let survivors = ints(out.survivors.into_data());
    let status = ints(out.status.into_data());
    // The outputs were read back, so the kernel ran (through Dispatch and, where Burn fuses,
    // Fusion) and its CubeBackend implementation counted the launch.
    assert!(
        launches(OP_NAME) > before,
        "{label}: no kernel launch counted"
    );
    assert_eq!(tokens.len(), batch * (l + 1));
    for (b, (_, _, host)) in cases.iter().enumerate() {
        let mut want: Vec<i64> = host.tokens.iter().map(|&t| t as i64).collect();
        want.resize(l + 1, PAD_TOKEN as i64);
        let want_surv: Vec<i64> = (0..k).map(|d| host.survivors.contains(&d) as i64).collect();
        let got = (
            status[b],
            &tokens[b * (l + 1)..(b + 1) * (l + 1)],
            accepted[b],
            &survivors[b * k..(b + 1) * k],
        );
        if got != (0, &want[..], host.accepted as i64, &want_surv[..]) {
            let report = format!(
                "{label} b={b}: host {host:?}, device (status, tokens, accepted, survivors) \
                 {got:?}"
            );
            if status[b] == 0 && host_near_tie(scheme, &cases[b].0, &cases[b].1, host, got.1) {
                tally.near_ties.push(report);
            } else {
                tally.mismatches.push(report);
            }
        }
    }
}

/// Every device scheme, K, style and `L ∈ 1..=5` at vocabulary size `v`, `batches` launches of
/// `batch` sequences each.
fn sweep(device: &Device, v: usize, lens: &[usize], batch: usize, batches: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut tally = Tally::default();
    for (scheme, ks) in schemes() {
        for &k in ks {
            for style in STYLES {
                for &l in lens {
                    for rep in 0..batches {
                        let cases: Vec<_> = (0..batch)
                            .map(|_| host_case(scheme, v, k, l, style, &mut rng))
                            .collect();
                        let label = format!("{} V={v} K={k} L={l} {style:?} #{rep}", scheme.name());
                        run_batch(device, scheme, v, k, l, &cases, &label, &mut tally);
                    }
                }
            }
        }
    }
    tally.assert_agreement();
}

/// V = 1 (every decision forced) and V = 7 (frequent shared tokens, many survivors), B = 1 and
/// B = 3, every L in 1..=5.
fn small_vocabularies_match_host(device: &Device) {
    sweep(device, 1, &[1, 5], 3, 1, 1);
    sweep(device, 7, &[1, 2, 3, 4, 5], 1, 1, 2);
    sweep(device, 7, &[1, 3, 5], 3, 4, 3);
}

/// Many sequences per launch at V = 7: a statistical sweep over the decision branches.
fn many_sequences_match_host(device: &Device) {
    sweep(device, 7, &[4], 40, 3, 4);
}

fn vocab_1000_matches_host(device: &Device) {
    sweep(device, 1000, &[1, 3], 3, 1, 5);
}

/// The full vocabulary size of a real tokenizer (prime-ish, not a multiple of the cube size).
///
/// Importance sampling gave wrong tokens on lavapipe at V = 16384 and above (cause not
/// understood): the kernel refuses V > `IS_MAX_VOCAB` with a typed error (checked in
/// `typed_errors`) and runs here at exactly that bound.
fn vocab_32003_matches_host(device: &Device) {
    let mut rng = StdRng::seed_from_u64(6);
    let mut tally = Tally::default();
    let sequential = schemes()
        .into_iter()
        .filter(|(s, _)| *s != Scheme::SequentialImportance);
    for (scheme, ks) in sequential {
        for (&k, style) in ks
            .iter()
            .zip([Style::Peaky, Style::Flat, Style::QEqualsP, Style::Flat])
        {
            let l = 2;
            let batch = if k == 2 { 3 } else { 1 };
            let cases: Vec<_> = (0..batch)
                .map(|_| host_case(scheme, 32_003, k, l, style, &mut rng))
                .collect();
            let label = format!("{} V=32003 K={k} L={l} {style:?}", scheme.name());
            run_batch(device, scheme, 32_003, k, l, &cases, &label, &mut tally);
        }
    }
    let (k, l) = (2, 2);
    let cases: Vec<_> = (0..2)
        .map(|_| {
            host_case(
                Scheme::SequentialImportance,
                IS_MAX_VOCAB,
                k,
                l,
                Style::Peaky,
                &mut rng,
            )
        })
        .collect();
    let label = format!("IS V={IS_MAX_VOCAB} K={k} L={l}");
    run_batch(
        device,
        Scheme::SequentialImportance,
        IS_MAX_VOCAB,
        k,
        l,
        &cases,
        &label,
        &mut tally,
    );
    tally.assert_agreement();
}

/// `L = 0`: only the bonus token.
fn bonus_only_blocks_match_host(device: &Device) {
    let mut rng = StdRng::seed_from_u64(7);
    let mut tally = Tally::default();
    for (scheme, ks) in schemes() {
        let k = *ks.last().expect("a draft count");
        let cases: Vec<_> = (0..3)
            .map(|_| host_case(scheme, 7, k, 0, Style::Flat, &mut rng))
            .collect();
        run_batch(device, scheme, 7, k, 0, &cases, "L=0", &mut tally);
    }
    tally.assert_agreement();
}

fn tensors(
    device: &Device,
    [batch, k, l, v]: [usize; 4],
    stride: usize,
) -> (Tensor<4>, Tensor<4>, Tensor<3, Int>, Tensor<3>) {
    (
        Tensor::ones([batch, k, l + 1, v], device),
        Tensor::ones([batch, k, l, v], device),
        Tensor::zeros([batch, k, l], device),
        Tensor::zeros([batch, l + 1, stride], device),
    )
}

fn typed_errors(device: &Device) {
    let call = |scheme, dims: [usize; 4], stride| {
        let (t, q, d, u) = tensors(device, dims, stride);
        verify(scheme, t, q, d, u).map(|_| ())
    };
    assert_eq!(
        call(Scheme::OPTIMAL, [2, 2, 3, 5], 4),
        Err(SpecDecError::UnsupportedOnDevice {
            scheme: Scheme::OPTIMAL
        })
    );
    assert_eq!(
        call(Scheme::SequentialImportance, [1, 2, 3, IS_MAX_VOCAB + 1], 4),
        Err(SpecDecError::DeviceVocabTooLarge {
            scheme: Scheme::SequentialImportance,
            vocab: IS_MAX_VOCAB + 1,
            max: IS_MAX_VOCAB,
        })
    );
    assert_eq!(
        call(Scheme::SingleDraft, [2, 2, 3, 5], 4),
        Err(SpecDecError::SingleDraftOnly { drafts: 2 })
    );
    assert_eq!(
        call(Scheme::SpecInfer, [2, 0, 3, 5], 2),
        Err(SpecDecError::NoDrafts)
    );
    assert_eq!(
        call(Scheme::SpecTr, [2, 2, 3, 0], 4),
        Err(SpecDecError::EmptyVocabulary)
    );
    assert_eq!(
        call(Scheme::SpecTr, [2, 2, 3, 5], 3),
        Err(SpecDecError::ShapeMismatch {
            tensor: "uniforms",
            expected: vec![2, 4, 4],
            found: vec![2, 4, 3],
        })
    );
    let (t, _, d, u) = tensors(device, [2, 2, 3, 5], 4);
    let q = Tensor::ones([2, 2, 3, 6], device);
    assert_eq!(
        verify(Scheme::SequentialImportance, t, q, d, u).map(|_| ()),
        Err(SpecDecError::ShapeMismatch {
            tensor: "draft_probs",
            expected: vec![2, 2, 3, 5],
            found: vec![2, 2, 3, 6],
        })
    );
    let (_, q, d, u) = tensors(device, [2, 2, 3, 5], 4);
    let t = Tensor::ones([2, 2, 3, 5], device);
    assert_eq!(
        verify(Scheme::SpecInfer, t, q, d, u).map(|_| ()),
        Err(SpecDecError::ShapeMismatch {
            tensor: "target_probs",
            expected: vec![2, 2, 4, 5],
            found: vec![2, 2, 3, 5],
        })
    );
}

/// Inputs the host rejects with an error give a nonzero status on the device (and still
/// well-formed outputs).
fn invalid_tokens_set_status(device: &Device) {
    let (t, _, _, u) = tensors(device, [3, 1, 1, 4], 3);
    // q = [0, 1, 1, 1]: token 0 has zero draft probability, token 9 is out of range.
    let q = Tensor::<4>::from_data(
        TensorData::new([0.0f32, 1.0, 1.0, 1.0].repeat(3), [3, 1, 1, 4]),
        device,
    );
    let d = Tensor::<3, Int>::from_data(TensorData::new(vec![0i32, 9, 2], [3, 1, 1]), device);
    let out = verify(Scheme::SpecInfer, t, q, d, u).expect("valid shapes");
    let status = ints(out.status.into_data());
    let bad = STATUS_BAD_TOKEN as i64;
    assert_eq!(status, vec![bad, bad, 0]);
}

fn empty_batch_is_empty(device: &Device) {
    let (t, q, d, u) = tensors(device, [0, 2, 3, 5], 4);
    let out = verify(Scheme::SpecTr, t, q, d, u).expect("valid shapes");
    assert_eq!(out.tokens.dims(), [0, 4]);
    assert_eq!(out.survivors.dims(), [0, 2]);
}

/// The extension on the unfused `CubeBackend`, called directly (outside Burn's `Dispatch`
/// and `Fusion`), gives exactly the outputs of [`verify_blocks`] on the same inputs: one
/// batch per kernel scheme, with the `L = 0` placeholder path and an empty batch.
#[cfg(feature = "cube")]
fn unfused_backend_matches_dispatch(device: &Device) {
    use burn_cubecl::CubeBackend;
    use burn_kernels_testing::unfused::{float, int, read_int};
    use burn_specdec::device::{KernelScheme, SpecDecKernels};

    let mut rng = StdRng::seed_from_u64(8);
    let runs = [
        (Scheme::SpecInfer, KernelScheme::SpecInfer, 2, 3, 4),
        (Scheme::SpecTr, KernelScheme::SpecTr, 3, 2, 3),
        (
            Scheme::SequentialImportance,
            KernelScheme::SequentialImportance,
            3,
            3,
            4,
        ),
        (Scheme::SpecTr, KernelScheme::SpecTr, 2, 0, 2),
        (Scheme::SpecInfer, KernelScheme::SpecInfer, 2, 2, 0),
    ];
    for (scheme, kernel_scheme, k, l, batch) in runs {
        let v = 7;
        let cases: Vec<_> = (0..batch)
            .map(|_| host_case(scheme, v, k, l, Style::Sparse, &mut rng))
            .collect();
        let (target, draft, drafts, uniforms) = batch_tensors(device, [v, k, l], &cases);
        let direct = <CubeBackend as SpecDecKernels>::specdec_verify_blocks(
            float(&target, device),
            float(&draft, device),
            int(&drafts, device),
            float(&uniforms, device),
            kernel_scheme,
        );
        let dispatched = verify(scheme, target, draft, drafts, uniforms).expect("valid launch");
        let label = format!("{} K={k} L={l} B={batch}", scheme.name());
        let pairs = [
            ("tokens", direct.tokens, dispatched.tokens.into_data()),
            ("accepted", direct.accepted, dispatched.accepted.into_data()),
            (
                "survivors",
                direct.survivors,
                dispatched.survivors.into_data(),
            ),
            ("status", direct.status, dispatched.status.into_data()),
        ];
        let mut outputs = Vec::new();
        for (name, direct, dispatched) in pairs {
            let direct = read_int(direct);
            assert_eq!(direct.shape(), dispatched.shape(), "{label} {name}");
            let (direct, dispatched) = (ints(direct), ints(dispatched));
            assert_eq!(direct, dispatched, "{label} {name}");
            outputs.push(direct);
        }
        // And both are the host's verdicts.
        for (b, (_, _, host)) in cases.iter().enumerate() {
            let mut want: Vec<i64> = host.tokens.iter().map(|&t| t as i64).collect();
            want.resize(l + 1, PAD_TOKEN as i64);
            assert_eq!(
                outputs[0][b * (l + 1)..(b + 1) * (l + 1)],
                want,
                "{label} b={b}"
            );
            assert_eq!(outputs[1][b], host.accepted as i64, "{label} b={b}");
            assert_eq!(outputs[3][b], 0, "{label} b={b}");
        }
    }
}

/// A device with autodiff runs no kernel (the kernel is forward only, and there is no
/// tensor-op reference): a typed error, after the usual validation.
fn autodiff_device_has_no_kernel(device: &Device) {
    let (t, q, d, u) = tensors(device, [2, 2, 3, 5], 4);
    let err = verify_blocks(Scheme::SpecTr, t, q, d, u).map(|_| ());
    assert!(
        matches!(err, Err(SpecDecError::NoDeviceKernel { .. })),
        "{err:?}"
    );
    let (t, q, d, u) = tensors(device, [2, 2, 3, 5], 4);
    assert_eq!(
        verify_blocks(Scheme::OPTIMAL, t, q, d, u).map(|_| ()),
        Err(SpecDecError::UnsupportedOnDevice {
            scheme: Scheme::OPTIMAL
        })
    );
}

testgen! {
    backend: [
        small_vocabularies_match_host,
        many_sequences_match_host,
        vocab_1000_matches_host,
        vocab_32003_matches_host,
        bonus_only_blocks_match_host,
        typed_errors,
        invalid_tokens_set_status,
        empty_batch_is_empty,
        unfused_backend_matches_dispatch,
    ],
    autodiff: [autodiff_device_has_no_kernel],
}

/// On Burn's `Flex` CPU backend the inputs are validated as on a GPU, and a valid call gets
/// [`SpecDecError::NoDeviceKernel`] (callers verify on the host): there is no tensor-op
/// reference for this op.
#[test]
fn cpu_validates_and_has_no_kernel() {
    let device = Device::flex();
    typed_errors(&device);
    let (t, q, d, u) = tensors(&device, [2, 2, 3, 5], 4);
    let err = verify_blocks(Scheme::SpecInfer, t, q, d, u).map(|_| ());
    assert!(
        matches!(err, Err(SpecDecError::NoDeviceKernel { .. })),
        "{err:?}"
    );
}
