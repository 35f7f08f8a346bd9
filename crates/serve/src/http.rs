//! The HTTP front end: KServe v2 / Triton's REST protocol on axum. Health, server and model
//! metadata, model readiness and config, inference (JSON tensors, and Triton's binary tensor
//! extension that `tritonclient.http` uses by default), the generate extension with its
//! server-sent-events stream, the model repository API, and `/metrics`.
//!
//! Every failure is a JSON body `{"error": "..."}` with the status of [`ErrorKind`]; a handler
//! never panics on input. Bodies are read up to a fixed limit (413 past it). This module never
//! runs a model: it parses, asks the repository for a version, queues, and encodes the answer.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::{ErrorKind, ServeError};
use crate::model::LoadedVersion;
use crate::tensor::{self, single_input, InputData, Output, Wanted};
use crate::text::Detokenizer;
use crate::{generate_options, metadata, AppState, SERVER_NAME};

/// The header carrying the JSON part's length in the binary tensor extension.
const HEADER_LEN: &str = "inference-header-content-length";

/// The router with every endpoint.
pub(crate) fn router(app: Arc<AppState>) -> Router {
    Router::new()
        .route("/v2", get(server_metadata))
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
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
        .fallback(not_found)
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

async fn not_found() -> HttpError {
    HttpError(ServeError::malformed(
        "no such endpoint (see the KServe v2 protocol: /v2/...)",
    ))
}

async fn live() -> StatusCode {
    StatusCode::OK
}

async fn ready(State(app): State<Arc<AppState>>) -> StatusCode {
    if app.ready.load(Ordering::Acquire) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn server_metadata() -> Json<Value> {
    Json(json!({
        "name": SERVER_NAME,
        "version": env!("CARGO_PKG_VERSION"),
        "extensions": crate::EXTENSIONS,
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
    let tensors = |ts: &[crate::TensorMeta]| {
        ts.iter()
            .map(|t| json!({"name": t.name, "datatype": t.datatype, "shape": t.shape}))
            .collect::<Vec<_>>()
    };
    Ok(Json(json!({
        "name": m.name,
        "versions": m.versions,
        "platform": m.platform,
        "inputs": tensors(&m.inputs),
        "outputs": tensors(&m.outputs),
    })))
}

async fn model_ready(State(app): State<Arc<AppState>>, Path(p): Params) -> Result<StatusCode> {
    app.repo.resolve(model_of(&p), version_of(&p))?;
    Ok(StatusCode::OK)
}

async fn model_config(State(app): State<Arc<AppState>>, Path(p): Params) -> Result<Json<Value>> {
    let lv = app.repo.resolve(model_of(&p), version_of(&p))?;
    let cfg = app.repo.config(model_of(&p))?;
    let mut v = serde_json::to_value(&*cfg).map_err(|e| ServeError::malformed(e.to_string()))?;
    v["name"] = json!(lv.model);
    v["platform"] = json!(crate::PLATFORM);
    v["input"] = json!([{"name": tensor::INPUT_IDS, "data_type": "TYPE_INT64", "dims": [-1]}]);
    v["output"] = json!([
        {"name": tensor::LOGITS, "data_type": "TYPE_FP32", "dims": [-1, lv.limits.vocab]},
        {"name": tensor::NEXT_TOKEN, "data_type": "TYPE_INT64", "dims": [1]},
    ]);
    Ok(Json(v))
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

/// Past the limit, this much more of a body is still read (and dropped) so that the client,
/// still sending, receives the 413 instead of a reset connection.
const DRAIN_BYTES: u64 = 64 << 20;

/// The body, refused past `limit` bytes.
async fn read_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<axum::body::Bytes> {
    use tokio_stream::StreamExt;
    if let Some(enc) = headers.get(header::CONTENT_ENCODING) {
        if enc.as_bytes() != b"identity" {
            return Err(ServeError::malformed(format!(
                "Content-Encoding {enc:?} is not supported; send the body uncompressed"
            ))
            .into());
        }
    }
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64 + DRAIN_BYTES) {
        return Err(ServeError::BodyTooLarge { limit }.into());
    }
    let mut stream = body.into_data_stream();
    let mut buf = Vec::with_capacity(declared.map_or(0, |n| n.min(limit as u64) as usize));
    let mut seen = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ServeError::malformed(format!("reading the body: {e}")))?;
        seen += chunk.len() as u64;
        if seen > limit as u64 + DRAIN_BYTES {
            break;
        }
        if seen <= limit as u64 {
            buf.extend_from_slice(&chunk);
        }
    }
    if seen > limit as u64 {
        return Err(ServeError::BodyTooLarge { limit }.into());
    }
    Ok(buf.into())
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
    input: tensor::TokenBatch,
    /// Outputs in response order, and whether each goes as binary.
    outputs: Vec<(Output, bool)>,
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
    let input = single_input(&lv.model, &req.inputs)?;
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
                    "input {:?}: binary_data_size {n} but only {} binary bytes follow the JSON",
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
    if !binary.is_empty() {
        return Err(ServeError::malformed(format!(
            "{} binary bytes after the JSON belong to no input",
            binary.len()
        )));
    }
    let batch = tensor::token_batch(
        &lv.model,
        lv.limits,
        &input.name,
        &input.datatype,
        &input.shape,
        data,
    )?;
    let default_binary = bool_param(&req.parameters, "binary_data_output")?.unwrap_or(false);
    let outputs = match &req.outputs {
        None => Output::ALL.iter().map(|&o| (o, default_binary)).collect(),
        Some(list) => {
            let mut out = Vec::with_capacity(list.len());
            for o in list {
                let which = Output::parse(&lv.model, &o.name)?;
                let binary = bool_param(&o.parameters, "binary_data")?.unwrap_or(default_binary);
                out.push((which, binary));
            }
            out
        }
    };
    Ok(Parsed {
        id: req.id,
        input: batch,
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
    let want = Wanted {
        logits: parsed.outputs.iter().any(|(o, _)| *o == Output::Logits),
        next_token: parsed.outputs.iter().any(|(o, _)| *o == Output::NextToken),
    };
    let result = lv.infer(parsed.input, want).await?;
    let mut outputs = Vec::with_capacity(parsed.outputs.len());
    let mut binary = Vec::new();
    for (o, as_binary) in &parsed.outputs {
        let mut t = json!({
            "name": o.name(),
            "datatype": o.datatype(),
            "shape": result.shape(*o),
        });
        if *as_binary {
            let bytes = result.le_bytes(*o);
            t["parameters"] = json!({ "binary_data_size": bytes.len() });
            binary.extend_from_slice(&bytes);
        } else {
            t["data"] = result.json(*o);
        }
        outputs.push(t);
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

/// A generate request: `text_input`, and the sampling parameters in `parameters` or beside it.
struct GenerateRequest {
    text_input: String,
    params: Map<String, Value>,
}

fn parse_generate(body: &[u8]) -> std::result::Result<GenerateRequest, ServeError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ServeError::malformed(format!("generate request JSON: {e}")))?;
    let Value::Object(mut obj) = v else {
        return Err(ServeError::malformed(
            "generate request must be a JSON object",
        ));
    };
    let text_input = match obj.remove("text_input") {
        Some(Value::String(s)) => s,
        Some(other) => {
            return Err(ServeError::malformed(format!(
                "text_input must be a string, got {other}"
            )))
        }
        None => return Err(ServeError::malformed("generate request has no text_input")),
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
    Ok(GenerateRequest { text_input, params })
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
        let (opts, exclude_input) = generate_options(&req.params, stream)?;
        let codec = lv.text.as_ref().map_err(|reason| ServeError::Text {
            model: lv.model.clone(),
            reason: reason.clone(),
        })?;
        let prompt = codec
            .encode(&req.text_input)
            .map_err(|reason| ServeError::Text {
                model: lv.model.clone(),
                reason,
            })?;
        let echo = (!exclude_input).then(|| codec.echo_prompt(&req.text_input, &prompt));
        Ok((prompt, opts, echo))
    })();
    let (prompt, opts, prompt_echo) = match prepared {
        Ok(x) => x,
        Err(e) => return Err(lv.reject(e, start).into()),
    };
    let (tokens, done) = lv.generate(prompt, opts)?;
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
    let ids = out?;
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
            mut tokens,
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
        while let Some(id) = tokens.recv().await {
            let piece = detok.push(id);
            // a client that left stops receiving; the generation itself runs to its end
            if !piece.is_empty() && tx.send(event(&piece)).await.is_err() {
                break;
            }
        }
        let out = done.await.unwrap_or_else(|_| Err(lv.lost()));
        lv.account(&out, start);
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

async fn repository_load(State(app): State<Arc<AppState>>, Path(p): Params) -> Result<Json<Value>> {
    let (repo, model) = (app.repo.clone(), model_of(&p).to_string());
    tokio::task::spawn_blocking(move || repo.load(&model))
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
