//! `POST /v1/chat/completions`: a conversation rendered with the model's chat template (its
//! directory's tokenizer_config.json or chat_template.jinja, with the generation prompt), then
//! generated through the same queue and in-flight batching as completions, plain or streamed
//! (`chat.completion.chunk` events ending with `data: [DONE]`).
//!
//! Generation stops at the template's end of turn (the `eos_token` of tokenizer_config.json,
//! e.g. `<|im_end|>`) or generation_config.json's eos ids, at a `stop` string, or after
//! `max_tokens` (256 when the request does not say), as [`super::stop`] says. Refused by name,
//! as for completions: `tools`, `tool_choice`, `functions`, `response_format`, `logprobs`,
//! `logit_bias`, `n` > 1, penalties. This module never runs a model.

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

use super::stop::run;
use super::{now_secs, unsupported, ApiError, Result, Sampling, NEXT_ID};
use crate::error::ServeError;
use crate::frontend::body::read_body;
use crate::frontend::AppState;

/// Tokens an answer may take when the request sets no `max_tokens`: OpenAI's chat has no limit
/// (the answer ends at the end of turn), but a model that never says it would run 4096 steps.
const DEFAULT_MAX_TOKENS: usize = 256;

/// A parsed chat completion request.
struct ChatRequest {
    model: String,
    chat: Chat,
    sampling: Sampling,
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
    for (k, v) in m {
        if v.is_null() {
            continue;
        }
        match k.as_str() {
            "model" | "messages" | "user" => {}
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
    })
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
    let prompt_tokens = prompt.len();
    let opts: SampleOptions = req.sampling.opts.clone();
    let (tokens, done) = lv.generate(prompt, opts, !req.sampling.ignore_eos)?;
    let id = format!("chatcmpl-{}", NEXT_ID.fetch_add(1, Ordering::Relaxed));
    let created = now_secs();
    let stopper = req.sampling.stopper(&lv);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_requests_are_read_or_refused_by_field() {
        let ok = |v: Value| parse(v.to_string().as_bytes());
        let r = ok(json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 7, "temperature": 0, "seed": 2, "stop": ["a", "b"], "stream": true, "top_k": 3, "top_p": 0.5}))
        .unwrap();
        assert_eq!(r.sampling.opts.top_p, 0.5);
        assert_eq!(
            (
                r.sampling.opts.max_new_tokens,
                r.sampling.opts.top_k,
                r.sampling.stop.len(),
                r.sampling.stream
            ),
            (7, Some(3), 2, true)
        );
        let m = json!([{"role": "user", "content": "x"}]);
        for (extra, param) in [
            (json!({"tools": []}), "tools"),
            (json!({"top_p": -0.5}), "top_p"),
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
