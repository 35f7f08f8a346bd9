//! A character-level vocabulary stored as `vocab.json` in a checkpoint directory: the minimal
//! text <-> token id mapping that sampling needs until checkpoints carry a real tokenizer.
//! Token id i is the i-th character. It must stay this small: anything smarter is a
//! [`Tokenizer`](crate::Tokenizer).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// File name of the vocabulary inside a checkpoint directory.
pub const VOCAB_FILE: &str = "vocab.json";

/// What went wrong reading or applying a vocabulary.
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum VocabError {
    /// The file could not be read.
    #[error("read {path}: {reason}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        reason: String,
    },
    /// The file is not a JSON array of one-character strings nor a map of characters to ids.
    #[error("{path}: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A character appears twice.
    #[error("character {0:?} appears twice in the vocabulary")]
    Duplicate(char),
    /// The text has a character outside the vocabulary.
    #[error("character {ch:?} at byte {offset} is not in the vocabulary")]
    UnknownChar {
        /// The character.
        ch: char,
        /// Its byte offset in the text.
        offset: usize,
    },
    /// A token id has no character.
    #[error("token id {0} is outside the vocabulary")]
    UnknownId(u32),
}

/// Characters indexed by token id.
#[derive(Debug, Clone, PartialEq)]
pub struct CharVocab {
    chars: Vec<char>,
    ids: HashMap<char, u32>,
}

impl CharVocab {
    /// The vocabulary whose token i is `chars[i]`.
    pub fn new(chars: impl IntoIterator<Item = char>) -> Result<CharVocab, VocabError> {
        let chars: Vec<char> = chars.into_iter().collect();
        let mut ids = HashMap::with_capacity(chars.len());
        for (i, &ch) in chars.iter().enumerate() {
            if ids.insert(ch, i as u32).is_some() {
                return Err(VocabError::Duplicate(ch));
            }
        }
        Ok(CharVocab { chars, ids })
    }

    /// The sorted distinct characters of `text`, as nanoGPT's shakespeare_char prepare.py.
    pub fn from_text(text: &str) -> CharVocab {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        CharVocab::new(chars).expect("deduplicated")
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.chars.len()
    }

    /// True for an empty vocabulary.
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// `vocab.json` contents: a JSON array of one-character strings, index = token id.
    pub fn to_json(&self) -> Vec<u8> {
        let strings: Vec<String> = self.chars.iter().map(|c| c.to_string()).collect();
        serde_json::to_vec(&strings).expect("strings serialize")
    }

    /// Parses `vocab.json`: an array of one-character strings, or an object mapping each
    /// character to its id (ids 0..n, each once).
    pub fn from_json(bytes: &[u8], path: &Path) -> Result<CharVocab, VocabError> {
        let bad = |reason: String| VocabError::Format {
            path: path.to_path_buf(),
            reason,
        };
        let one_char = |s: &str| -> Result<char, VocabError> {
            let mut it = s.chars();
            match (it.next(), it.next()) {
                (Some(c), None) => Ok(c),
                _ => Err(bad(format!("{s:?} is not exactly one character"))),
            }
        };
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        match value {
            serde_json::Value::Array(items) => {
                let chars = items
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .ok_or_else(|| bad(format!("{v} is not a string")))
                            .and_then(one_char)
                    })
                    .collect::<Result<Vec<char>, _>>()?;
                CharVocab::new(chars)
            }
            serde_json::Value::Object(map) => {
                let mut slots = vec![None; map.len()];
                for (s, id) in &map {
                    let ch = one_char(s)?;
                    let id = id
                        .as_u64()
                        .filter(|&i| (i as usize) < map.len())
                        .ok_or_else(|| {
                            bad(format!("id {id} of {s:?} is not in 0..{}", map.len()))
                        })?;
                    if slots[id as usize].replace(ch).is_some() {
                        return Err(bad(format!("id {id} is used twice")));
                    }
                }
                CharVocab::new(
                    slots
                        .into_iter()
                        .map(|c| c.expect("n distinct ids in 0..n")),
                )
            }
            _ => Err(bad("expected an array or an object".into())),
        }
    }

    /// The vocabulary of checkpoint directory `dir`, if it has a `vocab.json`.
    pub fn load(dir: &Path) -> Result<Option<CharVocab>, VocabError> {
        let path = dir.join(VOCAB_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => CharVocab::from_json(&bytes, &path).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(VocabError::Read {
                path,
                reason: e.to_string(),
            }),
        }
    }

    /// Token ids of `text`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, VocabError> {
        text.char_indices()
            .map(|(offset, ch)| {
                self.ids
                    .get(&ch)
                    .copied()
                    .ok_or(VocabError::UnknownChar { ch, offset })
            })
            .collect()
    }

    /// The text of token ids.
    pub fn decode(&self, ids: &[u32]) -> Result<String, VocabError> {
        ids.iter()
            .map(|&id| {
                self.chars
                    .get(id as usize)
                    .copied()
                    .ok_or(VocabError::UnknownId(id))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_both_json_forms() {
        let v = CharVocab::from_text("hello, world\n");
        assert_eq!(v.len(), 10);
        let ids = v.encode("world\n").unwrap();
        assert_eq!(v.decode(&ids).unwrap(), "world\n");
        let p = Path::new("vocab.json");
        assert_eq!(CharVocab::from_json(&v.to_json(), p).unwrap(), v);
        let map = br#"{"b": 1, "a": 0, "\u00e9": 2}"#;
        let m = CharVocab::from_json(map, p).unwrap();
        assert_eq!(m.decode(&[2, 0, 1]).unwrap(), "\u{e9}ab");
    }

    #[test]
    fn bad_vocabularies_and_text_are_errors() {
        let p = Path::new("v.json");
        for bad in [
            &br#"["ab"]"#[..],
            br#"[1]"#,
            br#"{"a": 0, "b": 0}"#,
            br#"{"a": 3}"#,
            br#""x""#,
            b"[",
        ] {
            assert!(
                matches!(CharVocab::from_json(bad, p), Err(VocabError::Format { .. })),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(
            CharVocab::from_json(br#"["a","a"]"#, p),
            Err(VocabError::Duplicate('a'))
        );
        let v = CharVocab::from_text("abc");
        assert_eq!(
            v.encode("abz"),
            Err(VocabError::UnknownChar { ch: 'z', offset: 2 })
        );
        assert_eq!(v.decode(&[3]), Err(VocabError::UnknownId(3)));
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(CharVocab::load(dir.path()), Ok(None));
        std::fs::write(dir.path().join(VOCAB_FILE), v.to_json()).unwrap();
        assert_eq!(CharVocab::load(dir.path()), Ok(Some(v)));
    }
}
