//! `cohort sample`: generate text from a checkpoint. Wiring only: load the checkpoint, turn the
//! prompt into token ids (`vocab.json` characters when the checkpoint has one, else the prompt
//! is space-separated ids), call `cohort_gpt::sample::generate`, stream what it produces.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use cohort_gpt::char_vocab::{CharVocab, VOCAB_FILE};
use cohort_gpt::checkpoint;
use cohort_gpt::sample::{generate, SampleOptions};

/// Generate tokens from a checkpoint with a KV cache.
#[derive(clap::Args, Debug)]
pub struct SampleArgs {
    /// Checkpoint directory, or a checkpoint root (its `latest` is used).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Text to continue; space-separated token ids when the checkpoint has no vocab.json.
    #[arg(long)]
    prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 100)]
    max_new_tokens: usize,
    /// Softmax temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Sample among the K most likely tokens only.
    #[arg(long)]
    top_k: Option<usize>,
    /// Seed of the sampler (same seed, same text).
    #[arg(long, default_value_t = 1337)]
    seed: u64,
}

pub fn main(args: SampleArgs) -> anyhow::Result<()> {
    let (model, dir) = checkpoint::load_model(&args.checkpoint)
        .with_context(|| format!("loading checkpoint {}", args.checkpoint.display()))?;
    let vocab = CharVocab::load(&dir)?;
    let prompt: Vec<u32> = match &vocab {
        Some(v) => v.encode(&args.prompt).with_context(|| {
            format!(
                "encoding the prompt with {}",
                dir.join(VOCAB_FILE).display()
            )
        })?,
        None => args
            .prompt
            .split_whitespace()
            .map(|s| s.parse::<u32>())
            .collect::<Result<_, _>>()
            .with_context(|| {
                format!(
                    "{} has no {VOCAB_FILE}, so the prompt must be space-separated token ids",
                    dir.display()
                )
            })?,
    };
    let opts = SampleOptions {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.seed,
    };
    let mut out = std::io::stdout().lock();
    // The prompt, then each token as it comes; after a failed write (a closed pipe) nothing
    // more is written, and a broken pipe is not an error.
    let mut write_err = None;
    let mut emit = |text: String| {
        if write_err.is_none() {
            if let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
                write_err = Some(e);
            }
        }
    };
    match &vocab {
        Some(_) => emit(args.prompt.clone()),
        None => emit(join_ids(&prompt)),
    }
    generate(&model, &prompt, &opts, |id| match &vocab {
        Some(v) => emit(
            v.decode(&[id])
                .unwrap_or_else(|_| char::REPLACEMENT_CHARACTER.into()),
        ),
        None => emit(format!(" {id}")),
    })
    .context("sampling")?;
    emit("\n".into());
    match write_err {
        Some(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Some(e) => Err(e).context("writing to stdout"),
        None => Ok(()),
    }
}

fn join_ids(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
}
