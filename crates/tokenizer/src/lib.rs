//! Tokenizers for cohort: text to token ids and back, and the vocabulary changes users make.
//!
//! - [`Tokenizer`]: character-level (vocabulary taken from a corpus) or byte-level BPE trained
//!   with Hugging Face's `tokenizers`, or any tokenizer.json loaded as is. Both kinds are stored
//!   as one Hugging Face tokenizer.json. [`Tokenizer::add_tokens`] and
//!   [`Tokenizer::add_special_tokens`] add tokens at the end of the vocabulary and report how
//!   many were new; special tokens are never split, normalised or lowercased.
//! - [`char_vocab::CharVocab`]: the minimal character vocabulary (`vocab.json`) that older
//!   checkpoints carry instead of a tokenizer.json.
//! - [`chat`]: chat templates rendered as transformers renders them ([`ChatTemplate`],
//!   [`Chat`]), and the assistant's tokens of a conversation ([`encode_chat`]).
//! - [`Utf8Chunks`]: reads a UTF-8 corpus in bounded chunks with exact error offsets.
//!
//! This crate knows nothing of models: growing a model's embeddings after adding tokens is the
//! model's `resize_token_embeddings` (cohort-gpt), and saving a model with its tokenizer is
//! cohort-pretrained. It never reads token files or schedules batches (that is `cohort-data`).
//!
//! ```
//! use cohort_tokenizer::Tokenizer;
//!
//! let mut tok = Tokenizer::char_level("start of entity".chars());
//! assert_eq!(tok.add_special_tokens(&["[ENT_START]"]).unwrap(), 1);
//! assert_eq!(tok.encode("of[ENT_START]").unwrap().len(), 3);
//! ```

#![deny(missing_docs)]

pub mod char_vocab;
pub mod chat;
mod hf_files;
mod tokenizer;
mod utf8;

pub use chat::{encode_chat, Chat, ChatError, ChatTemplate, ChatTokens, Rendered};
pub use hf_files::{hf_files, HfFiles};
pub use tokenizer::{ByteSpan, Tokenizer, TokenizerError};
pub use utf8::Utf8Chunks;

/// The tokenizer's file name inside a checkpoint or pretrained directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
