//! `save_pretrained` / `load_pretrained`: a model and its tokenizer in one directory
//! (config.json, model.safetensors, tokenizer.json), the layout Hugging Face's
//! `from_pretrained` reads.
//!
//! It sits above both the model (`cohort-gpt`) and the tokenizers (`cohort-tokenizer`), which
//! know nothing of each other. The model files are cohort-gpt's checkpoint files, so a
//! directory written here is also a checkpoint `cohort train --resume` and `cohort sample`
//! read. This crate never writes a file in place: it goes through the checkpoint module's
//! atomic save.
//!
//! ```
//! use cohort_gpt::{resize_token_embeddings, GPTConfig, RowInit, GPT};
//! use cohort_tokenizer::Tokenizer;
//!
//! let mut tok = Tokenizer::char_level("start of entity".chars());
//! let cfg = GPTConfig { vocab_size: tok.vocab_size(), max_position_embeddings: 8, n_layers: 1,
//!     n_heads: 2, d_model: 8, d_ff: 16, ..GPTConfig::default() };
//! let model = GPT::new(cfg, 0).unwrap();
//! tok.add_special_tokens(&["[ENT_START]"]).unwrap();
//! let init = RowInit::Mean(tok.encode("start of entity").unwrap());
//! let model = resize_token_embeddings(&model, tok.vocab_size(), &[init], 0).unwrap();
//! let dir = tempfile::tempdir().unwrap();
//! cohort_pretrained::save_pretrained(dir.path(), "v1", &model, &tok).unwrap();
//! let (back, tok2) = cohort_pretrained::load_pretrained(&dir.path().join("v1")).unwrap();
//! assert_eq!(back.config().vocab_size, tok2.vocab_size());
//! ```

#![deny(missing_docs)]

use std::path::{Path, PathBuf};

use cohort_gpt::checkpoint::{self, Checkpoint, CheckpointError};
use cohort_gpt::GPT;

use cohort_tokenizer::{hf_files, HfFiles, Tokenizer, TokenizerError, TOKENIZER_FILE};

/// Why a pretrained directory could not be written or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PretrainedError {
    /// The model files (config.json, model.safetensors).
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The tokenizer file.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// The tokenizer has ids the model cannot embed.
    #[error(
        "{path}: the tokenizer has {tokenizer} ids but the model embeds {model}; \
         call resize_token_embeddings after adding tokens"
    )]
    VocabMismatch {
        /// The directory.
        path: PathBuf,
        /// The tokenizer's vocabulary size.
        tokenizer: usize,
        /// The model's `vocab_size`.
        model: usize,
    },
    /// generation_config.json or config.json holds an `eos_token_id` that is not a token id (or
    /// a list of them), or is not JSON.
    #[error("{path}: {reason}")]
    BadEos {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

fn check_vocab(path: &Path, model: &GPT, tok: &Tokenizer) -> Result<(), PretrainedError> {
    if tok.vocab_size() > model.config().vocab_size {
        return Err(PretrainedError::VocabMismatch {
            path: path.into(),
            tokenizer: tok.vocab_size(),
            model: model.config().vocab_size,
        });
    }
    Ok(())
}

/// Writes `root/name/` (see [`save_pretrained_to`]) atomically and points `root/latest` at it
/// (the checkpoint module's layout); returns the directory.
pub fn save_pretrained(
    root: &Path,
    name: &str,
    model: &GPT,
    tokenizer: &Tokenizer,
) -> Result<PathBuf, PretrainedError> {
    check_vocab(&root.join(name), model, tokenizer)?;
    let (json, hf) = (
        tokenizer.to_json()?,
        hf_files(tokenizer, model.config().max_position_embeddings),
    );
    Ok(checkpoint::save(
        root,
        name,
        &pretrained(model, &json, &hf),
    )?)
}

/// Writes `dir` itself, atomically, as Hugging Face's `save_pretrained` does: config.json (with
/// the tokenizer's bos/eos/pad ids), model.safetensors, tokenizer.json, tokenizer_config.json,
/// special_tokens_map.json and generation_config.json, which `AutoTokenizer` and
/// `AutoModelForCausalLM` load without a warning.
pub fn save_pretrained_to(
    dir: &Path,
    model: &GPT,
    tokenizer: &Tokenizer,
) -> Result<(), PretrainedError> {
    check_vocab(dir, model, tokenizer)?;
    let (json, hf) = (
        tokenizer.to_json()?,
        hf_files(tokenizer, model.config().max_position_embeddings),
    );
    Ok(checkpoint::save_dir(dir, &pretrained(model, &json, &hf))?)
}

fn pretrained<'a>(model: &'a GPT, tokenizer_json: &'a str, hf: &'a HfFiles) -> Checkpoint<'a> {
    let mut extra_files = vec![(TOKENIZER_FILE, tokenizer_json.as_bytes())];
    extra_files.extend(hf.files.iter().map(|(name, bytes)| (*name, &bytes[..])));
    Checkpoint {
        model: Some(model),
        extra_files,
        config_extra: hf.config_keys.clone(),
        ..Checkpoint::default()
    }
}

/// Loads the model and tokenizer of a pretrained directory (or of the checkpoint a root's
/// `latest` names).
pub fn load_pretrained(path: &Path) -> Result<(GPT, Tokenizer), PretrainedError> {
    let (model, dir) = checkpoint::load_model(path)?;
    let tokenizer = Tokenizer::from_file(dir.join(TOKENIZER_FILE))?;
    check_vocab(&dir, &model, &tokenizer)?;
    Ok((model, tokenizer))
}

/// The file beside config.json that names, among others, the ids generation stops at.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// The ids generation stops at, as `transformers`' `generate` reads them: `eos_token_id` (one id
/// or a list) of generation_config.json, else of config.json; empty when neither names one (a
/// model without a tokenizer: generation runs its full length). Both files are read through the
/// checkpoint module, so a directory with checksums is checked against them.
pub fn eos_token_ids(dir: &Path) -> Result<Vec<u32>, PretrainedError> {
    for name in [GENERATION_CONFIG_FILE, checkpoint::CONFIG_FILE] {
        let Some(bytes) = checkpoint::read_file_verified(dir, name)? else {
            continue;
        };
        let path = dir.join(name);
        let bad = |reason: String| PretrainedError::BadEos {
            path: path.clone(),
            reason,
        };
        let json: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
        let id = |v: &serde_json::Value| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| bad(format!("eos_token_id {v} is not a token id")))
        };
        match &json["eos_token_id"] {
            serde_json::Value::Null => continue,
            serde_json::Value::Array(ids) => return ids.iter().map(id).collect(),
            one => return Ok(vec![id(one)?]),
        }
    }
    Ok(Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_gpt::{resize_token_embeddings, Backward, Forward, GPTConfig, Labels, RowInit};

    fn train_steps(model: &mut GPT, ids: &[u32], steps: usize) -> (f32, f32) {
        let labels: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
        let t = ids.len();
        let mut first = 0.0;
        let mut last = 0.0;
        for s in 0..steps {
            let loss = model
                .forward(Forward::new(ids, 1, t).labels(Labels::Aligned(&labels)))
                .unwrap()
                .unwrap();
            if s == 0 {
                first = loss;
            }
            last = loss;
            model.zero_grad();
            model.backward(Backward::new()).unwrap();
            let (p, g) = model.params_and_grads_mut();
            p.iter_mut().zip(g).for_each(|(p, g)| *p -= 0.5 * g);
        }
        (first, last)
    }

    /// Seed 002 end to end: add special tokens, resize (mean of a description), save, load back,
    /// encode with the new tokens and keep training.
    #[test]
    fn added_tokens_resize_save_load_and_train_on() {
        let text = "start of entity end of entity two cars collided in a tunnel";
        let mut tok = Tokenizer::char_level(text.chars());
        let cfg = GPTConfig {
            vocab_size: tok.vocab_size(),
            max_position_embeddings: 32,
            n_layers: 1,
            n_heads: 2,
            d_model: 16,
            d_ff: 32,
            dropout: 0.0,
            ..GPTConfig::default()
        };
        let model = GPT::new(cfg, 3).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let err = {
            let mut bigger = tok.clone();
            bigger.add_tokens(&["xyz"]).unwrap();
            save_pretrained(dir.path(), "bad", &model, &bigger).unwrap_err()
        };
        assert!(err.to_string().contains("resize_token_embeddings"), "{err}");

        assert_eq!(
            tok.add_special_tokens(&["[ENT_START]", "[ENT_END]"])
                .unwrap(),
            2
        );
        let inits = vec![
            RowInit::Mean(tok.encode("start of entity").unwrap()),
            RowInit::Mean(tok.encode("end of entity").unwrap()),
        ];
        let mut model = resize_token_embeddings(&model, tok.vocab_size(), &inits, 5).unwrap();
        let out = save_pretrained(dir.path(), "ent", &model, &tok).unwrap();
        for f in ["config.json", "model.safetensors", TOKENIZER_FILE] {
            assert!(out.join(f).is_file(), "{f}");
        }
        let (mut back, back_tok) = load_pretrained(&out).unwrap();
        assert_eq!(back.params(), model.params());
        assert_eq!(back.config(), model.config());
        let sentence = "two [ENT_START]cars[ENT_END] collided";
        let ids = back_tok.encode(sentence).unwrap();
        assert_eq!(ids, tok.encode(sentence).unwrap());
        assert!(ids.contains(&back_tok.token_to_id("[ENT_START]").unwrap()));
        let (a, b) = train_steps(&mut back, &ids, 8);
        let (c, d) = train_steps(&mut model, &ids, 8);
        assert_eq!(
            (a, b),
            (c, d),
            "the loaded model trains exactly as the saved one"
        );
        assert!(b < a * 0.8, "loss falls: {a} -> {b}");
        // The root's `latest` pointer resolves too.
        assert_eq!(
            load_pretrained(dir.path()).unwrap().1.vocab_size(),
            tok.vocab_size()
        );
    }

    /// Seed 002's story on a Llama (grouped heads, untied head): both the embedding and the
    /// head grow, the directory is Hugging Face's Llama format, and it loads back whole.
    #[test]
    fn a_llama_with_added_tokens_saves_and_loads_in_llama_format() {
        let text = "start of entity end of entity two llamas walk";
        let mut tok = Tokenizer::char_level(text.chars());
        let cfg = GPTConfig {
            n_heads: 4,
            n_kv_heads: Some(2),
            tie_word_embeddings: false,
            ..GPTConfig::llama_like(GPTConfig {
                vocab_size: tok.vocab_size(),
                max_position_embeddings: 32,
                n_layers: 1,
                d_model: 16,
                d_ff: 24,
                dropout: 0.0,
                ..GPTConfig::default()
            })
        };
        let model = GPT::new(cfg, 3).unwrap();
        tok.add_special_tokens(&["[ENT_START]"]).unwrap();
        let init = [RowInit::Mean(tok.encode("start of entity").unwrap())];
        let mut model = resize_token_embeddings(&model, tok.vocab_size(), &init, 5).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = save_pretrained(dir.path(), "ent", &model, &tok).unwrap();
        let config = std::fs::read_to_string(out.join("config.json")).unwrap();
        assert!(config.contains("LlamaForCausalLM") && config.contains("num_key_value_heads"));
        let (mut back, back_tok) = load_pretrained(&out).unwrap();
        assert_eq!(back.config(), model.config());
        assert_eq!(back.params(), model.params());
        let ids = back_tok.encode("two [ENT_START]llamas").unwrap();
        let (a, b) = train_steps(&mut back, &ids, 4);
        assert_eq!((a, b), train_steps(&mut model, &ids, 4));
        assert!(b < a, "loss falls: {a} -> {b}");
    }

    #[test]
    fn eos_ids_come_from_generation_config_then_config() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        assert_eq!(eos_token_ids(d).unwrap(), Vec::<u32>::new());
        std::fs::write(d.join("config.json"), r#"{"eos_token_id": 7}"#).unwrap();
        assert_eq!(eos_token_ids(d).unwrap(), vec![7]);
        std::fs::write(
            d.join(GENERATION_CONFIG_FILE),
            r#"{"eos_token_id": [2, 5]}"#,
        )
        .unwrap();
        assert_eq!(eos_token_ids(d).unwrap(), vec![2, 5]);
        std::fs::write(d.join(GENERATION_CONFIG_FILE), r#"{"eos_token_id": null}"#).unwrap();
        assert_eq!(eos_token_ids(d).unwrap(), vec![7]);
        std::fs::write(
            d.join(GENERATION_CONFIG_FILE),
            r#"{"eos_token_id": "</s>"}"#,
        )
        .unwrap();
        let err = eos_token_ids(d).unwrap_err().to_string();
        assert!(
            err.contains("generation_config.json") && err.contains("not a token id"),
            "{err}"
        );
    }
}
