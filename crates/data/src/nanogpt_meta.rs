//! nanoGPT's `meta.pkl`: the vocabulary its `prepare.py` writes beside `train.bin` and
//! `val.bin` for character-level data (`{"vocab_size": n, "stoi": {char: id}, "itos": {id:
//! char}}`, a Python pickle). A nanoGPT directory with one trains with that vocabulary, and
//! its checkpoints can encode and decode text; without one, the ids are all there is.
//!
//! This module only reads the file and builds the tokenizer; it never writes anything.

use std::collections::HashMap;
use std::path::Path;

use cohort_tokenizer::Tokenizer;

use crate::DataError;

/// The file nanoGPT's `prepare.py` writes beside the token files.
pub const META_FILE: &str = "meta.pkl";

#[derive(serde::Deserialize)]
struct Meta {
    vocab_size: usize,
    stoi: HashMap<String, u32>,
}

/// The character-level tokenizer `dir/meta.pkl` describes, or `None` without one. nanoGPT
/// gives ids in code-point order (`sorted(set(text))`), which is also our character-level
/// order; a file that does not (ids out of order, a vocabulary size that disagrees with
/// `stoi`, an entry that is not one character) is an error naming what is wrong.
pub fn nanogpt_tokenizer(dir: &Path) -> Result<Option<Tokenizer>, DataError> {
    let path = dir.join(META_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(DataError::Io {
                op: "read",
                path,
                source,
            })
        }
    };
    let bad = |reason: String| DataError::BadMeta {
        path: path.clone(),
        reason,
    };
    let meta: Meta = serde_pickle::from_slice(&bytes, serde_pickle::DeOptions::new())
        .map_err(|e| bad(format!("not nanoGPT's meta pickle ({e})")))?;
    if meta.stoi.len() != meta.vocab_size {
        return Err(bad(format!(
            "vocab_size is {} but stoi has {} entries",
            meta.vocab_size,
            meta.stoi.len()
        )));
    }
    let mut chars = Vec::with_capacity(meta.stoi.len());
    for s in meta.stoi.keys() {
        let mut it = s.chars();
        match (it.next(), it.next()) {
            (Some(c), None) => chars.push(c),
            _ => {
                return Err(bad(format!(
                    "stoi entry {s:?} is not one character (only character-level meta.pkl is \
                     supported)"
                )))
            }
        }
    }
    let tok = Tokenizer::char_level(chars);
    for (s, &id) in &meta.stoi {
        if tok.token_to_id(s) != Some(id) {
            return Err(bad(format!(
                "stoi gives {s:?} id {id}, not its place in code-point order ({:?})",
                tok.token_to_id(s)
            )));
        }
    }
    Ok(Some(tok))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_meta(dir: &Path, vocab_size: usize, stoi: &[(&str, u32)]) {
        #[derive(serde::Serialize)]
        struct Out {
            vocab_size: usize,
            stoi: HashMap<String, u32>,
            itos: HashMap<u32, String>,
        }
        let out = Out {
            vocab_size,
            stoi: stoi.iter().map(|&(s, i)| (s.to_string(), i)).collect(),
            itos: stoi.iter().map(|&(s, i)| (i, s.to_string())).collect(),
        };
        let bytes = serde_pickle::to_vec(&out, serde_pickle::SerOptions::new()).unwrap();
        std::fs::write(dir.join(META_FILE), bytes).unwrap();
    }

    #[test]
    fn a_meta_pickle_becomes_the_char_tokenizer_and_bad_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        assert!(nanogpt_tokenizer(dir.path()).unwrap().is_none());
        write_meta(dir.path(), 4, &[("\n", 0), (" ", 1), ("a", 2), ("b", 3)]);
        let tok = nanogpt_tokenizer(dir.path()).unwrap().unwrap();
        assert_eq!(tok.vocab_size(), 4);
        assert_eq!(tok.encode("ab a\n").unwrap(), vec![2, 3, 1, 2, 0]);
        assert_eq!(tok.decode(&[3, 2]).unwrap(), "ba");

        write_meta(dir.path(), 5, &[("a", 0), ("b", 1)]);
        let err = nanogpt_tokenizer(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("vocab_size is 5") && err.contains("meta.pkl"),
            "{err}"
        );
        write_meta(dir.path(), 2, &[("a", 1), ("b", 0)]);
        let err = nanogpt_tokenizer(dir.path()).unwrap_err().to_string();
        assert!(err.contains("code-point order"), "{err}");
        std::fs::write(dir.path().join(META_FILE), b"not a pickle").unwrap();
        let err = nanogpt_tokenizer(dir.path()).unwrap_err().to_string();
        assert!(err.contains("not nanoGPT's meta pickle"), "{err}");
    }
}
