//! Token-tree verification of a block: K drafted continuations of length L checked position by
//! position, as in SpecInfer's and SpecTr's multi-candidate verification.
//!
//! # How a token-level scheme is applied along the sequence
//! Draft `k` proposes `x_k = (x_{k,1} .. x_{k,L})`, drawn autoregressively from its own model:
//! `x_{k,j} ~ q_k(. | prefix, x_{k,<j})`, the K drafts independent given the prefix. The K
//! continuations form a token tree rooted at the prefix (drafts that share their first tokens
//! share a branch). Verification walks down the tree:
//!
//! 1. At position `j` the *survivors* are the drafts whose first `j - 1` tokens equal the tokens
//!    accepted so far (at `j = 1`, all K). They all condition on the same prefix, so the target
//!    distribution `p_j = p(. | prefix, accepted)` is read from any one of them (the first).
//! 2. The [`Scheme`] is run on `p_j` and the survivors' rows `q_{k,j}` with their tokens
//!    `x_{k,j}` (`K_j` = number of survivors, `K_j + 2` uniforms).
//! 3. If it accepts a draft, its token `t` is emitted and the survivors become the drafts with
//!    `x_{k,j} = t` (the accepted one and any that drafted the same token), and verification
//!    moves to position `j + 1`. A draft rejected here drops out for the rest of the block.
//! 4. If it returns a residual token, that token is emitted and the block ends (also when the
//!    residual token happens to equal a drafted token: the scheme reports it as not accepted).
//! 5. If all L positions are accepted, one *bonus* token is drawn from
//!    `p_{L+1} = p(. | prefix, x_{k,1..L})` (one more uniform), so a block emits between 1 and
//!    `L + 1` tokens.
//!
//! Exactness: each scheme outputs exactly `p_j` given any number of independent drafts from the
//! `q`s. Given the verdicts up to position `j - 1`, a survivor's token `x_{k,j}` was drawn from
//! `q_k(. | prefix, accepted)` independently of the uniforms that decided those verdicts, so the
//! survivors are again independent draft samples and step 2 outputs `p_j`. By induction the
//! emitted sequence follows the target exactly (`tests/block.rs` checks the law of whole
//! sequences on a small Markov chain).
//!
//! With a one-hot target (greedy decoding), every scheme emits the target's argmax at every
//! position, so speculative greedy decoding reproduces plain greedy decoding token for token.

use rand::Rng;

use crate::error::{DistributionId, Result, SpecDecError};
use crate::prob::{inverse_cdf, normalise};
use crate::{Scheme, Verifier};

/// The verdict on one block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockOutcome {
    /// The accepted draft tokens, then one more token (a residual sample, or the bonus token
    /// when all L positions were accepted): `accepted + 1` tokens.
    pub tokens: Vec<usize>,
    /// Number of accepted draft tokens, `0..=L`.
    pub accepted: usize,
    /// The drafts whose first `accepted` tokens are the accepted tokens (never empty; all K when
    /// nothing was accepted). A caller that batched the drafts as rows can keep the KV cache of
    /// any of these rows.
    pub survivors: Vec<usize>,
}

impl BlockOutcome {
    /// Whether the last token is the bonus token (every draft position was accepted).
    pub fn bonus(&self, draft_len: usize) -> bool {
        self.accepted == draft_len
    }
}

/// Verifies one block of K drafted continuations of length L (algorithm in the module docs).
///
/// - `drafts[k]`: the L tokens of draft `k` (every draft has the same length).
/// - `target(k, j)`: the target's distribution (a row proportional to it) after the prefix and
///   `drafts[k][..j]`, for `j` in `0..=L`; it is only asked for survivors of position `j`.
/// - `draft(k, j)`: the distribution `drafts[k][j]` was drawn from (only asked for survivors).
/// - `rng`: `K_j + 2` uniforms per verified position (in the layout of
///   [`crate::uniforms_per_token`]), then one for the bonus token.
///
/// # Errors
/// [`SpecDecError::NoDrafts`] and [`SpecDecError::DraftLengthMismatch`] for malformed `drafts`,
/// and any error of [`Verifier::new`] or [`Verifier::verify`] on the rows (e.g.
/// [`SpecDecError::SingleDraftOnly`] for [`Scheme::SingleDraft`] with K > 1, or
/// [`SpecDecError::ZeroDraftProbability`] if a drafted token has no mass under its row).
pub fn verify_block<T, P, Q, R>(
    scheme: Scheme,
    drafts: &[Vec<usize>],
    mut target: P,
    mut draft: Q,
    rng: &mut R,
) -> Result<BlockOutcome>
where
    T: Copy + Into<f64>,
    P: FnMut(usize, usize) -> Vec<T>,
    Q: FnMut(usize, usize) -> Vec<T>,
    R: Rng + ?Sized,
{
    let len = drafts.first().ok_or(SpecDecError::NoDrafts)?.len();
    if let Some((k, d)) = drafts.iter().enumerate().find(|(_, d)| d.len() != len) {
        return Err(SpecDecError::DraftLengthMismatch {
            draft: k,
            expected: len,
            found: d.len(),
        });
    }
    // columns[j][k] = drafts[k][j].
    let columns: Vec<Vec<usize>> = (0..len)
        .map(|j| drafts.iter().map(|d| d[j]).collect())
        .collect();
    let mut survivors: Vec<usize> = (0..drafts.len()).collect();
    let mut tokens = Vec::with_capacity(len + 1);
    for (j, column) in columns.iter().enumerate() {
        let p = target(survivors[0], j);
        let qs: Vec<Vec<T>> = survivors.iter().map(|&k| draft(k, j)).collect();
        let drafted: Vec<usize> = survivors.iter().map(|&k| column[k]).collect();
        let outcome = Verifier::new(scheme, &p, &qs)?.verify_with_rng(&drafted, rng)?;
        tokens.push(outcome.token);
        if outcome.accepted.is_none() {
            return Ok(BlockOutcome {
                tokens,
                accepted: j,
                survivors,
            });
        }
        survivors.retain(|&k| column[k] == outcome.token);
    }
    let p = normalise(DistributionId::Target, &target(survivors[0], len))?;
    let bonus = inverse_cdf(&p, rng.random::<f64>()).expect("a normalised row has mass");
    tokens.push(bonus);
    Ok(BlockOutcome {
        tokens,
        accepted: len,
        survivors,
    })
}
