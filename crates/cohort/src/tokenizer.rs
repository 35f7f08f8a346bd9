//! `cohort tokenizer`: build a tokenizer.json from a corpus, add (special) tokens to one, or
//! encode and decode text with one. Wiring only: parse flags, call `cohort-tokenizer`, print.

use std::path::PathBuf;

use anyhow::Context;
use cohort_tokenizer::Tokenizer;

/// Build or edit a tokenizer.json.
#[derive(clap::Subcommand, Debug)]
pub enum TokenizerCmd {
    /// Build a character-level or BPE tokenizer from UTF-8 corpus files.
    Train(TrainArgs),
    /// Add normal and special tokens (Hugging Face's add_tokens / add_special_tokens); prints how
    /// many were new.
    AddTokens(AddArgs),
    /// Print the token ids of a text (`tokenizer.encode(text).ids`), space-separated.
    Encode(EncodeArgs),
    /// Print the text of token ids (`tokenizer.decode(ids)`).
    Decode(DecodeArgs),
}

/// `cohort tokenizer encode`.
#[derive(clap::Args, Debug)]
pub struct EncodeArgs {
    /// A tokenizer.json, or a directory holding one (a saved model).
    #[arg(long)]
    tokenizer: PathBuf,
    /// The text (default: standard input, whole).
    #[arg(long)]
    text: Option<String>,
    /// A JSON array instead of space-separated ids.
    #[arg(long)]
    json: bool,
}

/// `cohort tokenizer decode`.
#[derive(clap::Args, Debug)]
pub struct DecodeArgs {
    /// A tokenizer.json, or a directory holding one (a saved model).
    #[arg(long)]
    tokenizer: PathBuf,
    /// The ids, separated by spaces or commas (default: standard input).
    #[arg(long)]
    ids: Option<String>,
}

/// The tokenizer at `path`: the file itself, or `tokenizer.json` inside a directory.
fn open(path: &std::path::Path) -> anyhow::Result<Tokenizer> {
    let file = if path.is_dir() {
        path.join("tokenizer.json")
    } else {
        path.to_path_buf()
    };
    Ok(Tokenizer::from_file(&file)?)
}

/// `given`, or all of standard input.
fn text_or_stdin(given: Option<String>) -> anyhow::Result<String> {
    match given {
        Some(t) => Ok(t),
        None => {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
                .context("reading standard input")?;
            Ok(s)
        }
    }
}

/// Ids separated by whitespace or commas; each must be below `vocab`.
fn parse_ids(text: &str, vocab: usize) -> anyhow::Result<Vec<u32>> {
    text.split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']')
        .filter(|s| !s.is_empty())
        .map(|s| {
            let id: u32 = s
                .parse()
                .with_context(|| format!("{s:?} is not a token id"))?;
            anyhow::ensure!(
                (id as usize) < vocab,
                "token id {id} is outside the vocabulary (size {vocab})"
            );
            Ok(id)
        })
        .collect()
}

/// `cohort tokenizer train`.
#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// Corpus files (UTF-8 text).
    #[arg(long, required = true, num_args = 1..)]
    corpus: Vec<PathBuf>,
    /// `char` (vocabulary = the corpus's characters) or `bpe` (byte-level, GPT-2's scheme).
    #[arg(long, default_value = "char")]
    kind: String,
    /// BPE vocabulary size.
    #[arg(long, default_value_t = 4096)]
    vocab_size: usize,
    /// Special tokens given the first ids (BPE), comma-separated.
    #[arg(long, value_delimiter = ',')]
    special: Vec<String>,
    /// Where to write tokenizer.json.
    #[arg(long)]
    out: PathBuf,
}

/// `cohort tokenizer add-tokens`.
#[derive(clap::Args, Debug)]
pub struct AddArgs {
    /// The tokenizer.json to extend.
    #[arg(long)]
    tokenizer: PathBuf,
    /// Normal tokens, comma-separated.
    #[arg(long, value_delimiter = ',')]
    tokens: Vec<String>,
    /// Special tokens (never split or normalised), comma-separated.
    #[arg(long, value_delimiter = ',')]
    special: Vec<String>,
    /// Where to write the result (may be the input).
    #[arg(long)]
    out: PathBuf,
}

pub fn main(cmd: TokenizerCmd) -> anyhow::Result<()> {
    match cmd {
        TokenizerCmd::Train(a) => {
            let tok = match a.kind.as_str() {
                "char" => Tokenizer::char_level_from_files(&a.corpus)?,
                "bpe" => {
                    let special: Vec<&str> = a.special.iter().map(String::as_str).collect();
                    Tokenizer::train_bpe(&a.corpus, a.vocab_size, &special)?
                }
                other => anyhow::bail!("--kind {other}: expected char or bpe"),
            };
            tok.save(&a.out)?;
            println!(
                "{} tokenizer, vocab size {}: {}",
                tok.kind(),
                tok.vocab_size(),
                a.out.display()
            );
        }
        TokenizerCmd::AddTokens(a) => {
            let mut tok = Tokenizer::from_file(&a.tokenizer)?;
            let before = tok.vocab_size();
            let normal: Vec<&str> = a.tokens.iter().map(String::as_str).collect();
            let special: Vec<&str> = a.special.iter().map(String::as_str).collect();
            let n = tok.add_tokens(&normal).context("adding tokens")?;
            let s = tok
                .add_special_tokens(&special)
                .context("adding special tokens")?;
            tok.save(&a.out)?;
            println!(
                "added {} tokens ({n} normal, {s} special); vocab size {before} -> {}: {}",
                n + s,
                tok.vocab_size(),
                a.out.display()
            );
        }
        TokenizerCmd::Encode(a) => {
            let tok = open(&a.tokenizer)?;
            let ids = tok.encode(&text_or_stdin(a.text)?)?;
            if a.json {
                println!("{}", serde_json::to_string(&ids)?);
            } else {
                let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
                println!("{}", ids.join(" "));
            }
        }
        TokenizerCmd::Decode(a) => {
            let tok = open(&a.tokenizer)?;
            let ids = parse_ids(&text_or_stdin(a.ids)?, tok.vocab_size())?;
            println!("{}", tok.decode(&ids)?);
        }
    }
    Ok(())
}
