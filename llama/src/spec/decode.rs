//! The speculative decode loop: prefill, drafting, batched verification of every draft's
//! block, acceptance and rollback.

use std::collections::HashMap;
use std::time::Instant;

use burn::tensor::{Int, Tensor, TensorData};
use burn_kernels_core::{AttentionImpl, Greedy, Sampler, SamplingConfig, TopKTopP};
use burn_specdec::{PromptLookup, Scheme, verify_block};
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::model::Llama;

use super::*;

/// Runs ragged rows of tokens through `model` after what `cache` holds, each row at its own
/// positions: row r's tokens continue attention row r of the cache. Shorter rows are left-padded
/// with dummy tokens that the cache masks.
///
/// # Shapes
/// - `rows.len()` = [`BranchKvCache::rows`]
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
fn logits_at(model: &Llama, hidden: Tensor<3>, positions: &[usize]) -> Vec<f32> {
    if positions.is_empty() {
        return Vec::new();
    }
    let [b, s, h] = hidden.dims();
    let device = hidden.device();
    let index: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
    let index = Tensor::<1, Int>::from_data(TensorData::new(index, [positions.len()]), &device);
    let x = hidden.reshape([b * s, h]).select(0, index);
    model
        .logits(x.unsqueeze::<3>())
        .into_data()
        .try_to_vec::<f32>()
        .expect("f32 logits")
}

/// Next-token distributions for one sampling setting (the sampler's own distribution, so
/// speculative and plain decoding sample from the same rows).
struct Distribution {
    cfg: SamplingConfig,
    sampler: TopKTopP,
}

impl Distribution {
    fn new(cfg: SamplingConfig) -> Self {
        Self {
            cfg,
            sampler: TopKTopP::new(cfg),
        }
    }

    fn of(&self, logits: &[f32]) -> Vec<f32> {
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
fn par_map<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
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
fn sample_drafts(
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

/// Draft models with the drafts (global indices) that run on each.
struct Group<'a> {
    model: &'a Llama,
    members: Vec<usize>,
}

fn validate(
    target: &Llama,
    drafts: &[Draft<'_>],
    prompts: &[Vec<u32>],
    opts: &SpecOptions,
) -> Result<(), SpecError> {
    if drafts.is_empty() {
        return Err(SpecError::NoDrafts);
    }
    if opts.draft_len == 0 {
        return Err(SpecError::ZeroDraftLength);
    }
    if opts.scheme == Scheme::SingleDraft && drafts.len() != 1 {
        return Err(SpecError::SingleDraftNeedsOneDraft {
            drafts: drafts.len(),
        });
    }
    let expected = target.config.vocab_size;
    for (k, model) in drafts
        .iter()
        .enumerate()
        .filter_map(|(k, d)| Some((k, d.model_ref()?)))
    {
        let found = model.config.vocab_size;
        if found != expected {
            return Err(SpecError::VocabularyMismatch {
                draft: k,
                expected,
                found,
            });
        }
    }
    if prompts.is_empty() {
        return Err(SpecError::NoPrompts);
    }
    if let Some(index) = prompts.iter().position(Vec::is_empty) {
        return Err(SpecError::EmptyPrompt { index });
    }
    for (index, prompt) in prompts.iter().enumerate() {
        if let Some(&token) = prompt.iter().find(|&&t| t as usize >= expected) {
            return Err(SpecError::PromptTokenOutOfVocab {
                index,
                token,
                vocab: expected,
            });
        }
    }
    Ok(())
}

/// Length of the common prefix of two token slices.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Prefills `cache` with every prompt token but the last (the first block feeds the last).
fn prefill(
    model: &Llama,
    cache: &mut dyn SpecCache,
    prompts: &[Vec<u32>],
    attention: &dyn AttentionImpl,
) -> Result<(), SpecError> {
    let rows: Vec<Vec<u32>> = prompts.iter().map(|p| p[..p.len() - 1].to_vec()).collect();
    if rows.iter().any(|r| !r.is_empty()) {
        forward_rows(model, cache, &rows, attention)?;
    }
    Ok(())
}

/// Generates a continuation of every prompt by multi-draft speculative decoding (algorithm,
/// batching and metrics in the module docs). `on_token(i, token)` is called as each token of
/// prompt `i` is emitted.
///
/// # Errors
/// [`SpecError`] for a bad configuration (K = 0, L = 0, single-draft SD with K ≠ 1, a draft
/// vocabulary ≠ the target's, no or empty prompts, a prompt token outside the vocabulary);
/// [`SpecError::Verify`] if a scheme rejects its inputs.
pub fn speculative_generate(
    target: &Llama,
    drafts: &[Draft<'_>],
    prompts: &[Vec<u32>],
    attention: &dyn AttentionImpl,
    opts: &SpecOptions,
    on_token: &mut dyn FnMut(usize, u32),
) -> Result<SpecGeneration, SpecError> {
    let cache = BranchKvCache::new(target.layers.len(), prompts.len());
    speculative_generate_with_cache(target, cache, drafts, prompts, attention, opts, on_token)
}

/// Whether `cache` can be the target cache of `batch` prompts with `drafts` drafts: it holds
/// that many sequences and branch rows, and nothing yet.
///
/// # Errors
/// [`SpecError::CacheLayout`], [`SpecError::CacheNotEmpty`].
pub fn check_cache(cache: &dyn SpecCache, batch: usize, drafts: usize) -> Result<(), SpecError> {
    if cache.batch() != batch || drafts > cache.max_fan() {
        return Err(SpecError::CacheLayout {
            cache: cache.name(),
            max_batch: cache.batch(),
            max_fan: cache.max_fan(),
            batch,
            drafts,
        });
    }
    match cache.seq_len() {
        0 => Ok(()),
        held => Err(SpecError::CacheNotEmpty { held }),
    }
}

/// [`speculative_generate`] with the target's cache given: a [`BranchKvCache`] for
/// `prompts.len()` sequences, or a [`LinearSpecCache`] around a compressed cache (one prompt,
/// one draft). The drafts keep [`BranchKvCache`]s.
///
/// # Errors
/// Those of [`speculative_generate`]; [`SpecError::CacheLayout`] if the cache cannot hold the
/// batch or K branch rows, [`SpecError::CacheNotEmpty`] if it holds tokens.
pub fn speculative_generate_with_cache<C: SpecCache>(
    target: &Llama,
    mut target_cache: C,
    drafts: &[Draft<'_>],
    prompts: &[Vec<u32>],
    attention: &dyn AttentionImpl,
    opts: &SpecOptions,
    on_token: &mut dyn FnMut(usize, u32),
) -> Result<SpecGeneration<C>, SpecError> {
    validate(target, drafts, prompts, opts)?;
    check_cache(&target_cache, prompts.len(), drafts.len())?;
    let batch = prompts.len();
    let k_drafts = drafts.len();
    let len = opts.draft_len;
    let mut groups: Vec<Group<'_>> = Vec::new();
    let mut lookups: Vec<(usize, PromptLookup)> = Vec::new();
    for (k, d) in drafts.iter().enumerate() {
        let model = match d.source {
            DraftSource::Model(model) => model,
            DraftSource::Lookup(lookup) => {
                lookups.push((k, lookup));
                continue;
            }
        };
        match groups.iter_mut().find(|g| std::ptr::eq(g.model, model)) {
            Some(g) => g.members.push(k),
            None => groups.push(Group {
                model,
                members: vec![k],
            }),
        }
    }
    let target_dist = Distribution::new(opts.target_sampling);
    let draft_dist: Vec<Distribution> = drafts
        .iter()
        .map(|d| Distribution::new(d.sampling))
        .collect();
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let mut stats = SpecStats {
        num_drafts: k_drafts,
        draft_len: len,
        accepted_at: vec![0; len],
        ..SpecStats::default()
    };

    let t0 = Instant::now();
    prefill(target, &mut target_cache, prompts, attention)?;
    let mut draft_caches: Vec<BranchKvCache> = groups
        .iter()
        .map(|g| {
            let mut cache = BranchKvCache::new(g.model.layers.len(), batch);
            prefill(g.model, &mut cache, prompts, attention)?;
            Ok(cache)
        })
        .collect::<Result<_, SpecError>>()?;
    stats.prefill_secs = t0.elapsed().as_secs_f64();

    // Full sequences; each cache holds a prefix of every sequence and is fed the rest.
    let mut seqs: Vec<Vec<u32>> = prompts.to_vec();
    let mut target_held: Vec<usize> = prompts.iter().map(|p| p.len() - 1).collect();
    let mut draft_held: Vec<Vec<usize>> = vec![target_held.clone(); groups.len()];
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); batch];
    let mut done = vec![opts.max_new_tokens == 0; batch];
    let t1 = Instant::now();
    let vocab = target.config.vocab_size;
    while !done.iter().all(|&d| d) {
        let active: Vec<usize> = (0..batch).filter(|&b| !done[b]).collect();
        // 1. Draft: tokens[k][b] (L tokens) and the rows they were drawn from, q[k][b][j].
        // Finished sequences get placeholder tokens; their rows are computed and discarded.
        let td = Instant::now();
        let mut tokens: Vec<Vec<Vec<u32>>> = (0..k_drafts)
            .map(|_| {
                (0..batch)
                    .map(|b| match done[b] {
                        true => vec![*seqs[b].last().expect("non-empty"); len],
                        false => Vec::with_capacity(len),
                    })
                    .collect()
            })
            .collect();
        let mut q = vec![vec![Vec::with_capacity(len); batch]; k_drafts];
        for &(k, lookup) in &lookups {
            for &b in &active {
                tokens[k][b] = lookup.propose(&seqs[b], len);
                q[k][b] = tokens[k][b]
                    .iter()
                    .map(|&t| {
                        // In the vocabulary: lookup copies prompt tokens, checked by
                        // `validate`, and emitted ones.
                        let mut row = vec![0.0; vocab];
                        row[t as usize] = 1.0;
                        row
                    })
                    .collect();
            }
        }
        for (g, group) in groups.iter().enumerate() {
            let fan = group.members.len();
            let cache = &mut draft_caches[g];
            // The emitted tokens this draft lacks are final, so they go straight into its
            // prefix; the drafts of a sequence then share the logits of their first token.
            let rows: Vec<Vec<u32>> = (0..batch)
                .map(|b| match done[b] {
                    true => Vec::new(),
                    false => seqs[b][draft_held[g][b]..].to_vec(),
                })
                .collect();
            let hidden = forward_rows(group.model, cache, &rows, attention)?;
            stats.draft_calls += 1;
            for &b in &active {
                draft_held[g][b] = seqs[b].len();
            }
            let s = hidden.dims()[1];
            let last: Vec<usize> = active.iter().map(|&b| b * s + s - 1).collect();
            let logits = logits_at(group.model, hidden, &last);
            let jobs: Vec<(usize, usize, usize)> = active
                .iter()
                .enumerate()
                .flat_map(|(row, &b)| group.members.iter().map(move |&k| (row, b, k)))
                .collect();
            let drawn = sample_drafts(&logits, vocab, &jobs, &draft_dist, &mut rng);
            for (&(_, b, k), (dist, token)) in jobs.iter().zip(drawn) {
                tokens[k][b].push(token);
                q[k][b].push(dist);
            }
            cache.fork(fan);
            for j in 1..len {
                let rows: Vec<Vec<u32>> = (0..batch * fan)
                    .map(|r| vec![tokens[group.members[r % fan]][r / fan][j - 1]])
                    .collect();
                let hidden = forward_rows(group.model, cache, &rows, attention)?;
                stats.draft_calls += 1;
                let live: Vec<usize> = (0..batch * fan).filter(|&r| !done[r / fan]).collect();
                let logits = logits_at(group.model, hidden, &live);
                let jobs: Vec<(usize, usize, usize)> = live
                    .iter()
                    .enumerate()
                    .map(|(row, &r)| (row, r / fan, group.members[r % fan]))
                    .collect();
                let drawn = sample_drafts(&logits, vocab, &jobs, &draft_dist, &mut rng);
                for (&(_, b, k), (dist, token)) in jobs.iter().zip(drawn) {
                    tokens[k][b].push(token);
                    q[k][b].push(dist);
                }
            }
        }
        stats.draft_secs += td.elapsed().as_secs_f64();

        // 2. One target forward over batch × K rows: pending token(s), then the L draft tokens.
        let tt = Instant::now();
        target_cache.fork(k_drafts);
        let rows: Vec<Vec<u32>> = (0..batch * k_drafts)
            .map(|r| {
                let (b, k) = (r / k_drafts, r % k_drafts);
                [&seqs[b][target_held[b]..], &tokens[k][b][..]].concat()
            })
            .collect();
        let width = rows.iter().map(Vec::len).max().unwrap_or(0);
        let hidden = forward_rows(target, &mut target_cache, &rows, attention)?;
        stats.target_calls += 1;
        // Logits only for the distinct nodes of each token tree: drafts that share their first
        // j tokens share the target distribution at position j.
        let node_index = |b: usize, k: usize, j: usize| (b * k_drafts + k) * (len + 1) + j;
        let mut node_of = vec![usize::MAX; batch * k_drafts * (len + 1)];
        let mut positions = Vec::new();
        let mut nodes: HashMap<(usize, &[u32]), usize> = HashMap::new();
        for &b in &active {
            for k in 0..k_drafts {
                for j in 0..=len {
                    let node = *nodes.entry((b, &tokens[k][b][..j])).or_insert_with(|| {
                        let row = b * k_drafts + k;
                        positions.push(row * width + width - (len + 1) + j);
                        positions.len() - 1
                    });
                    node_of[node_index(b, k, j)] = node;
                }
            }
        }
        let logits = logits_at(target, hidden, &positions);
        stats.target_secs += tt.elapsed().as_secs_f64();

        // 3. Verify each unfinished sequence's token tree; 4. choose what each cache keeps.
        let tv = Instant::now();
        let mut target_keep = vec![(0, 0); batch];
        let mut draft_keep: Vec<Vec<(usize, usize)>> = vec![vec![(0, 0); batch]; groups.len()];
        // Each sequence verifies with its own random stream (seeded by seed, block and
        // sequence), so the sequences verify in parallel and the result does not depend on the
        // number of threads; the host verification of IS/Optimal costs tens of ms per sequence.
        let verify_one = |b: usize| {
            let drafted: Vec<Vec<usize>> = (0..k_drafts)
                .map(|k| tokens[k][b].iter().map(|&t| t as usize).collect())
                .collect();
            let p = |k: usize, j: usize| {
                let node = node_of[node_index(b, k, j)];
                target_dist.of(&logits[node * vocab..(node + 1) * vocab])
            };
            let mut rng = StdRng::seed_from_u64(
                opts.seed
                    ^ (stats.target_calls as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    ^ (b as u64).wrapping_mul(0xD1B5_4A32_D192_ED03),
            );
            verify_block(
                opts.scheme,
                &drafted,
                p,
                |k, j| q[k][b][j].clone(),
                &mut rng,
            )
        };
        let outcomes = par_map(active.len(), |i| verify_one(active[i]));
        for (&b, outcome) in active.iter().zip(outcomes) {
            let outcome = outcome?;
            stats.blocks += 1;
            stats.accepted += outcome.accepted;
            for hit in &mut stats.accepted_at[..outcome.accepted] {
                *hit += 1;
            }
            let mut emitted = Vec::with_capacity(outcome.tokens.len());
            for &t in &outcome.tokens {
                let t = t as u32;
                emitted.push(t);
                out[b].push(t);
                on_token(b, t);
                if opts.stop_tokens.contains(&t) || out[b].len() >= opts.max_new_tokens {
                    done[b] = true;
                    break;
                }
            }
            stats.emitted += emitted.len();
            let e = emitted.len();
            // The target keeps its pending token(s) and the emitted drafts but the last one, so
            // it holds everything but the last emitted token (which the next block feeds).
            let pending = seqs[b].len() - target_held[b];
            let dummies = width - (pending + len);
            target_keep[b] = (outcome.survivors[0], dummies + pending + e - 1);
            target_held[b] += pending + e - 1;
            // A draft branch holds drafts 1..L-1 (the L-th was never fed): keep the longest run
            // that matches the emitted tokens but the last.
            for (g, group) in groups.iter().enumerate() {
                let (best, matched) = (0..group.members.len())
                    .map(|i| {
                        let d = &tokens[group.members[i]][b][..len - 1];
                        (i, common_prefix(d, &emitted[..e - 1]))
                    })
                    .max_by_key(|&(i, m)| (m, std::cmp::Reverse(i)))
                    .expect("a group has a member");
                draft_keep[g][b] = (best, matched);
                draft_held[g][b] += matched;
            }
            seqs[b].extend_from_slice(&emitted);
        }
        target_cache.merge(&target_keep);
        for (cache, keep) in draft_caches.iter_mut().zip(&draft_keep) {
            cache.merge(keep);
        }
        stats.verify_secs += tv.elapsed().as_secs_f64();
    }
    stats.decode_secs = t1.elapsed().as_secs_f64();
    Ok(SpecGeneration {
        tokens: out,
        stats,
        target_cache,
        draft_caches,
    })
}
