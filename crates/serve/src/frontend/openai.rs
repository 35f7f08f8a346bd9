//! An OpenAI-compatible front end on the HTTP port, as vLLM's and Triton's OpenAI frontends:
//! `GET /v1/models`, `POST /v1/completions` (non-streaming, and streaming as server-sent
//! events `data: {chunk}` ending with `data: [DONE]`) and `POST /v1/chat/completions` (the
//! model's chat template, see [`chat`]), so that the official `openai` clients work against
//! cohort unchanged.
//!
//! Completions run through the same queue, in-flight batching and sampler as the generate
//! extension, and end as chat answers do ([`stop`]): at the model's end of text
//! (generation_config.json's eos ids; vLLM's `ignore_eos` runs past it), at a `stop` string, or
//! after `max_tokens`. Sampling takes `temperature`, `top_p` (nucleus), `top_k` (vLLM's
//! extension) and `seed`. What OpenAI's API has and a cohort GPT cannot honour is refused with
//! a 400 that names the field, never silently ignored: `n` and `best_of` other than 1,
//! `logprobs`, `suffix`, `echo`, non-zero presence/frequency penalties, `logit_bias`, more than
//! one prompt. `user` is accepted and ignored (it only labels the caller). Without `seed` the
//! seed is `cohort sample`'s fixed 1337, so an unseeded completion is reproducible (OpenAI's
//! would vary).
//!
//! Every failure is OpenAI's error JSON, `{"error": {"message", "type", "param", "code"}}`, with
//! a 4xx status for the caller's mistakes. This module never runs a model.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cohort_gpt::sample::SampleOptions;
use serde_json::{json, Value};

mod chat;
mod stop;

use super::body::read_body;
use super::AppState;
use crate::error::{ErrorKind, ServeError};
use crate::{MAX_GENERATE_TOKENS, SERVER_NAME};

/// The routes, merged into the HTTP router.
pub(crate) fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
}

/// An error as OpenAI's API writes it.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<String>,
    code: Option<&'static str>,
}

impl ApiError {
    pub(crate) fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.to_string()),
            code: None,
        }
    }
}

impl From<ServeError> for ApiError {
    fn from(e: ServeError) -> ApiError {
        let (status, code) = match e.kind() {
            ErrorKind::BadRequest => (StatusCode::BAD_REQUEST, None),
            ErrorKind::NotFound => (StatusCode::NOT_FOUND, Some("model_not_found")),
            ErrorKind::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, None),
            ErrorKind::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, None),
            ErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, None),
        };
        ApiError {
            status,
            message: e.to_string(),
            param: None,
            code,
        }
    }
}

impl ApiError {
    pub(crate) fn body(&self) -> Value {
        let kind = if self.status.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        json!({"error": {
            "message": self.message,
            "type": kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        tracing::debug!(status = self.status.as_u16(), error = %self.message, "OpenAI request failed");
        (self.status, Json(self.body())).into_response()
    }
}

pub(crate) type Result<T> = std::result::Result<T, ApiError>;

pub(crate) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `GET /v1/models`: every ready model, as OpenAI lists models.
async fn models(State(app): State<Arc<AppState>>) -> Json<Value> {
    let mut names: Vec<String> = app.repo.index(true).into_iter().map(|e| e.name).collect();
    names.dedup();
    let data: Vec<Value> = names
        .iter()
        .map(|n| json!({"id": n, "object": "model", "created": 0, "owned_by": SERVER_NAME}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// The sampling and streaming fields completions and chat completions share.
pub(crate) struct Sampling {
    pub opts: SampleOptions,
    pub stream: bool,
    pub include_usage: bool,
    /// Strings that end the answer (cut off with what follows).
    pub stop: Vec<String>,
    /// vLLM's `ignore_eos`: generate past the model's end of text.
    pub ignore_eos: bool,
}

/// OpenAI's most stop strings per request.
const MAX_STOPS: usize = 4;

impl Default for Sampling {
    /// Without `seed` the seed is `cohort sample`'s fixed 1337; 16 tokens as OpenAI's default.
    fn default() -> Sampling {
        Sampling {
            opts: SampleOptions {
                max_new_tokens: 16,
                temperature: 1.0,
                top_k: None,
                top_p: 1.0,
                seed: 1337,
            },
            stream: false,
            include_usage: false,
            stop: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// `k: why` as a 400 naming field `k`.
pub(crate) fn unsupported(k: &str, why: &str) -> ApiError {
    ApiError::invalid(k, format!("{k}: {why}"))
}

impl Sampling {
    /// What reads the answer's tokens until it ends: this request's stop strings, and the
    /// model's end of text unless `ignore_eos`.
    fn stopper(&self, lv: &crate::model::LoadedVersion) -> stop::Stopper {
        let eos = if self.ignore_eos {
            Arc::from(Vec::new())
        } else {
            lv.eos.clone()
        };
        stop::Stopper::new(self.stop.clone(), eos)
    }

    /// Reads field `k` if it is one of the shared ones (true), refusing what cannot be honoured.
    pub(crate) fn field(&mut self, k: &str, v: &Value) -> Result<bool> {
        let number = || {
            v.as_f64()
                .ok_or_else(|| ApiError::invalid(k, format!("{k} must be a number, not {v}")))
        };
        match k {
            "max_tokens" | "max_completion_tokens" => {
                let n = v
                    .as_u64()
                    .filter(|&n| n >= 1 && n as usize <= MAX_GENERATE_TOKENS);
                self.opts.max_new_tokens = n.ok_or_else(|| {
                    ApiError::invalid(
                        k,
                        format!("{k} must be an integer in 1..={MAX_GENERATE_TOKENS}, not {v}"),
                    )
                })? as usize;
            }
            "temperature" => {
                let t = number()?;
                if !(0.0..=2.0).contains(&t) {
                    return Err(ApiError::invalid(
                        k,
                        format!("temperature must be in 0..=2 (0 = greedy), not {t}"),
                    ));
                }
                self.opts.temperature = t as f32;
            }
            "top_p" => {
                let p = number()?;
                if !(0.0..=1.0).contains(&p) {
                    return Err(ApiError::invalid(
                        k,
                        format!("top_p must be in 0..=1 (1 = all tokens), not {p}"),
                    ));
                }
                self.opts.top_p = p as f32;
            }
            "top_k" => {
                let k_ = v.as_i64().ok_or_else(|| {
                    ApiError::invalid(k, format!("top_k must be an integer, not {v}"))
                })?;
                self.opts.top_k = usize::try_from(k_).ok().filter(|&k| k > 0);
            }
            "seed" => {
                self.opts.seed = v
                    .as_u64()
                    .or_else(|| v.as_i64().map(|s| s as u64))
                    .ok_or_else(|| {
                        ApiError::invalid(k, format!("seed must be an integer, not {v}"))
                    })?;
            }
            "stop" => {
                self.stop = match v {
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
                if self.stop.len() > MAX_STOPS || self.stop.iter().any(String::is_empty) {
                    return Err(ApiError::invalid(
                        k,
                        format!("stop: at most {MAX_STOPS} non-empty strings"),
                    ));
                }
            }
            "ignore_eos" => {
                self.ignore_eos = v.as_bool().ok_or_else(|| {
                    ApiError::invalid(k, format!("ignore_eos must be a boolean, not {v}"))
                })?;
            }
            "stream" => {
                self.stream = v.as_bool().ok_or_else(|| {
                    ApiError::invalid(k, format!("stream must be a boolean, not {v}"))
                })?;
            }
            "stream_options" => {
                let Some(o) = v.as_object() else {
                    return Err(ApiError::invalid(k, "stream_options must be an object"));
                };
                for (ok, ov) in o {
                    match (ok.as_str(), ov.as_bool()) {
                        ("include_usage", Some(b)) => self.include_usage = b,
                        _ => {
                            return Err(unsupported(
                                &format!("stream_options.{ok}"),
                                "only include_usage (a boolean) is supported",
                            ))
                        }
                    }
                }
            }
            "n" | "best_of" => {
                if v.as_u64() != Some(1) {
                    return Err(unsupported(k, "only 1 completion per request"));
                }
            }
            "presence_penalty" | "frequency_penalty" => {
                if number()? != 0.0 {
                    return Err(unsupported(k, "only 0 (no penalties)"));
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// A parsed completion request.
struct Completion {
    model: String,
    prompt: Prompt,
    sampling: Sampling,
}

enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

/// Reads a completion request, refusing by name what cannot be honoured.
fn parse_completion(body: &[u8]) -> Result<Completion> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid("body", format!("the body is not JSON: {e}")))?;
    let Value::Object(m) = v else {
        return Err(ApiError::invalid("body", "the body must be a JSON object"));
    };
    let model = match m.get("model") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        _ => return Err(ApiError::invalid("model", "model (a string) is required")),
    };
    let prompt =
        match m.get("prompt") {
            Some(Value::String(s)) => Prompt::Text(s.clone()),
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                Prompt::Text(a[0].as_str().unwrap_or_default().to_string())
            }
            Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_u64) => Prompt::Ids(
                a.iter()
                    .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| ApiError::invalid("prompt", "a token id does not fit in u32"))?,
            ),
            Some(Value::Array(_)) => return Err(ApiError::invalid(
                "prompt",
                "one prompt per request: a string, a list of one string, or a list of token ids",
            )),
            _ => {
                return Err(ApiError::invalid(
                    "prompt",
                    "prompt (a string or a list of token ids) is required",
                ))
            }
        };
    let mut common = Sampling::default();
    for (k, v) in &m {
        // null is what clients send for "not set"
        if v.is_null() {
            continue;
        }
        match k.as_str() {
            "model" | "prompt" | "user" => {}
            "echo" => {
                if v.as_bool() != Some(false) {
                    return Err(unsupported(k, "not supported (the prompt is never echoed)"));
                }
            }
            "logprobs" | "suffix" | "logit_bias" => {
                return Err(unsupported(k, "not supported by cohort"))
            }
            _ if common.field(k, v)? => {}
            other => return Err(ApiError::invalid(other, format!("unknown field {other}"))),
        }
    }
    if common.include_usage && !common.stream {
        return Err(ApiError::invalid(
            "stream_options",
            "stream_options is only allowed with stream: true",
        ));
    }
    Ok(Completion {
        model,
        prompt,
        sampling: common,
    })
}

pub(crate) static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// `POST /v1/completions`.
async fn completions(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response> {
    let start = Instant::now();
    let body = read_body(&headers, body, app.max_body_bytes).await?;
    let req = parse_completion(&body)?;
    let lv = app.repo.resolve(&req.model, None)?;
    let codec = match &lv.text {
        Ok(c) => c,
        Err(reason) => {
            let e = ServeError::Text {
                model: lv.model.clone(),
                reason: reason.clone(),
            };
            return Err(lv.reject(e, start).into());
        }
    };
    let prompt = match &req.prompt {
        Prompt::Text(t) => codec.encode(t).map_err(|reason| ServeError::Text {
            model: lv.model.clone(),
            reason,
        }),
        Prompt::Ids(ids) => Ok(ids.clone()),
    };
    let prompt = match prompt {
        Ok(p) if p.is_empty() => {
            let e = ApiError::invalid("prompt", "the prompt is empty: generation needs a token");
            lv.reject(ServeError::malformed("empty prompt"), start);
            return Err(e);
        }
        Ok(p) => p,
        Err(e) => return Err(ApiError::from(lv.reject(e, start)).with_param("prompt")),
    };
    let prompt_tokens = prompt.len();
    let sampling = req.sampling;
    let (tokens, done) = lv.generate(prompt, sampling.opts.clone(), !sampling.ignore_eos)?;
    let id = format!("cmpl-{}", NEXT_ID.fetch_add(1, Ordering::Relaxed));
    let created = now_secs();
    let stopper = sampling.stopper(&lv);
    let usage = move |n: usize| {
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": n,
               "total_tokens": prompt_tokens + n})
    };
    if !sampling.stream {
        let (mut stopper, finish) = stop::run(&lv, tokens, done, start, stopper, None).await?;
        let text = stopper.take(true);
        return Ok(Json(json!({
            "id": id,
            "object": "text_completion",
            "created": created,
            "model": lv.model,
            "choices": [{"index": 0, "text": text, "logprobs": null,
                         "finish_reason": finish.as_str()}],
            "usage": usage(stopper.tokens),
        }))
        .into_response());
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<std::result::Result<Event, Infallible>>(64);
    let include_usage = sampling.include_usage;
    tokio::spawn(async move {
        let chunk = |text: &str, finish: Option<&str>| {
            let mut v = json!({
                "id": id,
                "object": "text_completion",
                "created": created,
                "model": lv.model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
            });
            if include_usage {
                v["usage"] = Value::Null;
            }
            Event::default().data(v.to_string())
        };
        let piece = |text: String| (!text.is_empty()).then(|| chunk(&text, None));
        match stop::run(&lv, tokens, done, start, stopper, Some((&tx, &piece))).await {
            Ok((mut stopper, finish)) => {
                let rest = stopper.take(true);
                let _ = tx.send(Ok(chunk(&rest, Some(finish.as_str())))).await;
                if include_usage {
                    let v = json!({"id": id, "object": "text_completion", "created": created,
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

impl ApiError {
    pub(crate) fn with_param(mut self, param: &str) -> ApiError {
        self.param = Some(param.to_string());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<Completion> {
        parse_completion(v.to_string().as_bytes())
    }

    #[test]
    fn completion_requests_are_read_or_refused_by_field() {
        let c = parse(
            json!({"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0,
            "seed": 3, "top_p": 1, "n": 1, "stream": true, "user": "u", "stop": null}),
        )
        .unwrap();
        assert_eq!(
            (
                c.sampling.opts.max_new_tokens,
                c.sampling.opts.temperature,
                c.sampling.opts.seed,
                c.sampling.stream
            ),
            (5, 0.0, 3, true)
        );
        for (body, param) in [
            (json!({"prompt": "x"}), "model"),
            (json!({"model": "m"}), "prompt"),
            (json!({"model": "m", "prompt": ["a", "b"]}), "prompt"),
            (json!({"model": "m", "prompt": "x", "top_p": 1.5}), "top_p"),
            (json!({"model": "m", "prompt": "x", "n": 2}), "n"),
            (
                json!({"model": "m", "prompt": "x", "max_tokens": 0}),
                "max_tokens",
            ),
            (
                json!({"model": "m", "prompt": "x", "temperature": -1}),
                "temperature",
            ),
            (json!({"model": "m", "prompt": "x", "stop": 3}), "stop"),
            (
                json!({"model": "m", "prompt": "x", "logprobs": 2}),
                "logprobs",
            ),
            (
                json!({"model": "m", "prompt": "x", "frobnicate": 1}),
                "frobnicate",
            ),
        ] {
            let e = parse(body.clone()).err().unwrap();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
            assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        }
        let ids = parse(json!({"model": "m", "prompt": [1, 2, 3]})).unwrap();
        assert!(matches!(ids.prompt, Prompt::Ids(ref v) if v == &[1, 2, 3]));
    }
}
