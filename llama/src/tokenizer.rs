//! Text ↔ token ids, with Hugging Face `tokenizers` underneath: from a `tokenizer.json`, or
//! rebuilt from the vocabulary a GGUF file embeds (GPT-2 style byte-level BPE).

use crate::error::LoadError;
use std::fmt;
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Tokens that end a turn or a document in the model families we load; `from_file` treats
/// those present in the vocabulary as end-of-sequence, since `tokenizer.json` does not say.
const KNOWN_EOS_TOKENS: &[&str] = &[
    "</s>",
    "<|endoftext|>",
    "<|im_end|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|eom_id|>",
];

/// Llama 3's pre-tokenizer split pattern (`tokenizer.ggml.pre = "llama-bpe"`), as in its
/// `tokenizer.json`.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer plus the ids that matter for generation.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab_size: usize,
    bos: Option<u32>,
    eos: Vec<u32>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

fn tok_err(e: impl fmt::Display) -> LoadError {
    LoadError::Tokenizer { msg: e.to_string() }
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`. End-of-sequence ids are those of the usual
    /// end tokens present (`<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, `</s>`, ...); add
    /// more with [`Tokenizer::with_eos_token_ids`].
    pub fn from_file(path: &Path) -> Result<Self, LoadError> {
        if !path.is_file() {
            return Err(LoadError::NotFound {
                path: path.to_path_buf(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| LoadError::Tokenizer {
            msg: format!("{}: {e}", path.display()),
        })?;
        let mut tok = Self::wrap(inner, None, Vec::new());
        let eos: Vec<u32> = KNOWN_EOS_TOKENS
            .iter()
            .filter_map(|t| tok.token_id(t))
            .collect();
        tok.add_eos(&eos);
        Ok(tok)
    }

    /// Rebuilds the tokenizer of a GGUF file with `tokenizer.ggml.model = "gpt2"`: byte-level
    /// BPE over `tokens` (ids are positions) and `merges` (`"left right"`, highest priority
    /// first). Control tokens (type 3) become special tokens, so `<|im_start|>` in text
    /// encodes to its single id; user-defined tokens (type 4) are matched whole too.
    ///
    /// `pre` is `tokenizer.ggml.pre` and picks the pre-tokenizer Hugging Face uses for that
    /// model: `smollm` (and the StarCoder family) split digits individually before the GPT-2
    /// regex; `llama-bpe` uses Llama 3's split pattern and adds `bos` in front; anything
    /// else gets plain GPT-2 splitting. `eos` lists end-of-sequence ids; `<|im_end|>` is
    /// added when the vocabulary has it, for ChatML.
    pub fn from_gguf_vocab(
        tokens: Vec<String>,
        merges: Vec<String>,
        token_types: Option<Vec<i32>>,
        pre: Option<&str>,
        bos: Option<u32>,
        eos: Vec<u32>,
    ) -> Result<Self, LoadError> {
        if let Some(types) = &token_types
            && types.len() != tokens.len()
        {
            return Err(tok_err(format!(
                "{} token types for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        let n = tokens.len() as u32;
        if let Some(bad) = bos.iter().chain(&eos).find(|&&id| id >= n) {
            return Err(tok_err(format!(
                "special token id {bad} is outside the vocabulary of {n} tokens"
            )));
        }

        let mut vocab = Vocab::default();
        for (id, t) in tokens.iter().enumerate() {
            // A duplicated token keeps its first id, as llama.cpp does.
            vocab.entry(t.clone()).or_insert(id as u32);
        }
        let merges = merges
            .iter()
            .map(|m| match m.split_once(' ') {
                Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains(' ') => {
                    Ok((a.to_string(), b.to_string()))
                }
                _ => Err(tok_err(format!("malformed merge `{m}`"))),
            })
            .collect::<Result<Vec<_>, _>>()?;

        let llama3 = matches!(pre, Some("llama-bpe" | "llama3"));
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            // Llama 3's tokenizer.json looks whole words up in the vocabulary before merging.
            .ignore_merges(llama3)
            .build()
            .map_err(tok_err)?;

        let byte_level = ByteLevel::new(false, true, true);
        let pre_tokenizer: PreTokenizerWrapper = match pre {
            Some("smollm" | "starcoder" | "refact") => {
                Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
            }
            _ if llama3 => Sequence::new(vec![
                Split::new(
                    SplitPattern::Regex(LLAMA3_SPLIT.into()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(tok_err)?
                .into(),
                ByteLevel::new(false, true, false).into(),
            ])
            .into(),
            Some("gpt2" | "default") | None => byte_level.into(),
            Some(other) => {
                log::warn!("tokenizer.ggml.pre = `{other}` is not known; using GPT-2 splitting");
                byte_level.into()
            }
        };

        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner
            .with_pre_tokenizer(Some(pre_tokenizer))
            .with_decoder(Some(ByteLevelDecoder::default()));
        if let Some(types) = &token_types {
            let added = |ty: i32, special: bool| -> Vec<AddedToken> {
                tokens
                    .iter()
                    .zip(types)
                    .filter(|&(_, &t)| t == ty)
                    .map(|(tok, _)| AddedToken::from(tok.clone(), special).normalized(false))
                    .collect()
            };
            inner.add_special_tokens(&added(TOKEN_TYPE_CONTROL, true));
            inner.add_tokens(&added(TOKEN_TYPE_USER_DEFINED, false));
        }

        let mut tok = Self::wrap(inner, bos, Vec::new());
        tok.add_eos(&eos);
        if let Some(im_end) = tok.token_id("<|im_end|>") {
            tok.add_eos(&[im_end]);
        }
        if llama3 {
            tok.set_add_bos(true)?;
        }
        Ok(tok)
    }

    fn wrap(inner: tokenizers::Tokenizer, bos: Option<u32>, eos: Vec<u32>) -> Self {
        // Ids, not entries: added tokens may share ids with the model vocabulary.
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        Self {
            inner,
            vocab_size,
            bos,
            eos,
        }
    }

    fn add_eos(&mut self, ids: &[u32]) {
        for &id in ids {
            if !self.eos.contains(&id) {
                self.eos.push(id);
            }
        }
    }

    /// Adds end-of-sequence ids (e.g. from `config.json`) to those already known.
    pub fn with_eos_token_ids(mut self, ids: &[u32]) -> Self {
        self.add_eos(ids);
        self
    }

    /// Sets the beginning-of-sequence id (used by [`Tokenizer::set_add_bos`]).
    pub fn with_bos_token_id(mut self, bos: Option<u32>) -> Self {
        self.bos = bos;
        self
    }

    /// Whether [`Tokenizer::encode`] puts the BOS token in front (GGUF
    /// `tokenizer.ggml.add_bos_token`). Needs a BOS id when `add` is true.
    pub fn set_add_bos(&mut self, add: bool) -> Result<(), LoadError> {
        if !add {
            self.inner.with_post_processor(None::<TemplateProcessing>);
            return Ok(());
        }
        let bos = self
            .bos
            .ok_or_else(|| tok_err("add_bos_token is set but there is no BOS token id"))?;
        let bos_tok = self
            .inner
            .id_to_token(bos)
            .ok_or_else(|| tok_err(format!("BOS id {bos} is not in the vocabulary")))?;
        let template = TemplateProcessing::builder()
            .try_single(format!("{bos_tok} $A"))
            .map_err(tok_err)?
            .try_pair(format!("{bos_tok} $A {bos_tok} $B:1"))
            .map_err(tok_err)?
            .special_tokens(vec![(bos_tok, bos)])
            .build()
            .map_err(tok_err)?;
        self.inner.with_post_processor(Some(template));
        Ok(())
    }

    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`) encode to
    /// their ids; BOS is added only where the model's own tokenizer adds it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, LoadError> {
        let enc = self.inner.encode(text, true).map_err(tok_err)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, leaving out special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String, LoadError> {
        self.inner.decode(ids, true).map_err(tok_err)
    }

    /// The id of `token` (vocabulary form, e.g. `<|im_end|>` or `Ġthe`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of token ids (highest id + 1).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The beginning-of-sequence id, if the model has one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos
    }

    /// Ids that end generation; includes `<|im_end|>` when the vocabulary has it.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    /// A ChatML prompt: `<|im_start|>{role}\n{content}<|im_end|>\n` per `(role, content)`
    /// message, then `<|im_start|>assistant\n` if `add_generation_prompt`.
    pub fn chat_prompt(&self, messages: &[(&str, &str)], add_generation_prompt: bool) -> String {
        let mut s = String::new();
        for (role, content) in messages {
            s.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
        }
        if add_generation_prompt {
            s.push_str("<|im_start|>assistant\n");
        }
        s
    }

    /// The underlying Hugging Face tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
