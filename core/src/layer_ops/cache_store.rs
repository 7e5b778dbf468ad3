//! The decode layer's projection, RoPE and static-cache store
//! ([`LayerOps::add_norm_qkv_rope_store`]): when [`super::FusedOps`] runs it as one launch, and the
//! composition it replaces.

use burn::nn::RmsNorm;
use burn::tensor::{Int, Tensor};

use super::{LayerOps, mismatch};
use crate::cache::IndexedSlot;
use crate::rope::Rope;
use crate::static_cache::write_at;

/// Whether [`super::FusedOps::add_norm_qkv_rope_store`] runs its one launch: unless
/// `BURN_KERNELS_QKV_STORE=0`, which keeps the three launches it replaces (to measure one
/// against the other on a device).
pub(super) fn one_launch_store() -> bool {
    use std::sync::OnceLock;
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("BURN_KERNELS_QKV_STORE").map_or(true, |v| v != "0"))
}

/// Why `x`, `y`, the weights, the positions and the slot cannot go to the one-launch
/// projection, RoPE and cache store, if they cannot.
pub(super) fn qkv_store_mismatch(
    x: &Tensor<3>,
    y: &Tensor<3>,
    w: &[Tensor<2>; 3],
    positions: &Tensor<2, Int>,
    slot: &IndexedSlot,
) -> Option<String> {
    let [b, s, k] = x.dims();
    let [kb, hkv, _, d] = slot.keys.dims();
    let ns = [0, 1, 2].map(|i| w[i].dims()[1]);
    mismatch(x, y)
        .or_else(|| {
            let dtypes = [&w[0], &w[1], &w[2]].map(|w| w.dtype());
            (dtypes.iter().any(|t| *t != x.dtype())
                || slot.keys.dtype() != x.dtype()
                || slot.values.dtype() != x.dtype())
            .then(|| format!("x is {:?}, the weights or the cache differ", x.dtype()))
        })
        .or_else(|| {
            (w.iter().any(|w| w.dims()[0] != k)
                || slot.values.dims() != slot.keys.dims()
                || kb != b
                || ns[1] != hkv * d
                || positions.dims() != [b, s]
                || slot.index.dims() != [s]
                || positions.dtype() != slot.index.dtype())
            .then(|| {
                format!(
                    "x {:?}, weights {ns:?}, cache {:?}, positions {:?}, index {:?} do not fit",
                    x.dims(),
                    slot.keys.dims(),
                    positions.dims(),
                    slot.index.dims()
                )
            })
        })
        .or_else(|| crate::kernels::qkv_store::unsupported(ns, d, x.dtype().size()))
}

/// [`LayerOps::add_norm_qkv_rope_store`]'s composition with `ops`' own kernels (or ops).
#[allow(clippy::too_many_arguments)]
pub(super) fn default_add_norm_qkv_rope_store<O: LayerOps + ?Sized>(
    ops: &O,
    norm: &RmsNorm,
    x: Tensor<3>,
    y: Tensor<3>,
    w: [Tensor<2>; 3],
    rope: &Rope,
    positions: Tensor<2, Int>,
    slot: IndexedSlot,
) -> (Tensor<3>, Tensor<4>, IndexedSlot) {
    let [b, s, _] = x.dims();
    let d = slot.keys.dims()[3];
    let (sum, [q, k, v]) = ops.add_norm_linear3(norm, x, y, w);
    let heads = |t: Tensor<3>| {
        let n = t.dims()[2] / d;
        t.reshape([b, s, n, d]).swap_dims(1, 2)
    };
    let (q, k) = ops.rope2(rope, heads(q), heads(k), positions);
    let (keys, values) = write_at(slot.keys, slot.values, k, heads(v), slot.index.clone());
    let slot = IndexedSlot {
        keys,
        values,
        index: slot.index,
    };
    (sum, q, slot)
}
