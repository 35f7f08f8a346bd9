//! [`Tokenizer`]: one type over Hugging Face's `tokenizers` for both the character-level and the
//! BPE vocabularies, so that a single file format (tokenizer.json) describes either.
//!
//! A character-level tokenizer is a `WordLevel` model behind a pre-tokenizer that isolates every
//! character (an empty-pattern `Split`) and a `Fuse` decoder, so Hugging Face's own libraries load
//! it too. Added and special tokens follow Hugging Face's semantics: new ones go at the
//! end of the vocabulary, existing ones keep their ids, special ones are matched before
//! normalisation and never split. This module never touches models or token files.

use std::collections::{BTreeSet, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::models::ModelWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, SplitDelimiterBehavior,
    TokenizerBuilder,
};

/// What went wrong reading, building or using a tokenizer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// A file could not be read or written.
    #[error("{op} {path}: {source}")]
    Io {
        /// `read` or `write`.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A tokenizer.json does not parse (the reason carries line and column).
    #[error("tokenizer file {path} does not parse: {reason}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        reason: String,
    },
    /// A corpus file has no text to build a vocabulary from.
    #[error("corpus {path} is empty")]
    EmptyCorpus {
        /// The file.
        path: PathBuf,
    },
    /// A corpus file is not UTF-8.
    #[error("corpus {path}: invalid UTF-8 at byte offset {offset}")]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// Offset of the first bad byte.
        offset: u64,
    },
    /// Text holds a character the character-level vocabulary lacks.
    #[error("character {ch:?} at byte {offset} of the text is not in the tokenizer's vocabulary")]
    UnknownChar {
        /// The character.
        ch: char,
        /// Its byte offset in the text given to `encode`.
        offset: usize,
    },
    /// `tokenizers` failed on an operation.
    #[error("tokenizer {op}: {reason}")]
    Op {
        /// `encode`, `decode`, `train`, `add tokens` or `save`.
        op: &'static str,
        /// The library's message.
        reason: String,
    },
}

fn op_err(op: &'static str) -> impl Fn(tokenizers::Error) -> TokenizerError {
    move |e| TokenizerError::Op {
        op,
        reason: e.to_string(),
    }
}

/// A token's byte range `(start, end)` in the text it was encoded from.
pub type ByteSpan = (usize, usize);

/// A tokenizer: a Hugging Face `tokenizers::Tokenizer` plus the vocabulary size a model needs.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// One past the highest id (added tokens included): the rows an embedding needs.
    vocab_size: usize,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind())
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl Tokenizer {
    fn wrap(inner: tokenizers::Tokenizer) -> Tokenizer {
        let mut t = Tokenizer {
            inner,
            vocab_size: 0,
        };
        t.refresh_size();
        t
    }

    fn refresh_size(&mut self) {
        self.vocab_size = self
            .inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
    }

    /// A character-level tokenizer whose vocabulary is `chars`, ids in code-point order (as
    /// nanoGPT's `sorted(set(text))`).
    pub fn char_level(chars: impl IntoIterator<Item = char>) -> Tokenizer {
        let set: BTreeSet<char> = chars.into_iter().collect();
        let vocab = set
            .iter()
            .enumerate()
            .map(|(i, c)| (c.to_string(), i as u32))
            .collect();
        // The unknown token is named but not in the vocabulary: an unseen character must be an
        // error, not a silent id.
        let model = WordLevel::builder()
            .vocab(vocab)
            .unk_token("[UNK]".into())
            .build()
            .expect("a WordLevel vocabulary from distinct characters is valid");
        let mut inner = tokenizers::Tokenizer::new(model);
        let every_char = Split::new(
            SplitPattern::Regex(String::new()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .expect("the empty pattern compiles");
        inner.with_pre_tokenizer(Some(every_char));
        inner.with_decoder(Some(Fuse::new()));
        Tokenizer::wrap(inner)
    }

    /// A character-level tokenizer over every character of the UTF-8 files `paths`, read in
    /// chunks (a corpus larger than memory works).
    pub fn char_level_from_files(paths: &[impl AsRef<Path>]) -> Result<Tokenizer, TokenizerError> {
        let mut chars = HashSet::new();
        for path in paths {
            let path = path.as_ref();
            let mut any = false;
            crate::utf8::for_each_chunk(path, |chunk, _| {
                any |= !chunk.is_empty();
                chars.extend(chunk.chars());
            })?;
            if !any {
                return Err(TokenizerError::EmptyCorpus { path: path.into() });
            }
        }
        Ok(Tokenizer::char_level(chars))
    }

    /// Trains a byte-level BPE (GPT-2's scheme) of `vocab_size` ids on the UTF-8 files `paths`;
    /// `special` tokens (e.g. `<|endoftext|>`) get the first ids.
    pub fn train_bpe(
        paths: &[impl AsRef<Path>],
        vocab_size: usize,
        special: &[&str],
    ) -> Result<Tokenizer, TokenizerError> {
        let mut files = Vec::new();
        for path in paths {
            let path = path.as_ref();
            // The trainer reads files itself; validate first so a bad file is named precisely.
            let mut any = false;
            crate::utf8::for_each_chunk(path, |chunk, _| any |= !chunk.is_empty())?;
            if !any {
                return Err(TokenizerError::EmptyCorpus { path: path.into() });
            }
            files.push(path.to_string_lossy().into_owned());
        }
        let mut trainer = BpeTrainerBuilder::new()
            .vocab_size(vocab_size)
            .min_frequency(0)
            .show_progress(false)
            .special_tokens(special.iter().map(|s| AddedToken::from(*s, true)).collect())
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build();
        let mut builder = TokenizerBuilder::<
            BPE,
            NormalizerWrapper,
            PreTokenizerWrapper,
            PostProcessorWrapper,
            DecoderWrapper,
        >::new()
        .with_model(BPE::default())
        .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false).into()))
        .with_decoder(Some(ByteLevelDecoder::default().into()))
        .build()
        .map_err(op_err("train"))?;
        builder
            .train_from_files(&mut trainer, files)
            .map_err(op_err("train"))?;
        let trained: tokenizers::TokenizerImpl<_, _, _, _, _> = builder;
        let inner: tokenizers::Tokenizer = trained.into();
        Ok(Tokenizer::wrap(inner))
    }

    /// Loads any tokenizer.json (Hugging Face's format).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer, TokenizerError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| TokenizerError::Io {
            op: "read",
            path: path.into(),
            source,
        })?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TokenizerError::Parse {
                path: path.into(),
                reason: e.to_string(),
            })?;
        Ok(Tokenizer::wrap(inner))
    }

    /// Reads tokenizer.json text already in memory (a checkpoint's copy).
    pub fn from_json(json: &str) -> Result<Tokenizer, TokenizerError> {
        let inner = json
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| TokenizerError::Parse {
                path: PathBuf::from("<tokenizer.json text>"),
                reason: e.to_string(),
            })?;
        Ok(Tokenizer::wrap(inner))
    }

    /// Writes the tokenizer as tokenizer.json (pretty-printed).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), TokenizerError> {
        let path = path.as_ref();
        let json = self.to_json()?;
        std::fs::write(path, json).map_err(|source| TokenizerError::Io {
            op: "write",
            path: path.into(),
            source,
        })
    }

    /// The tokenizer.json text.
    pub fn to_json(&self) -> Result<String, TokenizerError> {
        self.inner.to_string(true).map_err(op_err("save"))
    }

    /// Whether this is a character-level tokenizer (WordLevel model) or a subword one.
    pub fn kind(&self) -> &'static str {
        match self.inner.get_model() {
            ModelWrapper::WordLevel(_) => "char",
            ModelWrapper::BPE(_) => "bpe",
            ModelWrapper::WordPiece(_) => "wordpiece",
            ModelWrapper::Unigram(_) => "unigram",
        }
    }

    /// Ids needed to embed every token (one past the highest id, added tokens included); what
    /// `resize_token_embeddings` should be given (`len(tokenizer)` in Hugging Face).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Token ids of `text` (no special tokens are inserted around it).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match self.inner.encode_fast(text, false) {
            Ok(enc) => Ok(enc.get_ids().to_vec()),
            Err(e) => Err(self.unknown_char(text).unwrap_or(TokenizerError::Op {
                op: "encode",
                reason: e.to_string(),
            })),
        }
    }

    /// Token ids of `text` and each token's byte range in it (no special tokens inserted).
    pub fn encode_with_offsets(
        &self,
        text: &str,
    ) -> Result<(Vec<u32>, Vec<ByteSpan>), TokenizerError> {
        match self.inner.encode(text, false) {
            Ok(enc) => Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec())),
            Err(e) => Err(self.unknown_char(text).unwrap_or(TokenizerError::Op {
                op: "encode",
                reason: e.to_string(),
            })),
        }
    }

    /// For a character-level vocabulary: the first character of `text` it lacks.
    fn unknown_char(&self, text: &str) -> Option<TokenizerError> {
        if !matches!(self.inner.get_model(), ModelWrapper::WordLevel(_)) {
            return None;
        }
        let mut buf = [0u8; 4];
        text.char_indices()
            .find(|(_, c)| self.inner.token_to_id(c.encode_utf8(&mut buf)).is_none())
            .map(|(offset, ch)| TokenizerError::UnknownChar { ch, offset })
    }

    /// The tokens (as strings) `text` splits into.
    pub fn tokenize(&self, text: &str) -> Result<Vec<String>, TokenizerError> {
        let enc = self.inner.encode(text, false).map_err(op_err("encode"))?;
        Ok(enc.get_tokens().to_vec())
    }

    /// The text of `ids` (special tokens kept).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner.decode(ids, false).map_err(op_err("decode"))
    }

    /// The id of `token`, if the vocabulary (or the added tokens) has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token of `id`.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The special tokens, in id order (Hugging Face's `all_special_tokens`).
    pub fn special_tokens(&self) -> Vec<String> {
        let mut special: Vec<(u32, String)> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (id, t.content))
            .collect();
        special.sort();
        special.into_iter().map(|(_, token)| token).collect()
    }

    /// Whether `token` is registered as a special token.
    pub fn is_special(&self, token: &str) -> bool {
        self.inner.get_added_vocabulary().is_special_token(token)
    }

    /// Adds normal tokens (normalised like the text around them); returns how many were new.
    /// New tokens get ids at the end of the vocabulary; tokens it already has keep their ids.
    pub fn add_tokens(&mut self, tokens: &[&str]) -> Result<usize, TokenizerError> {
        self.add(tokens, false)
    }

    /// Adds special tokens (never split, normalised or lowercased); returns how many were new.
    pub fn add_special_tokens(&mut self, tokens: &[&str]) -> Result<usize, TokenizerError> {
        self.add(tokens, true)
    }

    fn add(&mut self, tokens: &[&str], special: bool) -> Result<usize, TokenizerError> {
        let mut seen = HashSet::new();
        let new = tokens
            .iter()
            .filter(|t| !t.is_empty() && seen.insert(**t) && self.token_to_id(t).is_none())
            .count();
        let added = tokens.iter().map(|t| AddedToken::from(*t, special));
        if special {
            self.inner.add_special_tokens(added)
        } else {
            self.inner.add_tokens(added)
        }
        .map_err(op_err("add tokens"))?;
        self.refresh_size();
        Ok(new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn char_level_round_trips_through_tokenizer_json() {
        let dir = tempfile::tempdir().unwrap();
        let text = "First Citizen:\r\nBefore we proceed, héllo ✓\n";
        let corpus = write(dir.path(), "c.txt", text.as_bytes());
        let tok = Tokenizer::char_level_from_files(&[&corpus]).unwrap();
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort();
        chars.dedup();
        assert_eq!(tok.vocab_size(), chars.len());
        assert_eq!(tok.kind(), "char");
        // nanoGPT's ids: position in the sorted character set.
        assert_eq!(tok.token_to_id("\n"), Some(0));
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids.len(), text.chars().count());
        assert_eq!(tok.decode(&ids).unwrap(), text);
        let saved = dir.path().join("tokenizer.json");
        tok.save(&saved).unwrap();
        let back = Tokenizer::from_file(&saved).unwrap();
        assert_eq!(back.encode(text).unwrap(), ids);
        assert_eq!(back.decode(&ids).unwrap(), text);
        let err = back.encode("Fir§t").unwrap_err().to_string();
        assert!(err.contains("'§'") && err.contains("byte 3"), "{err}");
    }

    #[test]
    fn bpe_trains_encodes_and_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let line = "the quick brown fox jumps over the lazy dog; the end.\n";
        let corpus = write(dir.path(), "c.txt", line.repeat(50).as_bytes());
        let tok = Tokenizer::train_bpe(&[&corpus], 300, &["<|endoftext|>"]).unwrap();
        assert_eq!(tok.kind(), "bpe");
        assert_eq!(tok.token_to_id("<|endoftext|>"), Some(0));
        assert!(tok.vocab_size() > 256 && tok.vocab_size() <= 300);
        let ids = tok.encode(line).unwrap();
        assert!(ids.len() < line.len() / 2, "merges learnt: {ids:?}");
        assert_eq!(tok.decode(&ids).unwrap(), line);
        let saved = dir.path().join("tokenizer.json");
        tok.save(&saved).unwrap();
        assert_eq!(
            Tokenizer::from_file(&saved).unwrap().encode(line).unwrap(),
            ids
        );
    }

    /// Ranks of a job never train their own tokenizer (rank 0 writes it, the others load it),
    /// but a rerun must get the same ids: training is deterministic even where pair counts tie
    /// and hash maps iterate in a different order (every map here has fresh random keys).
    #[test]
    fn bpe_training_is_deterministic_with_tied_counts() {
        let dir = tempfile::tempdir().unwrap();
        let words: Vec<String> = (0..400)
            .map(|i| format!("w{}x{} ", i % 37, i % 11))
            .collect();
        let corpus = write(dir.path(), "c.txt", words.concat().as_bytes());
        let first = Tokenizer::train_bpe(&[&corpus], 320, &["<|endoftext|>"])
            .unwrap()
            .to_json()
            .unwrap();
        for _ in 0..3 {
            let again = Tokenizer::train_bpe(&[&corpus], 320, &["<|endoftext|>"])
                .unwrap()
                .to_json()
                .unwrap();
            assert!(again == first, "two trainings on the same corpus differ");
        }
    }

    #[test]
    fn added_tokens_count_new_ones_and_keep_existing_ids() {
        let mut tok = Tokenizer::char_level("abc ".chars());
        let (a, v0) = (tok.token_to_id("a").unwrap(), tok.vocab_size());
        assert_eq!(tok.add_tokens(&["a", "new_tok1", "new_tok1"]).unwrap(), 1);
        assert_eq!(tok.token_to_id("a"), Some(a));
        assert_eq!(tok.token_to_id("new_tok1"), Some(v0 as u32));
        assert_eq!(
            tok.add_special_tokens(&["[ENT_START]", "[ENT_END]"])
                .unwrap(),
            2
        );
        assert_eq!(tok.add_special_tokens(&["[ENT_START]"]).unwrap(), 0);
        assert_eq!(tok.vocab_size(), v0 + 3);
        assert!(tok.is_special("[ENT_END]") && !tok.is_special("new_tok1"));
        let ids = tok.encode("a[ENT_START]b c[ENT_END]").unwrap();
        let start = tok.token_to_id("[ENT_START]").unwrap();
        let end = tok.token_to_id("[ENT_END]").unwrap();
        assert_eq!(ids.len(), 6, "{ids:?}");
        assert_eq!((ids[1], ids[5]), (start, end));
        assert_eq!(tok.decode(&ids).unwrap(), "a[ENT_START]b c[ENT_END]");
    }

    /// Seed 002's uncased example: normal added tokens are lowercased with the text, special
    /// ones keep their case and are never split.
    #[test]
    fn special_tokens_are_not_normalised_or_split() {
        let dir = tempfile::tempdir().unwrap();
        let corpus = write(
            dir.path(),
            "c.txt",
            "hello world two cars\n".repeat(20).as_bytes(),
        );
        let tok = Tokenizer::train_bpe(&[&corpus], 280, &[]).unwrap();
        let mut json: serde_json::Value = serde_json::from_str(&tok.to_json().unwrap()).unwrap();
        json["normalizer"] = serde_json::json!({"type": "Lowercase"});
        let lowered = write(dir.path(), "t.json", json.to_string().as_bytes());
        let mut tok = Tokenizer::from_file(&lowered).unwrap();
        assert_eq!(tok.add_tokens(&["[NEW_tok1]"]).unwrap(), 1);
        assert_eq!(tok.add_special_tokens(&["[NEW_tok3]"]).unwrap(), 1);
        let tokens = tok.tokenize("[NEW_tok1] Hello[NEW_tok3] World").unwrap();
        assert!(tokens.contains(&"[new_tok1]".to_string()), "{tokens:?}");
        assert!(tokens.contains(&"[NEW_tok3]".to_string()), "{tokens:?}");
        assert!(tokens.iter().any(|t| t.contains("hello")), "{tokens:?}");
        // Lowercase spelling of the special token is ordinary text, split by BPE.
        let lower = tok.tokenize("[new_tok3]").unwrap();
        assert!(lower.len() > 1, "{lower:?}");
    }

    #[test]
    fn bad_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.json");
        let err = Tokenizer::from_file(&missing).unwrap_err().to_string();
        assert!(err.contains("nope.json"), "{err}");
        let broken = write(
            dir.path(),
            "bad.json",
            b"{\"version\": \"1.0\",\n \"model\": [}",
        );
        let err = Tokenizer::from_file(&broken).unwrap_err().to_string();
        assert!(err.contains("bad.json") && err.contains("line 2"), "{err}");
        let empty = write(dir.path(), "empty.txt", b"");
        let err = Tokenizer::char_level_from_files(&[&empty])
            .unwrap_err()
            .to_string();
        assert!(err.contains("empty.txt") && err.contains("empty"), "{err}");
        let latin1 = write(dir.path(), "l1.txt", b"caf\xe9 au lait");
        let err = Tokenizer::train_bpe(&[&latin1], 300, &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("l1.txt") && err.contains("byte offset 3"),
            "{err}"
        );
    }
}
