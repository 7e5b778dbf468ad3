//! A draft without a model: prompt lookup (n-gram matching over the tokens so far, vLLM's
//! `ngram` proposer). Text that repeats its context (retrieval answers, quoted passages, code
//! edits, summaries) is drafted for free; a draft is a deterministic function of the context, so
//! its distribution is one-hot at the drafted token and every [`crate::Scheme`] stays exact.

use crate::{Result, SpecDecError};

/// Proposes the tokens that followed the most recent earlier occurrence of the context's last
/// n tokens, for the longest n in `min_ngram..=max_ngram` that occurs.
///
/// ```
/// use burn_specdec::PromptLookup;
///
/// let lookup = PromptLookup::new(1, 3)?;
/// // "a b c d ... a b" → the earlier "a b" was followed by "c d".
/// assert_eq!(lookup.propose(&[1, 2, 3, 4, 9, 1, 2], 2), vec![3, 4]);
/// # Ok::<(), burn_specdec::SpecDecError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLookup {
    min_ngram: usize,
    max_ngram: usize,
}

impl Default for PromptLookup {
    /// n-grams of 1 to 3 tokens.
    fn default() -> Self {
        Self {
            min_ngram: 1,
            max_ngram: 3,
        }
    }
}

impl PromptLookup {
    /// Matches suffixes of `min_ngram..=max_ngram` tokens, longest first.
    ///
    /// # Errors
    /// [`SpecDecError::NgramRange`] unless `1 <= min_ngram <= max_ngram`.
    pub fn new(min_ngram: usize, max_ngram: usize) -> Result<Self> {
        if min_ngram == 0 || min_ngram > max_ngram {
            return Err(SpecDecError::NgramRange {
                min: min_ngram,
                max: max_ngram,
            });
        }
        Ok(Self {
            min_ngram,
            max_ngram,
        })
    }

    /// The token after the most recent earlier occurrence of the longest matching suffix of
    /// `context`, or `None` if no suffix of `min_ngram` or more tokens occurs earlier.
    pub fn next_token(&self, context: &[u32]) -> Option<u32> {
        let len = context.len();
        (self.min_ngram..=self.max_ngram.min(len.saturating_sub(1)))
            .rev()
            .find_map(|n| {
                let suffix = &context[len - n..];
                // Occurrences ending before the last token, most recent first.
                (n..len)
                    .rev()
                    .find(|&end| &context[end - n..end] == suffix)
                    .map(|end| context[end])
            })
    }

    /// `len` draft tokens: each is [`PromptLookup::next_token`] of the context extended by the
    /// tokens drafted before it. Where nothing matches, the last token is repeated (any token
    /// keeps verification exact; a repeat is merely cheap). An empty context gives token 0.
    pub fn propose(&self, context: &[u32], len: usize) -> Vec<u32> {
        let mut ext = context.to_vec();
        for _ in 0..len {
            let next = self
                .next_token(&ext)
                .or_else(|| ext.last().copied())
                .unwrap_or(0);
            ext.push(next);
        }
        ext.split_off(context.len())
    }
}
