//! The host and device primitives of the speculative decode loop: ragged rows through a model
//! after a branching cache, logits of chosen positions, the sampler's distributions and draws,
//! and an order-preserving parallel map.

use burn::tensor::{Int, Tensor, TensorData};
use burn_kernels_core::{AttentionImpl, Greedy, Sampler, SamplingConfig, TopKTopP};
use rand::{Rng, rngs::StdRng};

use crate::model::Llama;

use super::{SpecCache, SpecError};

/// Runs ragged rows of tokens through `model` after what `cache` holds, each row at its own
/// positions: row r's tokens continue attention row r of the cache. Shorter rows are left-padded
/// with dummy tokens that the cache masks.
///
/// # Shapes
/// - `rows.len()` = `BranchKvCache::rows`
/// - returns `[rows, s, hidden]` with `s` the longest row; row r's tokens are its last
///   `rows[r].len()` positions
///
/// # Errors
/// As [`Llama::try_forward`].
///
/// # Panics
/// When every row is empty.
pub fn forward_rows(
    model: &Llama,
    cache: &mut dyn SpecCache,
    rows: &[Vec<u32>],
    attention: &dyn AttentionImpl,
) -> Result<Tensor<3>, crate::model::ForwardError> {
    let n = rows.len();
    let s = rows.iter().map(Vec::len).max().unwrap_or(0);
    assert!(s > 0, "forward_rows needs at least one token");
    let start = cache.seq_len();
    let mut ids = Vec::with_capacity(n * s);
    let mut valid = Vec::with_capacity(n);
    let mut left_pad = Vec::with_capacity(n);
    for (r, row) in rows.iter().enumerate() {
        let dummies = s - row.len();
        let filler = row.first().copied().unwrap_or(0);
        ids.extend(
            std::iter::repeat_n(filler, dummies)
                .chain(row.iter().copied())
                .map(i64::from),
        );
        valid.push((0..s).map(|t| t >= dummies).collect());
        // Llama::forward puts token t at position `start + t - left_pad`: the first real token
        // lands at this row's length.
        left_pad.push(start + dummies - cache.row_len(r));
    }
    cache.set_incoming_validity(valid);
    let device = model.embed.device();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [n, s]), &device);
    model.try_forward(tokens, &left_pad, cache, attention)
}

/// Logits of selected positions, on the host: `positions` index the rows of `hidden` flattened
/// to `[rows × s, hidden]`.
///
/// # Shapes
/// - `hidden`: `[rows, s, hidden]`; returns `[positions.len()][vocab]` flattened
///
/// # Errors
/// [`SpecError::Read`] where the device cannot hand the logits back.
pub(super) fn logits_at(
    model: &Llama,
    hidden: Tensor<3>,
    positions: &[usize],
) -> Result<Vec<f32>, SpecError> {
    if positions.is_empty() {
        return Ok(Vec::new());
    }
    let [b, s, h] = hidden.dims();
    let device = hidden.device();
    let index: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
    let index = Tensor::<1, Int>::from_data(TensorData::new(index, [positions.len()]), &device);
    let x = hidden.reshape([b * s, h]).select(0, index);
    model
        .logits(x.unsqueeze::<3>())
        .try_into_data()
        .map_err(|e| SpecError::Read(format!("{e:?}")))?
        .try_to_vec::<f32>()
        .map_err(|e| SpecError::Read(format!("{e:?}")))
}

/// Next-token distributions for one sampling setting (the sampler's own distribution, so
/// speculative and plain decoding sample from the same rows).
pub(super) struct Distribution {
    cfg: SamplingConfig,
    sampler: TopKTopP,
}

impl Distribution {
    pub(super) fn new(cfg: SamplingConfig) -> Self {
        Self {
            cfg,
            sampler: TopKTopP::new(cfg),
        }
    }

    pub(super) fn of(&self, logits: &[f32]) -> Vec<f32> {
        if self.cfg.temperature <= 0.0 {
            return Greedy.distribution(logits);
        }
        self.sampler.distribution(logits)
    }
}

/// Inverse-CDF draw from a probability row; only tokens with positive mass are returned.
fn draw(row: &[f32], u: f64) -> usize {
    let total: f64 = row.iter().map(|&x| f64::from(x)).sum();
    let target = u * total;
    let mut acc = 0.0;
    let mut last = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > 0.0 {
            acc += f64::from(x);
            last = i;
            if target < acc {
                return i;
            }
        }
    }
    last
}

/// `f(0)..f(n)` spread over the machine's cores, in order (the result does not depend on the
/// number of threads); one core or one item runs inline.
pub(super) fn par_map<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(n)
        .max(1);
    if threads == 1 {
        return (0..n).map(f).collect();
    }
    let per = n.div_ceil(threads);
    std::thread::scope(|scope| {
        let f = &f;
        let handles: Vec<_> = (0..n)
            .step_by(per)
            .map(|start| {
                scope.spawn(move || (start..(start + per).min(n)).map(f).collect::<Vec<_>>())
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a worker thread panicked"))
            .collect()
    })
}

/// Draft tokens and the rows they are drawn from, for `jobs` = (row of `logits`, sequence,
/// draft) in order. The uniforms are drawn from `rng` in job order before the rows are computed
/// in parallel (a 49K-entry row per draft and sequence is the draft step's host cost at large
/// batches), so the tokens do not depend on the number of threads.
pub(super) fn sample_drafts(
    logits: &[f32],
    vocab: usize,
    jobs: &[(usize, usize, usize)],
    dists: &[Distribution],
    rng: &mut StdRng,
) -> Vec<(Vec<f32>, u32)> {
    let us: Vec<f64> = jobs.iter().map(|_| rng.random()).collect();
    par_map(jobs.len(), |i| {
        let (row, _, k) = jobs[i];
        let dist = dists[k].of(&logits[row * vocab..(row + 1) * vocab]);
        let token = draw(&dist, us[i]) as u32;
        (dist, token)
    })
}

/// Length of the common prefix of two token slices.
pub(super) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
