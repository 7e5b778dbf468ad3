//! The per-layer KV cache interface and the full (uncompressed) cache.

use burn::tensor::{Int, Tensor};

use crate::attention::{AttentionImpl, AttnOptions};

/// Why a KV cache could not attend: the cache's own error, boxed (each cache crate has its own
/// error type).
pub type CacheError = Box<dyn std::error::Error + Send + Sync>;

/// A KV cache over all layers of a model, which also runs attention over what it holds, so
/// that compressed caches (sparse retrieval, cross-layer merging, quantization) decide what
/// the attention reads.
///
/// # Shapes
/// - `q`: `[batch, q_heads, s_new, head_dim]` (RoPE applied)
/// - `k`, `v`: `[batch, kv_heads, s_new, head_dim]` for the `s_new` new positions (keys with
///   RoPE applied)
/// - returns `[batch, q_heads, s_new, head_dim]`
///
/// `opts.key_padding`, when present, covers all `seq_len() + s_new` positions.
pub trait KvCache: Send {
    /// Appends the new keys and values of `layer` and attends `q` over every cached position.
    ///
    /// # Errors
    /// The cache's own error ([`CacheError`]) where it cannot hold or read the new positions.
    fn attend(
        &mut self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Result<Tensor<4>, CacheError>;

    /// The buffers of `layer` and the positions a step writes, taken out of the cache for a
    /// kernel that projects, rotates and stores the new keys and values in one launch
    /// ([`crate::LayerOps::add_norm_qkv_rope_store`]); hand them back through
    /// [`KvCache::attend_indexed`]. `None` (the default) where the cache stores otherwise or
    /// holds nothing for the layer yet.
    fn indexed_slot(&mut self, layer: usize) -> Option<IndexedSlot> {
        let _ = layer;
        None
    }

    /// Puts back the `slot` [`KvCache::indexed_slot`] gave out, its new positions written by
    /// the caller, and attends `q` over it.
    ///
    /// # Errors
    /// Where the cache gave out no slot (the default).
    fn attend_indexed(
        &mut self,
        layer: usize,
        q: Tensor<4>,
        slot: IndexedSlot,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Result<Tensor<4>, CacheError> {
        let _ = (q, slot, attention, opts);
        Err(format!("{} gives out no indexed slot (layer {layer})", self.name()).into())
    }

    /// Positions cached (in the last layer written).
    fn seq_len(&self) -> usize;

    /// Drops every position from `len` on, in every layer (rejected speculative tokens).
    fn truncate(&mut self, len: usize);

    /// Bytes of device and host memory the cache holds.
    fn bytes_held(&self) -> usize;

    /// A short name for logs and reports.
    fn name(&self) -> String;

    /// One line on the cache's work since it was built, for a run's closing report (what a
    /// compressed cache fetched, reused or merged); `None` (the default) where there is nothing
    /// to say.
    fn stats(&self) -> Option<String> {
        None
    }
}

/// One layer of a cache allocated to its capacity, out of the cache while a kernel writes a
/// step's keys and values into it ([`KvCache::indexed_slot`]).
///
/// # Shapes
/// - `keys`, `values`: `[batch, kv_heads, capacity, head_dim]`
/// - `index`: `[s_new]` int: the position each new key and value goes to
#[derive(Debug, Clone)]
pub struct IndexedSlot {
    pub keys: Tensor<4>,
    pub values: Tensor<4>,
    pub index: Tensor<1, Int>,
}

/// Every key and value of every layer, uncompressed.
#[derive(Debug, Clone)]
pub struct FullKvCache {
    layers: Vec<Option<(Tensor<4>, Tensor<4>)>>,
}

impl FullKvCache {
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
        }
    }

    /// The keys and values `layer` holds (handles, no copy), `None` before its first call.
    ///
    /// # Shapes
    /// - `[batch, kv_heads, seq_len, head_dim]` each
    pub fn layer(&self, layer: usize) -> Option<(Tensor<4>, Tensor<4>)> {
        self.layers[layer].clone()
    }
}

impl KvCache for FullKvCache {
    fn attend(
        &mut self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Result<Tensor<4>, CacheError> {
        append_kv(&mut self.layers[layer], k, v);
        let (k, v) = self.layers[layer].clone().expect("just appended");
        Ok(attention.attend(layer, q, k, v, opts))
    }

    fn seq_len(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|(k, _)| k.dims()[2])
            .next_back()
            .unwrap_or(0)
    }

    fn truncate(&mut self, len: usize) {
        for (k, v) in self.layers.iter_mut().flatten() {
            let [b, h, s, d] = k.dims();
            if len < s {
                *k = k.clone().slice([0..b, 0..h, 0..len, 0..d]);
                *v = v.clone().slice([0..b, 0..h, 0..len, 0..d]);
            }
        }
    }

    fn bytes_held(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|(k, v)| {
                let n = k.shape().num_elements() + v.shape().num_elements();
                n * k.dtype().size()
            })
            .sum()
    }

    fn name(&self) -> String {
        "full".into()
    }
}

/// Appends `k`, `v` along the sequence dimension to one layer's slot (starting it when empty)
/// and returns the slot's sequence length: the storage step every concatenating cache shares.
///
/// # Shapes
/// - slot tensors and `k`, `v`: `[batch, kv_heads, seq, head_dim]`
pub fn append_kv(slot: &mut Option<(Tensor<4>, Tensor<4>)>, k: Tensor<4>, v: Tensor<4>) -> usize {
    let (k, v) = match slot.take() {
        Some((k0, v0)) => (Tensor::cat(vec![k0, k], 2), Tensor::cat(vec![v0, v], 2)),
        None => (k, v),
    };
    let len = k.dims()[2];
    *slot = Some((k, v));
    len
}
