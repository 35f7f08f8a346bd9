//! The files beside config.json and model.safetensors that Hugging Face's `AutoTokenizer` and
//! `AutoModelForCausalLM` read to load a directory without guessing: `tokenizer_config.json`
//! (which tokenizer class reads tokenizer.json, the context length, the special tokens),
//! `special_tokens_map.json`, `generation_config.json`, and the token ids config.json must carry.
//!
//! Without them `transformers` takes GPT-2's defaults: bos/eos id 50256 (outside a small
//! vocabulary, so every load warns) and a GPT-2 byte-level tokenizer class for a tokenizer that
//! may be character-level (so `AutoTokenizer` gives the wrong ids). This module only computes the
//! files' contents from a tokenizer and a context length; it never writes and never sees a model.

use serde_json::{json, Value};

use crate::Tokenizer;

/// GPT-2's one special token, its beginning and end of text.
const END_OF_TEXT: &str = "<|endoftext|>";

/// What a model directory needs beside tokenizer.json for Hugging Face to load it as it is.
#[derive(Debug, Clone)]
pub struct HfFiles {
    /// (file name, contents): tokenizer_config.json, special_tokens_map.json,
    /// generation_config.json.
    pub files: Vec<(&'static str, Vec<u8>)>,
    /// `bos_token_id`, `eos_token_id`, `pad_token_id` for the model's config.json.
    pub config_keys: Vec<(&'static str, Value)>,
}

impl HfFiles {
    /// A model without a tokenizer (token ids as data): no files, and config.json says it has
    /// no bos/eos/pad ids instead of inheriting GPT-2's 50256.
    pub fn without_tokenizer() -> HfFiles {
        HfFiles {
            files: Vec::new(),
            config_keys: ["bos_token_id", "eos_token_id", "pad_token_id"]
                .into_iter()
                .map(|k| (k, Value::Null))
                .collect(),
        }
    }
}

impl HfFiles {
    /// The same files carrying a chat template (`template`: tokenizer_config.json's
    /// `chat_template` value, a string or a list of named templates) and, when `eos` is one of
    /// the tokenizer's tokens, that end-of-turn token as the end of text everywhere (
    /// tokenizer_config.json, generation_config.json, config.json's `eos_token_id`), so that a
    /// server stops where the template ends a turn.
    pub fn with_chat_template(
        mut self,
        tokenizer: &Tokenizer,
        template: Value,
        eos: Option<&str>,
    ) -> HfFiles {
        let eos = eos.and_then(|t| tokenizer.token_to_id(t).map(|id| (t, id)));
        for (name, bytes) in &mut self.files {
            let Ok(mut v) = serde_json::from_slice::<Value>(bytes) else {
                continue;
            };
            match *name {
                "tokenizer_config.json" => {
                    v["chat_template"] = template.clone();
                    if let Some((t, _)) = eos {
                        v["eos_token"] = json!(t);
                    }
                }
                "special_tokens_map.json" => match eos {
                    Some((t, _)) => v["eos_token"] = json!(t),
                    None => continue,
                },
                "generation_config.json" => match eos {
                    Some((_, id)) => v["eos_token_id"] = json!(id),
                    None => continue,
                },
                _ => continue,
            }
            *bytes = serde_json::to_vec_pretty(&v).expect("JSON values serialize");
        }
        if let Some((_, id)) = eos {
            for (key, value) in &mut self.config_keys {
                if *key == "eos_token_id" {
                    *value = json!(id);
                }
            }
        }
        self
    }
}

/// The files and config.json keys for `tokenizer` in front of a model of `positions` positions.
pub fn hf_files(tokenizer: &Tokenizer, positions: usize) -> HfFiles {
    // GPT-2's convention: <|endoftext|> begins and ends a text. A tokenizer without it has no
    // bos/eos, and says so (null) rather than inherit GPT-2's id 50256.
    let end = tokenizer
        .token_to_id(END_OF_TEXT)
        .map(|id| (END_OF_TEXT, id));
    let (token, id) = match end {
        Some((t, id)) => (json!(t), json!(id)),
        None => (Value::Null, Value::Null),
    };
    let additional: Vec<String> = tokenizer
        .special_tokens()
        .into_iter()
        .filter(|t| t != END_OF_TEXT)
        .collect();
    let tokenizer_config = json!({
        // The generic fast tokenizer reads tokenizer.json as it is, whatever its model.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": positions,
        "bos_token": token,
        "eos_token": token,
        "unk_token": Value::Null,
        "pad_token": Value::Null,
        "additional_special_tokens": additional,
        "clean_up_tokenization_spaces": false,
    });
    let mut special_map = serde_json::Map::new();
    if end.is_some() {
        special_map.insert("bos_token".into(), token.clone());
        special_map.insert("eos_token".into(), token.clone());
    }
    if !additional.is_empty() {
        special_map.insert("additional_special_tokens".into(), json!(additional));
    }
    let generation = json!({ "bos_token_id": id, "eos_token_id": id, "pad_token_id": Value::Null });
    let pretty = |v: &Value| serde_json::to_vec_pretty(v).expect("JSON values serialize");
    HfFiles {
        files: vec![
            ("tokenizer_config.json", pretty(&tokenizer_config)),
            (
                "special_tokens_map.json",
                pretty(&Value::Object(special_map)),
            ),
            ("generation_config.json", pretty(&generation)),
        ],
        config_keys: vec![
            ("bos_token_id", id.clone()),
            ("eos_token_id", id),
            ("pad_token_id", Value::Null),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(files: &HfFiles, name: &str) -> Value {
        let (_, bytes) = files.files.iter().find(|(n, _)| *n == name).unwrap();
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn a_char_tokenizer_has_no_bos_and_lists_its_added_special_tokens() {
        let mut tok = Tokenizer::char_level("abc".chars());
        tok.add_special_tokens(&["[ENT]"]).unwrap();
        let files = hf_files(&tok, 64);
        let config = file(&files, "tokenizer_config.json");
        assert_eq!(config["tokenizer_class"], "PreTrainedTokenizerFast");
        assert_eq!(config["model_max_length"], 64);
        assert_eq!(config["eos_token"], Value::Null);
        assert_eq!(config["additional_special_tokens"], json!(["[ENT]"]));
        assert_eq!(
            file(&files, "generation_config.json")["eos_token_id"],
            Value::Null
        );
        assert_eq!(files.config_keys[0], ("bos_token_id", Value::Null));
    }

    #[test]
    fn a_chat_template_comes_with_its_end_of_turn_as_eos() {
        let mut tok = Tokenizer::char_level("abc".chars());
        tok.add_special_tokens(&["<|im_end|>"]).unwrap();
        let id = tok.token_to_id("<|im_end|>").unwrap();
        let files = hf_files(&tok, 8).with_chat_template(&tok, json!("T"), Some("<|im_end|>"));
        let config = file(&files, "tokenizer_config.json");
        assert_eq!(
            (
                config["chat_template"].as_str(),
                config["eos_token"].as_str()
            ),
            (Some("T"), Some("<|im_end|>"))
        );
        assert_eq!(file(&files, "generation_config.json")["eos_token_id"], id);
        assert_eq!(files.config_keys[1], ("eos_token_id", json!(id)));
        // An end of turn the tokenizer lacks changes no eos.
        let files = hf_files(&tok, 8).with_chat_template(&tok, json!("T"), Some("<x>"));
        assert_eq!(
            file(&files, "tokenizer_config.json")["eos_token"],
            Value::Null
        );
    }

    #[test]
    fn gpt2s_end_of_text_is_bos_and_eos() {
        let mut tok = Tokenizer::char_level("abc".chars());
        tok.add_special_tokens(&[END_OF_TEXT, "[X]"]).unwrap();
        let id = tok.token_to_id(END_OF_TEXT).unwrap();
        let files = hf_files(&tok, 8);
        assert_eq!(
            file(&files, "special_tokens_map.json")["eos_token"],
            END_OF_TEXT
        );
        assert_eq!(
            file(&files, "special_tokens_map.json")["additional_special_tokens"],
            json!(["[X]"])
        );
        assert_eq!(file(&files, "generation_config.json")["bos_token_id"], id);
        assert_eq!(files.config_keys[1], ("eos_token_id", json!(id)));
    }
}
