//! The data set a run's config names: the built-in ones (`--data markov`, the default, and
//! `--data random`), or files (`--data PATH`) through `cohort-data` and `cohort-tokenizer`.
//!
//! PATH is UTF-8 text, a `.jsonl` file (one sample per document, batched by token budget), a
//! `.bin` token file or nanoGPT's directory with `train.bin`/`val.bin` (and, for character-level
//! data, the vocabulary in `meta.pkl`). `--tokenizer` is `char` (vocabulary from the corpus, or
//! nanoGPT's meta.pkl), `bpe` (trained on the corpus, `vocab_size` ids) or the path of a
//! tokenizer.json or of a model directory holding one. JSONL lines `{"messages": [...]}` are
//! conversations, rendered with the chat template beside that tokenizer.json and trained on the
//! assistant's tokens only. Rank 0 builds the tokenizer and the token cache first, then the other
//! ranks load what it wrote, so no two processes write the same file. This module never touches
//! the model.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cohort_comm::ProcessGroup;
use cohort_data::{Corpus, CorpusOptions, Samples};
use cohort_tokenizer::{ChatError, ChatTemplate, Tokenizer};

use crate::config::TrainConfig;
use crate::error::TrainError;
use cohort_data::{Dataset, MarkovCorpus, MarkovSpec, RandomTokens, Split};

/// Token data from files: windows of a token stream, or whole documents.
pub struct FileData {
    train: Box<dyn Samples>,
    val: Box<dyn Samples>,
    /// Window length, or the longest a document may be.
    seq_len: usize,
    documents: bool,
    tokenizer: Option<Tokenizer>,
    vocab_size: usize,
    describe: String,
}

impl std::fmt::Debug for FileData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe)
    }
}

/// Where caches built from `data` go: `OUT/data-cache` when the run has an out directory,
/// else beside the data, or in the user's cache when the data's directory is read-only
/// (`cohort_data::default_cache_dir`).
fn cache_dir(cfg: &TrainConfig, data: &Path) -> Result<PathBuf, TrainError> {
    let dir = match &cfg.out {
        Some(out) => out.join("data-cache"),
        None => cohort_data::default_cache_dir(data),
    };
    std::fs::create_dir_all(&dir).map_err(|source| cohort_data::DataError::Io {
        op: "create",
        path: dir.clone(),
        source,
    })?;
    Ok(dir)
}

/// Where the tokenizer built from `data` by `kind` is kept.
fn tokenizer_cache(dir: &Path, data: &Path, kind: &str, vocab: usize) -> PathBuf {
    let name = data
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "data".into());
    let tag = if kind == "bpe" {
        format!("bpe{vocab}")
    } else {
        kind.to_string()
    };
    dir.join(format!("{name}.{tag}.tokenizer.json"))
}

/// The tokenizer `cfg.tokenizer` names, built (rank 0) or loaded (other ranks).
fn tokenizer(
    cfg: &TrainConfig,
    data: &Path,
    builder: bool,
) -> Result<Option<Tokenizer>, TrainError> {
    let token_file = data.is_dir() || data.extension().is_some_and(|e| e == "bin");
    match cfg.tokenizer.as_str() {
        // A token file carries ids already. nanoGPT's directory may say its vocabulary in
        // meta.pkl (character-level data); otherwise the vocabulary is vocab_size.
        "char" if data.is_dir() => Ok(cohort_data::nanogpt_tokenizer(data)?),
        "char" | "bpe" if token_file => Ok(None),
        kind @ ("char" | "bpe") => {
            let cache = tokenizer_cache(&cache_dir(cfg, data)?, data, kind, cfg.vocab_size);
            if !builder {
                return Tokenizer::from_file(&cache)
                    .map(Some)
                    .map_err(TrainError::from);
            }
            let tok = if kind == "char" {
                Tokenizer::char_level_from_files(&[data])
            } else {
                Tokenizer::train_bpe(&[data], cfg.vocab_size, &["<|endoftext|>"])
            }?;
            tok.save(&cache)?;
            Ok(Some(tok))
        }
        path => Tokenizer::from_file(tokenizer_file(Path::new(path)))
            .map(Some)
            .map_err(TrainError::from),
    }
}

/// A `--tokenizer PATH`'s tokenizer.json: the file, or the one inside a model directory.
fn tokenizer_file(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join(cohort_tokenizer::TOKENIZER_FILE)
    } else {
        path.to_path_buf()
    }
}

/// The directory a `--tokenizer PATH` names the model of (None for the built-in tokenizers).
fn tokenizer_dir(cfg: &TrainConfig) -> Option<&Path> {
    if matches!(cfg.tokenizer.as_str(), "char" | "bpe") {
        return None;
    }
    let path = Path::new(&cfg.tokenizer);
    Some(if path.is_dir() {
        path
    } else {
        path.parent().unwrap_or(Path::new("."))
    })
}

/// The chat template beside `--tokenizer` as written, with its end-of-turn token, for
/// checkpoints to carry; None without one.
pub fn chat_template_source(
    cfg: &TrainConfig,
) -> Result<Option<(serde_json::Value, Option<String>)>, TrainError> {
    let Some(dir) = tokenizer_dir(cfg) else {
        return Ok(None);
    };
    ChatTemplate::source_in_dir(dir).map_err(|source| TrainError::ChatTemplate {
        path: cfg.tokenizer.clone(),
        source,
    })
}

/// What the model directory a run starts from says of its special tokens, for checkpoints to
/// carry: tokenizer_config.json beside `--tokenizer` (the `--init-from` directory's unless
/// another is named), and generation_config.json of the `--init-from` directory (else beside
/// `--tokenizer`). None for a file that is absent; a file that is not JSON is an error naming it.
pub fn model_dir_files(
    cfg: &TrainConfig,
) -> Result<(Option<serde_json::Value>, Option<serde_json::Value>), TrainError> {
    let read = |path: PathBuf| -> Result<Option<serde_json::Value>, TrainError> {
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(TrainError::InitFrom {
                    reason: format!("cannot read it: {e}"),
                    path,
                })
            }
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| TrainError::InitFrom {
                reason: format!("not JSON: {e}"),
                path,
            })
    };
    let tokenizer_dir = tokenizer_dir(cfg);
    let tokenizer_config = match tokenizer_dir {
        Some(dir) => read(dir.join("tokenizer_config.json"))?,
        None => None,
    };
    // The model's directory, or the checkpoint a root's `latest` names.
    let init = (cfg.init_from.as_deref())
        .map(|d| cohort_gpt::checkpoint::resolve(d).unwrap_or_else(|_| d.to_path_buf()));
    let mut generation = None;
    for dir in init.as_deref().into_iter().chain(tokenizer_dir) {
        generation = read(dir.join("generation_config.json"))?;
        if generation.is_some() {
            break;
        }
    }
    Ok((tokenizer_config, generation))
}

/// The chat template beside a `--tokenizer PATH` (the model directory's tokenizer_config.json or
/// chat_template.jinja), which renders JSONL conversations; None for the built-in tokenizers or
/// a directory without one.
fn chat_template(cfg: &TrainConfig) -> Result<Option<Arc<ChatTemplate>>, TrainError> {
    let Some(dir) = tokenizer_dir(cfg) else {
        return Ok(None);
    };
    match ChatTemplate::from_dir(dir) {
        Ok(t) => Ok(Some(Arc::new(t))),
        Err(ChatError::NoTemplate { .. }) => Ok(None),
        Err(source) => Err(TrainError::ChatTemplate {
            path: cfg.tokenizer.clone(),
            source,
        }),
    }
}

impl FileData {
    pub(crate) fn open(cfg: &TrainConfig, builder: bool) -> Result<FileData, TrainError> {
        let data = Path::new(&cfg.data);
        let tokenizer = tokenizer(cfg, data, builder)?;
        let vocab_size = tokenizer
            .as_ref()
            .map_or(cfg.vocab_size, |t| t.vocab_size());
        let opts = CorpusOptions {
            seq_len: cfg.seq_len,
            // A document must fit the model's context: seq_len positions, one token more.
            max_len: cfg.seq_len + 1,
            // Token files' ids are checked against the vocabulary: the tokenizer's (meta.pkl's
            // for nanoGPT's directory), else vocab_size.
            vocab_size: Some(vocab_size),
            cache_dir: Some(cache_dir(cfg, data)?),
            chat: chat_template(cfg)?,
            ..CorpusOptions::default()
        };
        let corpus = Corpus::open(data, tokenizer.as_ref(), &opts)?;
        let describe = format!(
            "{} ({} tokenizer, vocab {vocab_size})",
            corpus.describe(),
            tokenizer.as_ref().map_or("no", |t| t.kind()),
        );
        let (train, val, seq_len, documents): (Box<dyn Samples>, Box<dyn Samples>, _, _) =
            match corpus {
                Corpus::Stream { train, val } => {
                    let seq_len = train.seq_len();
                    (Box::new(train), Box::new(val), seq_len, false)
                }
                Corpus::Documents { train, val } => {
                    (Box::new(train), Box::new(val), cfg.seq_len, true)
                }
            };
        Ok(FileData {
            train,
            val,
            seq_len,
            documents,
            tokenizer,
            vocab_size,
            describe,
        })
    }
}

impl FileData {
    fn split(&self, split: Split) -> &dyn Samples {
        match split {
            Split::Train => &*self.train,
            Split::Val => &*self.val,
        }
    }
}

impl Dataset for FileData {
    fn len(&self, split: Split) -> usize {
        self.split(split).len()
    }
    fn seq_len(&self) -> usize {
        self.seq_len
    }
    fn sample_len(&self, split: Split, index: usize) -> usize {
        self.split(split).sample_len(index)
    }
    fn variable_length(&self) -> bool {
        self.documents
    }
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }
    fn read(&self, split: Split, index: usize, tokens: &mut [u32]) {
        self.split(split).read(index, tokens)
    }
    fn read_loss_mask(&self, split: Split, index: usize, out: &mut [u8]) -> bool {
        self.split(split).read_loss_mask(index, out)
    }
    fn loss_floor(&self) -> Option<f64> {
        None
    }
    fn describe(&self) -> String {
        self.describe.clone()
    }
    fn tokenizer_json(&self) -> Option<String> {
        self.tokenizer.as_ref().and_then(|t| t.to_json().ok())
    }
}

/// The data set `cfg.data` names: the built-in ones, or files (rank 0 prepares them first).
pub fn build(cfg: &TrainConfig, pg: &ProcessGroup) -> Result<Box<dyn Dataset>, TrainError> {
    if matches!(cfg.data.as_str(), "markov" | "random") {
        return build_dataset(cfg);
    }
    let data = if pg.rank() == 0 {
        let data = FileData::open(cfg, true);
        // Release the other ranks even when rank 0 failed; they then fail on their own.
        pg.barrier()
            .map_err(TrainError::comm("data preparation barrier"))?;
        data?
    } else {
        pg.barrier()
            .map_err(TrainError::comm("data preparation barrier"))?;
        FileData::open(cfg, false)?
    };
    Ok(Box::new(data))
}

/// Builds the data set a config asks for.
pub fn build_dataset(cfg: &TrainConfig) -> Result<Box<dyn Dataset>, TrainError> {
    Ok(match cfg.data.as_str() {
        "random" => Box::new(RandomTokens {
            vocab_size: cfg.vocab_size,
            seq_len: cfg.seq_len,
            num_samples: cfg.train_sequences,
            val_samples: cfg.val_sequences,
            seed: cfg.seed,
        }),
        _ => Box::new(MarkovCorpus::new(MarkovSpec {
            vocab_size: cfg.markov_vocab,
            order: cfg.markov_order,
            branching: cfg.markov_branching,
            seed: cfg.seed,
            seq_len: cfg.seq_len,
            train_sequences: cfg.train_sequences,
            val_sequences: cfg.val_sequences,
        })?),
    })
}
