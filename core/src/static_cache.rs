//! A KV cache allocated once to its capacity and written in place: the fixed-shape storage a
//! captured (CUDA-graph) decode step needs, and a cache whose decode steps never copy what it
//! already holds ([`crate::FullKvCache`] concatenates, copying every layer's cache each step).

use burn::tensor::{Bool, IndexingUpdateOp, Int, Tensor, TensorCreationOptions};

use burn::backend::Dispatch;

use crate::LayerKernels;
use crate::attention::{AttentionImpl, AttnOptions};
use crate::cache::{CacheError, IndexedSlot, KvCache};
use crate::route::{Grad, route};

/// Why a [`StaticKvCache`] refused a write.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StaticCacheError {
    /// The cached positions plus the new ones exceed the capacity it was allocated for.
    #[error("static KV cache full: {len} cached + {new} new positions, capacity {capacity}")]
    Full {
        len: usize,
        new: usize,
        capacity: usize,
    },
    /// The new keys and values disagree with each other or with what the layer holds.
    #[error("static KV cache, layer {layer}: keys {k:?}, values {v:?}, cache {cache:?}")]
    Shape {
        layer: usize,
        k: Vec<usize>,
        v: Vec<usize>,
        cache: Vec<usize>,
    },
}

/// Every layer's keys and values in `[batch, kv_heads, capacity, head_dim]` tensors allocated on
/// the first write (in the keys' dtype and device) and then written in place
/// (`slice_assign`/`select_assign` on a tensor only the cache holds writes its buffer directly
/// on CubeCL backends).
///
/// As a [`KvCache`] it appends at its length and attends over the positions written (a view of
/// the first `len` rows). [`StaticKvCache::at`] instead writes at positions held in a device
/// tensor and attends over the whole capacity, positions past the length masked by the caller:
/// a decode step that reads no host value and has the same shapes at every length, which is
/// what a captured graph replays.
#[derive(Debug)]
pub struct StaticKvCache {
    layers: Vec<Option<(Tensor<4>, Tensor<4>)>>,
    lens: Vec<usize>,
    capacity: usize,
}

impl StaticKvCache {
    /// An empty cache of `num_layers` layers for up to `capacity` positions (nothing is
    /// allocated before the first write).
    pub fn new(num_layers: usize, capacity: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            lens: vec![0; num_layers],
            capacity,
        }
    }

    /// Positions the cache was sized for.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The cache as a [`KvCache`] that writes each layer's new keys and values at the positions
    /// `index` holds and attends over all `capacity` positions (mask the ones not yet written
    /// with [`AttnOptions::key_padding`], e.g. from [`StaticKvCache::unwritten_mask`]).
    ///
    /// # Shapes
    /// - `index`: `[s_new]`, the positions the `s_new` new keys and values go to
    pub fn at(&mut self, index: Tensor<1, Int>) -> IndexedWrite<'_> {
        IndexedWrite { cache: self, index }
    }

    /// `true` for the positions after `len` (a device value) and where `padding` is `true`:
    /// the key mask of a step that writes position `len` and attends over the whole capacity.
    ///
    /// # Shapes
    /// - `positions`: `[1, capacity]`, `0..capacity`; `len`: `[1]`; `padding`: `[batch, capacity]`
    /// - returns `[batch, capacity]`
    pub fn unwritten_mask(
        positions: Tensor<2, Int>,
        len: Tensor<1, Int>,
        padding: Tensor<2, Bool>,
    ) -> Tensor<2, Bool> {
        let [b, cap] = padding.dims();
        let beyond = positions.greater(len.reshape([1, 1]).expand([1, cap]));
        beyond.expand([b, cap]).bool_or(padding)
    }

    /// Copies what row `row` holds at `positions` into every row, in place, in every layer
    /// written so far: after a speculative block, the rows continue from the accepted draft's
    /// row. Reads no host value (a step a captured graph can replay).
    ///
    /// # Shapes
    /// - `row`: `[1]`, `positions`: `[s]` int device tensors, each `< capacity`
    pub fn copy_row(&mut self, row: Tensor<1, Int>, positions: Tensor<1, Int>) {
        let s = positions.dims()[0];
        for slot in &mut self.layers {
            let Some((kc, vc)) = slot.take() else {
                continue;
            };
            let [b, h, _, d] = kc.dims();
            let pick = |c: &Tensor<4>| {
                c.clone()
                    .select(0, row.clone())
                    .select(2, positions.clone())
                    .expand([b, h, s, d])
            };
            let (k, v) = (pick(&kc), pick(&vc));
            *slot = Some(write_at(kc, vc, k, v, positions.clone()));
        }
    }

    /// The layer's buffers, allocated on the first write.
    fn slot(
        &mut self,
        layer: usize,
        k: &Tensor<4>,
        v: &Tensor<4>,
    ) -> Result<(Tensor<4>, Tensor<4>), StaticCacheError> {
        let [b, h, _, d] = k.dims();
        let want = [b, h, self.capacity, d];
        let shape_error = |cache: Vec<usize>| StaticCacheError::Shape {
            layer,
            k: k.dims().to_vec(),
            v: v.dims().to_vec(),
            cache,
        };
        if v.dims() != k.dims() {
            return Err(shape_error(want.to_vec()));
        }
        match self.layers[layer].take() {
            Some((kc, vc)) if kc.dims() == want => Ok((kc, vc)),
            Some((kc, vc)) => {
                let dims = kc.dims().to_vec();
                self.layers[layer] = Some((kc, vc));
                Err(shape_error(dims))
            }
            None => {
                let opts = TensorCreationOptions::new(k.device()).with_dtype(k.dtype());
                Ok((Tensor::zeros(want, opts.clone()), Tensor::zeros(want, opts)))
            }
        }
    }
}

impl KvCache for StaticKvCache {
    fn attend(
        &mut self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Result<Tensor<4>, CacheError> {
        let [b, h, s, d] = k.dims();
        let len = self.lens[layer];
        if len + s > self.capacity {
            return Err(Box::new(StaticCacheError::Full {
                len,
                new: s,
                capacity: self.capacity,
            }));
        }
        let (kc, vc) = self.slot(layer, &k, &v)?;
        let rows = [0..b, 0..h, len..len + s, 0..d];
        let kc = kc.slice_assign(rows.clone(), k.clone());
        let vc = vc.slice_assign(rows, v.clone());
        let out = if len == 0 {
            // Nothing cached before: the new keys are all there is (no view of the buffer).
            attention.attend(layer, q, k, v, opts)
        } else {
            let held = [0..b, 0..h, 0..len + s, 0..d];
            attention.attend(
                layer,
                q,
                kc.clone().slice(held.clone()),
                vc.clone().slice(held),
                opts,
            )
        };
        self.layers[layer] = Some((kc, vc));
        self.lens[layer] = len + s;
        Ok(out)
    }

    fn seq_len(&self) -> usize {
        self.lens.last().copied().unwrap_or(0)
    }

    fn truncate(&mut self, len: usize) {
        self.lens.iter_mut().for_each(|l| *l = (*l).min(len));
    }

    fn bytes_held(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|(k, v)| (k.shape().num_elements() + v.shape().num_elements()) * k.dtype().size())
            .sum()
    }

    fn name(&self) -> String {
        "static".into()
    }
}

/// [`StaticKvCache::at`]: writes at device-held positions, attends over the whole capacity.
#[derive(Debug)]
pub struct IndexedWrite<'a> {
    cache: &'a mut StaticKvCache,
    index: Tensor<1, Int>,
}

impl KvCache for IndexedWrite<'_> {
    fn attend(
        &mut self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Result<Tensor<4>, CacheError> {
        let (kc, vc) = self.cache.slot(layer, &k, &v)?;
        let (kc, vc) = write_at(kc, vc, k, v, self.index.clone());
        let out = attention.attend(layer, q, kc.clone(), vc.clone(), opts);
        self.cache.layers[layer] = Some((kc, vc));
        Ok(out)
    }

    fn indexed_slot(&mut self, layer: usize) -> Option<IndexedSlot> {
        let (keys, values) = self.cache.layers[layer].take()?;
        Some(IndexedSlot {
            keys,
            values,
            index: self.index.clone(),
        })
    }

    fn attend_indexed(
        &mut self,
        layer: usize,
        q: Tensor<4>,
        slot: IndexedSlot,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Result<Tensor<4>, CacheError> {
        let out = attention.attend(layer, q, slot.keys.clone(), slot.values.clone(), opts);
        self.cache.layers[layer] = Some((slot.keys, slot.values));
        Ok(out)
    }

    fn seq_len(&self) -> usize {
        self.cache.seq_len()
    }

    fn truncate(&mut self, len: usize) {
        self.cache.truncate(len);
    }

    fn bytes_held(&self) -> usize {
        self.cache.bytes_held()
    }

    fn name(&self) -> String {
        "static (indexed)".into()
    }
}

/// `kc[:, :, index[t]] = k[:, :, t]` and the same for the values, in place: core's `store_kv`
/// kernel where it runs, else Burn's `select_assign`.
pub(crate) fn write_at(
    kc: Tensor<4>,
    vc: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    index: Tensor<1, Int>,
) -> (Tensor<4>, Tensor<4>) {
    let unsupported = (k.dtype() != kc.dtype() || v.dtype() != vc.dtype()).then(|| {
        format!(
            "k {:?}, v {:?}, cache {:?}",
            k.dtype(),
            v.dtype(),
            kc.dtype()
        )
    });
    if route("store_kv", &k.device(), Grad::ForwardOnly, unsupported) {
        let (kc, vc) = Dispatch::store_kv(
            kc.into_dispatch(),
            vc.into_dispatch(),
            k.into_dispatch(),
            v.into_dispatch(),
            index.into_dispatch(),
        );
        (Tensor::from_dispatch(kc), Tensor::from_dispatch(vc))
    } else {
        (
            kc.select_assign(2, index.clone(), k, IndexingUpdateOp::Assign),
            vc.select_assign(2, index, v, IndexingUpdateOp::Assign),
        )
    }
}
