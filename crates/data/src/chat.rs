//! Chat lines of a JSONL file (`{"messages": [...]}`, the format TRL and OpenAI fine-tuning use):
//! each rendered with the model's chat template, tokenized, and its loss mask (1 for the tokens
//! the assistant wrote, which alone are trained as targets) kept beside the token file, one byte
//! per token. The assistant's tokens are the template's `{% generation %}` blocks where it has
//! them, otherwise the assistant messages' text found by rendering prefixes
//! ([`ChatTemplate::assistant_spans`]), mapped to the tokens that overlap them.
//!
//! A conversation with no assistant token to train on is an error naming its line, never a
//! sample whose every position is ignored. This module never opens the token file itself.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cohort_tokenizer::{encode_chat, Chat, ChatTemplate, Tokenizer};
use memmap2::Mmap;

use crate::DataError;

/// One conversation's ids and loss mask, or the reason (for the caller to name the line).
pub(crate) fn encode_line(
    template: Option<&ChatTemplate>,
    tokenizer: &Tokenizer,
    line: &str,
) -> Result<(Vec<u32>, Vec<u8>), String> {
    let template = template.ok_or(
        "a conversation (\"messages\") needs a tokenizer with a chat template \
         (tokenizer_config.json's chat_template or chat_template.jinja beside tokenizer.json)",
    )?;
    let chat = Chat::from_json(line).map_err(|e| e.to_string())?;
    let rendered = template.assistant_spans(&chat).map_err(|e| e.to_string())?;
    let tokens = encode_chat(tokenizer, &rendered).map_err(|e| e.to_string())?;
    // Token 0 is never a target (nothing comes before it to predict it from).
    if !tokens.assistant_mask.iter().skip(1).any(|&m| m == 1) {
        return Err(
            "no assistant token to train on (the loss would ignore the whole conversation)".into(),
        );
    }
    Ok((tokens.ids, tokens.assistant_mask))
}

/// The loss mask file beside a token file: written lazily, from the first conversation on (the
/// text documents before it count as all trained).
pub(crate) struct MaskWriter {
    path: PathBuf,
    out: Option<BufWriter<std::fs::File>>,
}

impl MaskWriter {
    /// A writer of `path`, which is created only if a conversation comes.
    pub(crate) fn new(path: PathBuf) -> MaskWriter {
        let _ = std::fs::remove_file(&path);
        MaskWriter { path, out: None }
    }

    /// Appends `mask` for the tokens after the first `before` (a text document's tokens are all
    /// trained: `mask` None).
    pub(crate) fn write(
        &mut self,
        before: u64,
        mask: Option<&[u8]>,
        len: usize,
    ) -> Result<(), DataError> {
        if self.out.is_none() {
            let Some(mask) = mask else { return Ok(()) };
            let f =
                std::fs::File::create(&self.path).map_err(DataError::io("create", &self.path))?;
            let mut w = BufWriter::new(f);
            write_ones(&mut w, before, &self.path)?;
            w.write_all(mask)
                .map_err(DataError::io("write", &self.path))?;
            self.out = Some(w);
            return Ok(());
        }
        let w = self.out.as_mut().expect("checked above");
        match mask {
            Some(m) => w.write_all(m).map_err(DataError::io("write", &self.path)),
            None => write_ones(w, len as u64, &self.path),
        }
    }

    /// Flushes; whether a mask file was written.
    pub(crate) fn finish(self) -> Result<bool, DataError> {
        match self.out {
            Some(mut w) => {
                w.flush().map_err(DataError::io("write", &self.path))?;
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

fn write_ones(w: &mut impl Write, n: u64, path: &Path) -> Result<(), DataError> {
    let ones = [1u8; 4096];
    let mut left = n;
    while left > 0 {
        let k = left.min(ones.len() as u64) as usize;
        w.write_all(&ones[..k])
            .map_err(DataError::io("write", path))?;
        left -= k as u64;
    }
    Ok(())
}

/// The mask file of a token file of `tokens` tokens, memory-mapped.
pub(crate) fn open_mask(path: &Path, tokens: usize) -> Result<Arc<Mmap>, DataError> {
    let f = std::fs::File::open(path).map_err(DataError::io("open", path))?;
    // SAFETY: the cache files are written once (under a temporary name or before their
    // metadata) and never modified while a run reads them; a concurrent writer is outside
    // what the token files support either.
    let map = unsafe { Mmap::map(&f) }.map_err(DataError::io("mmap", path))?;
    if map.len() != tokens {
        return Err(DataError::Truncated {
            path: path.into(),
            len: map.len() as u64,
            reason: "is not one loss-mask byte per token",
        });
    }
    Ok(Arc::new(map))
}
