//! The pass-key retrieval prompt (Mohtashami & Jaggi, 2023), the needle-in-a-haystack task of
//! the `needle` example and of the `e2e-generate` bench: repeated filler sentences with "The
//! pass key is NNNNN. Remember it. NNNNN is the pass key." at a relative depth, ending with
//! "What is the pass key? The pass key is". An answer is right when it contains the digits.

use crate::loader::LoadError;
use crate::tokenizer::Tokenizer;

const FILLER: &str = "The grass is green. The sky is blue. The sun is yellow. Here we go. \
                      There and back again. ";
const INTRO: &str = "There is an important info hidden inside a lot of irrelevant text. Find \
                     it and memorize it. I will quiz you about the important information \
                     there.\n";
const QUESTION: &str = "\nWhat is the pass key? The pass key is";

/// The prompt text with `fillers` filler groups and the key before filler `depth · fillers`.
pub fn passkey_text(fillers: usize, depth: f64, key: u32) -> String {
    let at = ((fillers as f64) * depth).round() as usize;
    let mut s = String::from(INTRO);
    for i in 0..fillers {
        if i == at {
            s.push_str(&format!(
                "The pass key is {key}. Remember it. {key} is the pass key. "
            ));
        }
        s.push_str(FILLER);
    }
    s.push_str(QUESTION);
    s
}

/// Filler groups that bring the prompt to about `tokens` tokens (at least 1).
///
/// # Errors
/// The tokenizer's.
pub fn fillers_for(tokenizer: &Tokenizer, tokens: usize) -> Result<usize, LoadError> {
    let per_filler = tokenizer.encode(&FILLER.repeat(10))?.len() as f64 / 10.0;
    let base = tokenizer.encode(&passkey_text(0, 0.0, 12345))?.len() as f64;
    Ok(((tokens as f64 - base) / per_filler).max(1.0) as usize)
}

/// The tokenized prompt of about `tokens` tokens with `key` at relative `depth`.
///
/// # Errors
/// The tokenizer's.
pub fn passkey_prompt(
    tokenizer: &Tokenizer,
    tokens: usize,
    depth: f64,
    key: u32,
) -> Result<Vec<u32>, LoadError> {
    tokenizer.encode(&passkey_text(fillers_for(tokenizer, tokens)?, depth, key))
}

/// Whether the decoded answer `text` contains `key`'s digits.
pub fn holds_key(text: &str, key: u32) -> bool {
    text.contains(&key.to_string())
}
