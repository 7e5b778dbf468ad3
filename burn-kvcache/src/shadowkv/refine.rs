//! Two-stage selection ([`ShadowKvConfig::candidates`] > 1): the landmarks pick candidate
//! chunks, their keys are rebuilt on the device, and each `(sequence, KV head)` keeps the
//! budget's worth of tokens whose rebuilt keys the step's queries score highest (the same
//! aggregate as the landmarks': softmax over the candidates, summed over the call's queries,
//! maxed over the GQA group). Only those tokens' values are fetched, so the transfer stays the
//! budget's.
//!
//! On SmolLM2-135M's RULER-style tasks a chunk's mean key blurs the one token a copying step
//! needs; selecting tokens approaches the token-level oracle (the crate README).

use std::time::Instant;

use burn::tensor::{DType, Tensor};

use super::decode::{Selection, sizes_tensor, top_k_ids};
use super::host::upload_rows;
use super::{DecodeTimings, Sparse, sync};

/// The tokens a two-stage step keeps: their keys `[b, h, kk·cs, d]` (sorted by candidate slot,
/// padding after the valid ones), which candidate slot each is (`picks[b·h][..]`), and the
/// [`Selection`] the attention masks by (`kk` slots of `cs` tokens, `valid` of them real).
pub(super) struct Picked {
    pub(super) keys: Tensor<4>,
    picks: Vec<Vec<usize>>,
    pub(super) selection: Selection,
}

/// Scores every candidate token (`cand_k` `[b, h, cand.kk·cs, d]`, rebuilt) against the
/// queries `q` `[b, hq, sq, d]` and keeps the top `select·cs` per `(sequence, KV head)`
/// (`select` capped by the candidates).
pub(super) fn pick_tokens(
    q: &Tensor<4>,
    cand_k: &Tensor<4>,
    cand: &Selection,
    select: usize,
    scale: f32,
    cs: usize,
) -> Picked {
    let [b, _, _, d] = q.dims();
    let h = cand_k.dims()[1];
    let device = q.device();
    let q = q.clone().cast(DType::F32);
    let kk = select.min(cand.kk);
    let valid: Vec<usize> = cand.valid.iter().map(|&n| n.min(kk)).collect();
    let n_tok = kk * cs;
    // Per (sequence, KV head): the candidates' tokens it has (the rest are padding, which the
    // scoring masks), and the ones it keeps; padding tokens (masked by the attention) repeat
    // a valid one.
    let sizes: Vec<[usize; 2]> = (0..b * h)
        .map(|ih| [cand.valid[ih / h] * cs, valid[ih / h] * cs])
        .collect();
    let sizes = sizes_tensor(&sizes, &device);
    let scores = crate::landmark_scores(q, cand_k.clone(), sizes.clone(), scale)
        .expect("f32 queries, candidate keys of their head dim and the cache's KV heads");
    let (idx, picks) = top_k_ids(scores, sizes, n_tok);
    let idx = idx
        .reshape([b, h, n_tok])
        .unsqueeze_dim::<4>(3)
        .repeat_dim(3, d);
    Picked {
        keys: cand_k.clone().gather(2, idx),
        picks,
        selection: Selection {
            sel: Vec::new(),
            valid,
            kk,
        },
    }
}

/// Transfer: the picked tokens' values `[b·h·kk, cs·d]` on the device (`kk·cs` tokens per
/// `(sequence, KV head)`, in the order of their keys). Nothing is reused from the previous
/// step: tokens, unlike chunks, rarely repeat whole.
pub(super) fn fetch_tokens(
    sp: &mut Sparse,
    cand: &Selection,
    picked: &Picked,
    dtype: DType,
    [cs, d]: [usize; 2],
    [profile, pinned]: [bool; 2],
    timings: &mut DecodeTimings,
) -> Tensor<2> {
    let device = sp.a.device();
    let t1 = Instant::now();
    let h = cand.sel[0].len();
    let row_bytes = d * dtype.size();
    let rows: Vec<&[u8]> = picked
        .picks
        .iter()
        .enumerate()
        .flat_map(|(ih, picks)| {
            let (i, hh) = (ih / h, ih % h);
            let values = &sp.values[i];
            let chunks = &cand.sel[i][hh];
            picks.iter().map(move |&p| {
                let off = (p % cs) * row_bytes;
                &values.chunk_slice(hh, chunks[p / cs])[off..off + row_bytes]
            })
        })
        .collect();
    let kk = picked.selection.kk;
    timings.chunks_fetched += rows.len() / cs;
    let t_up = Instant::now();
    timings.transfer_host += t_up - t1;
    let values = upload_rows(&rows, d, dtype, &device, pinned).reshape([rows.len() / cs, cs * d]);
    debug_assert_eq!(values.dims()[0], picked.picks.len() * kk);
    sync(profile, &device);
    timings.transfer_upload += t_up.elapsed();
    sp.prev = None;
    values
}
