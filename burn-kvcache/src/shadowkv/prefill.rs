//! The prefill side of [`ShadowKvCache`]: the prompt's keys factored to low rank, its values
//! moved to host memory, landmarks and outlier chunks chosen (see the module docs).

use burn::tensor::{Bool, DType, Device, Tensor};

use crate::KvCacheError;

use super::*;

impl ShadowKvCache {
    /// The RoPE tables covering positions `0..n`.
    pub(super) fn tables_for(&mut self, n: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
        match &self.tables {
            Some((c, s)) if c.dims()[0] >= n => (c.clone(), s.clone()),
            _ => {
                let t = rope_tables(self.head_dim, n, self.rope, device);
                self.tables = Some(t.clone());
                t
            }
        }
    }

    /// Decides at a layer's first call whether its prompt is compressed: returns the left
    /// padding per sequence if so.
    pub(super) fn eligible(
        &self,
        b: usize,
        s: usize,
        key_padding: Option<&Tensor<2, Bool>>,
    ) -> Option<Vec<usize>> {
        let pads = match key_padding {
            None => vec![0; b],
            Some(mask) => {
                let [_, cols] = mask.dims();
                // Through ints: the bool storage differs between backends (u8, u32).
                let mask: Vec<bool> = mask
                    .clone()
                    .int()
                    .into_data()
                    .convert::<i64>()
                    .try_to_vec::<i64>()
                    .ok()?
                    .into_iter()
                    .map(|x| x != 0)
                    .collect();
                let p = left_pads(&mask, b, cols)?;
                // New positions only: the mask covers this call (the cache is empty).
                if cols != s {
                    return None;
                }
                p
            }
        };
        let shortest = pads.iter().map(|p| s - p.min(&s)).min().unwrap_or(0);
        (shortest >= self.cfg.min_tokens()).then_some(pads)
    }

    /// Stores a prompt into an empty layer: compressed when eligible, else full.
    pub(super) fn install(
        &mut self,
        layer: usize,
        k: Tensor<4>,
        v: Tensor<4>,
        key_padding: Option<&Tensor<2, Bool>>,
    ) -> Result<bool, KvCacheError> {
        let [b, _, s, _] = k.dims();
        let state = match self.eligible(b, s, key_padding) {
            Some(pads) => Layer::Sparse(Box::new(self.prefill(k, v, pads)?)),
            None => Layer::Full(Some((k, v))),
        };
        let sparse = matches!(state, Layer::Sparse(_));
        self.layers[layer] = state;
        Ok(sparse)
    }

    /// Takes the keys and values of a prompt computed elsewhere (prefilled in pieces, or
    /// shared between caches) into an empty `layer`, without attention: compressed when
    /// eligible (returns `true`), else held in full.
    ///
    /// # Shapes
    /// - `k` (RoPE applied), `v`: `[batch, kv_heads, seq, head_dim]`; `key_padding`: `[batch,
    ///   seq]`, `true` on left padding
    ///
    /// # Errors
    /// [`KvCacheError::LayerOutOfRange`], [`KvCacheError::LayerNotEmpty`],
    /// [`KvCacheError::ShapeMismatch`] when the heads or head dim are not the cache's.
    pub fn compress_prompt(
        &mut self,
        layer: usize,
        k: Tensor<4>,
        v: Tensor<4>,
        key_padding: Option<&Tensor<2, Bool>>,
    ) -> Result<bool, KvCacheError> {
        let num_layers = self.layers.len();
        if layer >= num_layers {
            return Err(KvCacheError::LayerOutOfRange { layer, num_layers });
        }
        if !matches!(self.layers[layer], Layer::Empty) {
            return Err(KvCacheError::LayerNotEmpty(layer));
        }
        let [b, h, s, d] = k.dims();
        if h != self.kv_heads || d != self.head_dim || v.dims() != k.dims() {
            return Err(KvCacheError::ShapeMismatch {
                left: vec![b, self.kv_heads, s, self.head_dim],
                right: v.dims().to_vec(),
            });
        }
        if let Some(m) = key_padding
            && m.dims() != [b, s]
        {
            return Err(KvCacheError::ShapeMismatch {
                left: vec![b, s],
                right: m.dims().to_vec(),
            });
        }
        self.lens[layer] += s;
        self.last = layer;
        self.install(layer, k, v, key_padding)
    }

    /// Compresses one layer's prompt. See the module docs.
    pub(super) fn prefill(
        &mut self,
        k: Tensor<4>,
        v: Tensor<4>,
        pads: Vec<usize>,
    ) -> Result<Sparse, KvCacheError> {
        let [b, h, s, d] = k.dims();
        let device = k.device();
        let dtype = k.dtype();
        let (cs, o, rank) = (self.cfg.chunk, self.cfg.outlier_chunks, self.cfg.rank);
        let max_len = pads.iter().map(|p| s - p).max().unwrap_or(0);
        let (cos, sin) = self.tables_for(max_len, &device);

        let mut a_rows = Vec::with_capacity(b);
        let mut wts = Vec::with_capacity(b);
        let mut lms = Vec::with_capacity(b);
        let mut locals = Vec::with_capacity(b);
        let mut outs = Vec::with_capacity(b);
        let mut sp = Sparse {
            prompt_len: s,
            pads: pads.clone(),
            chunks: Vec::new(),
            a: Tensor::zeros([1, 1, 1], (&device, dtype)),
            wt: Tensor::zeros([1, 1, 1, 1], (&device, dtype)),
            landmarks: Tensor::zeros([1, 1, 1, 1], (&device, dtype)),
            n_land: Vec::new(),
            land_chunk: Vec::new(),
            local: (
                Tensor::zeros([1, 1, 1, 1], (&device, dtype)),
                Tensor::zeros([1, 1, 1, 1], (&device, dtype)),
            ),
            local_len: Vec::new(),
            outlier_chunk: Vec::new(),
            outliers: None,
            values: Vec::new(),
            generated: None,
            prev: None,
        };
        for (i, &pad) in pads.iter().enumerate() {
            let len = s - pad;
            let chunks = len / cs - self.cfg.local_chunks;
            let ctx = chunks * cs;
            let ki = item(&k, i, pad, s);
            let vi = item(&v, i, pad, s);

            // Low-rank pre-RoPE keys, [L, h·d].
            let pre = unrope(ki.clone(), &cos, &sin)
                .swap_dims(0, 1)
                .reshape([len, h * d]);
            let (a, wt) = key_factors(self.key_basis.as_ref(), pre, rank)?;
            a_rows.push(a.slice([0..ctx, 0..rank]).cast(dtype));
            wts.push(
                wt.reshape([rank, h, d])
                    .swap_dims(0, 1)
                    .cast(dtype)
                    .unsqueeze_dim::<4>(0),
            );

            // Landmarks and the least self-similar chunks, from the post-RoPE keys.
            let (mean, out_ids, land_ids) = split_chunks(
                ki.clone().slice([0..h, 0..ctx, 0..d]),
                cs,
                o,
                self.cfg.scoring,
            );
            let ld = mean.dims()[2];
            let flat = |ids: &[Vec<usize>]| -> Vec<i64> {
                ids.iter()
                    .enumerate()
                    .flat_map(|(hh, c)| c.iter().map(move |&c| (hh * chunks + c) as i64))
                    .collect()
            };
            let n_land = chunks - o;
            let li = flat(&land_ids);
            let lm = mean
                .reshape([h * chunks, ld])
                .select(0, idx_tensor::<1>(li, [h * n_land], &device))
                .reshape([h, n_land, ld])
                .cast(dtype);
            lms.push(lm);
            if o > 0 {
                let oi = idx_tensor::<1>(flat(&out_ids), [h * o], &device);
                let rows = |x: Tensor<3>| {
                    x.slice([0..h, 0..ctx, 0..d])
                        .reshape([h * chunks, cs * d])
                        .select(0, oi.clone())
                        .reshape([h, o * cs, d])
                };
                outs.push((rows(ki.clone()), rows(vi.clone())));
            }
            locals.push((
                ki.slice([0..h, ctx..len, 0..d]),
                vi.clone().slice([0..h, ctx..len, 0..d]),
            ));
            sp.values.push(HostValues::from_tensor(vi, cs, chunks));
            sp.chunks.push(chunks);
            sp.n_land.push(n_land);
            sp.land_chunk.push(land_ids);
            sp.outlier_chunk.push(out_ids);
            sp.local_len.push(len - ctx);
        }

        // Pad the per-sequence pieces to common sizes and stack them.
        let amax = sp.chunks.iter().max().copied().unwrap_or(0) * cs;
        sp.a = stack_rows(a_rows, amax);
        sp.wt = Tensor::cat(wts, 0);
        let cmax = sp.n_land.iter().max().copied().unwrap_or(0);
        let pad_to = |x: Tensor<3>, n: usize, left: bool| -> Tensor<4> {
            let [hh, m, dd] = x.dims();
            let x = if m < n {
                let z = Tensor::zeros([hh, n - m, dd], (&device, dtype));
                Tensor::cat(if left { vec![z, x] } else { vec![x, z] }, 1)
            } else {
                x
            };
            x.unsqueeze_dim::<4>(0)
        };
        sp.landmarks = Tensor::cat(lms.into_iter().map(|x| pad_to(x, cmax, false)).collect(), 0);
        let wmax = sp.local_len.iter().max().copied().unwrap_or(0);
        let (lk, lv): (Vec<_>, Vec<_>) = locals
            .into_iter()
            .map(|(k, v)| (pad_to(k, wmax, true), pad_to(v, wmax, true)))
            .unzip();
        sp.local = (Tensor::cat(lk, 0), Tensor::cat(lv, 0));
        if o > 0 {
            let (ok, ov): (Vec<_>, Vec<_>) = outs
                .into_iter()
                .map(|(k, v)| (k.unsqueeze_dim::<4>(0), v.unsqueeze_dim::<4>(0)))
                .unzip();
            sp.outliers = Some((Tensor::cat(ok, 0), Tensor::cat(ov, 0)));
        }
        Ok(sp)
    }
}

/// The low-rank factors `(A, Wᵀ)` of pre-RoPE keys `[L, h·d]`: with a shared `basis`, the same
/// product [`low_rank`] forms with the basis it finds; else [`low_rank`]'s own.
fn key_factors(
    basis: Option<&Tensor<2>>,
    pre: Tensor<2>,
    rank: usize,
) -> Result<(Tensor<2>, Tensor<2>), KvCacheError> {
    Ok(match basis {
        Some(w) => {
            let w = w.clone().cast(DType::F32);
            (pre.matmul(w.clone().transpose()), w)
        }
        None => {
            let lr = low_rank(pre, rank)?;
            (lr.a, lr.wt)
        }
    })
}

/// Splits a sequence's chunked keys `kc` `[h, chunks·cs, d]` (post-RoPE) into its `o` least
/// self-similar chunks per head (the outliers, kept exact) and the rest (landmarks): returns
/// every chunk's landmark (f32; its mean `[h, chunks, d]`, or with [`ChunkScoring::Bounds`]
/// its channel-wise maxima and minima `[h, chunks, 2·d]`) and per head the sorted outlier and
/// landmark chunk ids.
fn split_chunks(
    kc: Tensor<3>,
    cs: usize,
    o: usize,
    scoring: ChunkScoring,
) -> (Tensor<3>, Vec<Vec<usize>>, Vec<Vec<usize>>) {
    let [h, ctx, d] = kc.dims();
    let chunks = ctx / cs;
    let kc32 = kc.cast(DType::F32).reshape([h, chunks, cs, d]);
    let mean = kc32.clone().mean_dim(2);
    let dot = (kc32.clone() * mean.clone()).sum_dim(3);
    let nk = kc32.clone().powi_scalar(2).sum_dim(3).sqrt();
    let nm = mean.clone().powi_scalar(2).sum_dim(3).sqrt();
    let sim = dot / (nk * nm).clamp_min(1e-8);
    let worst = sim
        .min_dim(2)
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32");
    let mut out_ids = Vec::with_capacity(h);
    let mut land_ids = Vec::with_capacity(h);
    for hh in 0..h {
        let row = &worst[hh * chunks..(hh + 1) * chunks];
        let mut order: Vec<usize> = (0..chunks).collect();
        order.sort_by(|&x, &y| row[x].total_cmp(&row[y]).then(x.cmp(&y)));
        let mut out: Vec<usize> = order[..o].to_vec();
        let mut rest: Vec<usize> = order[o..].to_vec();
        out.sort_unstable();
        rest.sort_unstable();
        out_ids.push(out);
        land_ids.push(rest);
    }
    let landmark = match scoring {
        ChunkScoring::Mean => mean.reshape([h, chunks, d]),
        ChunkScoring::Bounds => {
            let hi = kc32.clone().max_dim(2).reshape([h, chunks, d]);
            let lo = kc32.min_dim(2).reshape([h, chunks, d]);
            Tensor::cat(vec![hi, lo], 2)
        }
    };
    (landmark, out_ids, land_ids)
}

/// The sequences' `[rows_i, rank]` factors zero-padded to `rows` rows and stacked:
/// `[batch, rows, rank]`.
fn stack_rows(parts: Vec<Tensor<2>>, rows: usize) -> Tensor<3> {
    let a: Vec<Tensor<3>> = parts
        .into_iter()
        .map(|x| {
            let [n, rank] = x.dims();
            let x = if n < rows {
                let zeros = Tensor::zeros([rows - n, rank], (&x.device(), x.dtype()));
                Tensor::cat(vec![x, zeros], 0)
            } else {
                x
            };
            x.unsqueeze_dim::<3>(0)
        })
        .collect();
    Tensor::cat(a, 0)
}
