//! `cohort tokenizer`: build a tokenizer.json from a corpus, add (special) tokens to one (or to a
//! model directory, resizing its embeddings), encode and decode text with one, or render a
//! conversation with a model's chat template. Wiring only: parse flags, call `cohort-tokenizer`, print.

use std::path::PathBuf;

use anyhow::Context;
use cohort_tokenizer::{encode_chat, Chat, ChatTemplate, Tokenizer};

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
    /// Render a conversation with a model's chat template (`apply_chat_template`): the text,
    /// then its ids.
    Chat(ChatArgs),
}

/// `cohort tokenizer chat`.
#[derive(clap::Args, Debug)]
pub struct ChatArgs {
    /// The model directory: tokenizer.json, and the template in tokenizer_config.json or
    /// chat_template.jinja.
    #[arg(long)]
    model: PathBuf,
    /// A JSON file: a list of messages, or {"messages": [...], "tools": [...]} ("-": standard
    /// input).
    #[arg(long)]
    messages: PathBuf,
    /// End with the assistant's header, ready for the model to answer.
    #[arg(long)]
    add_generation_prompt: bool,
    /// One JSON object instead: text, ids and the assistant mask (1 for the assistant's tokens).
    #[arg(long)]
    json: bool,
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
    /// The tokenizer.json to extend (writes a tokenizer.json).
    #[arg(long, required_unless_present = "model", conflicts_with = "model")]
    tokenizer: Option<PathBuf>,
    /// A model directory (config.json, model.safetensors, tokenizer.json: Hugging Face's
    /// layout, or a checkpoint) whose tokenizer and embeddings grow together: writes a model
    /// directory that `transformers` loads (`AutoTokenizer`, `AutoModelForCausalLM`).
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// With --model: how each new embedding row starts: `mean` (of all existing rows, as
    /// Hugging Face's resize), `zeros`, `random` (the model's init, seeded by --seed),
    /// `token:ID` (a copy of an existing token's row) or `text:WORDS` (the mean of the rows of
    /// WORDS' tokens, e.g. text:start of entity). Once for every new token, or once per new
    /// token in the order they are added (normal tokens, then special ones).
    #[arg(long, default_value = "mean")]
    init: Vec<String>,
    /// Seed of the `random` init.
    #[arg(long, default_value_t = 0)]
    seed: u64,
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

/// `add-tokens`: to a tokenizer.json, or to a model directory's tokenizer and embeddings.
fn add_tokens(a: AddArgs) -> anyhow::Result<()> {
    let (model, mut tok) = match (&a.model, &a.tokenizer) {
        (Some(dir), _) => {
            let (model, tok) = cohort_pretrained::load_pretrained(dir)
                .with_context(|| format!("loading the model in {}", dir.display()))?;
            (Some(model), tok)
        }
        (None, Some(file)) => (None, Tokenizer::from_file(file)?),
        (None, None) => anyhow::bail!("give --tokenizer FILE or --model DIR"),
    };
    let before = tok.vocab_size();
    let old = tok.clone();
    let normal: Vec<&str> = a.tokens.iter().map(String::as_str).collect();
    let special: Vec<&str> = a.special.iter().map(String::as_str).collect();
    let n = tok.add_tokens(&normal).context("adding tokens")?;
    let s = tok
        .add_special_tokens(&special)
        .context("adding special tokens")?;
    let added = format!(
        "added {} tokens ({n} normal, {s} special); vocab size {before} -> {}",
        n + s,
        tok.vocab_size()
    );
    let Some(model) = model else {
        tok.save(&a.out)?;
        println!("{added}: {}", a.out.display());
        return Ok(());
    };
    // A model may embed more ids than its tokenizer has (GPT-2 pads 50257 to 50304): rows
    // that exist already are kept; only rows beyond the model's are new.
    let old_rows = model.config().vocab_size;
    let rows = old_rows.max(tok.vocab_size());
    let new_rows = rows - old_rows;
    let inits = row_inits(&a.init, new_rows, old_rows, &old)?;
    let model = cohort_gpt::resize_token_embeddings(&model, rows, &inits, a.seed)
        .context("resizing the embeddings")?;
    cohort_pretrained::save_pretrained_to(&a.out, &model, &tok)
        .with_context(|| format!("writing {}", a.out.display()))?;
    println!(
        "{added}; embeddings {old_rows} -> {rows} rows (init {}): {}",
        a.init.join(", "),
        a.out.display()
    );
    Ok(())
}

/// The init of each of `new_rows` new embedding rows, from the `--init` values (one for all, or
/// one each); `old` is the tokenizer before the new tokens, which `text:` encodes with.
fn row_inits(
    given: &[String],
    new_rows: usize,
    old_rows: usize,
    old: &Tokenizer,
) -> anyhow::Result<Vec<cohort_gpt::RowInit>> {
    use cohort_gpt::RowInit;
    anyhow::ensure!(
        given.len() == 1 || given.len() == new_rows,
        "--init was given {} times for {new_rows} new rows: give it once, or once per new token",
        given.len()
    );
    let parse = |init: &str| -> anyhow::Result<RowInit> {
        Ok(match init.split_once(':') {
            None if init == "mean" => RowInit::Mean((0..old_rows as u32).collect()),
            None if init == "zeros" => RowInit::Zeros,
            None if init == "random" => RowInit::Random,
            Some(("token", id)) => {
                let id: u32 = id
                    .trim()
                    .parse()
                    .with_context(|| format!("--init {init}: {id:?} is not a token id"))?;
                anyhow::ensure!(
                    (id as usize) < old_rows,
                    "--init {init}: token id {id} is outside the model's {old_rows} rows"
                );
                RowInit::Copy(id)
            }
            Some(("text", words)) => {
                let ids = old.encode(words)?;
                anyhow::ensure!(!ids.is_empty(), "--init {init}: the text has no tokens");
                RowInit::Mean(ids)
            }
            _ => {
                anyhow::bail!("--init {init}: expected mean, zeros, random, token:ID or text:WORDS")
            }
        })
    };
    (0..new_rows)
        .map(|i| parse(&given[if given.len() == 1 { 0 } else { i }]))
        .collect()
}

fn chat(a: ChatArgs) -> anyhow::Result<()> {
    let tok = open(&a.model)?;
    let template = ChatTemplate::from_dir(&a.model)?;
    let json = if a.messages.as_os_str() == "-" {
        text_or_stdin(None)?
    } else {
        std::fs::read_to_string(&a.messages)
            .with_context(|| format!("reading {}", a.messages.display()))?
    };
    let conversation = Chat::from_json(&json).with_context(|| a.messages.display().to_string())?;
    // The assistant's spans need the whole conversation rendered without the prompt; with it,
    // only the text and ids are asked for.
    let rendered = if a.add_generation_prompt {
        template.render(&conversation, true)?
    } else {
        template.assistant_spans(&conversation)?
    };
    let out = encode_chat(&tok, &rendered)?;
    if a.json {
        let v = serde_json::json!({
            "text": rendered.text,
            "ids": out.ids,
            "assistant_mask": out.assistant_mask,
        });
        println!("{v}");
    } else {
        println!("{}", rendered.text);
        let ids: Vec<String> = out.ids.iter().map(u32::to_string).collect();
        println!("ids: {}", ids.join(" "));
    }
    Ok(())
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
        TokenizerCmd::AddTokens(a) => add_tokens(a)?,
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
        TokenizerCmd::Chat(a) => chat(a)?,
        TokenizerCmd::Decode(a) => {
            let tok = open(&a.tokenizer)?;
            let ids = parse_ids(&text_or_stdin(a.ids)?, tok.vocab_size())?;
            println!("{}", tok.decode(&ids)?);
        }
    }
    Ok(())
}
