//! Storage of one growing sequence `[batch, heads, seq, head_dim]` (full or KIVI-quantized)
//! and of a growing list of rows `[rows, head_dim]` (full or quantized per row).

use burn::tensor::{Int, Tensor};

use crate::{
    KvCacheError, Packed, QuantAttnView, QuantLayout, bytes_of, bytes_of_int, dequantize,
    kv_has_quant_attention, quantize_rows,
};

/// KIVI-style quantization settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantConfig {
    /// Bits per code: 2 or 4.
    pub bits: u32,
    /// Tokens per key group (per-channel quantization) and channels per value group
    /// (per-token quantization).
    pub group_size: usize,
    /// Most recent tokens kept in full precision (at least this many, fewer than
    /// `residual + group_size`).
    pub residual: usize,
    /// On backends with the kernel ([`crate::kv_has_quant_attention`]), attend
    /// straight from the packed keys and values ([`crate::quant_attention`]) instead of
    /// dequantizing the layer for the model's attention. The model's `AttentionImpl` is then
    /// not called for quantized layers.
    pub fused_attention: bool,
}

impl Default for QuantConfig {
    fn default() -> Self {
        Self {
            bits: 4,
            group_size: 32,
            residual: 32,
            fused_attention: true,
        }
    }
}

impl QuantConfig {
    /// The default settings with `bits` bits.
    pub fn bits(bits: u32) -> Self {
        Self {
            bits,
            ..Self::default()
        }
    }

    /// # Errors
    /// [`KvCacheError::InvalidBits`] unless `bits` is 2 or 4, [`KvCacheError::ZeroGroupSize`].
    pub fn validate(&self) -> Result<(), KvCacheError> {
        crate::QuantLayout::new(self.bits, self.group_size, 1).map(|_| ())
    }
}

/// Which way a quantized sequence is grouped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Axis {
    /// Keys: a min/scale per channel and block of `group_size` tokens.
    PerChannel,
    /// Values: a min/scale per token and group of `group_size` channels.
    PerToken,
}

fn cat4(a: Option<Tensor<4>>, b: Tensor<4>) -> Tensor<4> {
    match a {
        Some(a) => Tensor::cat(vec![a, b], 2),
        None => b,
    }
}

fn slice_seq(x: Tensor<4>, from: usize, to: usize) -> Tensor<4> {
    let [b, h, _, d] = x.dims();
    x.slice([0..b, 0..h, from..to, 0..d])
}

/// Quantized blocks of a sequence, each tensor `[b, h, blocks, ·]`.
#[derive(Debug, Clone)]
struct Blocks {
    words: Tensor<4, Int>,
    scale: Tensor<4>,
    min: Tensor<4>,
}

#[derive(Debug)]
pub(crate) struct QuantSeq {
    cfg: QuantConfig,
    axis: Axis,
    blocks: Option<Blocks>,
    /// Tokens in `blocks`.
    qlen: usize,
    residual: Option<Tensor<4>>,
    /// `[b, h, d]` of the sequence, known from the first append.
    dims: Option<[usize; 3]>,
}

impl QuantSeq {
    fn new(cfg: QuantConfig, axis: Axis) -> Self {
        Self {
            cfg,
            axis,
            blocks: None,
            qlen: 0,
            residual: None,
            dims: None,
        }
    }

    fn layout(&self, d: usize) -> QuantLayout {
        let g = self.cfg.group_size;
        let cols = match self.axis {
            Axis::PerChannel => g,
            Axis::PerToken => d,
        };
        QuantLayout::new(self.cfg.bits, g, cols).expect("validated config")
    }

    fn residual_len(&self) -> usize {
        self.residual.as_ref().map_or(0, |r| r.dims()[2])
    }

    fn append(&mut self, x: Tensor<4>) {
        let [b, h, _, d] = x.dims();
        self.dims = Some([b, h, d]);
        let res = cat4(self.residual.take(), x);
        let n = res.dims()[2];
        let g = self.cfg.group_size;
        if n < self.cfg.residual + g {
            self.residual = Some(res);
            return;
        }
        let nq = (n - self.cfg.residual) / g * g;
        self.quantize_block(slice_seq(res.clone(), 0, nq));
        self.residual = (nq < n).then(|| slice_seq(res, nq, n));
    }

    /// Quantizes `x` (`n` a multiple of the group size) onto the end of the blocks.
    fn quantize_block(&mut self, x: Tensor<4>) {
        let [b, h, n, d] = x.dims();
        let layout = self.layout(d);
        let g = self.cfg.group_size;
        let (rows, nb) = match self.axis {
            Axis::PerToken => (x.reshape([b * h * n, d]), n),
            Axis::PerChannel => {
                let nb = n / g;
                let t = x.reshape([b, h, nb, g, d]).swap_dims(3, 4);
                (t.reshape([b * h * nb * d, g]), nb)
            }
        };
        let p = quantize_rows(rows, layout);
        let per = |t: usize| match self.axis {
            Axis::PerToken => t,
            Axis::PerChannel => t * d,
        };
        let (wc, sc) = (
            per(layout.groups() * layout.words_per_group()),
            per(layout.groups()),
        );
        let new = Blocks {
            words: p.words.reshape([b, h, nb, wc]),
            scale: p.scale.reshape([b, h, nb, sc]),
            min: p.min.reshape([b, h, nb, sc]),
        };
        self.blocks = Some(match self.blocks.take() {
            Some(old) => Blocks {
                words: Tensor::cat(vec![old.words, new.words], 2),
                scale: Tensor::cat(vec![old.scale, new.scale], 2),
                min: Tensor::cat(vec![old.min, new.min], 2),
            },
            None => new,
        });
        self.qlen += n;
    }

    /// The quantized blocks as the 2-D rows [`crate::quantize`] packs (see
    /// [`crate::QuantAttnView`]).
    fn packed(&self) -> Option<(Packed, QuantLayout)> {
        let blocks = self.blocks.as_ref()?;
        let [b, h, d] = self.dims.expect("set with the blocks");
        let layout = self.layout(d);
        let nb = blocks.words.dims()[2];
        let rows = match self.axis {
            Axis::PerToken => b * h * nb,
            Axis::PerChannel => b * h * nb * d,
        };
        let packed = Packed {
            words: blocks
                .words
                .clone()
                .reshape([rows, layout.groups() * layout.words_per_group()]),
            scale: blocks.scale.clone().reshape([rows, layout.groups()]),
            min: blocks.min.clone().reshape([rows, layout.groups()]),
        };
        Some((packed, layout))
    }

    fn dequantized(&self) -> Option<Tensor<4>> {
        let (packed, layout) = self.packed()?;
        let [b, h, d] = self.dims.expect("set with the blocks");
        Some(seq_from_rows(
            dequantize(&packed, layout),
            self.axis,
            [b, h, self.qlen, d],
        ))
    }

    fn read(&self) -> Option<Tensor<4>> {
        match (self.dequantized(), self.residual.clone()) {
            (Some(q), Some(r)) => Some(Tensor::cat(vec![q, r], 2)),
            (q, r) => q.or(r),
        }
    }

    fn truncate(&mut self, len: usize) {
        if len >= self.qlen {
            let keep = len - self.qlen;
            if keep < self.residual_len() {
                self.residual = (keep > 0)
                    .then(|| slice_seq(self.residual.take().expect("non-empty"), 0, keep));
            }
            return;
        }
        // Cutting into the quantized blocks: dequantize, cut, and quantize again.
        let all = self.read().expect("len < qlen, so blocks exist");
        *self = Self::new(self.cfg, self.axis);
        if len > 0 {
            self.append(slice_seq(all, 0, len));
        }
    }

    fn bytes(&self) -> usize {
        let blocks = self.blocks.as_ref().map_or(0, |b| {
            bytes_of_int(&b.words) + bytes_of(&b.scale) + bytes_of(&b.min)
        });
        blocks + self.residual.as_ref().map_or(0, bytes_of)
    }
}

/// Dequantized rows back in sequence order: per-token rows `[b·h·n, d]` or per-channel rows
/// `[b·h·(n/g)·d, g]` (`g` tokens of one channel each) to `[b, h, n, d]`.
pub(crate) fn seq_from_rows(x: Tensor<2>, axis: Axis, [b, h, n, d]: [usize; 4]) -> Tensor<4> {
    match axis {
        Axis::PerToken => x.reshape([b, h, n, d]),
        Axis::PerChannel => {
            let g = x.dims()[1];
            x.reshape([b, h, n / g, d, g])
                .swap_dims(3, 4)
                .reshape([b, h, n, d])
        }
    }
}

/// One growing sequence `[b, h, seq, d]`.
// A few per layer, rarely moved: the size of Burn's tensor values does not call for a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum SeqStore {
    Full(Option<Tensor<4>>),
    Quant(QuantSeq),
}

impl SeqStore {
    pub(crate) fn new(quant: Option<QuantConfig>, axis: Axis) -> Self {
        match quant {
            Some(cfg) => Self::Quant(QuantSeq::new(cfg, axis)),
            None => Self::Full(None),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Full(x) => x.as_ref().map_or(0, |x| x.dims()[2]),
            Self::Quant(q) => q.qlen + q.residual_len(),
        }
    }

    pub(crate) fn append(&mut self, x: Tensor<4>) {
        match self {
            Self::Full(slot) => *slot = Some(cat4(slot.take(), x)),
            Self::Quant(q) => q.append(x),
        }
    }

    /// Everything held, dequantized.
    pub(crate) fn read(&self) -> Option<Tensor<4>> {
        match self {
            Self::Full(x) => x.clone(),
            Self::Quant(q) => q.read(),
        }
    }

    /// Everything held followed by `new` (not stored).
    pub(crate) fn read_with(&self, new: Tensor<4>) -> Tensor<4> {
        cat4(self.read(), new)
    }

    /// Attends `q` over everything `pair` (keys, values) holds plus the call's own `k`, `v`,
    /// exactly, then stores `k`, `v` (compressing them as the store does).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attend_then_store(
        pair: &mut (Self, Self),
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        attention: &dyn burn_kernels_core::AttentionImpl,
        opts: &burn_kernels_core::AttnOptions,
    ) -> Tensor<4> {
        let (ks, vs) = pair;
        let out = match (&*ks, &*vs) {
            (Self::Quant(kq), Self::Quant(vq))
                if kq.cfg.fused_attention
                    && kq.blocks.is_some()
                    && kv_has_quant_attention(&q.device()) =>
            {
                let view = QuantAttnView {
                    keys: kq.packed(),
                    values: vq.packed(),
                    qlen: kq.qlen,
                    tail: Some((
                        cat4(kq.residual.clone(), k.clone()),
                        cat4(vq.residual.clone(), v.clone()),
                    )),
                };
                crate::quant_attention(q, &view, opts).expect("the cache's own layout")
            }
            _ => attention.attend(
                layer,
                q,
                ks.read_with(k.clone()),
                vs.read_with(v.clone()),
                opts,
            ),
        };
        ks.append(k);
        vs.append(v);
        out
    }

    pub(crate) fn truncate(&mut self, len: usize) {
        match self {
            Self::Full(slot) => {
                if let Some(x) = slot.take() {
                    let s = x.dims()[2];
                    *slot = (len > 0).then(|| slice_seq(x, 0, len.min(s)));
                }
            }
            Self::Quant(q) => q.truncate(len),
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        match self {
            Self::Full(x) => x.as_ref().map_or(0, bytes_of),
            Self::Quant(q) => q.bytes(),
        }
    }
}

/// A growing list of rows `[rows, d]`: full, or quantized per row in groups of channels.
// One per merged pair, rarely moved: the size of Burn's tensor values does not call for a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum RowStore {
    Full(Option<Tensor<2>>),
    Quant {
        cfg: QuantConfig,
        packed: Option<(Packed, QuantLayout)>,
    },
}

impl RowStore {
    pub(crate) fn new(quant: Option<QuantConfig>) -> Self {
        match quant {
            Some(cfg) => Self::Quant { cfg, packed: None },
            None => Self::Full(None),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Full(x) => x.as_ref().map_or(0, |x| x.dims()[0]),
            Self::Quant { packed, .. } => packed.as_ref().map_or(0, |(p, _)| p.scale.dims()[0]),
        }
    }

    pub(crate) fn append(&mut self, rows: Tensor<2>) {
        if rows.dims()[0] == 0 {
            return;
        }
        match self {
            Self::Full(slot) => {
                *slot = Some(match slot.take() {
                    Some(old) => Tensor::cat(vec![old, rows], 0),
                    None => rows,
                })
            }
            Self::Quant { cfg, packed } => {
                let layout =
                    QuantLayout::new(cfg.bits, cfg.group_size, rows.dims()[1]).expect("validated");
                let new = quantize_rows(rows, layout);
                let merged = match packed.take() {
                    Some((old, _)) => Packed {
                        words: Tensor::cat(vec![old.words, new.words], 0),
                        scale: Tensor::cat(vec![old.scale, new.scale], 0),
                        min: Tensor::cat(vec![old.min, new.min], 0),
                    },
                    None => new,
                };
                *packed = Some((merged, layout));
            }
        }
    }

    pub(crate) fn read(&self) -> Option<Tensor<2>> {
        match self {
            Self::Full(x) => x.clone(),
            Self::Quant { packed, .. } => packed.as_ref().map(|(p, l)| dequantize(p, *l)),
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        match self {
            Self::Full(x) => x.as_ref().map_or(0, bytes_of),
            Self::Quant { packed, .. } => packed.as_ref().map_or(0, |(p, _)| p.bytes()),
        }
    }
}
