//! [`Corpus`]: any training data path turned into memory-mapped token files and a train/val split.
//!
//! Accepted inputs (`cohort train --data PATH`):
//! - a directory with nanoGPT's `train.bin` and `val.bin` (uint16, used as they are);
//! - a single token file (`.bin`): the last `val_fraction` of its tokens is the validation split;
//! - a JSONL file (`.jsonl`): one document per line, text in `text_field`, streamed line by line
//!   and tokenized once into a token file plus a document index (u64 LE offsets); a line with
//!   `messages` instead is a conversation, rendered with `chat` (the model's chat template) and
//!   trained on the assistant's tokens only (a loss mask file beside the tokens, see
//!   [`chat`](crate::chat));
//! - any other file: UTF-8 text, tokenized once in 1 MiB chunks (cut at line breaks) into a token
//!   file; the last `val_fraction` of the tokens is the validation split (nanoGPT's split).
//!
//! Tokenized files are cached beside the source (or in `cache_dir`; for a source in a
//! read-only directory, in the user's cache directory) under a name that carries a
//! hash of the tokenizer, with a sidecar `.meta.json` recording the source's size and mtime, so
//! they are rebuilt when either changes. This module never holds a whole corpus in memory.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use cohort_tokenizer::{ChatTemplate, Tokenizer, Utf8Chunks};
use serde::{Deserialize, Serialize};

use crate::dataset::{Documents, Samples, TokenWindows};
use crate::token_file::{TokenFile, TokenWriter};
use crate::DataError;

/// How to read a corpus.
#[derive(Debug, Clone)]
pub struct CorpusOptions {
    /// Tokens per training sequence (the model's context for token streams).
    pub seq_len: usize,
    /// Most tokens in one document: the model's context plus one, since the last token is only
    /// a target; longer JSONL documents are an error.
    pub max_len: usize,
    /// Share of a single file's tokens (or documents) held out for validation.
    pub val_fraction: f64,
    /// JSONL: the field holding the text.
    pub text_field: String,
    /// Where tokenized caches go (None: beside the source).
    pub cache_dir: Option<PathBuf>,
    /// Vocabulary of token files when no tokenizer is given (ids at or above are errors).
    pub vocab_size: Option<usize>,
    /// The chat template JSONL conversations (`{"messages": [...]}`) are rendered with.
    pub chat: Option<Arc<ChatTemplate>>,
}

impl Default for CorpusOptions {
    fn default() -> Self {
        CorpusOptions {
            seq_len: 64,
            max_len: 1024,
            val_fraction: 0.1,
            text_field: "text".into(),
            cache_dir: None,
            vocab_size: None,
            chat: None,
        }
    }
}

/// Token data split for training: fixed windows over a stream, or whole documents.
#[derive(Debug)]
pub enum Corpus {
    /// A token stream (text, `.bin`, nanoGPT's directory): fixed-length windows.
    Stream {
        /// Windows of the training split (stride 1, as nanoGPT's random offsets).
        train: TokenWindows,
        /// Non-overlapping windows of the validation split.
        val: TokenWindows,
    },
    /// Documents (JSONL): one sample per document, variable length.
    Documents {
        /// Training documents.
        train: Documents,
        /// Validation documents.
        val: Documents,
    },
}

impl Corpus {
    /// Opens `path` as described in the module docs. `tokenizer` is needed for text and JSONL;
    /// its vocabulary (else `opts.vocab_size`) is what every token file is checked against.
    pub fn open(
        path: &Path,
        tokenizer: Option<&Tokenizer>,
        opts: &CorpusOptions,
    ) -> Result<Corpus, DataError> {
        if !(0.0..1.0).contains(&opts.val_fraction) {
            return Err(DataError::Config {
                what: "val_fraction",
                reason: format!("{} is not in [0, 1)", opts.val_fraction),
            });
        }
        if opts.seq_len < 2 {
            return Err(DataError::Config {
                what: "seq_len",
                reason: format!("{} is below 2", opts.seq_len),
            });
        }
        if path.is_dir() {
            let missing: Vec<&str> = ["train.bin", "val.bin"]
                .into_iter()
                .filter(|f| !path.join(f).is_file())
                .collect();
            if !missing.is_empty() {
                return Err(DataError::NotADataDir {
                    dir: path.to_path_buf(),
                    missing: missing.join(" or "),
                });
            }
        }
        let vocab = match (tokenizer, opts.vocab_size) {
            (Some(t), _) => t.vocab_size(),
            (None, Some(v)) => v,
            (None, None) => {
                return Err(DataError::Config {
                    what: "vocab_size",
                    reason: format!(
                        "{}: a token file needs a tokenizer or a vocab_size",
                        path.display()
                    ),
                })
            }
        };
        let needs_tokenizer = || DataError::Config {
            what: "tokenizer",
            reason: format!("{} is text; it needs a tokenizer", path.display()),
        };
        let t = opts.seq_len;
        if path.is_dir() {
            let train = Arc::new(TokenFile::open(path.join("train.bin"), vocab)?);
            let val = Arc::new(TokenFile::open(path.join("val.bin"), vocab)?);
            let (n_train, n_val) = (train.len(), val.len());
            return Ok(Corpus::Stream {
                train: TokenWindows::new(train, 0..n_train, t, 1, "train")?,
                val: TokenWindows::new(val, 0..n_val, t, t, "val")?,
            });
        }
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        match ext {
            "bin" => {
                let tokens = Arc::new(TokenFile::open(path, vocab)?);
                stream_split(tokens, opts)
            }
            "jsonl" => {
                let tokenizer = tokenizer.ok_or_else(needs_tokenizer)?;
                let (tok_path, idx_path) = tokenize_jsonl(path, tokenizer, opts)?;
                let tokens = Arc::new(TokenFile::open(&tok_path, vocab)?);
                let mask_path = tok_path.with_extension("mask");
                let mask = if mask_path.is_file() {
                    Some(crate::chat::open_mask(&mask_path, tokens.len())?)
                } else {
                    None
                };
                let offsets = read_index(&idx_path, tokens.len())?;
                let docs = offsets.len() - 1;
                let n_train = docs - (docs as f64 * opts.val_fraction) as usize;
                if n_train == 0 {
                    return Err(DataError::Empty { path: path.into() });
                }
                let val_offsets = offsets[n_train..].to_vec();
                let mut train_offsets = offsets;
                train_offsets.truncate(n_train + 1);
                Ok(Corpus::Documents {
                    train: Documents::new(tokens.clone(), train_offsets).with_mask(mask.clone()),
                    val: Documents::new(tokens, val_offsets).with_mask(mask),
                })
            }
            _ => {
                let tokenizer = tokenizer.ok_or_else(needs_tokenizer)?;
                let tok_path = tokenize_text(path, tokenizer, opts)?;
                let tokens = Arc::new(TokenFile::open(&tok_path, vocab)?);
                stream_split(tokens, opts)
            }
        }
    }

    /// One line for the log.
    pub fn describe(&self) -> String {
        match self {
            Corpus::Stream { train, val } => format!(
                "{}: {} train tokens ({} windows of {}), {} val tokens ({} windows)",
                train.path().display(),
                train.tokens(),
                train.len(),
                train.seq_len(),
                val.tokens(),
                val.len()
            ),
            Corpus::Documents { train, val } => format!(
                "{}: {} train documents, {} val documents",
                train.path().display(),
                train.len(),
                val.len()
            ),
        }
    }
}

fn stream_split(tokens: Arc<TokenFile>, opts: &CorpusOptions) -> Result<Corpus, DataError> {
    let n = tokens.len();
    let split = n - (n as f64 * opts.val_fraction) as usize;
    let t = opts.seq_len;
    Ok(Corpus::Stream {
        train: TokenWindows::new(tokens.clone(), 0..split, t, 1, "train")?,
        val: TokenWindows::new(tokens, split..n, t, t, "val")?,
    })
}

/// What a cache was built from; a mismatch rebuilds it.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct CacheMeta {
    source: PathBuf,
    source_len: u64,
    source_mtime_ns: u128,
    tokenizer: String,
    vocab_size: usize,
    tokens: u64,
    documents: Option<u64>,
    max_len: Option<usize>,
    /// Whether a loss mask file was written (a JSONL file with conversations).
    #[serde(default)]
    loss_mask: bool,
}

fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The cache path for `source` (extension `ext`) and the metadata it must match: in
/// `opts.cache_dir`, else a valid cache beside the source, else in [`default_cache_dir`].
fn cache_for(
    source: &Path,
    tokenizer: &Tokenizer,
    opts: &CorpusOptions,
    ext: &str,
) -> Result<(PathBuf, CacheMeta), DataError> {
    let stat = std::fs::metadata(source).map_err(DataError::io("open", source))?;
    if stat.len() == 0 {
        return Err(DataError::Empty {
            path: source.into(),
        });
    }
    let json = tokenizer
        .to_json()
        .map_err(|e| DataError::tokenizer(source, e))?;
    // Conversations render with the template: it is part of what the cache was built from.
    let mut key = json.into_bytes();
    if let Some(chat) = &opts.chat {
        key.extend_from_slice(chat.fingerprint().as_bytes());
    }
    let hash = format!("{:016x}", fnv64(&key));
    let name = source
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "data".into());
    let mtime = stat
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let meta = CacheMeta {
        source: source.into(),
        source_len: stat.len(),
        source_mtime_ns: mtime,
        tokenizer: hash.clone(),
        vocab_size: tokenizer.vocab_size(),
        tokens: 0,
        documents: None,
        max_len: None,
        loss_mask: false,
    };
    let file = format!("{name}.{}.{ext}", &hash[..12]);
    if let Some(d) = &opts.cache_dir {
        std::fs::create_dir_all(d).map_err(DataError::io("create", d))?;
        return Ok((d.join(file), meta));
    }
    let beside = source.parent().unwrap_or(Path::new(".")).join(&file);
    if cache_valid(&beside, &meta) {
        return Ok((beside, meta));
    }
    let dir = default_cache_dir(source);
    std::fs::create_dir_all(&dir).map_err(DataError::io("create", &dir))?;
    Ok((dir.join(file), meta))
}

/// Where the caches built from `source` go by default: beside it when its
/// directory can be written, else a directory of their own in the user's
/// cache (see [`user_cache_dir`]), named after the source and a hash of its
/// absolute path, so that data in a read-only place still trains.
pub fn default_cache_dir(source: &Path) -> PathBuf {
    let parent = source.parent().unwrap_or(Path::new("."));
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    if writable(parent) {
        return parent.to_path_buf();
    }
    let name = source
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "data".into());
    let abs = std::fs::canonicalize(source).unwrap_or_else(|_| source.to_path_buf());
    let tag = fnv64(abs.as_os_str().as_encoded_bytes()) as u32;
    user_cache_dir().join(format!("{name}-{tag:08x}"))
}

/// Whether this process can create files in `dir` (tried, not guessed from
/// permission bits: a read-only mount refuses even root).
fn writable(dir: &Path) -> bool {
    let probe = dir.join(format!(".cohort-write-test-{}", std::process::id()));
    let ok = std::fs::File::create(&probe).is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

/// Where caches go when the data's own directory is read-only:
/// `$XDG_CACHE_HOME/cohort/tokens`, else `~/.cache/cohort/tokens`, else the
/// temp directory's `cohort-tokens`.
fn user_cache_dir() -> PathBuf {
    let var = |name| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = var("XDG_CACHE_HOME") {
        return d.join("cohort").join("tokens");
    }
    if let Some(h) = var("HOME") {
        return h.join(".cache").join("cohort").join("tokens");
    }
    std::env::temp_dir().join("cohort-tokens")
}

fn meta_path(cache: &Path) -> PathBuf {
    let mut p = cache.as_os_str().to_owned();
    p.push(".meta.json");
    PathBuf::from(p)
}

/// Whether `cache` was built from the same source and tokenizer.
fn cache_valid(cache: &Path, want: &CacheMeta) -> bool {
    let Ok(bytes) = std::fs::read(meta_path(cache)) else {
        return false;
    };
    let Ok(have) = serde_json::from_slice::<CacheMeta>(&bytes) else {
        return false;
    };
    cache.is_file()
        && have.source_len == want.source_len
        && have.source_mtime_ns == want.source_mtime_ns
        && have.tokenizer == want.tokenizer
        && have.max_len == want.max_len
        && (!have.loss_mask || cache.with_extension("mask").is_file())
}

fn write_meta(cache: &Path, meta: &CacheMeta) -> Result<(), DataError> {
    let p = meta_path(cache);
    let json = serde_json::to_vec_pretty(meta).expect("plain struct serializes");
    std::fs::write(&p, json).map_err(DataError::io("write", &p))
}

/// Tokenizes the UTF-8 text file `source` once (cached); returns the token file.
pub fn tokenize_text(
    source: &Path,
    tokenizer: &Tokenizer,
    opts: &CorpusOptions,
) -> Result<PathBuf, DataError> {
    let (cache, mut meta) = cache_for(source, tokenizer, opts, "tok")?;
    if cache_valid(&cache, &meta) {
        return Ok(cache);
    }
    let mut chunks =
        Utf8Chunks::open(source, 1 << 20).map_err(|e| DataError::tokenizer(source, e))?;
    let mut out = TokenWriter::create(&cache, tokenizer.vocab_size())?;
    while let Some((text, offset)) = chunks
        .next_chunk()
        .map_err(|e| DataError::tokenizer(source, e))?
    {
        let ids = tokenizer.encode(text).map_err(|e| match e {
            // Report the character's position in the file, not in the chunk.
            cohort_tokenizer::TokenizerError::UnknownChar { ch, offset: at } => {
                DataError::UnknownChar {
                    path: source.into(),
                    ch,
                    offset: offset + at as u64,
                }
            }
            e => DataError::tokenizer(source, e),
        })?;
        out.write(&ids)?;
    }
    meta.tokens = out.count();
    let cache = out.finish()?;
    write_meta(&cache, &meta)?;
    Ok(cache)
}

/// Tokenizes the JSONL file `source` once (cached), one document per line, streaming; returns
/// the token file and the document index.
pub fn tokenize_jsonl(
    source: &Path,
    tokenizer: &Tokenizer,
    opts: &CorpusOptions,
) -> Result<(PathBuf, PathBuf), DataError> {
    let (cache, mut meta) = cache_for(source, tokenizer, opts, "tok")?;
    meta.max_len = Some(opts.max_len);
    let index = cache.with_extension("idx");
    if cache_valid(&cache, &meta) && index.is_file() {
        return Ok((cache, index));
    }
    let file = std::fs::File::open(source).map_err(DataError::io("open", source))?;
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let mut out = TokenWriter::create(&cache, tokenizer.vocab_size())?;
    let mut masks = crate::chat::MaskWriter::new(cache.with_extension("mask"));
    let mut offsets: Vec<u8> = Vec::new();
    let mut line_buf = Vec::new();
    let (mut line, mut byte) = (0u64, 0u64);
    let mut docs = 0u64;
    loop {
        line_buf.clear();
        let n = reader
            .read_until(b'\n', &mut line_buf)
            .map_err(DataError::io("read", source))?;
        if n == 0 {
            break;
        }
        line += 1;
        let text = std::str::from_utf8(&line_buf).map_err(|e| DataError::NotUtf8 {
            path: source.into(),
            offset: byte + e.valid_up_to() as u64,
        })?;
        byte += n as u64;
        if text.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| DataError::Json {
            path: source.into(),
            line,
            reason,
        };
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let (ids, mask) = if value.get("messages").is_some() {
            let (ids, mask) =
                crate::chat::encode_line(opts.chat.as_deref(), tokenizer, text).map_err(bad)?;
            (ids, Some(mask))
        } else {
            let doc = value
                .get(&opts.text_field)
                .ok_or_else(|| bad(format!("no \"{}\" field", opts.text_field)))?
                .as_str()
                .ok_or_else(|| bad(format!("\"{}\" is not a string", opts.text_field)))?;
            (tokenizer.encode(doc).map_err(|e| bad(e.to_string()))?, None)
        };
        if ids.len() > opts.max_len {
            return Err(DataError::TooLong {
                path: source.into(),
                line,
                len: ids.len(),
                max: opts.max_len,
            });
        }
        if ids.is_empty() {
            continue;
        }
        offsets.extend_from_slice(&out.count().to_le_bytes());
        masks.write(out.count(), mask.as_deref(), ids.len())?;
        out.write(&ids)?;
        docs += 1;
    }
    if docs == 0 {
        return Err(DataError::Empty {
            path: source.into(),
        });
    }
    offsets.extend_from_slice(&out.count().to_le_bytes());
    meta.tokens = out.count();
    meta.documents = Some(docs);
    meta.loss_mask = masks.finish()?;
    let cache = out.finish()?;
    let mut f = std::fs::File::create(&index).map_err(DataError::io("create", &index))?;
    f.write_all(&offsets)
        .map_err(DataError::io("write", &index))?;
    write_meta(&cache, &meta)?;
    Ok((cache, index))
}

/// Reads a document index: n+1 increasing u64 offsets ending at the token count.
fn read_index(path: &Path, tokens: usize) -> Result<Vec<u64>, DataError> {
    let bytes = std::fs::read(path).map_err(DataError::io("read", path))?;
    if bytes.len() % 8 != 0 || bytes.len() < 16 {
        return Err(DataError::Truncated {
            path: path.into(),
            len: bytes.len() as u64,
            reason: "is not at least two whole u64 offsets",
        });
    }
    let offsets: Vec<u64> = bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let ok = offsets.windows(2).all(|w| w[0] < w[1]) && *offsets.last().unwrap() == tokens as u64;
    if !ok {
        return Err(DataError::BadHeader {
            path: path.into(),
            reason: format!("document offsets are not increasing up to {tokens} tokens"),
        });
    }
    Ok(offsets)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token_file::write_token_file;

    fn opts(seq_len: usize) -> CorpusOptions {
        CorpusOptions {
            seq_len,
            max_len: 16,
            ..CorpusOptions::default()
        }
    }

    #[test]
    fn text_is_tokenized_once_split_like_nanogpt_and_cached() {
        let dir = tempfile::tempdir().unwrap();
        let text: String = (0..200)
            .map(|i| format!("line {i}: to be or not to be\n"))
            .collect();
        let src = dir.path().join("input.txt");
        std::fs::write(&src, &text).unwrap();
        let tok = Tokenizer::char_level(text.chars());
        let Corpus::Stream { train, val } = Corpus::open(&src, Some(&tok), &opts(8)).unwrap()
        else {
            panic!("a text file is a stream")
        };
        let n = text.chars().count();
        assert_eq!(train.tokens() + val.tokens(), n);
        assert_eq!(val.tokens(), (n as f64 * 0.1) as usize);
        // 8 positions: a window of 9 tokens.
        let mut out = vec![0; 9];
        train.read(5, &mut out);
        assert_eq!(tok.decode(&out).unwrap(), &text[5..14]);
        // Cached: a second open reuses the file (same mtime), a new tokenizer rebuilds.
        let cached: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        let mtime = |p: &Path| std::fs::metadata(p).unwrap().modified().unwrap();
        let cache = train.path().to_path_buf();
        let before = mtime(&cache);
        Corpus::open(&src, Some(&tok), &opts(8)).unwrap();
        assert_eq!(mtime(&cache), before);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), cached.len());
        let mut bigger = tok.clone();
        bigger.add_special_tokens(&["<|endoftext|>"]).unwrap();
        let Corpus::Stream { train: t2, .. } = Corpus::open(&src, Some(&bigger), &opts(8)).unwrap()
        else {
            panic!()
        };
        assert_ne!(t2.path(), cache.as_path());
        // An out dir instead of beside the source.
        let o = CorpusOptions {
            cache_dir: Some(dir.path().join("cache")),
            ..opts(8)
        };
        let Corpus::Stream { train: t3, .. } = Corpus::open(&src, Some(&tok), &o).unwrap() else {
            panic!()
        };
        assert!(t3.path().starts_with(dir.path().join("cache")));
    }

    #[test]
    fn nanogpt_directory_and_single_bin_files() {
        let dir = tempfile::tempdir().unwrap();
        let ids: Vec<u32> = (0..500).map(|i| i % 65).collect();
        write_token_file(dir.path().join("train.bin"), &ids, 65).unwrap();
        write_token_file(dir.path().join("val.bin"), &ids[..100], 65).unwrap();
        let tok = Tokenizer::char_level((0..65u8).map(|b| (b'0' + b) as char));
        let Corpus::Stream { train, val } =
            Corpus::open(dir.path(), Some(&tok), &opts(10)).unwrap()
        else {
            panic!()
        };
        // Validation windows of 11 tokens, 10 apart: (100 - 11) / 10 + 1.
        assert_eq!((train.tokens(), val.tokens(), val.len()), (500, 100, 9));
        let Corpus::Stream { train, .. } =
            Corpus::open(&dir.path().join("train.bin"), Some(&tok), &opts(10)).unwrap()
        else {
            panic!()
        };
        assert_eq!(train.tokens(), 450);
        let ids_only = CorpusOptions {
            vocab_size: Some(65),
            ..opts(10)
        };
        assert!(Corpus::open(dir.path(), None, &ids_only).is_ok());
        let e = Corpus::open(dir.path(), None, &opts(10))
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs a tokenizer or a vocab_size"), "{e}");
        let small = Tokenizer::char_level("ab".chars());
        let e = Corpus::open(dir.path(), Some(&small), &opts(10))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("train.bin") && e.contains("token 2 is id 2"),
            "{e}"
        );
    }

    /// r43: a directory without nanoGPT's files says what a data directory holds.
    #[test]
    fn a_directory_without_token_files_says_what_it_must_hold() {
        let dir = tempfile::tempdir().unwrap();
        let e = Corpus::open(dir.path(), None, &opts(10))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not a data directory: it has no train.bin or val.bin")
                && e.contains("a data directory holds nanoGPT's train.bin and val.bin"),
            "{e}"
        );
    }

    #[test]
    fn jsonl_streams_documents() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("d.jsonl");
        let mut body = String::new();
        for i in 0..40 {
            body.push_str(&format!(
                "{{\"id\": {i}, \"text\": \"{}\"}}\n",
                "ab".repeat(1 + i % 5)
            ));
            if i == 3 {
                body.push('\n');
            }
        }
        std::fs::write(&src, &body).unwrap();
        let tok = Tokenizer::char_level("ab".chars());
        let Corpus::Documents { train, val } = Corpus::open(&src, Some(&tok), &opts(8)).unwrap()
        else {
            panic!()
        };
        assert_eq!((train.len(), val.len()), (36, 4));
        assert_eq!(train.sample_len(2), 6);
        let mut out = vec![0; 6];
        train.read(2, &mut out);
        assert_eq!(tok.decode(&out).unwrap(), "ababab");
        assert_eq!(val.sample_len(0), 2 * (1 + 36 % 5));
    }

    #[test]
    fn bad_inputs_name_file_and_position() {
        let dir = tempfile::tempdir().unwrap();
        let tok = Tokenizer::char_level("abc{}\":text \n".chars());
        let open = |name: &str, bytes: &[u8]| {
            let p = dir.path().join(name);
            std::fs::write(&p, bytes).unwrap();
            Corpus::open(&p, Some(&tok), &opts(4))
                .unwrap_err()
                .to_string()
        };
        let e = open("empty.txt", b"");
        assert!(e.contains("empty.txt") && e.contains("empty"), "{e}");
        let e = open("latin1.txt", b"abc\nab\xe9c\n");
        assert!(
            e.contains("latin1.txt") && e.contains("byte offset 6"),
            "{e}"
        );
        let e = open("unknown.txt", "abc\nabz\n".as_bytes());
        assert!(
            e.contains("unknown.txt") && e.contains("'z' at byte offset 6"),
            "{e}"
        );
        let e = open("short.txt", b"ab");
        assert!(e.contains("2 tokens, need at least 5"), "{e}");
        let e = open(
            "long.jsonl",
            b"{\"text\": \"abc\"}\n{\"text\": \"abcabcabcabcabcabc\"}\n",
        );
        assert!(
            e.contains("long.jsonl:2") && e.contains("18 tokens") && e.contains("longer than 16"),
            "{e}"
        );
        let e = open("broken.jsonl", b"{\"text\": \"abc\"}\n{\"text\": \"ab\n");
        assert!(
            e.contains("broken.jsonl:2") && e.contains("invalid JSON"),
            "{e}"
        );
        let e = open("field.jsonl", b"{\"txt\": \"abc\"}\n");
        assert!(
            e.contains("field.jsonl:1") && e.contains("no \"text\" field"),
            "{e}"
        );
        let e = open(
            "bad.jsonl",
            b"{\"text\": \"abc\"}\n{\"text\": \"a\xffb\"}\n",
        );
        assert!(
            e.contains("bad.jsonl") && e.contains("byte offset 27"),
            "{e}"
        );
        let e = open("odd.bin", &[1, 0, 2]);
        assert!(e.contains("odd.bin") && e.contains("truncated"), "{e}");
        // Failed tokenizations leave no temp files beside the data.
        let leftovers: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        let e = Corpus::open(&dir.path().join("missing.txt"), Some(&tok), &opts(4))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("missing.txt") && e.contains("No such file"),
            "{e}"
        );
    }
}
