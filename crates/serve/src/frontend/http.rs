//! The HTTP front end: KServe v2 / Triton's REST protocol on axum. Health, server and model
//! metadata, model readiness and config, inference (JSON tensors, BYTES elements as JSON
//! strings, and Triton's binary tensor extension that `tritonclient.http` uses by default, BYTES
//! elements each a 4-byte little-endian length then the bytes), the generate extension with its
//! server-sent-events stream (`text_input`, or `messages` rendered with the model's chat
//! template; generation ends at the model's end of text unless `ignore_eos`), the model repository API, the statistics extension, and
//! `/metrics` (also served alone on the metrics port, [`metrics_router`]); other routes on the
//! same port (the OpenAI-compatible `/v1` routes of the `openai` module) are handed to
//! [`router`] to be merged in, so this module never imports another front end.
//!
//! Request bodies may be gzip- or deflate-compressed (`Content-Encoding`); answers are
//! compressed when `Accept-Encoding` asks for gzip or deflate (not the event stream, which
//! must flow piece by piece); see the `body` module. A stream whose client went away stops its
//! generation (the `sse` module).
//!
//! Every failure is a JSON body `{"error": "..."}` with the status of [`ErrorKind`]; a handler
//! never panics on input. Bodies are read up to a fixed limit, which also bounds what a
//! compressed body may inflate to (413 past it). This module never runs a model: it parses,
//! asks the repository for a version, queues, and encodes the answer.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::body::{accepted_coding, read_body};
use super::metadata::{config_json, metadata, served_config};
use super::params::{generate_options, unsupported_load_parameter};
use super::sse::stream_pieces;
use super::AppState;
use crate::error::{ErrorKind, ServeError};
use crate::metrics::statistics_json;
use crate::model::LoadedVersion;
use crate::tensor::{self, InputData, TensorSpec, WireInput};
use crate::text::Detokenizer;
use crate::{EXTENSIONS, SERVER_NAME};

/// The header carrying the JSON part's length in the binary tensor extension.
const HEADER_LEN: &str = "inference-header-content-length";

/// The router with every endpoint, and `also` (routes of another protocol served on the same
/// port, answered and compressed alike).
pub(crate) fn router(app: Arc<AppState>, also: Router<Arc<AppState>>) -> Router {
    Router::new()
        .route("/v2", get(server_metadata))
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
        .route("/v2/models/stats", get(statistics))
        .route("/v2/models/{model}/stats", get(statistics))
        .route(
            "/v2/models/{model}/versions/{version}/stats",
            get(statistics),
        )
        .route("/v2/models/{model}", get(model_metadata))
        .route("/v2/models/{model}/versions/{version}", get(model_metadata))
        .route("/v2/models/{model}/ready", get(model_ready))
        .route(
            "/v2/models/{model}/versions/{version}/ready",
            get(model_ready),
        )
        .route("/v2/models/{model}/config", get(model_config))
        .route(
            "/v2/models/{model}/versions/{version}/config",
            get(model_config),
        )
        .route("/v2/models/{model}/infer", post(infer))
        .route("/v2/models/{model}/versions/{version}/infer", post(infer))
        .route("/v2/models/{model}/generate", post(generate))
        .route(
            "/v2/models/{model}/versions/{version}/generate",
            post(generate),
        )
        .route("/v2/models/{model}/generate_stream", post(generate_stream))
        .route(
            "/v2/models/{model}/versions/{version}/generate_stream",
            post(generate_stream),
        )
        .route("/v2/repository/index", post(repository_index))
        .route("/v2/repository/models/{model}/load", post(repository_load))
        .route(
            "/v2/repository/models/{model}/unload",
            post(repository_unload),
        )
        .route("/metrics", get(metrics))
        .merge(also)
        .fallback(not_found)
        .layer(axum::middleware::from_fn(compress_response))
        .with_state(app)
}

/// The metrics port's router: `/metrics` only, as Triton's port 8002.
pub(crate) fn metrics_router(app: Arc<AppState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .fallback(|uri: axum::http::Uri| async move {
            HttpError(ServeError::NoEndpoint {
                path: uri.path().to_string(),
                hint: "the metrics port serves /metrics only",
            })
        })
        .with_state(app)
}

/// A failure as the protocol writes it.
struct HttpError(ServeError);

impl From<ServeError> for HttpError {
    fn from(e: ServeError) -> Self {
        HttpError(e)
    }
}

fn status(kind: ErrorKind) -> StatusCode {
    match kind {
        ErrorKind::BadRequest => StatusCode::BAD_REQUEST,
        ErrorKind::NotFound => StatusCode::NOT_FOUND,
        ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let code = status(self.0.kind());
        tracing::debug!(status = code.as_u16(), error = %self.0, "request failed");
        (code, Json(json!({ "error": self.0.to_string() }))).into_response()
    }
}

type Result<T> = std::result::Result<T, HttpError>;

/// Path parameters: `model` and, on the versioned routes, `version`.
type Params = Path<HashMap<String, String>>;

fn model_of(p: &HashMap<String, String>) -> &str {
    p.get("model").map_or("", String::as_str)
}

fn version_of(p: &HashMap<String, String>) -> Option<&str> {
    p.get("version").map(String::as_str)
}

/// 404 for a path no route serves, saying what the port does serve.
async fn not_found(uri: axum::http::Uri) -> HttpError {
    let path = uri.path().to_string();
    let hint = if path.starts_with("/v1/") {
        "this server's OpenAI API serves /v1/completions, /v1/chat/completions and /v1/models \
         only"
    } else {
        "this port serves the KServe v2 protocol (/v2/...), OpenAI's /v1/completions, \
         /v1/chat/completions and /v1/models, and /metrics"
    };
    HttpError(ServeError::NoEndpoint { path, hint })
}

async fn live() -> StatusCode {
    StatusCode::OK
}

async fn ready(State(app): State<Arc<AppState>>) -> StatusCode {
    if app.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn server_metadata() -> Json<Value> {
    Json(json!({
        "name": SERVER_NAME,
        "version": env!("CARGO_PKG_VERSION"),
        "extensions": EXTENSIONS,
    }))
}

async fn model_metadata(State(app): State<Arc<AppState>>, Path(p): Params) -> Result<Json<Value>> {
    let lv = app.repo.resolve(model_of(&p), version_of(&p))?;
    let versions = match version_of(&p) {
        Some(v) => vec![v.to_string()],
        None => app
            .repo
            .versions(model_of(&p))?
            .iter()
            .map(u64::to_string)
            .collect(),
    };
    let m = metadata(&lv, versions);
    let tensors = |ts: &[TensorSpec]| {
        ts.iter()
            .map(|t| json!({"name": t.name, "datatype": t.datatype.name(), "shape": t.shape}))
            .collect::<Vec<_>>()
    };
    Ok(Json(json!({
        "name": m.name,
        "versions": m.versions,
        "platform": m.platform,
        "inputs": tensors(m.inputs),
        "outputs": tensors(m.outputs),
    })))
}

async fn model_ready(State(app): State<Arc<AppState>>, Path(p): Params) -> Result<StatusCode> {
    app.repo.resolve(model_of(&p), version_of(&p))?;
    Ok(StatusCode::OK)
}

async fn model_config(State(app): State<Arc<AppState>>, Path(p): Params) -> Result<Json<Value>> {
    let lv = app.repo.resolve(model_of(&p), version_of(&p))?;
    Ok(Json(config_json(&served_config(&lv))))
}

async fn statistics(State(app): State<Arc<AppState>>, Path(p): Params) -> Result<Json<Value>> {
    let model = p.get("model").map(String::as_str);
    let stats: Vec<_> = app
        .repo
        .served(model, version_of(&p))?
        .iter()
        .map(|lv| lv.metrics.statistics(&lv.model, lv.version))
        .collect();
    Ok(Json(statistics_json(&stats)))
}

async fn metrics(State(app): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.metrics.render(),
    )
}

/// must reach the client piece by piece.
async fn compress_response(req: Request, next: axum::middleware::Next) -> Response {
    let coding = accepted_coding(req.headers());
    let resp = next.run(req).await;
    let Some(coding) = coding else { return resp };
    let h = resp.headers();
    let streaming = h
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"text/event-stream"));
    if streaming || h.contains_key(header::CONTENT_ENCODING) {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    // answers other than the event stream are complete bodies already in memory
    let bytes = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(b) => b,
        Err(e) => {
            return HttpError(ServeError::malformed(format!("encoding the answer: {e}")))
                .into_response()
        }
    };
    let Ok(packed) = coding.compress(&bytes) else {
        // writing into memory does not fail; should it, the plain answer is still right
        return Response::from_parts(parts, Body::from(bytes));
    };
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_ENCODING,
        HeaderValue::from_static(coding.name()),
    );
    parts
        .headers
        .append(header::VARY, HeaderValue::from_static("accept-encoding"));
    Response::from_parts(parts, Body::from(packed))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InferRequest {
    #[serde(default)]
    id: Option<Value>,
    #[serde(default)]
    parameters: Map<String, Value>,
    inputs: Vec<InferInput>,
    #[serde(default)]
    outputs: Option<Vec<RequestedOutput>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InferInput {
    name: String,
    shape: Vec<i64>,
    datatype: String,
    #[serde(default)]
    parameters: Map<String, Value>,
    #[serde(default)]
    data: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestedOutput {
    name: String,
    #[serde(default)]
    parameters: Map<String, Value>,
}

fn bool_param(
    params: &Map<String, Value>,
    name: &str,
) -> std::result::Result<Option<bool>, ServeError> {
    match params.get(name) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ServeError::parameter(name, format!("{v} is not a boolean"))),
    }
}

/// A parsed HTTP inference request.
struct Parsed {
    id: Option<Value>,
    input: tensor::Request,
    /// Outputs in response order (indices into the model's outputs), and whether each goes as
    /// binary.
    outputs: Vec<(usize, bool)>,
}

fn parse_infer(
    lv: &LoadedVersion,
    headers: &HeaderMap,
    body: &[u8],
) -> std::result::Result<Parsed, ServeError> {
    let (json_part, mut binary) = match headers.get(HEADER_LEN) {
        Some(v) => {
            let n: usize = v
                .to_str()
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .ok_or_else(|| {
                    ServeError::malformed(format!("header {HEADER_LEN} is not a byte count"))
                })?;
            if n > body.len() {
                return Err(ServeError::malformed(format!(
                    "header {HEADER_LEN} says {n} bytes of JSON, the body has {}",
                    body.len()
                )));
            }
            body.split_at(n)
        }
        None => (body, &[][..]),
    };
    let req: InferRequest = serde_json::from_slice(json_part)
        .map_err(|e| ServeError::malformed(format!("inference request JSON: {e}")))?;
    let mut wire = Vec::with_capacity(req.inputs.len());
    // binary inputs follow the JSON in the order the inputs are listed
    for input in &req.inputs {
        let raw_size = match input.parameters.get("binary_data_size") {
            None => None,
            Some(v) => Some(v.as_u64().ok_or_else(|| {
                ServeError::parameter("binary_data_size", format!("{v} is not a byte count"))
            })? as usize),
        };
        let data = match (raw_size, &input.data) {
            (Some(_), Some(_)) => {
                return Err(ServeError::malformed(format!(
                    "input {:?} has both data and binary_data_size",
                    input.name
                )))
            }
            (Some(n), None) => {
                if n > binary.len() {
                    return Err(ServeError::malformed(format!(
                        "input {:?}: binary_data_size {n} but only {} binary bytes follow the \
                         JSON",
                        input.name,
                        binary.len()
                    )));
                }
                let (mine, rest) = binary.split_at(n);
                binary = rest;
                InputData::Raw(mine)
            }
            (None, Some(v)) => InputData::Json(v),
            (None, None) => {
                return Err(ServeError::malformed(format!(
                    "input {:?} has neither data nor binary_data_size",
                    input.name
                )))
            }
        };
        wire.push(WireInput {
            name: &input.name,
            datatype: &input.datatype,
            shape: &input.shape,
            data,
        });
    }
    if !binary.is_empty() {
        return Err(ServeError::malformed(format!(
            "{} binary bytes after the JSON belong to no input",
            binary.len()
        )));
    }
    let request = tensor::request(&lv.model, lv.inputs(), lv.config.max_batch_size, wire)?;
    lv.check(&request)?;
    let default_binary = bool_param(&req.parameters, "binary_data_output")?.unwrap_or(false);
    let outputs = match &req.outputs {
        None => (0..lv.outputs().len())
            .map(|o| (o, default_binary))
            .collect(),
        Some(list) => {
            let which = tensor::wanted_outputs(
                &lv.model,
                lv.outputs(),
                list.iter().map(|o| o.name.as_str()),
            )?;
            let mut out = Vec::with_capacity(list.len());
            for (o, &i) in list.iter().zip(&which) {
                let binary = bool_param(&o.parameters, "binary_data")?.unwrap_or(default_binary);
                out.push((i, binary));
            }
            out
        }
    };
    Ok(Parsed {
        id: req.id,
        input: request,
        outputs,
    })
}

async fn infer(
    State(app): State<Arc<AppState>>,
    Path(p): Params,
    headers: HeaderMap,
    body: Body,
) -> Result<Response> {
    let start = Instant::now();
    let body = read_body(&headers, body, app.max_body_bytes).await?;
    let lv = app.repo.resolve(model_of(&p), version_of(&p))?;
    let parsed = match parse_infer(&lv, &headers, &body) {
        Ok(x) => x,
        Err(e) => return Err(lv.reject(e, start).into()),
    };
    let want = parsed.outputs.iter().map(|&(o, _)| o).collect();
    let result = lv.infer(app.repo.as_ref(), parsed.input, want).await?;
    let mut outputs = Vec::with_capacity(parsed.outputs.len());
    let mut binary = Vec::new();
    for ((name, t), (_, as_binary)) in result.iter().zip(&parsed.outputs) {
        let mut o = json!({
            "name": name,
            "datatype": t.datatype.name(),
            "shape": t.wire_shape(),
        });
        if *as_binary {
            o["parameters"] = json!({ "binary_data_size": t.data.len() });
            binary.extend_from_slice(&t.data);
        } else {
            o["data"] = t.json();
        }
        outputs.push(o);
    }
    let mut head = json!({
        "model_name": lv.model,
        "model_version": lv.version.to_string(),
        "outputs": outputs,
    });
    if let Some(id) = parsed.id {
        head["id"] = id;
    }
    let head = serde_json::to_vec(&head).map_err(|e| ServeError::malformed(e.to_string()))?;
    if binary.is_empty() && parsed.outputs.iter().all(|(_, b)| !b) {
        return Ok(([(header::CONTENT_TYPE, "application/json")], head).into_response());
    }
    let head_len = head.len();
    let mut all = head;
    all.extend_from_slice(&binary);
    let mut resp = all.into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(HEADER_LEN, HeaderValue::from(head_len));
    Ok(resp)
}

/// A generate request: `text_input` (or `messages`, a conversation the model's chat template
/// renders, with the generation prompt), and the sampling parameters in `parameters` or
/// beside it.
struct GenerateRequest {
    input: GenerateInput,
    params: Map<String, Value>,
}

enum GenerateInput {
    Text(String),
    Messages(cohort_tokenizer::Chat),
}

fn parse_generate(body: &[u8]) -> std::result::Result<GenerateRequest, ServeError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ServeError::malformed(format!("generate request JSON: {e}")))?;
    let Value::Object(mut obj) = v else {
        return Err(ServeError::malformed(
            "generate request must be a JSON object",
        ));
    };
    let input = match (obj.remove("text_input"), obj.remove("messages")) {
        (Some(Value::String(s)), None) => GenerateInput::Text(s),
        (Some(other), None) => {
            return Err(ServeError::malformed(format!(
                "text_input must be a string, got {other}"
            )))
        }
        (None, Some(m @ Value::Array(_))) => GenerateInput::Messages(
            cohort_tokenizer::Chat::from_json(&m.to_string())
                .map_err(|e| ServeError::malformed(format!("messages: {e}")))?,
        ),
        (None, Some(other)) => {
            return Err(ServeError::malformed(format!(
                "messages must be a list of {{role, content}}, got {other}"
            )))
        }
        (Some(_), Some(_)) => {
            return Err(ServeError::malformed(
                "generate request has both text_input and messages; send one",
            ))
        }
        (None, None) => {
            return Err(ServeError::malformed(
                "generate request has neither text_input nor messages",
            ))
        }
    };
    let mut params = match obj.remove("parameters") {
        None => Map::new(),
        Some(Value::Object(m)) => m,
        Some(other) => {
            return Err(ServeError::malformed(format!(
                "parameters must be an object, got {other}"
            )))
        }
    };
    obj.remove("id");
    // Triton's generate extension also takes parameters as top-level keys
    for (k, v) in obj {
        params.insert(k, v);
    }
    Ok(GenerateRequest { input, params })
}

/// Resolves, parses and queues a generation; what both generate endpoints share.
struct Started {
    lv: Arc<LoadedVersion>,
    prompt_echo: Option<String>,
    tokens: tokio::sync::mpsc::UnboundedReceiver<u32>,
    done: tokio::sync::oneshot::Receiver<std::result::Result<Vec<u32>, ServeError>>,
    start: Instant,
}

async fn start_generate(
    app: &AppState,
    p: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Body,
    stream: bool,
) -> Result<Started> {
    let start = Instant::now();
    let body = read_body(headers, body, app.max_body_bytes).await?;
    let lv = app.repo.resolve(model_of(p), version_of(p))?;
    let prepared = (|| {
        let req = parse_generate(&body)?;
        let g = generate_options(&req.params, stream)?;
        let codec = lv.text.as_ref().map_err(|reason| ServeError::Text {
            model: lv.model.clone(),
            reason: reason.clone(),
        })?;
        let text_err = |reason: String| ServeError::Text {
            model: lv.model.clone(),
            reason,
        };
        let text = match req.input {
            GenerateInput::Text(t) => t,
            GenerateInput::Messages(chat) => {
                let template = lv.chat.as_ref().map_err(|r| text_err(r.clone()))?;
                template
                    .render(&chat, true)
                    .map_err(|e| text_err(e.to_string()))?
                    .text
            }
        };
        let prompt = codec.encode(&text).map_err(text_err)?;
        let echo = (!g.exclude_input).then(|| codec.echo_prompt(&text, &prompt));
        Ok((prompt, g, echo))
    })();
    let (prompt, g, prompt_echo) = match prepared {
        Ok(x) => x,
        Err(e) => return Err(lv.reject(e, start).into()),
    };
    let (tokens, done) = lv.generate(prompt, g.opts, !g.ignore_eos)?;
    Ok(Started {
        lv,
        prompt_echo,
        tokens,
        done,
        start,
    })
}

async fn generate(
    State(app): State<Arc<AppState>>,
    Path(p): Params,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>> {
    let s = start_generate(&app, &p, &headers, body, false).await?;
    let out = s.done.await.unwrap_or_else(|_| Err(s.lv.lost()));
    s.lv.account(&out, s.start);
    let mut ids = out?;
    // The end of text it stopped at is not text.
    if ids.last().is_some_and(|id| s.lv.eos.contains(id)) {
        ids.pop();
    }
    let codec = s.lv.text.as_ref().expect("checked before queueing");
    let text = codec.decode_all(&ids).map_err(|reason| ServeError::Text {
        model: s.lv.model.clone(),
        reason,
    })?;
    Ok(Json(json!({
        "model_name": s.lv.model,
        "model_version": s.lv.version.to_string(),
        "text_output": s.prompt_echo.unwrap_or_default() + &text,
    })))
}

/// Server-sent events: one `data: {"text_output": piece, ...}` per piece of generated text
/// (the prompt is not repeated), `data: {"error": ...}` if generation fails.
async fn generate_stream(
    State(app): State<Arc<AppState>>,
    Path(p): Params,
    headers: HeaderMap,
    body: Body,
) -> Result<Response> {
    let s = start_generate(&app, &p, &headers, body, true).await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<std::result::Result<Event, Infallible>>(64);
    tokio::spawn(async move {
        let Started {
            lv,
            tokens,
            done,
            start,
            ..
        } = s;
        let codec = lv.text.as_ref().expect("checked before queueing");
        let mut detok = Detokenizer::new(codec);
        let event = |text: &str| {
            let v = json!({
                "model_name": lv.model,
                "model_version": lv.version.to_string(),
                "text_output": text,
            });
            Ok(Event::default().data(v.to_string()))
        };
        let Some(out) = stream_pieces(&lv, tokens, done, start, &mut detok, &tx, event).await
        else {
            return;
        };
        match out {
            Ok(_) => {
                let rest = detok.finish();
                if !rest.is_empty() {
                    let _ = tx.send(event(&rest)).await;
                }
            }
            Err(e) => {
                let v = json!({ "error": e.to_string() });
                let _ = tx.send(Ok(Event::default().data(v.to_string()))).await;
            }
        }
    });
    Ok(Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx)).into_response())
}

#[derive(Deserialize, Default)]
struct IndexRequest {
    #[serde(default)]
    ready: bool,
}

async fn repository_index(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>> {
    let body = read_body(&headers, body, app.max_body_bytes).await?;
    let req: IndexRequest = if body.iter().all(u8::is_ascii_whitespace) {
        IndexRequest::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ServeError::malformed(format!("repository index request: {e}")))?
    };
    Ok(Json(json!(app.repo.index(req.ready))))
}

/// A repository load request: Triton's `{"parameters": {"config": "<JSON>"}}`, or nothing.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct LoadRequest {
    #[serde(default)]
    parameters: Map<String, Value>,
}

async fn repository_load(
    State(app): State<Arc<AppState>>,
    Path(p): Params,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>> {
    let body = read_body(&headers, body, app.max_body_bytes).await?;
    let req: LoadRequest = if body.iter().all(u8::is_ascii_whitespace) {
        LoadRequest::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ServeError::malformed(format!("repository load request: {e}")))?
    };
    let mut config = None;
    for (k, v) in &req.parameters {
        match (k.as_str(), v) {
            ("config", Value::String(c)) => config = Some(c.clone()),
            ("config", other) => {
                return Err(
                    ServeError::parameter(k, format!("{other} is not a string of JSON")).into(),
                )
            }
            _ => return Err(unsupported_load_parameter(k).into()),
        }
    }
    let override_cfg = config
        .map(|c| crate::config::ModelConfig::from_json(&c, model_of(&p)))
        .transpose()?;
    let (repo, model) = (app.repo.clone(), model_of(&p).to_string());
    tokio::task::spawn_blocking(move || repo.load(&model, override_cfg))
        .await
        .map_err(|e| ServeError::malformed(format!("load task failed: {e}")))??;
    Ok(Json(json!({})))
}

async fn repository_unload(
    State(app): State<Arc<AppState>>,
    Path(p): Params,
) -> Result<Json<Value>> {
    let (repo, model) = (app.repo.clone(), model_of(&p).to_string());
    tokio::task::spawn_blocking(move || repo.unload(&model))
        .await
        .map_err(|e| ServeError::malformed(format!("unload task failed: {e}")))??;
    Ok(Json(json!({})))
}
