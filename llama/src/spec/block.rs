//! One block of the speculative decode loop, in its three phases: the drafts propose `L` tokens
//! each ([`Loop::draft`]), the target scores every draft's block in one forward
//! ([`Loop::score`]), and each unfinished sequence verifies its token tree and every cache keeps
//! what was accepted ([`Loop::verify`]).

use std::collections::HashMap;

use burn_kernels_core::AttentionImpl;
use burn_specdec::{PromptLookup, verify_block};
use rand::{SeedableRng, rngs::StdRng};

use crate::model::Llama;

use super::rows::{Distribution, common_prefix, forward_rows, logits_at, par_map, sample_drafts};
use super::{BranchKvCache, Draft, DraftSource, SpecCache, SpecError, SpecOptions, SpecStats};

/// Draft models with the drafts (global indices) that run on each.
pub(super) struct Group<'a> {
    pub model: &'a Llama,
    pub members: Vec<usize>,
}

/// The drafts by how they propose: model groups (drafts sharing a model share its forward) and
/// prompt lookups with their draft index.
pub(super) fn group_drafts<'a>(
    drafts: &[Draft<'a>],
) -> (Vec<Group<'a>>, Vec<(usize, PromptLookup)>) {
    let mut groups: Vec<Group<'a>> = Vec::new();
    let mut lookups = Vec::new();
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
    (groups, lookups)
}

/// A block's drafts: `tokens[k][b]` (`L` tokens of draft `k` for sequence `b`) and the rows they
/// were drawn from, `q[k][b][j]`.
pub(super) struct Drafted {
    tokens: Vec<Vec<Vec<u32>>>,
    q: Vec<Vec<Vec<Vec<f32>>>>,
}

/// The target's scores of a block: the logits of the distinct nodes of each sequence's token
/// tree, `node_of[(b · K + k) · (L + 1) + j]` the node of draft `k`'s first `j` tokens, and the
/// width of the rows the target ran.
pub(super) struct Scored {
    logits: Vec<f32>,
    node_of: Vec<usize>,
    width: usize,
}

/// The speculative decode loop's state between blocks, and what it runs with.
pub(super) struct Loop<'a, 'm> {
    pub groups: Vec<Group<'m>>,
    pub lookups: Vec<(usize, PromptLookup)>,
    pub target_dist: Distribution,
    pub draft_dist: Vec<Distribution>,
    pub attention: &'a dyn AttentionImpl,
    pub opts: &'a SpecOptions,
    pub vocab: usize,
    /// Full sequences; each cache holds a prefix of every sequence and is fed the rest.
    pub seqs: Vec<Vec<u32>>,
    pub target_held: Vec<usize>,
    pub draft_held: Vec<Vec<usize>>,
    pub out: Vec<Vec<u32>>,
    pub done: Vec<bool>,
    pub stats: SpecStats,
}

impl Loop<'_, '_> {
    fn batch(&self) -> usize {
        self.seqs.len()
    }

    fn k_drafts(&self) -> usize {
        self.draft_dist.len()
    }

    /// The sequences still generating.
    pub fn active(&self) -> Vec<usize> {
        (0..self.batch()).filter(|&b| !self.done[b]).collect()
    }

    /// Phase 1: every draft proposes `L` tokens for every sequence. Finished sequences get
    /// placeholder tokens; their rows are computed and discarded.
    pub fn draft(
        &mut self,
        draft_caches: &mut [BranchKvCache],
        rng: &mut StdRng,
    ) -> Result<Drafted, SpecError> {
        let (batch, len) = (self.batch(), self.opts.draft_len);
        let tokens: Vec<Vec<Vec<u32>>> = (0..self.k_drafts())
            .map(|_| {
                (0..batch)
                    .map(|b| match self.done[b] {
                        true => vec![*self.seqs[b].last().expect("non-empty"); len],
                        false => Vec::with_capacity(len),
                    })
                    .collect()
            })
            .collect();
        let q = vec![vec![Vec::with_capacity(len); batch]; self.k_drafts()];
        let mut drafted = Drafted { tokens, q };
        let active = self.active();
        for &(k, lookup) in &self.lookups {
            for &b in &active {
                let proposed = lookup.propose(&self.seqs[b], len);
                // In the vocabulary: lookup copies prompt tokens, checked by `validate`, and
                // emitted ones.
                drafted.q[k][b] = proposed
                    .iter()
                    .map(|&t| {
                        let mut row = vec![0.0; self.vocab];
                        row[t as usize] = 1.0;
                        row
                    })
                    .collect();
                drafted.tokens[k][b] = proposed;
            }
        }
        for (g, cache) in draft_caches.iter_mut().enumerate() {
            self.draft_group(g, cache, &mut drafted, rng)?;
        }
        Ok(drafted)
    }

    /// Phase 1 for the drafts of model group `g`, whose cache is `cache`.
    fn draft_group(
        &mut self,
        g: usize,
        cache: &mut BranchKvCache,
        drafted: &mut Drafted,
        rng: &mut StdRng,
    ) -> Result<(), SpecError> {
        let (batch, len) = (self.batch(), self.opts.draft_len);
        let (model, members) = (self.groups[g].model, self.groups[g].members.clone());
        let fan = members.len();
        let active = self.active();
        // The emitted tokens this draft lacks are final, so they go straight into its prefix;
        // the drafts of a sequence then share the logits of their first token.
        let rows: Vec<Vec<u32>> = (0..batch)
            .map(|b| match self.done[b] {
                true => Vec::new(),
                false => self.seqs[b][self.draft_held[g][b]..].to_vec(),
            })
            .collect();
        let hidden = forward_rows(model, cache, &rows, self.attention)?;
        self.stats.draft_calls += 1;
        for &b in &active {
            self.draft_held[g][b] = self.seqs[b].len();
        }
        let s = hidden.dims()[1];
        let last: Vec<usize> = active.iter().map(|&b| b * s + s - 1).collect();
        let logits = logits_at(model, hidden, &last)?;
        let jobs: Vec<(usize, usize, usize)> = active
            .iter()
            .enumerate()
            .flat_map(|(row, &b)| members.iter().map(move |&k| (row, b, k)))
            .collect();
        self.push_drawn(drafted, &logits, &jobs, rng);
        cache.fork(fan);
        for j in 1..len {
            let rows: Vec<Vec<u32>> = (0..batch * fan)
                .map(|r| vec![drafted.tokens[members[r % fan]][r / fan][j - 1]])
                .collect();
            let hidden = forward_rows(model, cache, &rows, self.attention)?;
            self.stats.draft_calls += 1;
            let live: Vec<usize> = (0..batch * fan).filter(|&r| !self.done[r / fan]).collect();
            let logits = logits_at(model, hidden, &live)?;
            let jobs: Vec<(usize, usize, usize)> = live
                .iter()
                .enumerate()
                .map(|(row, &r)| (row, r / fan, members[r % fan]))
                .collect();
            self.push_drawn(drafted, &logits, &jobs, rng);
        }
        Ok(())
    }

    /// Draws the drafts' next tokens for `jobs` (row of `logits`, sequence, draft).
    fn push_drawn(
        &self,
        drafted: &mut Drafted,
        logits: &[f32],
        jobs: &[(usize, usize, usize)],
        rng: &mut StdRng,
    ) {
        let drawn = sample_drafts(logits, self.vocab, jobs, &self.draft_dist, rng);
        for (&(_, b, k), (dist, token)) in jobs.iter().zip(drawn) {
            drafted.tokens[k][b].push(token);
            drafted.q[k][b].push(dist);
        }
    }

    /// Phase 2: one target forward over batch × K rows (pending token(s), then the `L` draft
    /// tokens), logits only for the distinct nodes of each token tree: drafts that share their
    /// first `j` tokens share the target distribution at position `j`.
    pub fn score(
        &mut self,
        target: &Llama,
        target_cache: &mut dyn SpecCache,
        drafted: &Drafted,
    ) -> Result<Scored, SpecError> {
        let (k_drafts, len) = (self.k_drafts(), self.opts.draft_len);
        target_cache.fork(k_drafts);
        let rows: Vec<Vec<u32>> = (0..self.batch() * k_drafts)
            .map(|r| {
                let (b, k) = (r / k_drafts, r % k_drafts);
                [
                    &self.seqs[b][self.target_held[b]..],
                    &drafted.tokens[k][b][..],
                ]
                .concat()
            })
            .collect();
        let width = rows.iter().map(Vec::len).max().unwrap_or(0);
        let hidden = forward_rows(target, target_cache, &rows, self.attention)?;
        self.stats.target_calls += 1;
        let mut node_of = vec![usize::MAX; self.batch() * k_drafts * (len + 1)];
        let mut positions = Vec::new();
        let mut nodes: HashMap<(usize, &[u32]), usize> = HashMap::new();
        for b in self.active() {
            for k in 0..k_drafts {
                for j in 0..=len {
                    let node = *nodes
                        .entry((b, &drafted.tokens[k][b][..j]))
                        .or_insert_with(|| {
                            let row = b * k_drafts + k;
                            positions.push(row * width + width - (len + 1) + j);
                            positions.len() - 1
                        });
                    node_of[(b * k_drafts + k) * (len + 1) + j] = node;
                }
            }
        }
        let logits = logits_at(target, hidden, &positions)?;
        Ok(Scored {
            logits,
            node_of,
            width,
        })
    }

    /// Phase 3: verifies each unfinished sequence's token tree, emits the accepted tokens and
    /// merges every cache to the branch and length it keeps.
    pub fn verify(
        &mut self,
        drafted: &Drafted,
        scored: &Scored,
        target_cache: &mut dyn SpecCache,
        draft_caches: &mut [BranchKvCache],
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<(), SpecError> {
        let active = self.active();
        let mut target_keep = vec![(0, 0); self.batch()];
        let mut draft_keep = vec![vec![(0, 0); self.batch()]; self.groups.len()];
        let outcomes = par_map(active.len(), |i| {
            self.verify_one(active[i], drafted, scored)
        });
        for (&b, outcome) in active.iter().zip(outcomes) {
            let outcome = outcome?;
            self.stats.blocks += 1;
            self.stats.accepted += outcome.accepted;
            for hit in &mut self.stats.accepted_at[..outcome.accepted] {
                *hit += 1;
            }
            let emitted = self.emit(b, &outcome.tokens, on_token);
            let (e, len) = (emitted.len(), self.opts.draft_len);
            // The target keeps its pending token(s) and the emitted drafts but the last one, so
            // it holds everything but the last emitted token (which the next block feeds).
            let pending = self.seqs[b].len() - self.target_held[b];
            let dummies = scored.width - (pending + len);
            target_keep[b] = (outcome.survivors[0], dummies + pending + e - 1);
            self.target_held[b] += pending + e - 1;
            // A draft branch holds drafts 1..L-1 (the L-th was never fed): keep the longest run
            // that matches the emitted tokens but the last.
            for (g, group) in self.groups.iter().enumerate() {
                let (best, matched) = (0..group.members.len())
                    .map(|i| {
                        let d = &drafted.tokens[group.members[i]][b][..len - 1];
                        (i, common_prefix(d, &emitted[..e - 1]))
                    })
                    .max_by_key(|&(i, m)| (m, std::cmp::Reverse(i)))
                    .expect("a group has a member");
                draft_keep[g][b] = (best, matched);
                self.draft_held[g][b] += matched;
            }
            self.seqs[b].extend_from_slice(&emitted);
        }
        target_cache.merge(&target_keep);
        for (cache, keep) in draft_caches.iter_mut().zip(&draft_keep) {
            cache.merge(keep);
        }
        Ok(())
    }

    /// Verifies sequence `b`'s token tree. Each sequence verifies with its own random stream
    /// (seeded by seed, block and sequence), so the sequences verify in parallel and the result
    /// does not depend on the number of threads; the host verification of IS/Optimal costs tens
    /// of ms per sequence.
    fn verify_one(
        &self,
        b: usize,
        drafted: &Drafted,
        scored: &Scored,
    ) -> Result<burn_specdec::BlockOutcome, SpecError> {
        let (k_drafts, len, vocab) = (self.k_drafts(), self.opts.draft_len, self.vocab);
        let tokens: Vec<Vec<usize>> = (0..k_drafts)
            .map(|k| drafted.tokens[k][b].iter().map(|&t| t as usize).collect())
            .collect();
        let p = |k: usize, j: usize| {
            let node = scored.node_of[(b * k_drafts + k) * (len + 1) + j];
            self.target_dist
                .of(&scored.logits[node * vocab..(node + 1) * vocab])
        };
        let mut rng = StdRng::seed_from_u64(
            self.opts.seed
                ^ (self.stats.target_calls as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ (b as u64).wrapping_mul(0xD1B5_4A32_D192_ED03),
        );
        Ok(verify_block(
            self.opts.scheme,
            &tokens,
            p,
            |k, j| drafted.q[k][b][j].clone(),
            &mut rng,
        )?)
    }

    /// Emits sequence `b`'s verified tokens until a stop token or the token budget; returns
    /// those emitted.
    fn emit(
        &mut self,
        b: usize,
        tokens: &[usize],
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Vec<u32> {
        let mut emitted = Vec::with_capacity(tokens.len());
        for &t in tokens {
            let t = t as u32;
            emitted.push(t);
            self.out[b].push(t);
            on_token(b, t);
            if self.opts.stop_tokens.contains(&t) || self.out[b].len() >= self.opts.max_new_tokens {
                self.done[b] = true;
                break;
            }
        }
        self.stats.emitted += emitted.len();
        emitted
    }
}
