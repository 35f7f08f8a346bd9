//! [`DataError`]: every way a data file can be bad, each naming the file and the position.
//!
//! Nothing here reads data; it only describes what went wrong.

use std::path::PathBuf;

use cohort_tokenizer::TokenizerError;

/// What is wrong with a data file or a data setting.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// A file could not be opened, read, mapped or written (missing files land here).
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A `--data` directory without nanoGPT's token files.
    #[error(
        "{dir}: not a data directory: it has no {missing} (a data directory holds nanoGPT's \
         train.bin and val.bin, uint16 token ids as its prepare.py writes them, and \
         optionally meta.pkl; or pass a .txt, .jsonl or .bin file)"
    )]
    NotADataDir {
        /// The directory.
        dir: PathBuf,
        /// The files it lacks.
        missing: String,
    },
    /// The file has no data.
    #[error("{path}: empty file")]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// Text that is not UTF-8.
    #[error("{path}: invalid UTF-8 at byte offset {offset}")]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// Offset of the first bad byte.
        offset: u64,
    },
    /// A token file whose length does not fit its format.
    #[error("{path}: truncated token file: {len} bytes {reason}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Its length in bytes.
        len: u64,
        /// What the length should be.
        reason: &'static str,
    },
    /// A token file's header is unusable.
    #[error("{path}: bad token file header: {reason}")]
    BadHeader {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A token id at or above the vocabulary size.
    #[error("{path}: token {index} is id {id}, outside the vocabulary 0..{vocab}")]
    TokenOutOfRange {
        /// The file.
        path: PathBuf,
        /// Index of the token in the file.
        index: u64,
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// nanoGPT's `meta.pkl` cannot be read or disagrees with itself.
    #[error("{path}: {reason}")]
    BadMeta {
        /// The meta.pkl file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A document longer than the model's context.
    #[error(
        "{path}:{line}: sequence of {len} tokens is longer than {max}, the most a sample holds \
         (the model's context plus one: the last token is only a target)"
    )]
    TooLong {
        /// The file.
        path: PathBuf,
        /// 1-based line of the document.
        line: u64,
        /// Its length in tokens.
        len: usize,
        /// The model's context.
        max: usize,
    },
    /// A JSONL line that is not a JSON object with the text field.
    #[error("{path}:{line}: {reason}")]
    Json {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// Text with a character the (character-level) tokenizer lacks.
    #[error(
        "{path}: character {ch:?} at byte offset {offset} is not in the tokenizer's vocabulary"
    )]
    UnknownChar {
        /// The file.
        path: PathBuf,
        /// The character.
        ch: char,
        /// Its byte offset in the file.
        offset: u64,
    },
    /// Too little data for one sequence.
    #[error("{path}: {have} tokens, need at least {need} for one sequence of the {split} split")]
    TooShort {
        /// The file.
        path: PathBuf,
        /// Tokens available.
        have: usize,
        /// Tokens needed.
        need: usize,
        /// `train` or `val`.
        split: &'static str,
    },
    /// Tokenizing a file failed.
    #[error("{path}: {source}")]
    Tokenizer {
        /// The file being tokenized.
        path: PathBuf,
        /// The tokenizer's error.
        source: TokenizerError,
    },
    /// A setting is out of range.
    #[error("invalid {what}: {reason}")]
    Config {
        /// The setting.
        what: &'static str,
        /// Why.
        reason: String,
    },
    /// A built-in data set's parameter is out of its range.
    #[error("markov corpus: {what} = {value} is out of range ({range})")]
    OutOfRange {
        /// The parameter.
        what: &'static str,
        /// Its value.
        value: usize,
        /// What it must be.
        range: &'static str,
    },
    /// A rank outside `0..num_replicas`, or no replicas at all.
    #[error("rank {rank} is not in 0..{num_replicas}")]
    InvalidRank {
        /// The rank given.
        rank: usize,
        /// The number of replicas given.
        num_replicas: usize,
    },
}

impl DataError {
    pub(crate) fn io(
        op: &'static str,
        path: &std::path::Path,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_path_buf();
        move |source| DataError::Io { op, path, source }
    }

    /// A tokenizer error about `path`, with UTF-8 problems reported as [`DataError::NotUtf8`].
    pub(crate) fn tokenizer(path: &std::path::Path, e: TokenizerError) -> Self {
        match e {
            TokenizerError::NotUtf8 { path, offset } => DataError::NotUtf8 { path, offset },
            TokenizerError::Io { op, path, source } => DataError::Io { op, path, source },
            source => DataError::Tokenizer {
                path: path.to_path_buf(),
                source,
            },
        }
    }
}
