//! Tokenizers for cohort, and the vocabulary changes they imply for a model (seed 002).
//!
//! - [`Tokenizer`]: character-level (vocabulary taken from a corpus) or byte-level BPE trained
//!   with Hugging Face's `tokenizers`, or any tokenizer.json loaded as is. Both kinds are stored
//!   as one Hugging Face tokenizer.json. [`Tokenizer::add_tokens`] and
//!   [`Tokenizer::add_special_tokens`] add tokens at the end of the vocabulary and report how
//!   many were new; special tokens are never split, normalised or lowercased.
//! - [`resize_token_embeddings`]: a copy of a [`cohort_gpt::GPT`] with a larger vocabulary,
//!   every existing row kept, new rows by a [`RowInit`] strategy.
//! - [`save_pretrained`] / [`load_pretrained`]: model + tokenizer in one directory.
//! - [`Utf8Chunks`]: reads a UTF-8 corpus in bounded chunks with exact error offsets.
//!
//! This crate never reads token files or schedules batches (that is `cohort-data`), and never
//! trains a model.
//!
//! ```
//! use cohort_gpt::{GPTConfig, GPT};
//! use cohort_tokenizer::{resize_token_embeddings, RowInit, Tokenizer};
//!
//! let mut tok = Tokenizer::char_level("start of entity".chars());
//! let cfg = GPTConfig { vocab_size: tok.vocab_size(), max_position_embeddings: 8, n_layers: 1,
//!     n_heads: 2, d_model: 8, d_ff: 16, ..GPTConfig::default() };
//! let model = GPT::new(cfg, 0).unwrap();
//! assert_eq!(tok.add_special_tokens(&["[ENT_START]"]).unwrap(), 1);
//! let init = RowInit::Mean(tok.encode("start of entity").unwrap());
//! let model = resize_token_embeddings(&model, tok.vocab_size(), &[init], 0).unwrap();
//! assert_eq!(model.config().vocab_size, tok.vocab_size());
//! assert_eq!(tok.encode("of[ENT_START]").unwrap().len(), 3);
//! ```

#![deny(missing_docs)]

mod pretrained;
mod resize;
mod tokenizer;
mod utf8;

pub use pretrained::{load_pretrained, save_pretrained, PretrainedError, TOKENIZER_FILE};
pub use resize::{resize_token_embeddings, ResizeError, RowInit};
pub use tokenizer::{Tokenizer, TokenizerError};
pub use utf8::Utf8Chunks;
