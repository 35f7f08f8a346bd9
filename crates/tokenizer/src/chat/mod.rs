//! Chat templates: a conversation (`[{"role": ..., "content": ...}, ...]`) rendered to the text
//! a model was trained on, exactly as transformers' `apply_chat_template` renders it, and the
//! parts of that text the assistant wrote (what an assistant-only loss trains on).
//!
//! [`ChatTemplate`] is the model directory's template (tokenizer_config.json's `chat_template`,
//! a string or a list of named templates, or `chat_template.jinja`) compiled with minijinja in
//! transformers' environment: `trim_blocks` and `lstrip_blocks`, loop controls, Python's string
//! and dict methods, `raise_exception`, `strftime_now`, `tojson` as `json.dumps`, the special
//! tokens (`bos_token`, `eos_token`, ...) as variables, and the `{% generation %}` block that marks
//! assistant text. [`Chat`] is one conversation read from JSON, in key order. [`Rendered`] is the
//! text with the generation blocks' byte ranges; [`ChatTemplate::assistant_spans`] finds the
//! assistant's text also in templates without generation blocks, by rendering prefixes.
//! [`encode_chat`] tokenizes a rendered text and marks the tokens that overlap assistant text, as
//! transformers' `return_assistant_tokens_mask` does.
//!
//! This module knows no model and no data file: it renders and tokenizes one conversation.

mod python;

use std::ops::Range;
use std::path::{Path, PathBuf};

use minijinja::{Environment, Error, ErrorKind, UndefinedBehavior, Value};

use crate::{Tokenizer, TokenizerError};

/// What went wrong loading a template or rendering a conversation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChatError {
    /// A file could not be read.
    #[error("read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The model directory has no chat template.
    #[error("{path}: no chat template (tokenizer_config.json has no \"chat_template\" and there is no chat_template.jinja)")]
    NoTemplate {
        /// The directory.
        path: PathBuf,
    },
    /// tokenizer_config.json or the template list is malformed.
    #[error("{path}: {reason}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The template does not compile.
    #[error("chat template {name:?} does not compile: {reason}")]
    Syntax {
        /// The template's name (`default` for a single one).
        name: String,
        /// minijinja's message, with the line.
        reason: String,
    },
    /// A conversation is not a list of message objects.
    #[error("conversation: {0}")]
    Conversation(String),
    /// Rendering failed, or the template raised an exception (`raise_exception`).
    #[error("chat template {name:?}: {reason}")]
    Render {
        /// The template's name.
        name: String,
        /// The exception's message, or minijinja's.
        reason: String,
    },
    /// The assistant's text cannot be found by rendering prefixes of the conversation.
    #[error("message {message} (assistant): {reason}; mark the assistant's text with {{% generation %}} ... {{% endgeneration %}} in the template")]
    Spans {
        /// The message's index.
        message: usize,
        /// Why.
        reason: String,
    },
    /// Tokenizing the rendered text failed.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// Where transformers' named special tokens go in a template's variables.
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Marks the start and end of a `{% generation %}` block's output: Unicode noncharacters, which
/// no text a user sends should hold (a conversation that does is refused when it matters).
const GEN_START: char = '\u{FDD0}';
const GEN_END: char = '\u{FDD1}';
const GEN_FILTER: &str = "__cohort_generation";

/// One conversation: its messages (keys in the order written), and the optional `tools`,
/// `documents` and extra template variables.
#[derive(Debug, Clone)]
pub struct Chat {
    messages: Vec<Value>,
    tools: Option<Value>,
    documents: Option<Value>,
    kwargs: Vec<(String, Value)>,
}

impl Chat {
    /// A conversation from JSON: a list of messages, or an object with `messages` and optionally
    /// `tools`, `documents` and `chat_template_kwargs` (more template variables). Other keys of
    /// the object are ignored (a data set's `id`, ...).
    pub fn from_json(text: &str) -> Result<Chat, ChatError> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| ChatError::Conversation(format!("invalid JSON: {e}")))?;
        Chat::from_value(value)
    }

    /// A conversation from an already parsed value (see [`Chat::from_json`]).
    pub fn from_value(value: Value) -> Result<Chat, ChatError> {
        let field = |name: &str| {
            value
                .get_attr(name)
                .ok()
                .filter(|v| !v.is_undefined() && !v.is_none())
        };
        let (messages, tools, documents, kwargs) = match value.kind() {
            minijinja::value::ValueKind::Seq => (value.clone(), None, None, Vec::new()),
            minijinja::value::ValueKind::Map => {
                let messages = field("messages")
                    .ok_or_else(|| ChatError::Conversation("no \"messages\" list".to_string()))?;
                let mut kwargs = Vec::new();
                if let Some(extra) = field("chat_template_kwargs") {
                    for key in extra.try_iter().map_err(|_| {
                        ChatError::Conversation("\"chat_template_kwargs\" is not an object".into())
                    })? {
                        let v = extra.get_item(&key).unwrap_or_default();
                        kwargs.push((key.to_string(), v));
                    }
                }
                (messages, field("tools"), field("documents"), kwargs)
            }
            _ => {
                return Err(ChatError::Conversation(
                    "expected a list of messages or an object with \"messages\"".into(),
                ))
            }
        };
        if messages.kind() != minijinja::value::ValueKind::Seq {
            return Err(ChatError::Conversation(
                "\"messages\" is not a list".to_string(),
            ));
        }
        let messages = messages
            .try_iter()
            .map_err(|e| ChatError::Conversation(e.to_string()))?
            .enumerate()
            .map(|(i, m)| normalize_message(i, &m))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Chat {
            messages,
            tools,
            documents,
            kwargs,
        })
    }

    /// Number of messages.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// Whether there are no messages.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// The role of message `i` (`user`, `assistant`, ...), if it has a string one.
    pub fn role(&self, i: usize) -> Option<String> {
        self.messages.get(i).and_then(|m| {
            m.get_attr("role")
                .ok()
                .and_then(|r| r.as_str().map(str::to_string))
        })
    }

    /// The first `n` messages, with the same tools, documents and variables.
    pub fn prefix(&self, n: usize) -> Chat {
        Chat {
            messages: self.messages[..n.min(self.messages.len())].to_vec(),
            ..self.clone()
        }
    }

    /// Appends a message (the serving side's assistant turn, ...).
    pub fn push(&mut self, role: &str, content: &str) {
        self.messages.push(Value::from_iter([
            ("role", Value::from(role)),
            ("content", Value::from(content)),
        ]));
    }
}

/// As transformers: keys whose value is null are dropped (many templates print a literal None
/// otherwise), and reasoning given as `thinking` or `reasoning` is also `reasoning_content`
/// (and `reasoning_content` also `thinking`).
fn normalize_message(i: usize, m: &Value) -> Result<Value, ChatError> {
    if m.kind() != minijinja::value::ValueKind::Map {
        return Err(ChatError::Conversation(format!(
            "message {i} is not an object"
        )));
    }
    let mut entries: Vec<(Value, Value)> = m
        .try_iter()
        .map_err(|e| ChatError::Conversation(e.to_string()))?
        .map(|k| {
            let v = m.get_item(&k).unwrap_or_default();
            (k, v)
        })
        .filter(|(_, v)| !v.is_none())
        .collect();
    let get = |entries: &[(Value, Value)], name: &str| {
        entries
            .iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v.clone())
    };
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|name| get(&entries, name));
    if let Some(r) = reasoning {
        // Python: {"thinking": r, **message, "reasoning_content": r}: thinking first unless
        // the message has it already (where it keeps its own place and value).
        entries.retain(|(k, _)| k.as_str() != Some("reasoning_content"));
        if get(&entries, "thinking").is_none() {
            entries.insert(0, (Value::from("thinking"), r.clone()));
        }
        entries.push((Value::from("reasoning_content"), r));
    }
    Ok(Value::from_iter(entries))
}

/// A rendered conversation: the text, and the byte ranges of its `{% generation %}` blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// What the template wrote.
    pub text: String,
    /// Byte ranges of `text` inside generation blocks, in order, not overlapping.
    pub generation: Vec<Range<usize>>,
}

/// A model's chat template(s), compiled once, with its special tokens.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Template names, the default (or only) one first when there is one.
    names: Vec<String>,
    has_generation: bool,
    special: Vec<(String, String)>,
    /// The templates as written, for [`ChatTemplate::fingerprint`].
    sources: Vec<(String, String)>,
}

impl ChatTemplate {
    /// One template with the special tokens `special` (`("eos_token", "<|im_end|>")`, ...).
    pub fn new(source: &str, special: &[(&str, &str)]) -> Result<ChatTemplate, ChatError> {
        ChatTemplate::named(vec![("default".to_string(), source.to_string())], special)
    }

    /// Several named templates (the list form of tokenizer_config.json).
    fn named(
        templates: Vec<(String, String)>,
        special: &[(&str, &str)],
    ) -> Result<ChatTemplate, ChatError> {
        let mut env = environment();
        let mut has_generation = false;
        let mut names = Vec::new();
        let sources = templates.clone();
        for (name, source) in templates {
            let (source, generation) = rewrite_generation_blocks(&source);
            has_generation |= generation;
            env.add_template_owned(name.clone(), source)
                .map_err(|e| ChatError::Syntax {
                    name: name.clone(),
                    reason: describe(&e),
                })?;
            names.push(name);
        }
        Ok(ChatTemplate {
            env,
            names,
            has_generation,
            special: special
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            sources,
        })
    }

    /// Everything a render depends on (templates and special tokens) in one string, for caches
    /// keyed by it: two templates with the same fingerprint render alike.
    pub fn fingerprint(&self) -> String {
        let mut s = String::new();
        for (name, source) in &self.sources {
            s.push_str(&format!("{name}\0{source}\0"));
        }
        for (name, text) in &self.special {
            s.push_str(&format!("{name}={text}\0"));
        }
        s
    }

    /// The template of a model directory: `chat_template.jinja` when present (transformers
    /// prefers it), else tokenizer_config.json's `chat_template` (a string, or a list of
    /// `{"name", "template"}`); the special tokens from tokenizer_config.json.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<ChatTemplate, ChatError> {
        let dir = dir.as_ref();
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read(&config_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| ChatError::Config {
                path: config_path.clone(),
                reason: format!("invalid JSON: {e}"),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(source) => {
                return Err(ChatError::Io {
                    path: config_path,
                    source,
                })
            }
        };
        let special = special_tokens(&config);
        let special: Vec<(&str, &str)> = special
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let source = std::fs::read_to_string(&jinja).map_err(|source| ChatError::Io {
                path: jinja.clone(),
                source,
            })?;
            return ChatTemplate::new(&source, &special);
        }
        let bad = |reason: &str| ChatError::Config {
            path: config_path.clone(),
            reason: reason.to_string(),
        };
        match config.get("chat_template") {
            Some(serde_json::Value::String(s)) => ChatTemplate::new(s, &special),
            Some(serde_json::Value::Array(list)) => {
                let mut templates = Vec::new();
                for item in list {
                    let (Some(name), Some(template)) = (
                        item.get("name").and_then(|v| v.as_str()),
                        item.get("template").and_then(|v| v.as_str()),
                    ) else {
                        return Err(bad(
                            "a \"chat_template\" list item lacks a string \"name\" or \"template\"",
                        ));
                    };
                    templates.push((name.to_string(), template.to_string()));
                }
                // The default first: it is what a plain render uses.
                templates.sort_by_key(|(n, _)| n != "default");
                if templates.is_empty() {
                    return Err(bad("\"chat_template\" is an empty list"));
                }
                ChatTemplate::named(templates, &special)
            }
            Some(_) => Err(bad("\"chat_template\" is neither a string nor a list")),
            None => Err(ChatError::NoTemplate { path: dir.into() }),
        }
    }

    /// A model directory's template as written (tokenizer_config.json's `chat_template` value,
    /// or chat_template.jinja's text) and its `eos_token`, to copy into another directory; None
    /// when it has no template.
    pub fn source_in_dir(
        dir: impl AsRef<Path>,
    ) -> Result<Option<(serde_json::Value, Option<String>)>, ChatError> {
        let dir = dir.as_ref();
        // Loading it checks that it compiles: a broken template is not copied.
        match ChatTemplate::from_dir(dir) {
            Err(ChatError::NoTemplate { .. }) => return Ok(None),
            Err(e) => return Err(e),
            Ok(_) => {}
        }
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = std::fs::read(&config_path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or(serde_json::Value::Null);
        let eos = special_tokens(&config)
            .into_iter()
            .find(|(k, _)| k == "eos_token")
            .map(|(_, v)| v);
        let jinja = dir.join("chat_template.jinja");
        let template = match std::fs::read_to_string(&jinja) {
            Ok(text) => serde_json::Value::String(text),
            Err(_) => config["chat_template"].clone(),
        };
        Ok(Some((template, eos)))
    }

    /// Whether the template marks the assistant's text with `{% generation %}` blocks.
    pub fn has_generation_blocks(&self) -> bool {
        self.has_generation
    }

    /// A special token's text (`eos_token`, `bos_token`, ...), if the model has it.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The template a conversation renders with: as transformers, `tool_use` when the
    /// conversation has tools and the model has that template, else `default`; a list without
    /// a default is an error.
    fn pick(&self, chat: &Chat) -> Result<&str, ChatError> {
        let has = |n: &str| self.names.iter().any(|m| m == n);
        if chat.tools.is_some() && has("tool_use") {
            return Ok("tool_use");
        }
        if has("default") {
            return Ok("default");
        }
        Err(ChatError::Render {
            name: self.names.join(", "),
            reason: "the model has several chat templates and none is named \"default\"".into(),
        })
    }

    /// Renders `chat` (with the assistant's header after it when `add_generation_prompt`).
    pub fn render(&self, chat: &Chat, add_generation_prompt: bool) -> Result<Rendered, ChatError> {
        let name = self.pick(chat)?;
        let template = self
            .env
            .get_template(name)
            .expect("every name was added at construction");
        let mut vars: Vec<(String, Value)> = self
            .special
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        vars.extend(chat.kwargs.iter().cloned());
        vars.push(("messages".into(), Value::from(chat.messages.clone())));
        vars.push((
            "tools".into(),
            chat.tools.clone().unwrap_or(Value::from(())),
        ));
        vars.push((
            "documents".into(),
            chat.documents.clone().unwrap_or(Value::from(())),
        ));
        vars.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        let ctx = Value::from_iter(vars);
        let raw = template.render(ctx).map_err(|e| ChatError::Render {
            name: name.to_string(),
            reason: describe(&e),
        })?;
        if !self.has_generation {
            return Ok(Rendered {
                text: raw,
                generation: Vec::new(),
            });
        }
        split_generation(&raw).ok_or_else(|| {
            ChatError::Conversation(format!(
                "holds the noncharacter U+{:04X} or U+{:04X}, which marks generation blocks",
                GEN_START as u32, GEN_END as u32
            ))
        })
    }

    /// The text of the whole conversation and the byte ranges the assistant wrote: the
    /// template's generation blocks when it has them; otherwise, for each assistant message i,
    /// what rendering messages 0..=i adds to rendering 0..i with the generation prompt (the
    /// message and the template's end of turn after it). A template whose renders of prefixes
    /// are not prefixes of the whole is an error.
    pub fn assistant_spans(&self, chat: &Chat) -> Result<Rendered, ChatError> {
        let whole = self.render(chat, false)?;
        if self.has_generation {
            return Ok(whole);
        }
        let mut spans = Vec::new();
        for i in 0..chat.len() {
            if chat.role(i).as_deref() != Some("assistant") {
                continue;
            }
            let before = self.render(&chat.prefix(i), true)?.text;
            let through = self.render(&chat.prefix(i + 1), false)?.text;
            let span_err = |reason: &str| ChatError::Spans {
                message: i,
                reason: reason.to_string(),
            };
            if !through.starts_with(&before) {
                return Err(span_err(
                    "rendering the messages before it with the generation prompt is not a prefix of rendering it",
                ));
            }
            if !whole.text.starts_with(&through) {
                return Err(span_err(
                    "rendering the conversation up to it is not a prefix of rendering the whole",
                ));
            }
            if through.len() > before.len() {
                spans.push(before.len()..through.len());
            }
        }
        Ok(Rendered {
            text: whole.text,
            generation: spans,
        })
    }
}

/// A conversation tokenized: ids, and per token whether it overlaps assistant text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTokens {
    /// The rendered text's ids (no special tokens added around it, as transformers).
    pub ids: Vec<u32>,
    /// 1 where the token overlaps one of the spans, else 0.
    pub assistant_mask: Vec<u8>,
}

/// Tokenizes `rendered.text` and marks the tokens overlapping `rendered.generation`, as
/// transformers' `return_assistant_tokens_mask` (a token half inside a span counts).
pub fn encode_chat(tokenizer: &Tokenizer, rendered: &Rendered) -> Result<ChatTokens, ChatError> {
    let (ids, offsets) = tokenizer.encode_with_offsets(&rendered.text)?;
    let mut mask = vec![0u8; ids.len()];
    let spans = &rendered.generation;
    let mut s = 0;
    for (t, &(start, end)) in offsets.iter().enumerate() {
        while s < spans.len() && start >= spans[s].end {
            s += 1;
        }
        if s == spans.len() {
            break;
        }
        if end > spans[s].start {
            mask[t] = 1;
        }
    }
    Ok(ChatTokens {
        ids,
        assistant_mask: mask,
    })
}

/// transformers' Jinja environment (see the module docs).
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", python::tojson);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        },
    );
    env.add_function("strftime_now", |format: String| {
        python::strftime_now(&format)
    });
    env.add_filter(GEN_FILTER, |body: String| -> String {
        format!("{GEN_START}{body}{GEN_END}")
    });
    env.set_formatter(|out, state, value| match python::py_str(value) {
        Some(s) => out.write_str(&s).map_err(Error::from),
        None => minijinja::escape_formatter(out, state, value),
    });
    env
}

/// minijinja's message with its cause, on one line.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s.replace('\n', " ")
}

/// The template with `{% generation %}` / `{% endgeneration %}` (any whitespace control) turned
/// into a filter block, which keeps their whitespace handling (both are block tags) and wraps
/// the block's output in markers; and whether it had any.
fn rewrite_generation_blocks(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut found = false;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(close) = tag.find("%}") else {
            out.push_str(tag);
            rest = "";
            break;
        };
        let inner = &tag[2..close];
        let (open_ctl, body) = match inner.chars().next() {
            Some(c @ ('-' | '+')) => (c.to_string(), &inner[1..]),
            _ => (String::new(), inner),
        };
        let (body, close_ctl) = match body.trim_end().chars().last() {
            Some(c @ ('-' | '+')) => {
                let t = body.trim_end();
                (&t[..t.len() - 1], c.to_string())
            }
            _ => (body, String::new()),
        };
        let replacement = match body.trim() {
            "generation" => Some(format!("filter {GEN_FILTER}")),
            "endgeneration" => Some("endfilter".to_string()),
            _ => None,
        };
        match replacement {
            Some(r) => {
                found = true;
                out.push_str(&format!("{{%{open_ctl} {r} {close_ctl}%}}"));
            }
            None => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    (out, found)
}

/// The text without generation markers, and the outermost blocks' byte ranges; None when the
/// markers do not pair up (the conversation held one).
fn split_generation(raw: &str) -> Option<Rendered> {
    let mut text = String::with_capacity(raw.len());
    let mut spans = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for c in raw.chars() {
        match c {
            GEN_START => {
                if depth == 0 {
                    start = text.len();
                }
                depth += 1;
            }
            GEN_END => {
                depth = depth.checked_sub(1)?;
                if depth == 0 && text.len() > start {
                    spans.push(start..text.len());
                }
            }
            c => text.push(c),
        }
    }
    (depth == 0).then_some(Rendered {
        text,
        generation: spans,
    })
}

/// transformers' `special_tokens_map` from tokenizer_config.json: each named special token that
/// is set, as its text (a string, or an AddedToken object's `content`).
fn special_tokens(config: &serde_json::Value) -> Vec<(String, String)> {
    SPECIAL_TOKENS
        .iter()
        .filter_map(|&name| {
            let v = config.get(name)?;
            let text = match v {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Object(o) => o.get("content")?.as_str()?.to_string(),
                _ => return None,
            };
            Some((name.to_string(), text))
        })
        .collect()
}

#[cfg(test)]
mod tests;
