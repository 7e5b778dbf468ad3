//! The decode layer's one-launch projection, RoPE and static-cache store against the
//! launches it replaces.

use burn::module::Param;
use burn::nn::RmsNorm;
use burn::tensor::{DType, Device, IndexingUpdateOp, Int, Tensor, TensorData};
use burn_kernels_core::route::{launches, require_kernels};
use burn_kernels_core::{FusedOps, IndexedSlot, LayerOps, Rope};
use burn_kernels_testing::{
    Dist, Tolerance, assert_close, compare::to_f32, float_dtypes, poison_memory, random_tensor,
};

use crate::projections::strided;

/// One test case: sequences, the cache positions of their new positions, hidden size, query
/// and KV heads, head dim, cache capacity.
struct Case {
    batch: usize,
    index: Vec<usize>,
    k: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    capacity: usize,
}

/// `add_norm_qkv_rope_store` (one launch: the residual add and RMSNorm, the Q/K/V products,
/// RoPE of the queries and keys, the keys' and values' store at device-held cache positions)
/// against the composition it replaces: `add_norm_linear3` (the same plan, so the same sums),
/// `rope2`, and Burn's `select_assign` into the cache. Both sides rotate the same rounded
/// projections in f32, so the tolerance is two roundings of the dtype, scaled to the largest
/// value. The caches start random and are compared whole: a position written that should not
/// be, or one not written, fails. Cases: one row with two vectors per head; three sequences (a
/// partial cube of rows, position 0); two sequences of three positions written out of order (a
/// speculative verification); SmolLM2's shape with five rows (two cubes of rows). The launch
/// reads row-strided views of the weights (as Burn's pitched layouts), the composition the
/// contiguous ones. The queries land in NaN-poisoned memory.
pub fn qkv_rope_store_matches_composition(device: &Device) {
    let before = launches("norm_gemv3_rope_store");
    let cases = [
        (1, vec![4], 97, 3, 1, 16, 7),
        (3, vec![0], 131, 4, 2, 32, 5),
        (2, vec![7, 2, 9], 64, 2, 1, 64, 11),
        (5, vec![12], 576, 9, 3, 64, 13),
    ]
    .map(|(batch, index, k, hq, hkv, d, capacity)| Case {
        batch,
        index,
        k,
        hq,
        hkv,
        d,
        capacity,
    });
    for dtype in float_dtypes(device) {
        for (i, case) in cases.iter().enumerate() {
            check_case(device, dtype, case, 300 + 16 * i as u64);
        }
    }
    assert!(
        launches("norm_gemv3_rope_store") > before,
        "norm_gemv3_rope_store: no kernel launch counted"
    );
}

fn check_case(device: &Device, dtype: DType, c: &Case, seed: u64) {
    let (b, s, k, d) = (c.batch, c.index.len(), c.k, c.d);
    let name = format!("{dtype:?} batch {b} index {:?} k {k} d {d}", c.index);
    let x = random_tensor::<3>([b, s, k], Dist::STANDARD, seed, dtype, device);
    let y = random_tensor::<3>([b, s, k], Dist::STANDARD, seed + 1, dtype, device);
    let gamma = random_tensor::<1>([k], Dist::STANDARD, seed + 2, dtype, device);
    let norm = RmsNorm {
        gamma: Param::from_tensor(gamma),
        epsilon: 1e-5,
    };
    let w = [c.hq * d, c.hkv * d, c.hkv * d]
        .into_iter()
        .enumerate()
        .map(|(j, n)| {
            random_tensor::<2>([k, n], Dist::STANDARD, seed + 3 + j as u64, dtype, device)
        })
        .collect::<Vec<_>>();
    let w3 = || [w[0].clone(), w[1].clone(), w[2].clone()];
    let max_pos = 64;
    let rope = Rope::new(d, max_pos, 10_000.0, None, device);
    let positions: Vec<i64> = (0..b * s)
        .map(|r| ((r * 37 + 5) % max_pos) as i64)
        .collect();
    let positions = Tensor::<2, Int>::from_data(TensorData::new(positions, [b, s]), device);
    let index: Vec<i64> = c.index.iter().map(|&p| p as i64).collect();
    let index = Tensor::<1, Int>::from_data(TensorData::new(index, [s]), device);
    // Two copies of each starting cache, so that the kernel's buffers are its own (written
    // in place) and the reference's are separate.
    let cache = |seed| {
        random_tensor::<4>(
            [b, c.hkv, c.capacity, d],
            Dist::STANDARD,
            seed,
            dtype,
            device,
        )
    };

    let (sum_want, [q, kk, v]) = FusedOps.add_norm_linear3(&norm, x.clone(), y.clone(), w3());
    let heads = |t: Tensor<3>, n: usize| t.reshape([b, s, n, d]).swap_dims(1, 2);
    let (q_want, k_want) =
        FusedOps.rope2(&rope, heads(q, c.hq), heads(kk, c.hkv), positions.clone());
    let assign = IndexingUpdateOp::Assign;
    let keys_want = cache(seed + 6).select_assign(2, index.clone(), k_want, assign);
    let values_want = cache(seed + 7).select_assign(2, index.clone(), heads(v, c.hkv), assign);

    let slot = IndexedSlot {
        keys: cache(seed + 6),
        values: cache(seed + 7),
        index,
    };
    poison_memory(device, b * s * (k + c.hq * d), dtype);
    let (sum, q_got, slot) = require_kernels(|| {
        let w = w3().map(strided);
        FusedOps.add_norm_qkv_rope_store(&norm, x.clone(), y.clone(), w, &rope, positions, slot)
    });
    assert_eq!(q_got.dims(), [b, c.hq, s, d], "{name}");
    assert_eq!(sum.dims(), [b, s, k], "{name}");
    for (what, got, want) in [
        ("sum", to_f32(sum.into_data()), to_f32(sum_want.into_data())),
        (
            "queries",
            to_f32(q_got.into_data()),
            to_f32(q_want.into_data()),
        ),
        (
            "keys",
            to_f32(slot.keys.into_data()),
            to_f32(keys_want.into_data()),
        ),
        (
            "values",
            to_f32(slot.values.into_data()),
            to_f32(values_want.into_data()),
        ),
    ] {
        let magnitude = want.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
        let one = Tolerance::for_dtype(dtype);
        let tol = Tolerance {
            atol: one.atol * magnitude.max(1.0),
            rtol: 2.0 * one.rtol,
        };
        assert_close(&format!("{what} {name}"), &got, &want, tol);
    }
}
