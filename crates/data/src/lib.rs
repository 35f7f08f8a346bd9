//! Training data for cohort: what a training loop reads ([`Dataset`]: built-in synthetic data or
//! token files on disk, memory-mapped at training time), and the samplers and loader that
//! feed it to each rank.
//!
//! - [`Dataset`]: the one seam for training data (both splits, vocabulary, loss floor);
//!   [`MarkovCorpus`] (a learnable corpus whose best loss is known) and [`RandomTokens`]
//!   (uniform ids, for throughput) are built in.
//! - [`Corpus::open`] turns `--data PATH` (nanoGPT's `train.bin`/`val.bin` directory, a `.bin`
//!   token file, a `.jsonl` file or UTF-8 text) into a train/val split, tokenizing text and
//!   JSONL once into cached token files ([`TokenFile`], uint16 or uint32, see
//!   [`token_file`](TokenWriter)).
//! - [`TokenWindows`] (fixed windows of a stream) and [`Documents`] (one sample per JSONL
//!   document or conversation, with the conversation's loss mask: only the assistant's tokens
//!   are targets) implement [`Samples`].
//! - [`DistributedSampler`]: torch's `DistributedSampler`, the indices each rank reads in an
//!   epoch.
//! - [`TokenBudgetSampler`]: sort-buffer, token-budget dynamic batching across ranks (documents
//!   of different lengths), resumable at any step.
//! - [`DataLoader`]: worker threads collate padded [`Batch`]es (attention mask, labels -100 at
//!   padding) ahead of the consumer, identical whatever the number of workers.
//!
//! Every bad input is a [`DataError`] naming the file and the position. This crate never
//! touches a model or a process group.
//!
//! ```
//! use std::sync::Arc;
//! use cohort_data::{BudgetConfig, Corpus, CorpusOptions, DataLoader, LoaderConfig, Samples,
//!     TokenBudgetSampler};
//! use cohort_tokenizer::Tokenizer;
//!
//! let dir = tempfile::tempdir().unwrap();
//! let lines: String = (0..50).map(|i| format!("{{\"text\": \"{}\"}}\n", "ab".repeat(1 + i % 7))).collect();
//! std::fs::write(dir.path().join("d.jsonl"), lines).unwrap();
//! let tok = Tokenizer::char_level("ab".chars());
//! let opts = CorpusOptions { max_len: 64, ..CorpusOptions::default() };
//! let Corpus::Documents { train, .. } = Corpus::open(&dir.path().join("d.jsonl"), Some(&tok), &opts).unwrap()
//!     else { unreachable!() };
//! let cfg = BudgetConfig { batch_tokens: 32, ..BudgetConfig::default() };
//! let plan = TokenBudgetSampler::new(&train, cfg, 1, 0).unwrap().batches(0, 0);
//! for batch in DataLoader::new(Arc::new(train), plan, LoaderConfig::default()) {
//!     assert!(batch.batch * batch.seq <= 32);
//! }
//! ```

#![deny(missing_docs)]

mod chat;
mod corpus;
mod dataset;
mod distributed_sampler;
mod error;
mod loader;
mod nanogpt_meta;
mod pack;
mod sampler;
mod synthetic;
mod token_file;

pub use corpus::{default_cache_dir, tokenize_jsonl, tokenize_text, Corpus, CorpusOptions};
pub use dataset::{Dataset, Documents, Samples, Split, TokenWindows};
pub use distributed_sampler::DistributedSampler;
pub use error::DataError;
pub use loader::{collate, collate_as, Batch, DataLoader, LoaderConfig, IGNORE_INDEX};
pub use nanogpt_meta::{nanogpt_tokenizer, META_FILE};
pub use pack::collate_packed;
pub use sampler::{BudgetConfig, TokenBudgetSampler};
pub use synthetic::{MarkovCorpus, MarkovSpec, RandomTokens};
pub use token_file::{write_token_file, TokenFile, TokenWriter};
