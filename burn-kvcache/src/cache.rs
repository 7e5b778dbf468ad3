//! The caches: [`QuantKv`] (KIVI-style), [`MiniCacheKv`] (cross-layer merging) and their
//! composition [`MiniCacheKv::with_quant`]. The design choices are in the crate docs.

use burn::tensor::{DType, Int, Tensor, TensorCreationOptions, TensorData};
use burn_kernels_core::{AttentionImpl, AttnOptions, CacheError, KvCache};

pub use crate::store::QuantConfig;
use crate::store::{Axis, RowStore, SeqStore};
use crate::{KvCacheError, bytes_of, bytes_of_int, check_t_gamma};

/// MiniCache settings. See the crate docs for the exact definitions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MiniCacheConfig {
    /// First merged layer; `None` = `num_layers / 2` (the paper merges from the middle).
    pub start_layer: Option<usize>,
    /// SLERP interpolation weight of the deeper layer of a pair, in `[0, 1]`.
    pub t: f32,
    /// Retention threshold on the normalized angle `θ/π`, ≥ 0.
    pub gamma: f32,
    /// Positions held in full precision for both layers of a pair before they are merged.
    pub window: usize,
}

impl Default for MiniCacheConfig {
    fn default() -> Self {
        Self {
            start_layer: None,
            t: 0.6,
            gamma: 0.05,
            window: 16,
        }
    }
}

impl MiniCacheConfig {
    /// The first merged layer for a model of `num_layers` layers.
    pub fn start_for(&self, num_layers: usize) -> usize {
        self.start_layer.unwrap_or(num_layers / 2)
    }

    /// # Errors
    /// [`KvCacheError::NoLayers`], [`KvCacheError::StartLayerOutOfRange`],
    /// [`KvCacheError::InvalidInterpolation`], [`KvCacheError::InvalidGamma`],
    /// [`KvCacheError::ZeroMergeWindow`].
    pub fn validate(&self, num_layers: usize) -> Result<(), KvCacheError> {
        if num_layers == 0 {
            return Err(KvCacheError::NoLayers);
        }
        let start_layer = self.start_for(num_layers);
        if start_layer >= num_layers {
            return Err(KvCacheError::StartLayerOutOfRange {
                start_layer,
                num_layers,
            });
        }
        check_t_gamma(self.t, self.gamma)?;
        if self.window == 0 {
            return Err(KvCacheError::ZeroMergeWindow);
        }
        Ok(())
    }
}

/// Every layer's keys and values quantized KIVI-style (keys per channel, values per token),
/// the most recent tokens in full precision.
#[derive(Debug)]
pub struct QuantKv {
    cfg: QuantConfig,
    layers: Vec<(SeqStore, SeqStore)>,
    last: usize,
}

impl QuantKv {
    /// # Errors
    /// [`KvCacheError::NoLayers`] and the errors of [`QuantConfig::validate`].
    pub fn new(num_layers: usize, cfg: QuantConfig) -> Result<Self, KvCacheError> {
        if num_layers == 0 {
            return Err(KvCacheError::NoLayers);
        }
        cfg.validate()?;
        let layers = (0..num_layers)
            .map(|_| {
                (
                    SeqStore::new(Some(cfg), Axis::PerChannel),
                    SeqStore::new(Some(cfg), Axis::PerToken),
                )
            })
            .collect();
        Ok(Self {
            cfg,
            layers,
            last: 0,
        })
    }
}

impl KvCache for QuantKv {
    fn attend(
        &mut self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Result<Tensor<4>, CacheError> {
        self.last = layer;
        // The call's own tokens are attended exactly; they are quantized afterwards.
        Ok(SeqStore::attend_then_store(
            &mut self.layers[layer],
            layer,
            q,
            k,
            v,
            attention,
            opts,
        ))
    }

    fn seq_len(&self) -> usize {
        self.layers[self.last].0.len()
    }

    fn truncate(&mut self, len: usize) {
        for (k, v) in &mut self.layers {
            k.truncate(len);
            v.truncate(len);
        }
    }

    fn bytes_held(&self) -> usize {
        self.layers.iter().map(|(k, v)| k.bytes() + v.bytes()).sum()
    }

    fn name(&self) -> String {
        format!(
            "quant{}(g{},r{})",
            self.cfg.bits, self.cfg.group_size, self.cfg.residual
        )
    }
}

fn cat_opt<const D: usize>(a: Option<Tensor<D>>, b: Tensor<D>) -> Tensor<D> {
    match a {
        Some(a) => Tensor::cat(vec![a, b], 2),
        None => b,
    }
}

fn cat_opt_int(a: Option<Tensor<3, Int>>, b: Tensor<3, Int>) -> Tensor<3, Int> {
    match a {
        Some(a) => Tensor::cat(vec![a, b], 2),
        None => b,
    }
}

fn seq_slice(x: Tensor<4>, len: usize) -> Option<Tensor<4>> {
    let [b, h, s, d] = x.dims();
    (len > 0).then(|| x.slice([0..b, 0..h, 0..len.min(s), 0..d]))
}

/// The keys (or values) of one merged pair of layers: merged positions `[0, m)` and the
/// positions after them still held in full precision per layer.
#[derive(Debug)]
struct MergedSeq {
    quant: Option<QuantConfig>,
    axis: Axis,
    /// Shared directions `[b, h, m, d]`.
    dir: SeqStore,
    /// `[b, h, m]` each.
    mag_a: Option<Tensor<3>>,
    mag_b: Option<Tensor<3>>,
    /// `[b, h, m]` i32: 0 merged, `r + 1` = retained row `r`.
    slot: Option<Tensor<3, Int>>,
    /// Layer `l+1`'s vectors of the retained positions.
    retained: RowStore,
    pending_a: Option<Tensor<4>>,
    pending_b: Option<Tensor<4>>,
    /// Sum of `θ/π` over every row pair merged (statistics only).
    dist_sum: f64,
}

impl MergedSeq {
    fn new(quant: Option<QuantConfig>, axis: Axis) -> Self {
        Self {
            quant,
            axis,
            dir: SeqStore::new(quant, axis),
            mag_a: None,
            mag_b: None,
            slot: None,
            retained: RowStore::new(quant),
            pending_a: None,
            pending_b: None,
            dist_sum: 0.0,
        }
    }

    fn pending(&self, second: bool) -> &Option<Tensor<4>> {
        if second {
            &self.pending_b
        } else {
            &self.pending_a
        }
    }

    fn pending_len(&self, second: bool) -> usize {
        self.pending(second).as_ref().map_or(0, |x| x.dims()[2])
    }

    fn merged_len(&self) -> usize {
        self.dir.len()
    }

    /// The merged positions of one layer, restored.
    fn restore(&self, second: bool) -> Option<Tensor<4>> {
        let dir = self.dir.read()?;
        let [b, h, m, d] = dir.dims();
        let n = b * h * m;
        let mag = if second { &self.mag_b } else { &self.mag_a };
        let mag = mag.clone().expect("set with dir").reshape([n]);
        let retained = (second && self.retained.len() > 0).then(|| {
            (
                self.slot.clone().expect("set with dir").reshape([n]),
                self.retained.read().expect("non-empty"),
            )
        });
        Some(
            crate::restore(dir.reshape([n, d]), mag, retained)
                .expect("the pair's own shapes")
                .reshape([b, h, m, d]),
        )
    }

    fn read_with(&self, second: bool, new: Tensor<4>) -> Tensor<4> {
        let held = match (self.restore(second), self.pending(second).clone()) {
            (Some(m), Some(p)) => Some(Tensor::cat(vec![m, p], 2)),
            (m, p) => m.or(p),
        };
        cat_opt(held, new)
    }

    fn push(&mut self, second: bool, x: Tensor<4>) {
        let slot = if second {
            &mut self.pending_b
        } else {
            &mut self.pending_a
        };
        *slot = Some(cat_opt(slot.take(), x));
    }

    /// Merges the positions pending in both layers.
    fn merge_pending(&mut self, t: f32, gamma: f32) {
        let p = self.pending_len(false).min(self.pending_len(true));
        if p == 0 {
            return;
        }
        let split = |x: Tensor<4>| {
            let [b, h, s, d] = x.dims();
            let rest = (s > p).then(|| x.clone().slice([0..b, 0..h, p..s, 0..d]));
            (x.slice([0..b, 0..h, 0..p, 0..d]), rest)
        };
        let (a, rest_a) = split(self.pending_a.take().expect("p > 0"));
        let (bt, rest_b) = split(self.pending_b.take().expect("p > 0"));
        self.pending_a = rest_a;
        self.pending_b = rest_b;

        let [b, h, _, d] = a.dims();
        let n = b * h * p;
        let device = a.device();
        let rows_b = bt.reshape([n, d]);
        let m =
            crate::merge(a.reshape([n, d]), rows_b.clone(), t, gamma).expect("validated config");
        // One small read: which rows are retained (the same f32 comparison as the merge's).
        let dist = m
            .dist
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .expect("f32");
        let r0 = self.retained.len();
        let mut slots = vec![0i32; n];
        let mut idx = Vec::new();
        for (i, &x) in dist.iter().enumerate() {
            self.dist_sum += f64::from(x);
            if x > gamma {
                idx.push(i as i32);
                slots[i] = (r0 + idx.len()) as i32;
            }
        }
        if !idx.is_empty() {
            let k = idx.len();
            let idx = Tensor::<1, Int>::from_data(TensorData::new(idx, [k]), &device);
            self.retained.append(rows_b.select(0, idx));
        }
        let opts = TensorCreationOptions::new(device).with_dtype(DType::I32);
        let slots = Tensor::<1, Int>::from_data(TensorData::new(slots, [n]), opts);
        self.slot = Some(cat_opt_int(self.slot.take(), slots.reshape([b, h, p])));
        self.mag_a = Some(cat_opt(self.mag_a.take(), m.mag_a.reshape([b, h, p])));
        self.mag_b = Some(cat_opt(self.mag_b.take(), m.mag_b.reshape([b, h, p])));
        self.dir.append(m.dir.reshape([b, h, p, d]));
    }

    fn truncate(&mut self, len: usize, t: f32, gamma: f32, window: usize) {
        let m = self.merged_len();
        if len >= m {
            let keep = len - m;
            self.pending_a = self.pending_a.take().and_then(|x| seq_slice(x, keep));
            self.pending_b = self.pending_b.take().and_then(|x| seq_slice(x, keep));
            return;
        }
        // Cutting into the merged positions: restore, cut, merge again.
        let full = |second: bool| {
            let held = self.restore(second).expect("m > len ≥ 0");
            let all = match self.pending(second).clone() {
                Some(p) => Tensor::cat(vec![held, p], 2),
                None => held,
            };
            seq_slice(all, len)
        };
        let (a, b) = (full(false), full(true));
        let dist_sum = self.dist_sum;
        *self = Self::new(self.quant, self.axis);
        self.dist_sum = dist_sum;
        self.pending_a = a;
        self.pending_b = b;
        if len >= window {
            self.merge_pending(t, gamma);
        }
    }

    fn bytes(&self) -> usize {
        let opt = |x: &Option<Tensor<3>>| x.as_ref().map_or(0, bytes_of);
        let pend = |x: &Option<Tensor<4>>| x.as_ref().map_or(0, bytes_of);
        self.dir.bytes()
            + opt(&self.mag_a)
            + opt(&self.mag_b)
            + self.slot.as_ref().map_or(0, bytes_of_int)
            + self.retained.bytes()
            + pend(&self.pending_a)
            + pend(&self.pending_b)
    }
}

#[derive(Debug, Clone, Copy)]
enum Role {
    /// Stored unmerged, index into `full`.
    Full(usize),
    /// The shallower layer of pair `i`.
    First(usize),
    /// The deeper layer of pair `i`.
    Second(usize),
}

/// Counts of merged positions, summed over pairs, keys and values, `(batch, kv_head)` rows.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MergeStats {
    /// Token vectors pairs merged so far (each a `(layer l, layer l+1)` pair).
    pub merged: usize,
    /// Of those, the pairs retained unmerged (`θ/π > γ`).
    pub retained: usize,
    /// Sum of the normalized angles `θ/π` of every pair merged (re-merges after a truncation
    /// count again).
    pub dist_sum: f64,
}

impl MergeStats {
    /// `retained / merged`, 0 when nothing is merged.
    pub fn retained_fraction(&self) -> f64 {
        self.retained as f64 / self.merged.max(1) as f64
    }

    /// Mean normalized angle `θ/π` between the two layers of a merged pair.
    pub fn mean_dist(&self) -> f64 {
        self.dist_sum / self.merged.max(1) as f64
    }
}

/// MiniCache cross-layer merging over a model's layers, optionally composed with KIVI-style
/// quantization ([`MiniCacheKv::with_quant`]). See the crate docs.
#[derive(Debug)]
pub struct MiniCacheKv {
    cfg: MiniCacheConfig,
    start_layer: usize,
    quant: Option<QuantConfig>,
    roles: Vec<Role>,
    full: Vec<(SeqStore, SeqStore)>,
    pairs: Vec<(MergedSeq, MergedSeq)>,
    lens: Vec<usize>,
    last: usize,
}

impl MiniCacheKv {
    /// MiniCache with every held tensor in full precision.
    ///
    /// # Errors
    /// As [`MiniCacheConfig::validate`].
    pub fn new(num_layers: usize, cfg: MiniCacheConfig) -> Result<Self, KvCacheError> {
        Self::build(num_layers, cfg, None)
    }

    /// MiniCache whose directions, unmerged layers and retained rows are quantized.
    ///
    /// # Errors
    /// As [`MiniCacheConfig::validate`] and [`QuantConfig::validate`].
    pub fn with_quant(
        num_layers: usize,
        cfg: MiniCacheConfig,
        quant: QuantConfig,
    ) -> Result<Self, KvCacheError> {
        quant.validate()?;
        Self::build(num_layers, cfg, Some(quant))
    }

    fn build(
        num_layers: usize,
        cfg: MiniCacheConfig,
        quant: Option<QuantConfig>,
    ) -> Result<Self, KvCacheError> {
        cfg.validate(num_layers)?;
        let start_layer = cfg.start_for(num_layers);
        let mut roles = Vec::with_capacity(num_layers);
        let (mut full, mut pairs) = (Vec::new(), Vec::new());
        let mut l = 0;
        while l < num_layers {
            if l >= start_layer && l + 1 < num_layers {
                roles.push(Role::First(pairs.len()));
                roles.push(Role::Second(pairs.len()));
                pairs.push((
                    MergedSeq::new(quant, Axis::PerChannel),
                    MergedSeq::new(quant, Axis::PerToken),
                ));
                l += 2;
            } else {
                roles.push(Role::Full(full.len()));
                full.push((
                    SeqStore::new(quant, Axis::PerChannel),
                    SeqStore::new(quant, Axis::PerToken),
                ));
                l += 1;
            }
        }
        Ok(Self {
            cfg,
            start_layer,
            quant,
            roles,
            full,
            pairs,
            lens: vec![0; num_layers],
            last: 0,
        })
    }

    /// Number of merged layer pairs.
    pub fn num_pairs(&self) -> usize {
        self.pairs.len()
    }

    /// Merged and retained counts so far.
    pub fn stats(&self) -> MergeStats {
        let mut s = MergeStats::default();
        for (k, v) in &self.pairs {
            for seq in [k, v] {
                let rows = seq.mag_a.as_ref().map_or(0, |m| m.shape().num_elements());
                s.merged += rows;
                s.retained += seq.retained.len();
                s.dist_sum += seq.dist_sum;
            }
        }
        s
    }
}

impl KvCache for MiniCacheKv {
    fn attend(
        &mut self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Result<Tensor<4>, CacheError> {
        self.lens[layer] += k.dims()[2];
        self.last = layer;
        // The call's own tokens are attended exactly; compression happens afterwards.
        Ok(match self.roles[layer] {
            Role::Full(i) => {
                SeqStore::attend_then_store(&mut self.full[i], layer, q, k, v, attention, opts)
            }
            Role::First(i) | Role::Second(i) => {
                let second = matches!(self.roles[layer], Role::Second(_));
                let (ks, vs) = &mut self.pairs[i];
                let out = attention.attend(
                    layer,
                    q,
                    ks.read_with(second, k.clone()),
                    vs.read_with(second, v.clone()),
                    opts,
                );
                ks.push(second, k);
                vs.push(second, v);
                let w = self.cfg.window;
                if second && ks.pending_len(false).min(ks.pending_len(true)) >= w {
                    ks.merge_pending(self.cfg.t, self.cfg.gamma);
                    vs.merge_pending(self.cfg.t, self.cfg.gamma);
                }
                out
            }
        })
    }

    fn seq_len(&self) -> usize {
        self.lens[self.last]
    }

    fn truncate(&mut self, len: usize) {
        for (k, v) in &mut self.full {
            k.truncate(len);
            v.truncate(len);
        }
        let (t, gamma, w) = (self.cfg.t, self.cfg.gamma, self.cfg.window);
        for (k, v) in &mut self.pairs {
            k.truncate(len, t, gamma, w);
            v.truncate(len, t, gamma, w);
        }
        for l in &mut self.lens {
            *l = (*l).min(len);
        }
    }

    fn bytes_held(&self) -> usize {
        let full: usize = self.full.iter().map(|(k, v)| k.bytes() + v.bytes()).sum();
        let pairs: usize = self.pairs.iter().map(|(k, v)| k.bytes() + v.bytes()).sum();
        full + pairs
    }

    fn name(&self) -> String {
        let base = format!(
            "minicache(start={},t={},γ={})",
            self.start_layer, self.cfg.t, self.cfg.gamma
        );
        match self.quant {
            Some(q) => format!("{base}+quant{}", q.bits),
            None => base,
        }
    }
}
