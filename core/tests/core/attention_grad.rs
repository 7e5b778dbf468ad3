//! Training through [`BurnAttention`]: on a CubeCL device Burn 0.23's autodiff records its fused
//! attention (forward with each query's log-sum-exp, a FlashAttention-2 style backward that
//! recomputes the probabilities) instead of the decomposed one, which saves the `B·H·N²` scores.
//! [`RecomputeAttention`] (Burn's fused forward, a backward of tensor ops) is checked the same way.
//! Their gradients are checked against [`ReferenceAttention`]'s (f32 tensor ops, differentiated by
//! Burn's autodiff), and its saved state against the memory the scores would take. CUDA only
//! (`core.rs` says why); on lavapipe the f32 checks of the first three cases and the memory test
//! passed once (2026-11-28).

use burn::tensor::{Bool, DType, Device, Tensor, TensorData};
use burn_kernels_core::recompute_attention::{FLASH_BACKWARD, FLASH_FORWARD, RECOMPUTE_BACKWARD};
use burn_kernels_core::route::{launches, memory_in_use};
use burn_kernels_core::{
    AttentionImpl, AttnOptions, BurnAttention, RecomputeAttention, ReferenceAttention,
};
use burn_kernels_testing::compare::{assert_rel_l2, rounding_rel_l2, to_f32};
use burn_kernels_testing::{Dist, Tolerance, assert_close, float_dtypes, is_cuda, random_tensor};

/// `[batch, q_heads, kv_heads, queries, keys, head_dim, causal]`.
type Case = (usize, usize, usize, usize, usize, usize, bool);

/// One query and key; primes with grouped heads; unequal queries and keys (bottom-right causal);
/// a tail past a 64-row tile with SmolLM2's 9 query / 3 key heads; no mask.
const CASES: [Case; 5] = [
    (1, 1, 1, 1, 1, 16, true),
    (2, 4, 2, 37, 37, 32, true),
    (1, 2, 1, 7, 29, 64, true),
    (1, 9, 3, 130, 130, 64, true),
    (2, 3, 3, 41, 41, 32, false),
];

/// Head dim 64, where 16-bit operands take the flash backward kernels on CUDA: one query and
/// key; primes past a 64-row tile with three query heads a key head; fewer queries than keys
/// (bottom-right causal, so the first key tiles are hidden from some query tiles); SmolLM2's
/// 9 / 3 heads; no mask with fewer keys than queries.
const FLASH_CASES: [Case; 5] = [
    (1, 1, 1, 1, 1, 64, true),
    (2, 6, 2, 67, 67, 64, true),
    (1, 2, 1, 37, 131, 64, true),
    (1, 9, 3, 130, 130, 64, true),
    (2, 4, 4, 97, 53, 64, false),
];

/// `(out, dQ, dK, dV)` of `attention` on `q, k, v` with the upstream gradient `g`.
fn gradients(
    attention: &dyn AttentionImpl,
    [q, k, v, g]: [&Tensor<4>; 4],
    opts: &AttnOptions,
) -> [Vec<f32>; 4] {
    let (q, k, v) = (
        q.clone().require_grad(),
        k.clone().require_grad(),
        v.clone().require_grad(),
    );
    let out = attention.attend(0, q.clone(), k.clone(), v.clone(), opts);
    let loss = (out.clone().cast(DType::F32) * g.clone()).sum();
    let grads = loss.backward();
    let grad = |t: &Tensor<4>| {
        let grad = t.grad(&grads).expect("a gradient for every input");
        to_f32(grad.cast(DType::F32).into_data())
    };
    [
        to_f32(out.cast(DType::F32).into_data()),
        grad(&q),
        grad(&k),
        grad(&v),
    ]
}

/// Checks `actual` against the f32 reference computed from the same (rounded) inputs. f32 off
/// CUDA: element-wise within the f32 tolerance of a reduction over the longer sequence (every
/// gradient sums over queries or keys and head_dim). f32 on CUDA: relative L2 within TF32's
/// bound, since cubek's attention routines may run f32 products on the matrix units whatever
/// cubek's matmul setting. 16-bit operands: relative L2 within four roundings of the dtype (the
/// probabilities and the gradients pass through it).
fn check(name: &str, actual: &[f32], expected: &[f32], dtype: DType, len: usize, device: &Device) {
    let rel_bound = match dtype {
        DType::F32 if !is_cuda(device) => {
            return assert_close(name, actual, expected, Tolerance::for_reduction(dtype, len));
        }
        DType::F32 => burn_kernels_testing::compare::TF32_REL_L2,
        _ => rounding_rel_l2(dtype, 4),
    };
    assert_rel_l2(name, actual, expected, rel_bound);
}

/// dQ, dK, dV (and the output) of Burn's attention on an autodiff device against the
/// decomposed reference's, every float dtype the device runs.
pub fn fused_attention_gradients_match_reference(device: &Device) {
    attention_gradients_match_reference(&BurnAttention, &float_dtypes(device), device);
}

/// The same for [`RecomputeAttention`], every float dtype the device runs (f32: Burn's composed
/// backward; f16/bf16: core's flash kernels at head dim 64, Burn's fused backward at the other
/// head dims): its own backward must have run once per case and dtype (counted).
pub fn recompute_attention_gradients_match_reference(device: &Device) {
    let before = launches(RECOMPUTE_BACKWARD);
    let dtypes = float_dtypes(device);
    attention_gradients_match_reference(&RecomputeAttention, &dtypes, device);
    // `>=`: the memory test, in another test thread, may count its backward too.
    let ran = launches(RECOMPUTE_BACKWARD) - before;
    let want = (CASES.len() * dtypes.len()) as u64;
    assert!(
        ran >= want,
        "the recomputing backward ran {ran} times for {want} cases ({dtypes:?})"
    );
}

/// [`RecomputeAttention`]'s 16-bit forward and backward at head dim 64 ([`FLASH_CASES`]), with
/// Q/K/V contiguous and as views of token-major (`[batch, seq, heads, dim]`) buffers, as a
/// model's projections are: the flash kernels must have run for every case, layout and 16-bit
/// dtype (counted), the forward also without autodiff (a validation pass), where only the
/// output is compared. Before each case the memory pool is handed blocks of NaN the size of
/// each output and gradient, so an element the kernels leave unwritten fails the comparison
/// instead of reading a previous test's values.
pub fn flash_attention_gradients_match_reference(device: &Device) {
    let dtypes: Vec<DType> = float_dtypes(device)
        .into_iter()
        .filter(|d| matches!(d, DType::F16 | DType::BF16))
        .collect();
    assert!(!dtypes.is_empty(), "no 16-bit dtype on this device");
    let (backward, forward) = (launches(FLASH_BACKWARD), launches(FLASH_FORWARD));
    for &dtype in &dtypes {
        for token_major in [false, true] {
            poison(&FLASH_CASES, dtype, device);
            attention_gradients_match_layout(
                &RecomputeAttention,
                &[dtype],
                &FLASH_CASES,
                token_major,
                device,
            );
            poison(&FLASH_CASES, dtype, device);
            forward_matches_reference(&RecomputeAttention, dtype, token_major, device);
        }
    }
    for &dtype in &dtypes {
        poison(&PADDED_CASES, dtype, device);
        padded_gradients_match_reference(dtype, device);
    }
    let runs = ((FLASH_CASES.len() * 2 + PADDED_CASES.len()) * dtypes.len()) as u64;
    let ran = launches(FLASH_BACKWARD) - backward;
    assert!(
        ran >= runs,
        "the flash backward ran {ran} times for {runs} cases ({dtypes:?})"
    );
    // A tracked and an untracked forward a case.
    let ran = launches(FLASH_FORWARD) - forward;
    assert!(
        ran >= 2 * runs,
        "the flash forward ran {ran} times for {} forwards ({dtypes:?})",
        2 * runs
    );
}

/// Flash cases with a key-padding mask: grouped heads past a tile (one batch unpadded), a whole
/// key tile hidden with fewer queries than keys (bottom-right causal), no causal mask with more
/// queries than keys. Key 0 is never hidden, so every query sees a key.
const PADDED_CASES: [Case; 3] = [
    (2, 6, 2, 67, 67, 64, true),
    (1, 2, 1, 37, 131, 64, true),
    (2, 4, 4, 97, 53, 64, false),
];

/// Whether case `case`'s mask hides key `key` of batch `b`: about 3 keys in 10 (none of batch 0
/// in the first case), and in the second case the whole key tile 64..128.
fn padded(case: usize, b: usize, key: usize) -> bool {
    let spread = key > 0 && (key * 7 + b * 3 + case) % 10 < 3;
    match case {
        0 => b == 1 && spread,
        1 => spread || (64..128).contains(&key),
        _ => spread,
    }
}

/// [`PADDED_CASES`] through [`RecomputeAttention`] (the flash kernels with the mask) against the
/// reference with the same mask: output, dQ, dK, dV, and the output without autodiff.
fn padded_gradients_match_reference(dtype: DType, device: &Device) {
    for (i, &(b, hq, hkv, sq, skv, d, causal)) in PADDED_CASES.iter().enumerate() {
        let seed = 700 + 10 * i as u64;
        let make = |shape: [usize; 4], s: u64| operand(shape, seed + s, dtype, i == 1, device);
        let q = make([b, hq, sq, d], 0);
        let k = make([b, hkv, skv, d], 1);
        let v = make([b, hkv, skv, d], 2);
        let g = random_tensor([b, hq, sq, d], Dist::STANDARD, seed + 3, DType::F32, device);
        let hidden: Vec<bool> = (0..b * skv).map(|j| padded(i, j / skv, j % skv)).collect();
        let mask = Tensor::<2, Bool>::from_data(TensorData::new(hidden, [b, skv]), device);
        let opts = AttnOptions {
            causal,
            scale: (d as f32).sqrt().recip(),
            key_padding: Some(mask),
        };
        let flash = gradients(&RecomputeAttention, [&q, &k, &v, &g], &opts);
        let reference = gradients(&ReferenceAttention, [&q, &k, &v, &g], &opts);
        let len = sq.max(skv) * d;
        let label = format!("{dtype:?} b{b} hq{hq} hkv{hkv} sq{sq} skv{skv}");
        for (what, (a, e)) in ["out", "dQ", "dK", "dV"]
            .iter()
            .zip(flash.iter().zip(&reference))
        {
            check(&format!("padded {what} {label}"), a, e, dtype, len, device);
        }
        // Untracked operands: the forward alone (a validation pass).
        let run = |a: &dyn AttentionImpl| {
            let out = a.attend(0, q.clone(), k.clone(), v.clone(), &opts);
            to_f32(out.cast(DType::F32).into_data())
        };
        let name = format!("padded forward (no autodiff) {label}");
        check(
            &name,
            &run(&RecomputeAttention),
            &run(&ReferenceAttention),
            dtype,
            len,
            device,
        );
    }
}

/// Hands the memory pool blocks of NaN the size of every case's operands and outputs.
/// The blocks are alive together, so the pool keeps three NaN blocks (one per output), where
/// `poison_memory` would hand the same block back three times.
fn poison(cases: &[Case], dtype: DType, device: &Device) {
    for &(b, hq, hkv, sq, skv, d, _) in cases {
        let blocks = [[b, hq, sq, d], [b, hkv, skv, d], [b, hkv, skv, d]]
            .map(|shape| Tensor::<4>::full(shape, f32::NAN, (device, dtype)));
        let _ = device.sync();
        drop(blocks);
    }
}

/// `[batch, heads, seq, dim]` random inputs: contiguous, or a view of a token-major buffer.
fn operand(
    [b, h, s, d]: [usize; 4],
    seed: u64,
    dtype: DType,
    token_major: bool,
    device: &Device,
) -> Tensor<4> {
    match token_major {
        false => random_tensor([b, h, s, d], Dist::STANDARD, seed, dtype, device),
        true => random_tensor([b, s, h, d], Dist::STANDARD, seed, dtype, device).swap_dims(1, 2),
    }
}

/// The output of `attention` without autodiff against the reference's, [`FLASH_CASES`].
fn forward_matches_reference(
    attention: &dyn AttentionImpl,
    dtype: DType,
    token_major: bool,
    device: &Device,
) {
    for (i, &(b, hq, hkv, sq, skv, d, causal)) in FLASH_CASES.iter().enumerate() {
        let seed = 500 + 10 * i as u64;
        let q = operand([b, hq, sq, d], seed, dtype, token_major, device);
        let k = operand([b, hkv, skv, d], seed + 1, dtype, token_major, device);
        let v = operand([b, hkv, skv, d], seed + 2, dtype, token_major, device);
        let opts = AttnOptions {
            causal,
            scale: (d as f32).sqrt().recip(),
            key_padding: None,
        };
        let run = |a: &dyn AttentionImpl| {
            let out = a.attend(0, q.clone(), k.clone(), v.clone(), &opts);
            to_f32(out.cast(DType::F32).into_data())
        };
        let name = format!(
            "{} forward (no autodiff) {dtype:?} token-major {token_major} b{b} hq{hq} hkv{hkv} \
             sq{sq} skv{skv}",
            attention.name()
        );
        let len = sq.max(skv) * d;
        check(
            &name,
            &run(attention),
            &run(&ReferenceAttention),
            dtype,
            len,
            device,
        );
    }
}

fn attention_gradients_match_reference(
    attention: &dyn AttentionImpl,
    dtypes: &[DType],
    device: &Device,
) {
    attention_gradients_match_cases(attention, dtypes, &CASES, device);
}

fn attention_gradients_match_cases(
    attention: &dyn AttentionImpl,
    dtypes: &[DType],
    cases: &[Case],
    device: &Device,
) {
    attention_gradients_match_layout(attention, dtypes, cases, false, device);
}

fn attention_gradients_match_layout(
    attention: &dyn AttentionImpl,
    dtypes: &[DType],
    cases: &[Case],
    token_major: bool,
    device: &Device,
) {
    for &dtype in dtypes {
        for (i, &(b, hq, hkv, sq, skv, d, causal)) in cases.iter().enumerate() {
            let seed = 100 + 10 * i as u64;
            let make =
                |shape: [usize; 4], s: u64| operand(shape, seed + s, dtype, token_major, device);
            let q = make([b, hq, sq, d], 0);
            let k = make([b, hkv, skv, d], 1);
            let v = make([b, hkv, skv, d], 2);
            let g = random_tensor([b, hq, sq, d], Dist::STANDARD, seed + 3, DType::F32, device);
            let opts = AttnOptions {
                causal,
                scale: (d as f32).sqrt().recip(),
                key_padding: None,
            };
            let fused = gradients(attention, [&q, &k, &v, &g], &opts);
            let reference = gradients(&ReferenceAttention, [&q, &k, &v, &g], &opts);
            let len = sq.max(skv) * d;
            for (what, (a, e)) in ["out", "dQ", "dK", "dV"]
                .iter()
                .zip(fused.iter().zip(&reference))
            {
                let name = format!(
                    "{} {what} {dtype:?} token-major {token_major} b{b} hq{hq} hkv{hkv} sq{sq} \
                     skv{skv} d{d}",
                    attention.name()
                );
                check(&name, a, e, dtype, len, device);
            }
        }
    }
}

/// What a training forward through [`BurnAttention`] (and [`RecomputeAttention`]) keeps for the
/// backward on a CubeCL device:
/// the output and one log-sum-exp per query, not the `B·H·N²` scores (the decomposed
/// attention keeps them, and its probabilities, `2·B·H·N²·4` bytes). N = 512, 4 query heads over
/// 2 key heads: the scores would be 4 MiB; the bound is a quarter of that, above the output's
/// 256 KiB and the log-sum-exp's 8 KiB. The reference is measured too, to show that the
/// measurement sees saved scores.
pub fn fused_attention_keeps_no_scores(device: &Device) {
    let (b, hq, hkv, n, d) = (1, 4, 2, 512, 32);
    let make = |shape: [usize; 4], s: u64| {
        random_tensor(shape, Dist::STANDARD, s, DType::F32, device).require_grad()
    };
    let (q, k, v) = (
        make([b, hq, n, d], 1),
        make([b, hkv, n, d], 2),
        make([b, hkv, n, d], 3),
    );
    let opts = AttnOptions {
        causal: true,
        scale: (d as f32).sqrt().recip(),
        key_padding: None,
    };
    let scores = (b * hq * n * n * 4) as u64;
    let saved = |attention: &dyn AttentionImpl| {
        let _ = device.sync();
        let before = memory_in_use(device).expect("a CubeCL device");
        let out = attention.attend(0, q.clone(), k.clone(), v.clone(), &opts);
        let _ = device.sync();
        let after = memory_in_use(device).expect("a CubeCL device");
        // The output stays alive (with the graph that holds the saved state) until here.
        let grads = out.sum().backward();
        assert!(
            q.grad(&grads).is_some(),
            "{}: no gradient",
            attention.name()
        );
        after.saturating_sub(before)
    };
    for attention in [&BurnAttention as &dyn AttentionImpl, &RecomputeAttention] {
        let fused = saved(attention);
        assert!(
            fused <= scores / 4,
            "{}: the forward kept {fused} B (scores: {scores} B)",
            attention.name()
        );
    }
    let reference = saved(&ReferenceAttention);
    assert!(
        reference >= scores,
        "the decomposed attention's forward kept only {reference} B: the measurement does not \
         see saved scores ({scores} B)"
    );
}
