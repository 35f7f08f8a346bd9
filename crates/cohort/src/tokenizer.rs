//! `cohort tokenizer`: build a tokenizer.json from a corpus, or add (special) tokens to one.
//! Wiring only: parse flags, call `cohort-tokenizer`, print what changed.

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
    }
    Ok(())
}
