//! `cohort sample`: generate text from a checkpoint. Wiring only: load the checkpoint, turn the
//! prompt into token ids, call `cohort_gpt::sample::generate`, print what it produces.
//!
//! Text <-> ids, by what the checkpoint directory holds: a Hugging Face `tokenizer.json` (what
//! `cohort train` writes), else a character-level `vocab.json`, else none, and then the prompt
//! is space-separated token ids and the output is ids.
//!
//! Generation stops, as `transformers`' `generate` does, at an `eos_token_id` of the
//! directory's generation_config.json (else config.json), which is not printed; `--ignore-eos`
//! runs the full `--max-new-tokens`.
//!
//! `--weights` picks what the decode's matrix products read: fp32 (the default: the logits of
//! the training forward, which the tests hold to `transformers`' within 1e-4, the same on every
//! machine), or a copy made at load in bf16 or q8 (8-bit blocks): a decode step reads every
//! weight once per token, so half or about a quarter of the bytes is that much faster, for
//! logits that move by the rounding (see `cohort_gpt::sample::WeightFormat`). Opt-in, not
//! picked by the CPU: the text of a checkpoint does not change with the machine it runs on.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use anyhow::Context;
use cohort_gpt::checkpoint;
use cohort_gpt::sample::{
    generate_while_in, DecodeWeights, KvDtype, SampleOptions, WeightFormat, Workspace,
};
use cohort_tokenizer::char_vocab::{CharVocab, VOCAB_FILE};
use cohort_tokenizer::{Tokenizer, TOKENIZER_FILE};

/// Generate tokens from a checkpoint with a KV cache.
#[derive(clap::Args, Debug)]
pub struct SampleArgs {
    /// Checkpoint directory, or a checkpoint root (its `latest` is used).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Text to continue; space-separated token ids when the checkpoint has neither
    /// tokenizer.json nor vocab.json.
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
    /// Nucleus sampling: among the most likely tokens whose probabilities first reach P in
    /// sum (1 = all tokens).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Seed of the sampler (same seed, same text).
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Keep generating past an end-of-sequence id (vLLM's flag): all --max-new-tokens tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// What the decode's matrix products read: the checkpoint's f32 weights (fp32, exact), or
    /// a copy made at load in bf16 (half the bytes per token; VDPBF16PS where the CPU has
    /// AVX512_BF16) or in 8-bit blocks (q8, llama.cpp's Q8_0: about a quarter).
    #[arg(long, default_value_t = WeightFormat::F32)]
    weights: WeightFormat,
    /// Where the decode computes: cpu (a device's decode comes later).
    #[arg(long, default_value = "cpu", value_name = "cpu|cuda|cuda:N")]
    device: cohort_train::DeviceChoice,
}

/// How the checkpoint maps text to token ids.
enum Text {
    Tokenizer(Box<Tokenizer>),
    Chars(CharVocab),
    Ids,
}

impl Text {
    fn load(dir: &Path) -> anyhow::Result<Text> {
        let tokenizer = dir.join(TOKENIZER_FILE);
        if tokenizer.is_file() {
            return Ok(Text::Tokenizer(Box::new(Tokenizer::from_file(&tokenizer)?)));
        }
        Ok(match CharVocab::load(dir)? {
            Some(v) => Text::Chars(v),
            None => Text::Ids,
        })
    }

    fn encode(&self, dir: &Path, prompt: &str) -> anyhow::Result<Vec<u32>> {
        let file = |name: &str| dir.join(name).display().to_string();
        match self {
            Text::Tokenizer(t) => t
                .encode(prompt)
                .with_context(|| format!("encoding the prompt with {}", file(TOKENIZER_FILE))),
            Text::Chars(v) => v
                .encode(prompt)
                .with_context(|| format!("encoding the prompt with {}", file(VOCAB_FILE))),
            Text::Ids => prompt
                .split_whitespace()
                .map(|s| s.parse::<u32>())
                .collect::<Result<_, _>>()
                .with_context(|| {
                    format!(
                        "{} has no {TOKENIZER_FILE} or {VOCAB_FILE}, so the prompt must be \
                         space-separated token ids",
                        dir.display()
                    )
                }),
        }
    }
}

pub fn main(args: SampleArgs) -> anyhow::Result<()> {
    if args.device.is_device() {
        anyhow::bail!(
            "cohort sample --device {}: decoding is not on a device yet (its KV caches and \
             per-row attention take host memory); use --device cpu",
            args.device
        );
    }
    let (model, dir) = checkpoint::load_model(&args.checkpoint)
        .with_context(|| format!("loading checkpoint {}", args.checkpoint.display()))?;
    let text = Text::load(&dir)?;
    let prompt = text.encode(&dir, &args.prompt)?;
    let eos = if args.ignore_eos {
        Vec::new()
    } else {
        cohort_pretrained::eos_token_ids(&dir).context("reading the end-of-sequence ids")?
    };
    let opts = SampleOptions {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    let mut out = std::io::stdout().lock();
    // The prompt, then the tokens as they come (a subword tokenizer's text only at the end: a
    // token may be part of a character); after a failed write (a closed pipe) nothing more is
    // written, and a broken pipe is not an error.
    let mut write_err = None;
    let mut emit = |s: &str| {
        if write_err.is_none() {
            if let Err(e) = out.write_all(s.as_bytes()).and_then(|_| out.flush()) {
                write_err = Some(e);
            }
        }
    };
    match &text {
        Text::Ids => emit(&join_ids(&prompt)),
        _ => emit(&args.prompt),
    }
    let mut ws = match args.weights.decode_format() {
        None => Workspace::new(&model),
        Some(format) => {
            let copy = std::sync::Arc::new(DecodeWeights::new(&model, format));
            Workspace::with_weights(&model, copy).context("preparing the decode weights")?
        }
    };
    let mut generated = generate_while_in(&mut ws, &model, &prompt, &opts, KvDtype::F32, |id| {
        if eos.contains(&id) {
            return ControlFlow::Break(());
        }
        match &text {
            Text::Chars(v) => emit(
                &v.decode(&[id])
                    .unwrap_or_else(|_| char::REPLACEMENT_CHARACTER.into()),
            ),
            Text::Ids => emit(&format!(" {id}")),
            Text::Tokenizer(_) => {}
        }
        ControlFlow::Continue(())
    })
    .context("sampling")?;
    // The end-of-sequence id it stopped at is not text.
    if generated.last().is_some_and(|id| eos.contains(id)) {
        generated.pop();
    }
    if let Text::Tokenizer(t) = &text {
        emit(
            &t.decode(&generated)
                .context("decoding the generated tokens")?,
        );
    }
    emit("\n");
    match write_err {
        Some(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Some(e) => Err(e).context("writing to stdout"),
        None => Ok(()),
    }
}

fn join_ids(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
}
