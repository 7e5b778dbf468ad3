//! The KV caches speculative decoding runs on: [`BranchKvCache`] (every draft's branch at
//! once, committed prefix shared) and [`LinearSpecCache`] (any [`KvCache`] holding one row,
//! rolled back after rejections).

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use burn_kernels_core::{AttentionImpl, AttnOptions, CacheError, KvCache, append_kv};

/// Per layer: committed keys/values `[batch, kv_heads, s, head_dim]` and, while forked, branch
/// keys/values `[batch × fan, kv_heads, t, head_dim]`.
#[derive(Debug, Clone, Default)]
struct LayerKv {
    prefix: Option<(Tensor<4>, Tensor<4>)>,
    branch: Option<(Tensor<4>, Tensor<4>)>,
}

/// A KV cache for speculative decoding: a committed *prefix* per sequence and, while a block is
/// drafted or verified, `fan` *branch* rows per sequence that share that prefix.
///
/// Attention rows are the sequences (`batch`) when not forked, and `batch × fan` rows (row
/// `b × fan + i` = branch i of sequence b) while forked: the prefix is broadcast to the fan
/// rows for each attention call instead of being copied into K caches. Every slot has a
/// validity bit; invalid slots (left padding, dummy tokens of ragged inputs) are masked as keys,
/// so the [`AttnOptions::key_padding`] that [`Llama::forward`](crate::model::Llama::forward) derives from `left_pad` is
/// replaced by the cache's own mask.
///
/// # Shapes
/// - `attend`: `q` `[rows, q_heads, s_new, head_dim]`, `k`/`v` `[rows, kv_heads, s_new,
///   head_dim]`, with `rows` = `batch` or `batch × fan`
#[derive(Debug, Clone)]
pub struct BranchKvCache {
    layers: Vec<LayerKv>,
    /// `[batch][s]`.
    prefix_valid: Vec<Vec<bool>>,
    /// `[batch × fan][t]` while forked.
    branch_valid: Vec<Vec<bool>>,
    fan: Option<usize>,
    /// Validity of the tokens of the next forward pass, `[rows][s_new]` (all valid if `None`).
    incoming: Option<Vec<Vec<bool>>>,
    /// The key mask of the current layout, built once for all layers.
    mask: Option<Option<Tensor<2, Bool>>>,
}

impl BranchKvCache {
    /// An empty cache for `batch` sequences of a `num_layers` model.
    pub fn new(num_layers: usize, batch: usize) -> Self {
        Self {
            layers: vec![LayerKv::default(); num_layers],
            prefix_valid: vec![Vec::new(); batch],
            branch_valid: Vec::new(),
            fan: None,
            incoming: None,
            mask: None,
        }
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.prefix_valid.len()
    }

    /// Attention rows of the next forward pass: `batch`, or `batch × fan` while forked.
    pub fn rows(&self) -> usize {
        self.batch() * self.fan.unwrap_or(1)
    }

    /// Branch rows per sequence while forked.
    pub fn fan(&self) -> Option<usize> {
        self.fan
    }

    /// Tokens of sequence `b` in the committed prefix.
    pub fn sequence_len(&self, b: usize) -> usize {
        self.prefix_valid[b].iter().filter(|&&v| v).count()
    }

    /// Tokens attention row `row` sees (its sequence's prefix and, while forked, its branch).
    pub fn row_len(&self, row: usize) -> usize {
        match self.fan {
            None => self.sequence_len(row),
            Some(fan) => {
                self.sequence_len(row / fan) + self.branch_valid[row].iter().filter(|&&v| v).count()
            }
        }
    }

    /// Starts a block: `fan` branch rows per sequence, all empty.
    ///
    /// # Panics
    /// If already forked or `fan == 0`.
    pub fn fork(&mut self, fan: usize) {
        assert!(self.fan.is_none(), "already forked");
        assert!(fan > 0, "fan must be positive");
        self.fan = Some(fan);
        self.branch_valid = vec![Vec::new(); self.batch() * fan];
        self.mask = None;
    }

    /// Ends a block: for each sequence b, `keep[b] = (i, n)` appends the first `n` branch slots
    /// of branch row i to b's prefix (their valid tokens) and drops everything else in the
    /// branches (the rollback of rejected tokens). The prefix is then repacked so that every
    /// sequence's tokens are right-aligned with no holes.
    ///
    /// # Panics
    /// If not forked, `keep.len() != batch`, `i >= fan` or `n` exceeds the branch length.
    pub fn merge(&mut self, keep: &[(usize, usize)]) {
        let fan = self.fan.take().expect("merge needs a forked cache");
        let batch = self.batch();
        assert_eq!(keep.len(), batch, "one choice per sequence");
        let prefix_len = self.prefix_valid[0].len();
        let branch_len = self.branch_valid[0].len();
        // Source columns (in `prefix ++ chosen branch row`) of each sequence's valid tokens.
        let sources: Vec<Vec<usize>> = keep
            .iter()
            .enumerate()
            .map(|(b, &(i, n))| {
                assert!(i < fan && n <= branch_len, "bad merge choice {:?}", keep[b]);
                let row = &self.branch_valid[b * fan + i];
                let old = self.prefix_valid[b].iter().enumerate().filter(|(_, v)| **v);
                let new = row[..n].iter().enumerate().filter(|(_, v)| **v);
                old.map(|(c, _)| c)
                    .chain(new.map(|(t, _)| prefix_len + t))
                    .collect()
            })
            .collect();
        let new_len = sources.iter().map(Vec::len).max().unwrap_or(0);
        // Nothing kept from the branches and the prefix already packed: just drop the branches.
        let unchanged = new_len == prefix_len
            && sources
                .iter()
                .all(|src| src.iter().copied().eq(prefix_len - src.len()..prefix_len));
        if unchanged {
            for layer in &mut self.layers {
                layer.branch = None;
            }
            self.branch_valid.clear();
            self.mask = None;
            return;
        }
        let rows: Vec<i64> = keep
            .iter()
            .enumerate()
            .map(|(b, &(i, _))| (b * fan + i) as i64)
            .collect();
        let mut index = None;
        for layer in &mut self.layers {
            let prefix = layer.prefix.take();
            let branch = layer.branch.take();
            if new_len == 0 {
                continue;
            }
            let device = match (&prefix, &branch) {
                (Some((k, _)), _) | (None, Some((k, _))) => k.device(),
                (None, None) => continue,
            };
            let rows = Tensor::<1, Int>::from_data(TensorData::new(rows.clone(), [batch]), &device);
            let pick = |t: Tensor<4>| t.select(0, rows.clone());
            let (k, v) = match (prefix, branch) {
                (Some((pk, pv)), Some((bk, bv))) => (
                    Tensor::cat(vec![pk, pick(bk)], 2),
                    Tensor::cat(vec![pv, pick(bv)], 2),
                ),
                (Some(kv), None) => kv,
                (None, Some((bk, bv))) => (pick(bk), pick(bv)),
                (None, None) => unreachable!(),
            };
            let [_, h, _, d] = k.dims();
            let index = index
                .get_or_insert_with(|| {
                    // Left-pad each sequence by pointing its padding slots at column 0 (masked).
                    let mut data = Vec::with_capacity(batch * h * new_len * d);
                    for src in &sources {
                        let cols: Vec<i64> = std::iter::repeat_n(0, new_len - src.len())
                            .chain(src.iter().map(|&c| c as i64))
                            .collect();
                        for _ in 0..h {
                            for &c in &cols {
                                data.extend(std::iter::repeat_n(c, d));
                            }
                        }
                    }
                    Tensor::<4, Int>::from_data(
                        TensorData::new(data, [batch, h, new_len, d]),
                        &device,
                    )
                })
                .clone();
            layer.prefix = Some((k.gather(2, index.clone()), v.gather(2, index)));
        }
        debug_assert!(sources.iter().all(|s| s.len() <= prefix_len + branch_len));
        self.prefix_valid = sources
            .iter()
            .map(|s| {
                let mut v = vec![false; new_len - s.len()];
                v.resize(new_len, true);
                v
            })
            .collect();
        self.branch_valid.clear();
        self.mask = None;
    }

    /// Marks which tokens of the next forward pass are real, `[rows][s_new]`; the others are
    /// masked as keys forever (dummies that pad ragged inputs).
    pub fn set_incoming_validity(&mut self, valid: Vec<Vec<bool>>) {
        assert_eq!(valid.len(), self.rows(), "one row per attention row");
        self.incoming = Some(valid);
    }

    /// The `[rows, total]` key mask (`true` = hidden), `None` if every key is visible.
    fn key_mask(&mut self, device: &Device) -> Option<Tensor<2, Bool>> {
        if let Some(mask) = &self.mask {
            return mask.clone();
        }
        let rows = self.rows();
        let fan = self.fan.unwrap_or(1);
        let forked = self.fan.is_some();
        let mut data = Vec::new();
        for r in 0..rows {
            data.extend(self.prefix_valid[r / fan].iter().map(|v| !v));
            if forked {
                data.extend(self.branch_valid[r].iter().map(|v| !v));
            }
        }
        let total = data.len() / rows.max(1);
        let mask = data
            .iter()
            .any(|&m| m)
            .then(|| Tensor::from_data(TensorData::new(data, [rows, total]), device));
        self.mask = Some(mask.clone());
        mask
    }
}

impl KvCache for BranchKvCache {
    fn attend(
        &mut self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Result<Tensor<4>, CacheError> {
        let [rows, _, s_new, _] = k.dims();
        if rows != self.rows() {
            return Err(format!(
                "branching cache: {rows} attention rows, the cache's layout has {}",
                self.rows()
            )
            .into());
        }
        let device = k.device();
        let slot = &mut self.layers[layer];
        let (keys, values, len, valid) = match self.fan {
            None => {
                let len = append_kv(&mut slot.prefix, k, v);
                let (k, v) = slot.prefix.clone().expect("just appended");
                (k, v, len, &mut self.prefix_valid)
            }
            Some(fan) => {
                let len = append_kv(&mut slot.branch, k, v);
                let (bk, bv) = slot.branch.clone().expect("just appended");
                let (k, v) = match &slot.prefix {
                    Some((pk, pv)) => {
                        // The shared prefix is broadcast to the fan rows of its sequence.
                        let widen = |t: Tensor<4>| {
                            let [b, h, s, d] = t.dims();
                            t.unsqueeze_dim::<5>(1).expand([b, fan, h, s, d]).reshape([
                                b * fan,
                                h,
                                s,
                                d,
                            ])
                        };
                        (
                            Tensor::cat(vec![widen(pk.clone()), bk], 2),
                            Tensor::cat(vec![widen(pv.clone()), bv], 2),
                        )
                    }
                    None => (bk, bv),
                };
                (k, v, len, &mut self.branch_valid)
            }
        };
        // The first layer of a forward pass extends the host-side validity of the new slots.
        if valid.first().map_or(0, Vec::len) < len {
            let incoming = self.incoming.take();
            for (r, row) in valid.iter_mut().enumerate() {
                match &incoming {
                    Some(inc) => {
                        assert_eq!(inc[r].len(), s_new, "incoming validity length");
                        row.extend_from_slice(&inc[r]);
                    }
                    None => row.extend(std::iter::repeat_n(true, s_new)),
                }
            }
            self.mask = None;
        }
        let opts = AttnOptions {
            causal: opts.causal,
            scale: opts.scale,
            key_padding: self.key_mask(&device),
        };
        Ok(attention.attend(layer, q, keys, values, &opts))
    }

    fn seq_len(&self) -> usize {
        let last = self
            .layers
            .iter()
            .rev()
            .find(|l| l.prefix.is_some() || l.branch.is_some());
        last.map_or(0, |l| {
            let len =
                |s: &Option<(Tensor<4>, Tensor<4>)>| s.as_ref().map_or(0, |(k, _)| k.dims()[2]);
            len(&l.prefix) + len(&l.branch)
        })
    }

    /// Drops every slot from `len` on (prefix slots included if `len` reaches into the prefix);
    /// per-sequence rollback is [`BranchKvCache::merge`].
    fn truncate(&mut self, len: usize) {
        let prefix_len = self.prefix_valid.first().map_or(0, Vec::len);
        let cut = |slot: &mut Option<(Tensor<4>, Tensor<4>)>, keep: usize| {
            if let Some((k, v)) = slot.take()
                && keep > 0
            {
                let [b, h, s, d] = k.dims();
                let keep = keep.min(s);
                *slot = Some((
                    k.slice([0..b, 0..h, 0..keep, 0..d]),
                    v.slice([0..b, 0..h, 0..keep, 0..d]),
                ));
            }
        };
        for layer in &mut self.layers {
            cut(&mut layer.prefix, len);
            cut(&mut layer.branch, len.saturating_sub(prefix_len));
        }
        for row in &mut self.prefix_valid {
            row.truncate(len);
        }
        for row in &mut self.branch_valid {
            row.truncate(len.saturating_sub(prefix_len));
        }
        self.mask = None;
    }

    fn bytes_held(&self) -> usize {
        let bytes = |s: &Option<(Tensor<4>, Tensor<4>)>| {
            s.as_ref().map_or(0, |(k, v)| {
                (k.shape().num_elements() + v.shape().num_elements()) * k.dtype().size()
            })
        };
        self.layers
            .iter()
            .map(|l| bytes(&l.prefix) + bytes(&l.branch))
            .sum()
    }

    fn name(&self) -> String {
        "branch".into()
    }
}

/// A target KV cache that speculative decoding can fork into draft branches and roll back:
/// [`BranchKvCache`] (any batch, any K) or a [`LinearSpecCache`] around any [`KvCache`] (the
/// compressed ones: one sequence, one draft).
pub trait SpecCache: KvCache {
    /// Number of sequences.
    fn batch(&self) -> usize;
    /// The most branch rows per sequence [`SpecCache::fork`] accepts.
    fn max_fan(&self) -> usize;
    /// Attention rows of the next forward pass ([`BranchKvCache::rows`]).
    fn rows(&self) -> usize;
    /// Tokens attention row `row` sees ([`BranchKvCache::row_len`]).
    fn row_len(&self, row: usize) -> usize;
    /// Starts a block with `fan` branch rows per sequence ([`BranchKvCache::fork`]).
    fn fork(&mut self, fan: usize);
    /// Ends a block, keeping `keep[b] = (row, n)` ([`BranchKvCache::merge`]).
    fn merge(&mut self, keep: &[(usize, usize)]);
    /// Validity of the next forward pass's tokens ([`BranchKvCache::set_incoming_validity`]).
    fn set_incoming_validity(&mut self, valid: Vec<Vec<bool>>);
}

impl SpecCache for BranchKvCache {
    fn batch(&self) -> usize {
        BranchKvCache::batch(self)
    }

    fn max_fan(&self) -> usize {
        usize::MAX
    }

    fn rows(&self) -> usize {
        BranchKvCache::rows(self)
    }

    fn row_len(&self, row: usize) -> usize {
        BranchKvCache::row_len(self, row)
    }

    fn fork(&mut self, fan: usize) {
        BranchKvCache::fork(self, fan);
    }

    fn merge(&mut self, keep: &[(usize, usize)]) {
        BranchKvCache::merge(self, keep);
    }

    fn set_incoming_validity(&mut self, valid: Vec<Vec<bool>>) {
        BranchKvCache::set_incoming_validity(self, valid);
    }
}

/// Any [`KvCache`] as the target cache of single-draft speculative decoding of one sequence:
/// a block appends the pending token and the L draft tokens to the cache, and the rollback is
/// [`KvCache::truncate`] to what was kept. This is how the compressed caches (ShadowKV,
/// MiniCache, quantized) speculate: they have no branch rows, so batch 1 and K = 1 (any
/// scheme; with one draft they all reduce to single-draft verification).
///
/// A ShadowKV cache scores its landmarks with all L + 1 queries of a block (summed, as for a
/// multi-token step), so its selection, and thus its sampled tokens, can differ from
/// one-token decoding unless the budget covers the whole prompt.
pub struct LinearSpecCache {
    inner: Box<dyn KvCache>,
    /// Positions held when the current block forked.
    forked_at: Option<usize>,
}

impl LinearSpecCache {
    /// Wraps an empty `inner` cache.
    pub fn new(inner: Box<dyn KvCache>) -> Self {
        Self {
            inner,
            forked_at: None,
        }
    }
}

impl std::fmt::Debug for LinearSpecCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinearSpecCache")
            .field("inner", &self.inner.name())
            .field("forked_at", &self.forked_at)
            .finish()
    }
}

impl KvCache for LinearSpecCache {
    fn attend(
        &mut self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Result<Tensor<4>, CacheError> {
        self.inner.attend(layer, q, k, v, attention, opts)
    }

    fn seq_len(&self) -> usize {
        self.inner.seq_len()
    }

    fn truncate(&mut self, len: usize) {
        self.inner.truncate(len);
    }

    fn bytes_held(&self) -> usize {
        self.inner.bytes_held()
    }

    fn name(&self) -> String {
        self.inner.name()
    }
}

impl SpecCache for LinearSpecCache {
    fn batch(&self) -> usize {
        1
    }

    fn max_fan(&self) -> usize {
        1
    }

    fn rows(&self) -> usize {
        1
    }

    fn row_len(&self, row: usize) -> usize {
        assert_eq!(row, 0, "a linear cache has one row");
        self.inner.seq_len()
    }

    fn fork(&mut self, fan: usize) {
        assert!(self.forked_at.is_none(), "already forked");
        assert_eq!(fan, 1, "a linear cache has one branch");
        self.forked_at = Some(self.inner.seq_len());
    }

    fn merge(&mut self, keep: &[(usize, usize)]) {
        let base = self.forked_at.take().expect("merge needs a forked cache");
        let [(0, n)] = keep else {
            panic!("a linear cache keeps (0, n) of its one branch, got {keep:?}");
        };
        self.inner.truncate(base + n);
    }

    fn set_incoming_validity(&mut self, valid: Vec<Vec<bool>>) {
        // One row is never padded: every token of a forward pass is real.
        assert!(
            valid.len() == 1 && valid[0].iter().all(|&v| v),
            "a linear cache has one row of real tokens"
        );
    }
}
