//! Speculative decoding whose draft and target steps are captured once and replayed
//! ([`crate::graph`]): one prompt, K drafts from one draft model, as `K` rows of fixed shapes.
//!
//! # Layout
//! Both models keep their keys and values in a [`StaticKvCache`] with `K` rows, one per draft.
//! Every row holds the same committed prefix; within a block row `k` holds draft `k`'s tokens.
//! - **Draft step** ([`CapturedDecoder`], `[K, 1]`): row `k` feeds draft `k`'s last token and
//!   gives the distribution of its next one. The draft has already consumed the pending token
//!   (the last emitted one), so a block takes `L − 1` draft steps.
//! - **Verify step** (`[K, L + 1]`): row `k` feeds `[pending, x_{k,1} .. x_{k,L}]` at positions
//!   `n .. n + L` and gives the target's distribution at each of them. Its keys and values are
//!   written twice: at `n .. n + L` (for later steps) and in a scratch tail after the cache's
//!   main region, which is what the step's queries attend to besides the committed prefix.
//!   With the block at the end of the keys, the bottom-right causal mask is the block's own
//!   causal mask, so the step needs no host value and no per-query mask.
//! - **Commit** (`K > 1`): after verification the accepted draft's row `r` is copied over the
//!   other rows at the block's positions ([`StaticKvCache::copy_row`]), in both caches, by a
//!   captured step of its own.
//!
//! Then the draft is truncated to what row `r` computed that was emitted, and fed the emitted
//! tokens it lacks (the bonus token's predecessor when all `L` drafts were accepted, and the
//! last emitted token), whose logits start the next block.
//!
//! Positions past the committed length are masked, so what rejected drafts wrote there is never
//! read and is overwritten later.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_kernels_core::{AttentionImpl, AttnOptions, CacheError, KvCache, StaticKvCache};
use burn_specdec::verify_block;
use rand::{SeedableRng, rngs::StdRng};

use crate::generate::{GenerateError, host_logits};
use crate::graph::{CaptureInfo, CapturedDecoder, Replayed, StepInputs, StepOutput, step_inputs};
use crate::model::{ForwardError, Llama};

use super::decode::validate;
use super::rows::{Distribution, sample_drafts};
use super::{Draft, SpecError, SpecOptions, SpecStats};

/// What [`speculative_generate_captured`] produced.
#[derive(Debug, Clone, PartialEq)]
pub struct CapturedSpec {
    /// The new tokens (a stop token, if hit, is the last one).
    pub tokens: Vec<u32>,
    pub stats: SpecStats,
    /// How the draft's step ran (a hardware graph or eagerly, and why).
    pub draft: CaptureInfo,
    /// How the target's verification step ran.
    pub target: CaptureInfo,
    /// Seconds spent warming up and capturing the steps (part of `stats.decode_secs`; the
    /// draft and target parts of `stats` leave them out, so they are the replayed steps' cost).
    pub capture_secs: f64,
    /// Bytes the target's static cache holds (K rows, the scratch tail included).
    pub target_cache_bytes: usize,
}

/// The target's `[K, L + 1]` verification step and its commit, over one [`StaticKvCache`].
struct Verifier<'a> {
    cache: Rc<RefCell<StaticKvCache>>,
    step: Replayed<'a, StepOutput>,
    commit: Committer<'a>,
    rows: usize,
    width: usize,
    main: usize,
}

impl<'a> Verifier<'a> {
    /// Prefills every row with `prefix` (when not empty) into a cache whose main region holds
    /// `main` positions, followed by a scratch tail of `width` positions.
    fn new(
        model: &'a Llama,
        attention: &'a dyn AttentionImpl,
        prefix: &[u32],
        rows: usize,
        width: usize,
        main: usize,
    ) -> Result<Self, SpecError> {
        let device = model.embed.device();
        let total = main + width;
        let mut cache = StaticKvCache::new(model.config.num_layers, total);
        if !prefix.is_empty() {
            let ids: Vec<i64> = (0..rows)
                .flat_map(|_| prefix.iter().map(|&t| i64::from(t)))
                .collect();
            let tokens =
                Tensor::<2, Int>::from_data(TensorData::new(ids, [rows, prefix.len()]), &device);
            model.try_forward(tokens, &vec![0; rows], &mut cache, attention)?;
        }
        let cache = Rc::new(RefCell::new(cache));
        let inputs = StepInputs::default();
        // Constants owned by the step: key positions, and which of them are the main region.
        let positions = Tensor::<1, Int>::arange(0..total as i64, &device).reshape([1, total]);
        let scratch = positions.clone().greater_equal_elem(main as i64);
        let (scale, vocab) = (model.attention_scale(), model.config.vocab_size);
        let (shared, values) = (cache.clone(), inputs.clone());
        let n_tok = rows * width;
        let step = Box::new(move || {
            let inputs = step_inputs(&values);
            let tokens = inputs.clone().slice(0..n_tok).reshape([rows, width]);
            let rope = inputs
                .clone()
                .slice(n_tok..2 * n_tok)
                .reshape([rows, width]);
            let index = inputs.clone().slice(2 * n_tok..2 * n_tok + 2 * width);
            let len = inputs.slice(2 * n_tok + 2 * width..2 * n_tok + 2 * width + 1);
            // Keys at the committed length or later are masked, except the scratch tail.
            let uncommitted = positions
                .clone()
                .greater_equal(len.reshape([1, 1]).expand([1, total]));
            let mask = uncommitted
                .bool_and(scratch.clone().bool_not())
                .expand([rows, total]);
            let opts = AttnOptions {
                causal: true,
                scale,
                key_padding: Some(mask),
            };
            let mut cache = shared.borrow_mut();
            let mut write = TailWrite {
                inner: cache.at(index),
            };
            let hidden = model.forward_at(tokens, rope, &opts, &mut write, attention)?;
            Ok(model.logits(hidden).reshape([rows * width, vocab]))
        });
        let mut step = Replayed::new(&device, inputs, step);
        step.info.capacity = total;
        Ok(Self {
            commit: Committer::new(&device, cache.clone()),
            cache,
            step,
            rows,
            width,
            main,
        })
    }

    /// Runs the verification of `drafts` (K rows of L tokens) after `pending` at position `n`;
    /// returns the logits `[K · (L + 1), vocab]` on the host.
    fn verify(
        &mut self,
        pending: u32,
        drafts: &[Vec<u32>],
        n: usize,
    ) -> Result<Vec<f32>, SpecError> {
        let (k, w) = (self.rows, self.width);
        let mut values = Vec::with_capacity(2 * k * w + 2 * w + 1);
        for row in drafts {
            values.push(i64::from(pending));
            values.extend(row.iter().map(|&t| i64::from(t)));
        }
        values.extend((0..k).flat_map(|_| (n..n + w).map(|p| p as i64)));
        values.extend((n..n + w).map(|p| p as i64));
        values.extend((self.main..self.main + w).map(|p| p as i64));
        values.push(n as i64);
        let logits = self.step.run(values).map_err(ForwardError::from)??;
        Ok(host_logits(logits)?)
    }
}

/// A captured [`StaticKvCache::copy_row`] over `width` positions of one cache.
struct Committer<'a> {
    step: Replayed<'a, ()>,
}

impl<'a> Committer<'a> {
    fn new(device: &Device, cache: Rc<RefCell<StaticKvCache>>) -> Self {
        let inputs = StepInputs::default();
        let values = inputs.clone();
        let step = Box::new(move || {
            let inputs = step_inputs(&values);
            let n = inputs.dims()[0];
            let row = inputs.clone().slice(0..1);
            cache.borrow_mut().copy_row(row, inputs.slice(1..n));
        });
        Self {
            step: Replayed::new(device, inputs, step),
        }
    }

    /// Copies row `row` over the others at `positions`.
    fn run(&mut self, row: usize, positions: std::ops::Range<usize>) -> Result<(), SpecError> {
        let mut values = vec![row as i64];
        values.extend(positions.map(|p| p as i64));
        self.step.run(values).map_err(ForwardError::from)?;
        Ok(())
    }
}

/// [`StaticKvCache::at`] that writes each layer's new keys and values twice: the index holds
/// their positions and then their scratch-tail positions.
struct TailWrite<'c> {
    inner: burn_kernels_core::IndexedWrite<'c>,
}

impl KvCache for TailWrite<'_> {
    fn attend(
        &mut self,
        layer: usize,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        attention: &dyn AttentionImpl,
        opts: &AttnOptions,
    ) -> Result<Tensor<4>, CacheError> {
        let k = Tensor::cat(vec![k.clone(), k], 2);
        let v = Tensor::cat(vec![v.clone(), v], 2);
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
        "static (verify)".into()
    }
}

/// The draft model every draft runs on, or why the captured path cannot take these drafts.
fn one_draft_model<'m>(drafts: &[Draft<'m>]) -> Result<&'m Llama, SpecError> {
    let mut models = drafts.iter().map(Draft::model_ref);
    let first = models.next().flatten();
    match first {
        Some(m) if models.all(|d| d.is_some_and(|d| std::ptr::eq(d, m))) => Ok(m),
        _ => Err(SpecError::GraphUnsupported(
            "every draft must run on one draft model (no prompt lookup)".into(),
        )),
    }
}

/// Each row's draft tokens and the rows they were drawn from (`[K][L]`, `[K][L][vocab]`).
type Drafts = (Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>);

/// A block's drafts: `L` tokens per row and the rows they were drawn from, sampled from
/// `logits` (`[K · vocab]`, after the pending token) and then from `L − 1` replayed draft steps;
/// `logits` is left holding the last step's.
fn draft_block(
    draft: &mut CapturedDecoder<'_>,
    logits: &mut Vec<f32>,
    dists: &[Distribution],
    len: usize,
    rng: &mut StdRng,
) -> Result<Drafts, SpecError> {
    let k = dists.len();
    let vocab = logits.len() / k;
    let jobs: Vec<(usize, usize, usize)> = (0..k).map(|r| (r, 0, r)).collect();
    let mut tokens = vec![Vec::with_capacity(len); k];
    let mut q = vec![Vec::with_capacity(len); k];
    for j in 0..len {
        let drawn = sample_drafts(logits, vocab, &jobs, dists, rng);
        for (r, (dist, token)) in drawn.into_iter().enumerate() {
            tokens[r].push(token);
            q[r].push(dist);
        }
        if j + 1 < len {
            let last: Vec<u32> = tokens.iter().map(|t| t[j]).collect();
            *logits = host_logits(draft.step(&last)?)?;
        }
    }
    Ok((tokens, q))
}

/// [`super::speculative_generate`] for one prompt with every decode step replayed from a
/// capture (layout in the module docs): the same algorithm, schemes and statistics, with the
/// draft's `[K, 1]` step, the target's `[K, L + 1]` verification and (K > 1) the row commits
/// each one graph launch on CUDA.
///
/// # Errors
/// Those of [`super::speculative_generate`]; [`SpecError::GraphUnsupported`] for more than one
/// prompt or drafts that are not all the same draft model; [`SpecError::Generate`] when the
/// prompt plus `max_new_tokens` and a block exceed a model's context, or the device failed.
pub fn speculative_generate_captured(
    target: &Llama,
    drafts: &[Draft<'_>],
    prompt: &[u32],
    attention: &dyn AttentionImpl,
    opts: &SpecOptions,
    on_token: &mut dyn FnMut(u32),
) -> Result<CapturedSpec, SpecError> {
    validate(target, drafts, &[prompt.to_vec()], opts)?;
    let draft_model = one_draft_model(drafts)?;
    let (k, len, vocab) = (drafts.len(), opts.draft_len, target.config.vocab_size);
    let width = len + 1;
    let p = prompt.len();
    // A block writes positions up to n + L + 1 with n < p + max_new_tokens.
    let main = p + opts.max_new_tokens + 2 * width;
    if main > target.max_positions() {
        return Err(GenerateError::ContextTooLong {
            prompt: p,
            new_tokens: opts.max_new_tokens,
            needed: main,
            max: target.max_positions(),
        }
        .into());
    }
    let t0 = Instant::now();
    let mut verifier = Verifier::new(target, attention, &prompt[..p - 1], k, width, main)?;
    let rows = vec![prompt.to_vec(); k];
    let (mut draft, first) = CapturedDecoder::prefill(draft_model, attention, &rows, main - p)?;
    let mut draft_commit = Committer::new(&draft_model.embed.device(), draft.cache().clone());
    let mut draft_logits = first.concat();
    let target_dist = Distribution::new(opts.target_sampling);
    let draft_dist: Vec<Distribution> = drafts
        .iter()
        .map(|d| Distribution::new(d.sampling))
        .collect();
    let mut stats = SpecStats {
        num_drafts: k,
        draft_len: len,
        accepted_at: vec![0; len],
        prefill_secs: t0.elapsed().as_secs_f64(),
        ..SpecStats::default()
    };
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let (mut n, mut pending) = (p - 1, prompt[p - 1]);
    let mut out = Vec::new();
    let t1 = Instant::now();
    while out.len() < opts.max_new_tokens {
        // Draft: L tokens per row; the first from the logits after the pending token.
        let td = Instant::now();
        let (tokens, q) = draft_block(&mut draft, &mut draft_logits, &draft_dist, len, &mut rng)?;
        stats.draft_calls += len - 1;
        stats.draft_secs += td.elapsed().as_secs_f64();
        // Target: every row's block in one replay.
        let tt = Instant::now();
        let logits = verifier.verify(pending, &tokens, n)?;
        stats.target_calls += 1;
        stats.target_secs += tt.elapsed().as_secs_f64();
        let tv = Instant::now();
        let drafted: Vec<Vec<usize>> = tokens
            .iter()
            .map(|t| t.iter().map(|&x| x as usize).collect())
            .collect();
        let row = |r: usize, j: usize| {
            let at = (r * width + j) * vocab;
            target_dist.of(&logits[at..at + vocab])
        };
        let mut block_rng = StdRng::seed_from_u64(
            opts.seed ^ (stats.target_calls as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        let outcome = verify_block(
            opts.scheme,
            &drafted,
            row,
            |r, j| q[r][j].clone(),
            &mut block_rng,
        )?;
        let (r, a) = (outcome.survivors[0], outcome.accepted);
        stats.blocks += 1;
        stats.accepted += a;
        stats.accepted_at[..a].iter_mut().for_each(|hit| *hit += 1);
        let mut done = false;
        for &t in &outcome.tokens {
            let t = t as u32;
            out.push(t);
            on_token(t);
            if opts.stop_tokens.contains(&t) || out.len() >= opts.max_new_tokens {
                done = true;
                break;
            }
        }
        stats.verify_secs += tv.elapsed().as_secs_f64();
        if done {
            break;
        }
        // Keep row r: the target's block positions, the draft's; then catch the draft up.
        let td = Instant::now();
        if k > 1 {
            verifier.commit.run(r, n..n + width)?;
            draft_commit.run(r, n + 1..n + 1 + width)?;
        }
        draft.truncate(n + 1 + a.min(len - 1));
        if a == len {
            draft.step(&vec![tokens[r][len - 1]; k])?;
            stats.draft_calls += 1;
        }
        let last = *outcome.tokens.last().expect("a block emits a token") as u32;
        draft_logits = host_logits(draft.step(&vec![last; k])?)?;
        stats.draft_calls += 1;
        stats.draft_secs += td.elapsed().as_secs_f64();
        n += a + 1;
        pending = last;
    }
    stats.emitted = out.len();
    stats.decode_secs = t1.elapsed().as_secs_f64();
    // The commits run in the draft's part of the block (the rollback).
    let draft_capture = draft.info().capture_secs
        + draft_commit.step.info.capture_secs
        + verifier.commit.step.info.capture_secs;
    let target_capture = verifier.step.info.capture_secs;
    stats.draft_secs = (stats.draft_secs - draft_capture).max(0.0);
    stats.target_secs = (stats.target_secs - target_capture).max(0.0);
    Ok(CapturedSpec {
        tokens: out,
        stats,
        draft: draft.info().clone(),
        target: verifier.step.info.clone(),
        capture_secs: draft_capture + target_capture,
        target_cache_bytes: KvCache::bytes_held(&*verifier.cache.borrow()),
    })
}
