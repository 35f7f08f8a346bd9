//! Text <-> token ids for the generate endpoints, chosen by what the checkpoint directory holds,
//! exactly as `cohort sample` chooses: a Hugging Face `tokenizer.json`, else a character-level
//! `vocab.json`, else none (the prompt is space-separated ids and the output is ids). The text a
//! generation returns is built the way `cohort sample` prints it, so the two agree byte for
//! byte. This module never runs the model.

use std::path::Path;

use cohort_tokenizer::char_vocab::{CharVocab, VOCAB_FILE};
use cohort_tokenizer::{Tokenizer, TOKENIZER_FILE};

/// How a model version maps text to ids.
pub(crate) enum TextCodec {
    Tokenizer(Box<Tokenizer>),
    Chars(CharVocab),
    Ids,
}

impl TextCodec {
    /// The codec of checkpoint directory `dir`.
    pub fn load(dir: &Path) -> Result<TextCodec, String> {
        let tokenizer = dir.join(TOKENIZER_FILE);
        if tokenizer.is_file() {
            return Tokenizer::from_file(&tokenizer)
                .map(|t| TextCodec::Tokenizer(Box::new(t)))
                .map_err(|e| e.to_string());
        }
        match CharVocab::load(dir) {
            Ok(Some(v)) => Ok(TextCodec::Chars(v)),
            Ok(None) => Ok(TextCodec::Ids),
            Err(e) => Err(e.to_string()),
        }
    }

    /// The prompt's token ids.
    pub fn encode(&self, prompt: &str) -> Result<Vec<u32>, String> {
        match self {
            TextCodec::Tokenizer(t) => t
                .encode(prompt)
                .map_err(|e| format!("encoding the prompt with {TOKENIZER_FILE}: {e}")),
            TextCodec::Chars(v) => v
                .encode(prompt)
                .map_err(|e| format!("encoding the prompt with {VOCAB_FILE}: {e}")),
            TextCodec::Ids => prompt
                .split_whitespace()
                .map(|s| s.parse::<u32>())
                .collect::<Result<_, _>>()
                .map_err(|e| {
                    format!(
                        "the checkpoint has no {TOKENIZER_FILE} or {VOCAB_FILE}, so the prompt \
                         must be space-separated token ids ({e})"
                    )
                }),
        }
    }

    /// The prompt as `cohort sample` echoes it (ids are re-joined with single spaces).
    pub fn echo_prompt(&self, prompt: &str, ids: &[u32]) -> String {
        match self {
            TextCodec::Ids => ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" "),
            _ => prompt.to_string(),
        }
    }

    /// The text of all generated tokens, as `cohort sample` prints it after the prompt.
    pub fn decode_all(&self, ids: &[u32]) -> Result<String, String> {
        match self {
            TextCodec::Tokenizer(t) => t
                .decode(ids)
                .map_err(|e| format!("decoding the generated tokens: {e}")),
            _ => Ok(ids.iter().map(|&id| self.piece(id)).collect()),
        }
    }

    /// The text of one token for codecs where every token stands alone.
    fn piece(&self, id: u32) -> String {
        match self {
            TextCodec::Chars(v) => v
                .decode(&[id])
                .unwrap_or_else(|_| char::REPLACEMENT_CHARACTER.into()),
            TextCodec::Ids => format!(" {id}"),
            TextCodec::Tokenizer(t) => t.decode(&[id]).unwrap_or_default(),
        }
    }
}

/// Turns a stream of generated ids into text pieces whose concatenation is `decode_all` of the
/// ids (for a subword tokenizer, text is held back while it ends inside a character).
pub(crate) struct Detokenizer<'c> {
    codec: &'c TextCodec,
    ids: Vec<u32>,
    emitted: usize,
}

impl<'c> Detokenizer<'c> {
    pub fn new(codec: &'c TextCodec) -> Detokenizer<'c> {
        Detokenizer {
            codec,
            ids: Vec::new(),
            emitted: 0,
        }
    }

    /// The new text after `id` (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        let TextCodec::Tokenizer(t) = self.codec else {
            return self.codec.piece(id);
        };
        self.ids.push(id);
        let Ok(text) = t.decode(&self.ids) else {
            return String::new();
        };
        if text.ends_with(char::REPLACEMENT_CHARACTER) || text.len() < self.emitted {
            return String::new();
        }
        let piece = text.get(self.emitted..).unwrap_or_default().to_string();
        self.emitted = text.len();
        piece
    }

    /// What is still held back at the end.
    pub fn finish(&mut self) -> String {
        let TextCodec::Tokenizer(t) = self.codec else {
            return String::new();
        };
        match t.decode(&self.ids) {
            Ok(text) if text.len() > self.emitted => {
                let rest = text.get(self.emitted..).unwrap_or_default().to_string();
                self.emitted = text.len();
                rest
            }
            _ => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_pieces_add_up_to_the_whole_text() {
        let chars = TextCodec::Chars(CharVocab::new("abc ".chars()).unwrap());
        let tok = TextCodec::Tokenizer(Box::new(Tokenizer::char_level("abc é".chars())));
        for (codec, prompt) in [(&chars, "ab"), (&tok, "aé"), (&TextCodec::Ids, " 1  2")] {
            let ids = codec.encode(prompt).unwrap();
            let generated = [2u32, 0, 3, 1];
            let whole = codec.decode_all(&generated).unwrap();
            let mut d = Detokenizer::new(codec);
            let mut streamed: String = generated.iter().map(|&i| d.push(i)).collect();
            streamed += &d.finish();
            assert_eq!(streamed, whole, "prompt {prompt:?}");
            if let TextCodec::Ids = codec {
                assert_eq!(codec.echo_prompt(prompt, &ids), "1 2");
                assert_eq!(whole, " 2 0 3 1");
            } else {
                assert_eq!(codec.echo_prompt(prompt, &ids), prompt);
            }
        }
        assert!(TextCodec::Ids
            .encode("1 x")
            .unwrap_err()
            .contains("token ids"));
        assert!(chars.encode("aZ").unwrap_err().contains(VOCAB_FILE));
    }
}
