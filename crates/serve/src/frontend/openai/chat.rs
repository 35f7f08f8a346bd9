//! `POST /v1/chat/completions`: a conversation rendered with the model's chat template (its
//! directory's tokenizer_config.json or chat_template.jinja, with the generation prompt), then
//! generated through the same queue and in-flight batching as completions, plain or streamed
//! (`chat.completion.chunk` events ending with `data: [DONE]`).
//!
//! Generation stops at the template's end of turn (the `eos_token` of tokenizer_config.json,
//! e.g. `<|im_end|>`), which is not part of the answer, or at the first of up to four `stop`
//! strings, which is cut off with what follows (`finish_reason` "stop"), else after
//! `max_tokens` ("length"; 256 when the request does not say). Streamed text is held back
//! while it could be the start of a stop string, so no event ever carries part of one.
//! Stopping closes the generation's token channel, so the instance ends it after its current
//! step. Refused by name, as for completions: `tools`, `tool_choice`, `functions`,
//! `response_format`, `logprobs`, `logit_bias`, `n` > 1, `top_p` < 1, penalties. This module
//! never runs a model.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cohort_gpt::sample::SampleOptions;
use cohort_tokenizer::Chat;
use serde_json::{json, Value};

use super::{now_secs, unsupported, ApiError, Result, Sampling, NEXT_ID};
use crate::error::ServeError;
use crate::frontend::body::read_body;
use crate::frontend::AppState;
use crate::model::LoadedVersion;
use crate::text::Detokenizer;

/// Tokens an answer may take when the request sets no `max_tokens`: OpenAI's chat has no limit
/// (the answer ends at the end of turn), but a model that never says it would run 4096 steps.
const DEFAULT_MAX_TOKENS: usize = 256;

/// OpenAI's most stop strings per request.
const MAX_STOPS: usize = 4;

/// A parsed chat completion request.
struct ChatRequest {
    model: String,
    chat: Chat,
    sampling: Sampling,
    stop: Vec<String>,
}

fn parse(body: &[u8]) -> Result<ChatRequest> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid("body", format!("the body is not JSON: {e}")))?;
    let Value::Object(m) = &v else {
        return Err(ApiError::invalid("body", "the body must be a JSON object"));
    };
    let model = match m.get("model") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        _ => return Err(ApiError::invalid("model", "model (a string) is required")),
    };
    let messages = match m.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        _ => {
            return Err(ApiError::invalid(
                "messages",
                "messages (a non-empty list of {role, content}) is required",
            ))
        }
    };
    let mut sampling = Sampling::default();
    sampling.opts.max_new_tokens = DEFAULT_MAX_TOKENS;
    let mut stop = Vec::new();
    for (k, v) in m {
        if v.is_null() {
            continue;
        }
        match k.as_str() {
            "model" | "messages" | "user" => {}
            "stop" => {
                stop = match v {
                    Value::String(s) => vec![s.clone()],
                    Value::Array(a) if a.iter().all(Value::is_string) => a
                        .iter()
                        .filter_map(|s| s.as_str().map(str::to_string))
                        .collect(),
                    _ => {
                        return Err(ApiError::invalid(
                            k,
                            "stop must be a string or a list of strings",
                        ))
                    }
                };
                if stop.len() > MAX_STOPS || stop.iter().any(String::is_empty) {
                    return Err(ApiError::invalid(
                        k,
                        format!("stop: at most {MAX_STOPS} non-empty strings"),
                    ));
                }
            }
            "logprobs" => {
                if v.as_bool() != Some(false) {
                    return Err(unsupported(k, "not supported by cohort"));
                }
            }
            "tools"
            | "tool_choice"
            | "functions"
            | "function_call"
            | "parallel_tool_calls"
            | "response_format"
            | "logit_bias"
            | "top_logprobs"
            | "modalities"
            | "audio"
            | "prediction"
            | "reasoning_effort" => return Err(unsupported(k, "not supported by cohort")),
            _ if sampling.field(k, v)? => {}
            other => return Err(ApiError::invalid(other, format!("unknown field {other}"))),
        }
    }
    if sampling.include_usage && !sampling.stream {
        return Err(ApiError::invalid(
            "stream_options",
            "stream_options is only allowed with stream: true",
        ));
    }
    let messages = messages
        .iter()
        .map(|m| {
            // OpenAI's content may be a list of parts; text parts are joined, others refused.
            let mut m = m.clone();
            if let Some(parts) = m.get("content").and_then(Value::as_array) {
                let mut text = String::new();
                for p in parts {
                    match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => text.push_str(t),
                        _ => {
                            return Err(unsupported(
                                "messages.content",
                                "only text parts are supported",
                            ))
                        }
                    }
                }
                m["content"] = Value::String(text);
            }
            Ok(m)
        })
        .collect::<Result<Vec<Value>>>()?;
    let chat = Chat::from_json(&Value::Array(messages).to_string())
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    Ok(ChatRequest {
        model,
        chat,
        sampling,
        stop,
    })
}

/// Why a generation ended.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Finish {
    Stop,
    Length,
}

impl Finish {
    fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// The answer's text as tokens arrive: stops at the end-of-turn id or a stop string, and says
/// how much is safe to send (never part of a stop string).
struct Stopper {
    stop: Vec<String>,
    eos: Option<u32>,
    text: String,
    /// Bytes of `text` already handed out.
    sent: usize,
    /// Tokens of the answer (the end-of-turn token excluded).
    tokens: usize,
}

impl Stopper {
    /// Adds a token and its decoded `piece`: Some when generation must stop.
    fn push(&mut self, id: u32, piece: &str) -> Option<Finish> {
        if Some(id) == self.eos {
            return Some(Finish::Stop);
        }
        self.tokens += 1;
        self.text.push_str(piece);
        self.cut().then_some(Finish::Stop)
    }

    /// Adds the detokenizer's held-back rest at the end; true when it completes a stop string.
    fn finish(&mut self, rest: &str) -> bool {
        self.text.push_str(rest);
        self.cut()
    }

    /// Cuts the text at the first stop string; whether there was one.
    fn cut(&mut self) -> bool {
        let first = self
            .stop
            .iter()
            .filter_map(|s| self.text.find(s.as_str()))
            .min();
        if let Some(at) = first {
            self.text.truncate(at);
            return true;
        }
        false
    }

    /// The text not sent yet that cannot be the start of a stop string (`all`: everything).
    fn take(&mut self, all: bool) -> String {
        let mut end = self.text.len();
        if !all {
            for s in &self.stop {
                for (i, _) in s.char_indices().skip(1) {
                    if self.text.ends_with(&s[..i]) {
                        end = end.min(self.text.len() - i);
                    }
                }
            }
        }
        let end = end.max(self.sent);
        let piece = self.text[self.sent..end].to_string();
        self.sent = end;
        piece
    }
}

/// `POST /v1/chat/completions`.
pub(super) async fn chat_completions(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response> {
    let start = Instant::now();
    let body = read_body(&headers, body, app.max_body_bytes).await?;
    let req = parse(&body)?;
    let lv = app.repo.resolve(&req.model, None)?;
    let text_err = |reason: String| ServeError::Text {
        model: lv.model.clone(),
        reason,
    };
    let (codec, template) = match (&lv.text, &lv.chat) {
        (Ok(c), Ok(t)) => (c, t.clone()),
        (Err(reason), _) | (_, Err(reason)) => {
            let e = text_err(reason.clone());
            return Err(lv.reject(e, start).into());
        }
    };
    let prompt = template
        .render(&req.chat, true)
        .map_err(|e| e.to_string())
        .and_then(|r| codec.encode(&r.text));
    let prompt = match prompt {
        Ok(p) if !p.is_empty() => p,
        Ok(_) => {
            lv.reject(ServeError::malformed("empty prompt"), start);
            return Err(ApiError::invalid(
                "messages",
                "the conversation renders to no token",
            ));
        }
        Err(reason) => {
            return Err(ApiError::from(lv.reject(text_err(reason), start)).with_param("messages"))
        }
    };
    let eos = template
        .special_token("eos_token")
        .and_then(|t| codec.encode(t).ok())
        .filter(|ids| ids.len() == 1)
        .map(|ids| ids[0]);
    let prompt_tokens = prompt.len();
    let opts: SampleOptions = req.sampling.opts.clone();
    let (tokens, done) = lv.generate(prompt, opts)?;
    let id = format!("chatcmpl-{}", NEXT_ID.fetch_add(1, Ordering::Relaxed));
    let created = now_secs();
    let stopper = Stopper {
        stop: req.stop,
        eos,
        text: String::new(),
        sent: 0,
        tokens: 0,
    };
    let usage = move |n: usize| {
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": n,
               "total_tokens": prompt_tokens + n})
    };
    if !req.sampling.stream {
        let (mut stopper, finish) = run(&lv, tokens, done, start, stopper, None).await?;
        let text = stopper.take(true);
        return Ok(Json(json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": lv.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": null, "finish_reason": finish.as_str()}],
            "usage": usage(stopper.tokens),
        }))
        .into_response());
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<std::result::Result<Event, Infallible>>(64);
    let include_usage = req.sampling.include_usage;
    tokio::spawn(async move {
        let chunk = |delta: Value, finish: Option<&str>| {
            let mut v = json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": lv.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
            });
            if include_usage {
                v["usage"] = Value::Null;
            }
            Event::default().data(v.to_string())
        };
        let _ = tx
            .send(Ok(chunk(json!({"role": "assistant", "content": ""}), None)))
            .await;
        let piece =
            |text: String| (!text.is_empty()).then(|| chunk(json!({"content": text}), None));
        match run(&lv, tokens, done, start, stopper, Some((&tx, &piece))).await {
            Ok((mut stopper, finish)) => {
                let rest = stopper.take(true);
                if !rest.is_empty() {
                    let _ = tx.send(Ok(chunk(json!({"content": rest}), None))).await;
                }
                let _ = tx.send(Ok(chunk(json!({}), Some(finish.as_str())))).await;
                if include_usage {
                    let v = json!({"id": id, "object": "chat.completion.chunk", "created": created,
                        "model": lv.model, "choices": [], "usage": usage(stopper.tokens)});
                    let _ = tx.send(Ok(Event::default().data(v.to_string()))).await;
                }
            }
            Err(e) => {
                let _ = tx
                    .send(Ok(Event::default().data(e.body().to_string())))
                    .await;
            }
        }
        let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
    });
    Ok(Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx)).into_response())
}

type Tokens = tokio::sync::mpsc::UnboundedReceiver<u32>;
type Done = tokio::sync::oneshot::Receiver<std::result::Result<Vec<u32>, ServeError>>;
type EventTx = tokio::sync::mpsc::Sender<std::result::Result<Event, Infallible>>;
/// The event a piece of streamed text goes out in (None for nothing to send).
type PieceEvent<'a> = dyn Fn(String) -> Option<Event> + Send + Sync + 'a;

/// Reads the generation's tokens into `stopper` until it stops or the generation ends; when
/// streaming (`sink`), sends `event(text)` on the channel for each piece that is safe to send.
/// Stopping early closes the token channel, which ends the generation after its current step
/// (counted a success); a client gone (the event stream closed) drops both receivers, which
/// counts it cancelled.
async fn run(
    lv: &LoadedVersion,
    mut tokens: Tokens,
    mut done: Done,
    start: Instant,
    mut stopper: Stopper,
    sink: Option<(&EventTx, &PieceEvent<'_>)>,
) -> Result<(Stopper, Finish)> {
    let codec = lv
        .text
        .as_ref()
        .map_err(|r| ApiError::invalid("model", r.clone()))?;
    let mut detok = Detokenizer::new(codec);
    while let Some(id) = tokens.recv().await {
        let piece = detok.push(id);
        if let Some(finish) = stopper.push(id, &piece) {
            // Closing the token channel ends the generation after its current step; the
            // instance then answers `done` as for a finished one, so it counts as a success.
            drop(tokens);
            let out = done.await.unwrap_or_else(|_| Err(lv.lost()));
            lv.account(&out, start);
            return Ok((stopper, finish));
        }
        if let Some((tx, event)) = sink {
            if let Some(e) = event(stopper.take(false)) {
                if tx.send(Ok(e)).await.is_err() {
                    break;
                }
            }
        }
    }
    if sink.is_some_and(|(tx, _)| tx.is_closed()) {
        drop(tokens);
        if let Ok(out) = done.try_recv() {
            lv.account(&out, start);
        }
        return Err(ApiError::invalid("stream", "the client went away"));
    }
    let out = (&mut done).await.unwrap_or_else(|_| Err(lv.lost()));
    lv.account(&out, start);
    out?;
    let finish = if stopper.finish(&detok.finish()) {
        Finish::Stop
    } else {
        Finish::Length
    };
    Ok((stopper, finish))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stopper(stop: &[&str]) -> Stopper {
        Stopper {
            stop: stop.iter().map(|s| s.to_string()).collect(),
            eos: Some(9),
            text: String::new(),
            sent: 0,
            tokens: 0,
        }
    }

    #[test]
    fn stop_strings_cut_the_text_and_are_never_streamed() {
        let mut s = stopper(&["END", "\n\n"]);
        let mut streamed = String::new();
        let pieces = ["hel", "lo E", "N", "x", " wor", "ld E", "ND more"];
        for (i, piece) in pieces.iter().enumerate() {
            let finish = s.push(1, piece);
            if i + 1 == pieces.len() {
                assert_eq!(finish, Some(Finish::Stop));
                break;
            }
            assert_eq!(finish, None);
            streamed += &s.take(false);
            if i == 1 {
                // "E" may start "END": held back.
                assert_eq!(streamed, "hello ");
            }
        }
        streamed += &s.take(true);
        assert_eq!(streamed, "hello ENx world ");
        let mut s = stopper(&[]);
        assert_eq!(s.push(3, "a"), None);
        assert_eq!(s.push(9, ""), Some(Finish::Stop));
        assert_eq!((s.take(true), s.tokens), ("a".to_string(), 1));
    }

    #[test]
    fn chat_requests_are_read_or_refused_by_field() {
        let ok = |v: Value| parse(v.to_string().as_bytes());
        let r = ok(json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 7, "temperature": 0, "seed": 2, "stop": ["a", "b"], "stream": true, "top_k": 3}))
        .unwrap();
        assert_eq!(
            (
                r.sampling.opts.max_new_tokens,
                r.sampling.opts.top_k,
                r.stop.len(),
                r.sampling.stream
            ),
            (7, Some(3), 2, true)
        );
        let m = json!([{"role": "user", "content": "x"}]);
        for (extra, param) in [
            (json!({"tools": []}), "tools"),
            (json!({"top_p": 0.5}), "top_p"),
            (json!({"n": 3}), "n"),
            (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
            (
                json!({"response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (json!({"frobnicate": 1}), "frobnicate"),
            (json!({"logprobs": true}), "logprobs"),
        ] {
            let mut body = json!({"model": "m", "messages": m});
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            let e = ok(body.clone()).err().unwrap();
            assert_eq!(e.body()["error"]["param"], param, "{body}");
        }
        let e = ok(json!({"model": "m", "messages": []})).err().unwrap();
        assert_eq!(e.body()["error"]["param"], "messages");
    }
}
