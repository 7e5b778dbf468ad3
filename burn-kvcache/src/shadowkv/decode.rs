//! The decode side of [`ShadowKvCache`]: score the landmarks, select chunks, fetch their values
//! from host memory, rebuild their keys, attend (see the module docs).

use std::time::Instant;

use burn::tensor::{Bool, DType, Int, Tensor, TensorData};
use burn_kernels_core::{AttentionImpl, AttnOptions, append_kv};

use super::host::upload_rows;
use super::refine::{fetch_tokens, pick_tokens};
use crate::gather_reconstruct_rope;
use rayon::prelude::*;

use super::*;

impl ShadowKvCache {
    /// One decode step of a sparse layer: score the landmarks and select chunks, rebuild the
    /// selected keys on the device, fetch the selected values, attend. See the module docs.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn decode(
        &mut self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Tensor<4> {
        let (cs, select) = (self.cfg.chunk, self.cfg.select_chunks());
        let (profile, pinned) = (self.profile, self.cfg.pinned_uploads);
        let device = q.device();
        let (cos, sin) = self.tables.clone().expect("set at the prefill");
        let Layer::Sparse(sp) = &mut self.layers[layer] else {
            unreachable!("decode on a sparse layer")
        };
        let timings = &mut self.timings;
        let dtype = v.dtype();
        append_kv(&mut sp.generated, k, v);

        // Profiling: the work queued before the step (the layer's projections) is not scoring.
        sync(profile, &device);
        let t0 = Instant::now();
        let candidates = self.cfg.candidates.max(1);
        let selection = select_chunks(
            sp,
            &q,
            opts.scale,
            select * candidates,
            self.kv_heads,
            self.cfg.scoring,
            &mut timings.scoring_issue,
        );
        timings.scoring += t0.elapsed();

        // Reconstruct the selected keys, launched before the transfer: the device rebuilds
        // them while the host gathers and copies the values.
        let t2 = Instant::now();
        let [b, h, kk] = [q.dims()[0], self.kv_heads, selection.kk];
        let ids: Vec<i32> = selection
            .sel
            .iter()
            .flat_map(|per_head| per_head.iter().flat_map(|c| c.iter().map(|&c| c as i32)))
            .collect();
        let ids = i32_tensor::<3>(ids, [b, h, kk], &device);
        let sel_k = gather_reconstruct_rope(sp.a.clone(), sp.wt.clone(), ids, cos, sin, cs)
            .expect("the layer's own factors");
        sync(profile, &device);
        timings.reconstruct += t2.elapsed();

        let d = q.dims()[3];
        let (sel_k, values, selection) = if candidates > 1 {
            let t0 = Instant::now();
            let picked = pick_tokens(&q, &sel_k, &selection, select, opts.scale, cs);
            timings.scoring += t0.elapsed();
            let t1 = Instant::now();
            let values = fetch_tokens(
                sp,
                &selection,
                &picked,
                dtype,
                [cs, d],
                [profile, pinned],
                timings,
            );
            timings.transfer += t1.elapsed();
            (picked.keys, values, picked.selection)
        } else {
            let t1 = Instant::now();
            let reuse_min = self.cfg.reuse_min_percent;
            let flags = [profile, pinned];
            let values = fetch_values(sp, &selection, dtype, [cs, d], flags, reuse_min, timings);
            timings.transfer += t1.elapsed();
            (sel_k, values, selection)
        };

        let t3 = Instant::now();
        let out = sparse_attention(layer, sp, q, sel_k, values, &selection, cs, attention, opts);
        timings.attention_issue += t3.elapsed();
        sync(profile, &device);
        timings.attention += t3.elapsed();
        timings.layer_steps += 1;
        out
    }

    /// Rebuilds a sparse layer's prompt as full keys and values `[b, h, prompt_len, d]`:
    /// exact local window, outliers and values; low-rank keys elsewhere; zeros in padding.
    pub(super) fn densify(&self, sp: &Sparse) -> (Tensor<4>, Tensor<4>) {
        let (cs, o) = (self.cfg.chunk, self.cfg.outlier_chunks);
        let (cos, sin) = self.tables.clone().expect("set at the prefill");
        let device = sp.a.device();
        let dtype = sp.a.dtype();
        let [b, h, _, d] = sp.wt.dims();
        let r = sp.a.dims()[2];
        let amax = sp.a.dims()[1];
        let wmax = sp.local.0.dims()[2];
        let mut ks = Vec::with_capacity(b);
        let mut vs = Vec::with_capacity(b);
        for i in 0..b {
            let chunks = sp.chunks[i];
            let ids: Vec<i32> = (0..h).flat_map(|_| (0..chunks).map(|c| c as i32)).collect();
            let ids = i32_tensor::<3>(ids, [1, h, chunks], &device);
            let a = sp.a.clone().slice([i..i + 1, 0..amax, 0..r]);
            let wt = sp.wt.clone().slice([i..i + 1, 0..h, 0..r, 0..d]);
            let rec = gather_reconstruct_rope(a, wt, ids, cos.clone(), sin.clone(), cs)
                .expect("the layer's own factors")
                .reshape([h * chunks, cs * d]);
            // Outlier chunks from their exact copies.
            let key_rows = match &sp.outliers {
                Some((ok, _)) if o > 0 => {
                    let exact = ok
                        .clone()
                        .slice([i..i + 1, 0..h, 0..o * cs, 0..d])
                        .reshape([h * o, cs * d]);
                    let mut src: Vec<i64> = (0..(h * chunks) as i64).collect();
                    for (hh, cids) in sp.outlier_chunk[i].iter().enumerate() {
                        for (j, &c) in cids.iter().enumerate() {
                            src[hh * chunks + c] = (h * chunks + hh * o + j) as i64;
                        }
                    }
                    Tensor::cat(vec![rec, exact], 0)
                        .select(0, idx_tensor::<1>(src, [h * chunks], &device))
                }
                _ => rec,
            };
            let all: Vec<Vec<usize>> = (0..h).map(|_| (0..chunks).collect()).collect();
            let vals = sp.values[i].gather_in(&all, &device, self.cfg.pinned_uploads);
            let ll = sp.local_len[i];
            let lk = item(&sp.local.0, i, wmax - ll, wmax);
            let lv = item(&sp.local.1, i, wmax - ll, wmax);
            let pad = sp.pads[i];
            let z = || Tensor::<3>::zeros([h, pad, d], (&device, dtype));
            let mut kparts = Vec::new();
            let mut vparts = Vec::new();
            if pad > 0 {
                kparts.push(z());
                vparts.push(z());
            }
            kparts.extend([key_rows.reshape([h, chunks * cs, d]), lk]);
            vparts.extend([vals, lv]);
            ks.push(Tensor::cat(kparts, 1).unsqueeze_dim::<4>(0));
            vs.push(Tensor::cat(vparts, 1).unsqueeze_dim::<4>(0));
        }
        (Tensor::cat(ks, 0), Tensor::cat(vs, 0))
    }
}

/// The chunks a decode step attends to: per sequence and KV head, the `kk` selected chunk
/// ids (sorted; padding slots repeat a valid one) and how many of them are valid.
pub(super) struct Selection {
    pub(super) sel: Vec<Vec<Vec<usize>>>,
    pub(super) valid: Vec<usize>,
    pub(super) kk: usize,
}

/// The `(n, k)` of each row as a `[rows, 2]` i32 tensor on `device`.
pub(super) fn sizes_tensor(sizes: &[[usize; 2]], device: &burn::tensor::Device) -> Tensor<2, Int> {
    let flat: Vec<i32> = sizes.iter().flatten().map(|&x| x as i32).collect();
    i32_tensor::<2>(flat, [sizes.len(), 2], device)
}

/// Per row of `scores` `[rows, t]` (f32) with `(n, k) = sizes[row]`: the positions of the `k`
/// highest of its first `n` scores, ascending, then the first repeated up to `kk` (on the
/// device, [`crate::top_k_rows`]). Returns them on the device (`[rows, kk]` i32) and on the
/// host, one `Vec` per row ([`read_ids`]).
pub(super) fn top_k_ids(
    scores: Tensor<2>,
    sizes: Tensor<2, Int>,
    kk: usize,
) -> (Tensor<2, Int>, Vec<Vec<usize>>) {
    let rows = sizes.dims()[0];
    let ids = crate::top_k_rows(scores, sizes, kk).expect("f32 scores, [rows, 2] sizes, kk ≤ t");
    let host = read_ids(&ids, rows, kk);
    (ids, host)
}

/// The `[rows, kk]` ids of [`crate::top_k_rows`] read back, one `Vec` per row.
fn read_ids(ids: &Tensor<2, Int>, rows: usize, kk: usize) -> Vec<Vec<usize>> {
    let host: Vec<i64> = ids
        .to_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .expect("i64");
    host.chunks(kk.max(1))
        .take(rows)
        .map(|r| r.iter().map(|&x| x as usize).collect())
        .collect()
}

/// Scoring: softmax of the queries over the landmarks, summed over queries, max over the GQA
/// group; then the top `select` landmarks' chunks per (sequence, KV head). With
/// [`ChunkScoring::Bounds`] a query `q` scores `[max | min]` landmarks as
/// `[max(q, 0) | min(q, 0)]`: the largest score a key of the chunk could give it.
fn select_chunks(
    sp: &Sparse,
    q: &Tensor<4>,
    scale: f32,
    select: usize,
    h: usize,
    scoring: ChunkScoring,
    issue: &mut std::time::Duration,
) -> Selection {
    let t0 = Instant::now();
    let b = q.dims()[0];
    let q = q.clone().cast(DType::F32);
    let q = match scoring {
        ChunkScoring::Mean => q,
        ChunkScoring::Bounds => Tensor::cat(vec![q.clone().clamp_min(0.0), q.clamp_max(0.0)], 3),
    };
    let kk = select.min(sp.n_land.iter().max().copied().unwrap_or(0));
    let valid: Vec<usize> = sp.n_land.iter().map(|&n| kk.min(n)).collect();
    // Top-k per (sequence, KV head) on the device: a step reads back `kk` ids a row instead
    // of every landmark's score (at batch 8 and 128K a layer has 64 rows of 16K landmarks).
    // The row's landmark count also bounds its scoring (the landmarks past it are padding).
    let sizes: Vec<[usize; 2]> = (0..b * h)
        .map(|ih| [sp.n_land[ih / h], valid[ih / h]])
        .collect();
    let sizes = sizes_tensor(&sizes, &q.device());
    let scores = crate::landmark_scores(q, sp.landmarks.clone(), sizes.clone(), scale)
        .expect("f32 queries, landmarks of their head dim and the cache's KV heads");
    let ids = crate::top_k_rows(scores, sizes, kk).expect("f32 scores, [rows, 2] sizes, kk ≤ t");
    *issue += t0.elapsed();
    let ids = read_ids(&ids, b * h, kk);
    let land_chunk = &sp.land_chunk;
    let flat: Vec<Vec<usize>> = ids
        .into_iter()
        .enumerate()
        .map(|(ih, ids)| {
            let (i, hh) = (ih / h, ih % h);
            let mut chunks: Vec<usize> = ids[..valid[i]]
                .iter()
                .map(|&l| land_chunk[i][hh][l])
                .collect();
            chunks.sort_unstable();
            // Padding slots (masked below) repeat a valid chunk.
            chunks.resize(kk, chunks[0]);
            chunks
        })
        .collect();
    let mut flat = flat.into_iter();
    let sel = (0..b).map(|_| flat.by_ref().take(h).collect()).collect();
    Selection { sel, valid, kk }
}

/// Transfer: the selected chunks' values `[b·h·kk, cs·d]` on the device, reusing the rows the
/// previous step uploaded where they are at least `reuse_min_percent`% of the chunks
/// ([`worth_reusing`]) and fetching the rest from host memory; remembered for the next step.
fn fetch_values(
    sp: &mut Sparse,
    selection: &Selection,
    dtype: DType,
    [cs, d]: [usize; 2],
    [profile, pinned]: [bool; 2],
    reuse_min_percent: u32,
    timings: &mut DecodeTimings,
) -> Tensor<2> {
    let Selection { sel, valid, kk } = selection;
    let (b, h, kk) = (sel.len(), sel[0].len(), *kk);
    let device = sp.a.device();
    let t1 = Instant::now();
    let prev_ids = sp.prev.as_ref().map(|p| (&p.chunks, &p.valid));
    // Per valid slot: the previous step's row holding its chunk, if any.
    let mut hits: Vec<Vec<Option<i64>>> = (0..b * h)
        .into_par_iter()
        .map(|ih| {
            let (i, hh) = (ih / h, ih % h);
            sel[i][hh][..valid[i]]
                .iter()
                .map(|&c| {
                    let (chunks, pvalid) = prev_ids?;
                    let ids = &chunks[i][hh];
                    ids[..pvalid[i]]
                        .binary_search(&c)
                        .ok()
                        .map(|j| (ih * ids.len() + j) as i64)
                })
                .collect()
        })
        .collect();
    let found = hits.iter().flatten().filter(|r| r.is_some()).count();
    let slots = hits.iter().map(Vec::len).sum::<usize>();
    timings.chunks_selected += slots;
    timings.chunks_overlapping += found;
    let reuse = worth_reusing(found, slots, reuse_min_percent);
    if !reuse {
        hits.iter_mut().flatten().for_each(|r| *r = None);
    }
    let prev_rows = match (&sp.prev, reuse) {
        (Some(p), true) => p.values.dims()[0],
        _ => 0,
    };
    let mut src = vec![0i64; b * h * kk];
    let mut rows: Vec<&[u8]> = Vec::new();
    for (ih, hit) in hits.iter().enumerate() {
        let (i, hh) = (ih / h, ih % h);
        let base = ih * kk;
        for (slot, r) in hit.iter().enumerate() {
            src[base + slot] = r.unwrap_or_else(|| {
                rows.push(sp.values[i].chunk_slice(hh, sel[i][hh][slot]));
                (prev_rows + rows.len() - 1) as i64
            });
        }
        // Padding slots reuse the sequence-head's first slot.
        for slot in valid[i]..kk {
            src[base + slot] = src[base];
        }
    }
    let fetched = rows.len();
    timings.chunks_fetched += fetched;
    timings.chunks_reused += b * h * kk - fetched;
    let t_up = Instant::now();
    timings.transfer_host += t_up - t1;
    let fresh = (fetched > 0).then(|| upload_rows(&rows, cs * d, dtype, &device, pinned));
    sync(profile, &device);
    let t_asm = Instant::now();
    timings.transfer_upload += t_asm - t_up;
    let prev = sp.prev.take().filter(|_| reuse);
    let identity = prev.is_none() && fetched == b * h * kk;
    let pool = match (prev, fresh) {
        (Some(p), Some(f)) => Tensor::cat(vec![p.values, f], 0),
        (Some(p), None) => p.values,
        (None, Some(f)) => f,
        (None, None) => unreachable!("k ≥ 1 valid slots, each reused or fetched"),
    };
    let values = if identity {
        pool
    } else {
        pool.select(0, idx_tensor::<1>(src, [b * h * kk], &device))
    };
    sp.prev = Some(Prev {
        chunks: sel.clone(),
        valid: valid.clone(),
        values: values.clone(),
    });
    sync(profile, &device);
    timings.transfer_assemble += t_asm.elapsed();
    values
}

/// Whether a step reuses the `found` of its `slots` chunks already on the device: `found` is at
/// least `min_percent`% of `slots` ([`ShadowKvConfig::reuse_min_percent`]).
fn worth_reusing(found: usize, slots: usize, min_percent: u32) -> bool {
    found > 0 && 100 * found as u64 >= min_percent as u64 * slots as u64
}

/// Attention over the local window, the outliers, the selected chunks and the generated
/// tokens, with the padding of each part masked.
#[allow(clippy::too_many_arguments)]
fn sparse_attention(
    layer: usize,
    sp: &Sparse,
    q: Tensor<4>,
    sel_k: Tensor<4>,
    values: Tensor<2>,
    selection: &Selection,
    cs: usize,
    attention: &dyn AttentionImpl,
    opts: &AttnOptions,
) -> Tensor<4> {
    let [b, _, _, d] = q.dims();
    let (valid, kk) = (&selection.valid, selection.kk);
    let h = sel_k.dims()[1];
    let device = q.device();
    let sel_v = values.reshape([b, h, kk * cs, d]);
    let (gk, gv) = sp.generated.clone().expect("appended above");
    let mut ks = vec![sp.local.0.clone()];
    let mut vs = vec![sp.local.1.clone()];
    if let Some((ok, ov)) = &sp.outliers {
        ks.push(ok.clone());
        vs.push(ov.clone());
    }
    ks.extend([sel_k, gk]);
    vs.extend([sel_v, gv]);
    let keys = Tensor::cat(ks, 2);
    let vals = Tensor::cat(vs, 2);
    let wmax = sp.local.0.dims()[2];
    let n_out = sp.outliers.as_ref().map_or(0, |(k, _)| k.dims()[2]);
    let n_gen = keys.dims()[2] - wmax - n_out - kk * cs;
    let masked = sp.local_len.iter().any(|&l| l < wmax) || valid.iter().any(|&n| n < kk);
    let key_padding = if masked || opts.key_padding.is_some() {
        let head: Vec<bool> = (0..b)
            .flat_map(|i| {
                let (ll, nv) = (sp.local_len[i], valid[i]);
                (0..wmax)
                    .map(move |j| j < wmax - ll)
                    .chain((0..n_out).map(|_| false))
                    .chain((0..kk * cs).map(move |j| j / cs >= nv))
            })
            .collect();
        let cols = wmax + n_out + kk * cs;
        let head = Tensor::<1, Bool>::from_data(TensorData::new(head, [b * cols]), &device)
            .reshape([b, cols]);
        let tail = match &opts.key_padding {
            Some(m) => {
                let total = m.dims()[1];
                m.clone().slice([0..b, total - n_gen..total])
            }
            None => Tensor::<1, Bool>::from_data(
                TensorData::new(vec![false; b * n_gen], [b * n_gen]),
                &device,
            )
            .reshape([b, n_gen]),
        };
        Some(Tensor::cat(vec![head, tail], 1))
    } else {
        None
    };
    let opts = AttnOptions {
        causal: opts.causal,
        scale: opts.scale,
        key_padding,
    };
    attention.attend(layer, q, keys, vals, &opts)
}
