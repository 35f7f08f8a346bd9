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
                    // A list (Llama 3's three ends) keeps its other ids: each still ends text.
                    Some((_, id)) => v["eos_token_id"] = with_eos(&v["eos_token_id"], id),
                    None => continue,
                },
                _ => continue,
            }
            *bytes = serde_json::to_vec_pretty(&v).expect("JSON values serialize");
        }
        if let Some((_, id)) = eos {
            for (key, value) in &mut self.config_keys {
                if *key == "eos_token_id" {
                    *value = with_eos(value, id);
                }
            }
        }
        self
    }

    /// The same files saying what a model directory's own files say of its special tokens, so
    /// that a model fine-tuned from that directory keeps them: from its tokenizer_config.json
    /// (`tokenizer_config`) the bos/eos/unk/pad tokens and the chat template, from its
    /// generation_config.json (`generation_config`) the whole file (its eos ids, one or a
    /// list, and any sampling defaults), and config.json's ids from the latter. A token
    /// `tokenizer` lacks, or an id outside its vocabulary, is not carried (the computed value
    /// stays): the files never name what the tokenizer cannot produce.
    pub fn carrying(
        mut self,
        tokenizer: &Tokenizer,
        tokenizer_config: Option<&Value>,
        generation_config: Option<&Value>,
    ) -> HfFiles {
        let known = |v: &Value| -> Option<Value> {
            let text = match v {
                Value::Null => return Some(Value::Null),
                Value::String(s) => s.as_str(),
                Value::Object(o) => o.get("content")?.as_str()?,
                _ => return None,
            };
            tokenizer.token_to_id(text).map(|_| json!(text))
        };
        let vocab = tokenizer.vocab_size() as u64;
        let valid_ids = |v: &Value| match v {
            Value::Null => true,
            Value::Array(ids) => ids.iter().all(|id| id.as_u64().is_some_and(|i| i < vocab)),
            one => one.as_u64().is_some_and(|i| i < vocab),
        };
        let mut generation = None;
        for (name, bytes) in &mut self.files {
            let Ok(mut v) = serde_json::from_slice::<Value>(bytes) else {
                continue;
            };
            match (*name, tokenizer_config, generation_config) {
                ("tokenizer_config.json", Some(src), _) => {
                    for key in SPECIAL_KEYS {
                        if let Some(t) = src.get(key).and_then(known) {
                            v[key] = t;
                        }
                    }
                    if let Some(t) = src.get("chat_template").filter(|t| !t.is_null()) {
                        v["chat_template"] = t.clone();
                    }
                }
                ("generation_config.json", _, Some(Value::Object(src))) => {
                    for (key, value) in src {
                        let id_key = ID_KEYS.contains(&key.as_str());
                        if !id_key || valid_ids(value) {
                            v[key.as_str()] = value.clone();
                        }
                    }
                    generation = Some(v.clone());
                }
                _ => continue,
            }
            *bytes = serde_json::to_vec_pretty(&v).expect("JSON values serialize");
        }
        if let Some(generation) = generation {
            for (key, value) in &mut self.config_keys {
                *value = generation[*key].clone();
            }
        }
        // special_tokens_map.json says what tokenizer_config.json now says.
        let config = self
            .files
            .iter()
            .find(|(n, _)| *n == "tokenizer_config.json")
            .and_then(|(_, b)| serde_json::from_slice::<Value>(b).ok());
        if let (Some(config), Some((_, bytes))) = (
            config,
            self.files
                .iter_mut()
                .find(|(n, _)| *n == "special_tokens_map.json"),
        ) {
            let mut map = serde_json::Map::new();
            for key in SPECIAL_KEYS {
                if !config[key].is_null() {
                    map.insert(key.into(), config[key].clone());
                }
            }
            if config["additional_special_tokens"]
                .as_array()
                .is_some_and(|a| !a.is_empty())
            {
                map.insert(
                    "additional_special_tokens".into(),
                    config["additional_special_tokens"].clone(),
                );
            }
            *bytes = serde_json::to_vec_pretty(&Value::Object(map)).expect("JSON values serialize");
        }
        self
    }
}

/// tokenizer_config.json's keys that name a special token.
const SPECIAL_KEYS: [&str; 4] = ["bos_token", "eos_token", "unk_token", "pad_token"];

/// generation_config.json's (and config.json's) keys that hold token ids.
const ID_KEYS: [&str; 3] = ["bos_token_id", "eos_token_id", "pad_token_id"];

/// An `eos_token_id` value that ends text at `id` too: a list gains it, anything else becomes it.
fn with_eos(old: &Value, id: u32) -> Value {
    match old {
        Value::Array(ids) if ids.iter().any(|x| x.as_u64() == Some(u64::from(id))) => old.clone(),
        Value::Array(ids) => {
            let mut ids = ids.clone();
            ids.push(json!(id));
            Value::Array(ids)
        }
        _ => json!(id),
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
    fn a_model_directorys_special_tokens_and_eos_ids_are_carried() {
        let mut tok = Tokenizer::char_level("abc".chars());
        tok.add_special_tokens(&[END_OF_TEXT, "<|im_start|>", "<|im_end|>"])
            .unwrap();
        let (start, end) = (
            tok.token_to_id("<|im_start|>").unwrap(),
            tok.token_to_id("<|im_end|>").unwrap(),
        );
        let config = json!({"bos_token": "<|im_start|>",
            "eos_token": {"content": "<|im_end|>", "special": true},
            "pad_token": "<|im_end|>", "unk_token": "<nope>", "chat_template": "T"});
        let generation = json!({"bos_token_id": start, "eos_token_id": [end, 1],
            "pad_token_id": 9999, "temperature": 0.2});
        let files = hf_files(&tok, 8).carrying(&tok, Some(&config), Some(&generation));
        let tc = file(&files, "tokenizer_config.json");
        assert_eq!(
            (&tc["bos_token"], &tc["eos_token"], &tc["pad_token"]),
            (
                &json!("<|im_start|>"),
                &json!("<|im_end|>"),
                &json!("<|im_end|>")
            )
        );
        // A token the tokenizer lacks is not carried; the template is.
        assert_eq!(
            (&tc["unk_token"], &tc["chat_template"]),
            (&Value::Null, &json!("T"))
        );
        let g = file(&files, "generation_config.json");
        assert_eq!(g["eos_token_id"], json!([end, 1]));
        assert_eq!(g["bos_token_id"], json!(start));
        // An id outside the vocabulary is not carried either.
        assert_eq!(g["pad_token_id"], Value::Null);
        assert_eq!(g["temperature"], json!(0.2));
        assert_eq!(files.config_keys[1], ("eos_token_id", json!([end, 1])));
        let map = file(&files, "special_tokens_map.json");
        assert_eq!(map["eos_token"], "<|im_end|>");
        // The template's end of turn joins a list of eos ids rather than replacing it.
        let files = files.with_chat_template(&tok, json!("T"), Some(END_OF_TEXT));
        let eot = tok.token_to_id(END_OF_TEXT).unwrap();
        assert_eq!(
            file(&files, "generation_config.json")["eos_token_id"],
            json!([end, 1, eot])
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
