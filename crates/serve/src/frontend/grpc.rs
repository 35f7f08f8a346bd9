//! The gRPC front end: KServe v2's `inference.GRPCInferenceService` (the service Triton's gRPC
//! clients call) on tonic: liveness, readiness, server and model metadata, inference (typed
//! `contents` or `raw_input_contents` in; `raw_output_contents` out, as Triton answers; BYTES
//! elements length-prefixed in raw contents, one per entry in `bytes_contents`), the
//! streaming inference of Triton's decoupled models (a `text_input` request generates, one
//! response per piece of text, `triton_final_response` on the last), the served configuration
//! and statistics, and the repository index / load / unload. Errors are gRPC statuses mapped
//! from [`ErrorKind`] (on a stream, `error_message` responses).
//!
//! [`Protocol`] wraps the service to answer as a gRPC server in C++ (Triton's) does where tonic
//! answers otherwise: a caller's deadline that passes is DEADLINE_EXCEEDED (tonic says
//! CANCELLED), and a message over the size limit is RESOURCE_EXHAUSTED (tonic says
//! OUT_OF_RANGE). A request abandoned that way is dropped, and the instance skips it. This
//! module never runs a model.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tonic::codegen::http;
use tonic::{Code, Request, Response, Status};

use super::metadata::{metadata, served_config};
use super::params::{generate_options, unsupported_load_parameter};
use super::AppState;
use crate::error::{ErrorKind, ServeError};
use crate::proto::grpc_inference_service_server::GrpcInferenceService;
use crate::proto::{self, model_infer_response, model_metadata_response};
use crate::tensor::TensorSpec;
use crate::tensor::{self, InputData, WireInput};
use crate::{EXTENSIONS, SERVER_NAME};

/// How much earlier than the caller's deadline the answer is given up: tonic's own timer, with
/// the same deadline, answers CANCELLED; this one must fire first.
const DEADLINE_MARGIN: Duration = Duration::from_millis(2);

/// The tower service around the gRPC routes (see the module doc).
#[derive(Clone)]
pub(crate) struct Protocol<S> {
    inner: S,
}

impl<S> Protocol<S> {
    pub fn new(inner: S) -> Protocol<S> {
        Protocol { inner }
    }
}

/// A `grpc-timeout` header's duration: up to 8 digits and a unit (H, M, S, m, u, n).
fn grpc_timeout(v: &http::HeaderValue) -> Option<Duration> {
    let s = v.to_str().ok()?;
    if s.len() < 2 || s.len() > 9 {
        return None;
    }
    let (digits, unit) = s.split_at(s.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// tonic's answer to a message over `max_decoding_message_size` (OUT_OF_RANGE, trailers-only),
/// as RESOURCE_EXHAUSTED: what gRPC's other servers answer, and what clients retry on.
fn too_large_is_resource_exhausted<B>(mut resp: http::Response<B>) -> http::Response<B> {
    let h = resp.headers();
    let out_of_range = h.get("grpc-status").is_some_and(|s| s == "11");
    let too_large = h.get("grpc-message").is_some_and(|m| {
        let m = m.as_bytes();
        m.windows(9).any(|w| w == b"too large") || m.windows(11).any(|w| w == b"too%20large")
    });
    if out_of_range && too_large {
        let code = (Code::ResourceExhausted as i32).to_string();
        if let Ok(v) = http::HeaderValue::from_str(&code) {
            resp.headers_mut().insert("grpc-status", v);
        }
    }
    resp
}

impl<S, B> tower::Service<http::Request<B>> for Protocol<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let deadline = req.headers().get("grpc-timeout").and_then(grpc_timeout);
        // the clone that was made ready serves this call; a fresh clone waits for the next
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let answer = inner.call(req);
        Box::pin(async move {
            let resp = match deadline {
                None => answer.await?,
                Some(d) => {
                    match tokio::time::timeout(d.saturating_sub(DEADLINE_MARGIN), answer).await {
                        Ok(r) => r?,
                        // dropping the answer drops the request's wait; its instance skips it
                        Err(_) => {
                            return Ok(Status::deadline_exceeded(format!(
                                "the caller's deadline of {d:?} passed before the answer"
                            ))
                            .into_http())
                        }
                    }
                }
            };
            Ok(too_large_is_resource_exhausted(resp))
        })
    }
}

/// The service over the shared state.
pub(crate) struct Service {
    pub app: Arc<AppState>,
}

fn status(e: ServeError) -> Status {
    let code = match e.kind() {
        ErrorKind::BadRequest => Code::InvalidArgument,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::TooLarge => Code::ResourceExhausted,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::Internal => Code::Internal,
    };
    Status::new(code, e.to_string())
}

fn opt(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

fn bool_param(
    params: &std::collections::HashMap<String, proto::InferParameter>,
    name: &str,
) -> Result<Option<bool>, ServeError> {
    use proto::infer_parameter::ParameterChoice;
    match params.get(name).and_then(|p| p.parameter_choice.as_ref()) {
        None => Ok(None),
        Some(ParameterChoice::BoolParam(b)) => Ok(Some(*b)),
        Some(other) => Err(ServeError::parameter(
            name,
            format!("{other:?} is not a boolean"),
        )),
    }
}

#[tonic::async_trait]
impl GrpcInferenceService for Service {
    async fn server_live(
        &self,
        _: Request<proto::ServerLiveRequest>,
    ) -> Result<Response<proto::ServerLiveResponse>, Status> {
        Ok(Response::new(proto::ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _: Request<proto::ServerReadyRequest>,
    ) -> Result<Response<proto::ServerReadyResponse>, Status> {
        Ok(Response::new(proto::ServerReadyResponse {
            ready: self.app.is_ready(),
        }))
    }

    async fn model_ready(
        &self,
        req: Request<proto::ModelReadyRequest>,
    ) -> Result<Response<proto::ModelReadyResponse>, Status> {
        let r = req.into_inner();
        let ready = self.app.repo.resolve(&r.name, opt(&r.version)).is_ok();
        Ok(Response::new(proto::ModelReadyResponse { ready }))
    }

    async fn server_metadata(
        &self,
        _: Request<proto::ServerMetadataRequest>,
    ) -> Result<Response<proto::ServerMetadataResponse>, Status> {
        Ok(Response::new(proto::ServerMetadataResponse {
            name: SERVER_NAME.into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: EXTENSIONS.iter().map(|s| s.to_string()).collect(),
        }))
    }

    async fn model_metadata(
        &self,
        req: Request<proto::ModelMetadataRequest>,
    ) -> Result<Response<proto::ModelMetadataResponse>, Status> {
        let r = req.into_inner();
        let lv = self
            .app
            .repo
            .resolve(&r.name, opt(&r.version))
            .map_err(status)?;
        let versions = match opt(&r.version) {
            Some(v) => vec![v.to_string()],
            None => self
                .app
                .repo
                .versions(&r.name)
                .map_err(status)?
                .iter()
                .map(u64::to_string)
                .collect(),
        };
        let m = metadata(&lv, versions);
        let tensors = |ts: &[TensorSpec]| {
            ts.iter()
                .map(|t| model_metadata_response::TensorMetadata {
                    name: t.name.clone(),
                    datatype: t.datatype.name().into(),
                    shape: t.shape.clone(),
                })
                .collect()
        };
        Ok(Response::new(proto::ModelMetadataResponse {
            name: m.name,
            versions: m.versions,
            platform: m.platform.into(),
            inputs: tensors(m.inputs),
            outputs: tensors(m.outputs),
        }))
    }

    async fn model_infer(
        &self,
        req: Request<proto::ModelInferRequest>,
    ) -> Result<Response<proto::ModelInferResponse>, Status> {
        infer_one(&self.app, req.into_inner())
            .await
            .map(Response::new)
    }

    async fn model_config(
        &self,
        req: Request<proto::ModelConfigRequest>,
    ) -> Result<Response<proto::ModelConfigResponse>, Status> {
        let r = req.into_inner();
        let lv = self
            .app
            .repo
            .resolve(&r.name, opt(&r.version))
            .map_err(status)?;
        Ok(Response::new(proto::ModelConfigResponse {
            config: Some(served_config(&lv)),
        }))
    }

    async fn model_statistics(
        &self,
        req: Request<proto::ModelStatisticsRequest>,
    ) -> Result<Response<proto::ModelStatisticsResponse>, Status> {
        let r = req.into_inner();
        let model_stats = self
            .app
            .repo
            .served(opt(&r.name), opt(&r.version))
            .map_err(status)?
            .iter()
            .map(|lv| lv.metrics.statistics(&lv.model, lv.version))
            .collect();
        Ok(Response::new(proto::ModelStatisticsResponse {
            model_stats,
        }))
    }

    type ModelStreamInferStream = std::pin::Pin<
        Box<
            dyn tokio_stream::Stream<Item = Result<proto::ModelStreamInferResponse, Status>> + Send,
        >,
    >;

    /// Each request on the stream is answered as it completes, concurrently: an inference
    /// (`input_ids`) with one response, a generation (`text_input`) decoupled, with one response
    /// per piece of text. A failed request is an `error_message` response; the stream goes on.
    async fn model_stream_infer(
        &self,
        req: Request<tonic::Streaming<proto::ModelInferRequest>>,
    ) -> Result<Response<Self::ModelStreamInferStream>, Status> {
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel::<Result<proto::ModelStreamInferResponse, Status>>(64);
        let app = self.app.clone();
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    m = inbound.message() => m,
                    // the client is gone: its requests in flight stop with their senders
                    _ = tx.closed() => return,
                };
                match next {
                    Ok(Some(r)) => {
                        let (app, tx) = (app.clone(), tx.clone());
                        tokio::spawn(async move { stream_one(&app, r, &tx).await });
                    }
                    // half-closed: the requests in flight still answer, then the stream ends
                    Ok(None) => return,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn repository_index(
        &self,
        req: Request<proto::RepositoryIndexRequest>,
    ) -> Result<Response<proto::RepositoryIndexResponse>, Status> {
        let r = req.into_inner();
        let models = self
            .app
            .repo
            .index(r.ready)
            .into_iter()
            .map(|e| proto::repository_index_response::ModelIndex {
                name: e.name,
                version: e.version,
                state: e.state,
                reason: e.reason,
            })
            .collect();
        Ok(Response::new(proto::RepositoryIndexResponse { models }))
    }

    async fn repository_model_load(
        &self,
        req: Request<proto::RepositoryModelLoadRequest>,
    ) -> Result<Response<proto::RepositoryModelLoadResponse>, Status> {
        use proto::model_repository_parameter::ParameterChoice;
        let r = req.into_inner();
        let name = r.model_name;
        let mut config = None;
        for (k, v) in &r.parameters {
            match (k.as_str(), &v.parameter_choice) {
                ("config", Some(ParameterChoice::StringParam(c))) => config = Some(c.clone()),
                ("config", other) => {
                    return Err(status(ServeError::parameter(
                        k,
                        format!("{other:?} is not a string of JSON"),
                    )))
                }
                _ => return Err(status(unsupported_load_parameter(k))),
            }
        }
        let config = config
            .map(|c| crate::config::ModelConfig::from_json(&c, &name))
            .transpose()
            .map_err(status)?;
        let repo = self.app.repo.clone();
        tokio::task::spawn_blocking(move || repo.load(&name, config))
            .await
            .map_err(|e| Status::internal(format!("load task failed: {e}")))?
            .map_err(status)?;
        Ok(Response::new(proto::RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        req: Request<proto::RepositoryModelUnloadRequest>,
    ) -> Result<Response<proto::RepositoryModelUnloadResponse>, Status> {
        let name = req.into_inner().model_name;
        let repo = self.app.repo.clone();
        tokio::task::spawn_blocking(move || repo.unload(&name))
            .await
            .map_err(|e| Status::internal(format!("unload task failed: {e}")))?
            .map_err(status)?;
        Ok(Response::new(proto::RepositoryModelUnloadResponse {}))
    }
}

/// One inference request, as ModelInfer and ModelStreamInfer answer it.
async fn infer_one(
    app: &AppState,
    r: proto::ModelInferRequest,
) -> Result<proto::ModelInferResponse, Status> {
    let start = Instant::now();
    let lv = app
        .repo
        .resolve(&r.model_name, opt(&r.model_version))
        .map_err(status)?;
    let parsed = (|| {
        if !r.raw_input_contents.is_empty() && r.raw_input_contents.len() != r.inputs.len() {
            return Err(ServeError::malformed(format!(
                "{} raw_input_contents for {} input(s)",
                r.raw_input_contents.len(),
                r.inputs.len()
            )));
        }
        let mut wire = Vec::with_capacity(r.inputs.len());
        for (i, input) in r.inputs.iter().enumerate() {
            let data = match (r.raw_input_contents.get(i), &input.contents) {
                (Some(_), Some(_)) => {
                    return Err(ServeError::malformed(format!(
                        "input {:?} has both contents and raw_input_contents",
                        input.name
                    )))
                }
                (Some(raw), None) => InputData::Raw(raw),
                (None, Some(c)) => {
                    let (bytes, n) = typed_contents(&input.name, &input.datatype, c)?;
                    InputData::Typed(bytes, n)
                }
                (None, None) => InputData::Typed(Vec::new(), 0),
            };
            wire.push(WireInput {
                name: &input.name,
                datatype: &input.datatype,
                shape: &input.shape,
                data,
            });
        }
        let request = tensor::request(&lv.model, lv.inputs(), lv.config.max_batch_size, wire)?;
        lv.check(&request)?;
        let want = tensor::wanted_outputs(
            &lv.model,
            lv.outputs(),
            r.outputs.iter().map(|o| o.name.as_str()),
        )?;
        // Triton's binary-output parameter means nothing here (raw bytes always), but a
        // malformed one is still an error
        for o in &r.outputs {
            bool_param(&o.parameters, "binary_data")?;
        }
        Ok((request, want))
    })();
    let (request, want) = match parsed {
        Ok(x) => x,
        Err(e) => return Err(status(lv.reject(e, start))),
    };
    let result = lv
        .infer(app.repo.as_ref(), request, want)
        .await
        .map_err(status)?;
    let mut resp = proto::ModelInferResponse {
        model_name: lv.model.clone(),
        model_version: lv.version.to_string(),
        id: r.id,
        ..Default::default()
    };
    for (name, t) in result {
        resp.outputs.push(model_infer_response::InferOutputTensor {
            name,
            datatype: t.datatype.name().into(),
            shape: t.wire_shape(),
            ..Default::default()
        });
        resp.raw_output_contents.push(t.data);
    }
    Ok(resp)
}

/// The little-endian bytes of typed protobuf contents of KServe type `datatype` (BYTES in the
/// serialized form tensors keep), and how many elements they held (none for a type cohort does
/// not serve: the datatype check refuses it). FP16 has no field in KServe's contents, so typed
/// FP16 contents are refused by the input's `name` rather than read as empty.
fn typed_contents(
    name: &str,
    datatype: &str,
    c: &proto::InferTensorContents,
) -> Result<(Vec<u8>, usize), ServeError> {
    use crate::tensor::DataType as D;
    fn le<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> (Vec<u8>, usize) {
        (v.iter().flat_map(|&x| f(x)).collect(), v.len())
    }
    Ok(match D::from_name(datatype) {
        Some(D::Bool) => le(&c.bool_contents, |b| [u8::from(b)]),
        Some(D::Uint8) => le(&c.uint_contents, |x| [x as u8]),
        Some(D::Int8) => le(&c.int_contents, |x| (x as i8).to_le_bytes()),
        Some(D::Int16) => le(&c.int_contents, |x| (x as i16).to_le_bytes()),
        Some(D::Int32) => le(&c.int_contents, i32::to_le_bytes),
        Some(D::Int64) => le(&c.int64_contents, i64::to_le_bytes),
        Some(D::Uint16) => le(&c.uint_contents, |x| (x as u16).to_le_bytes()),
        Some(D::Uint32) => le(&c.uint_contents, u32::to_le_bytes),
        Some(D::Uint64) => le(&c.uint64_contents, u64::to_le_bytes),
        Some(D::Fp16) => {
            return Err(ServeError::malformed(format!(
                "input {name:?}: FP16 has no typed contents in KServe's protocol; send its \
                 little-endian halves as raw_input_contents (as Triton's clients do)"
            )))
        }
        Some(D::Fp32) => le(&c.fp32_contents, f32::to_le_bytes),
        Some(D::Fp64) => le(&c.fp64_contents, f64::to_le_bytes),
        Some(D::Bytes) => (
            crate::tensor::Tensor::from_bytes(vec![], &c.bytes_contents).data,
            c.bytes_contents.len(),
        ),
        None => (Vec::new(), 0),
    })
}

/// The request parameter asking for an empty last response that carries only the final flag
/// (tritonclient's `enable_empty_final_response`).
const EMPTY_FINAL: &str = "triton_enable_empty_final_response";
/// The response parameter marking a decoupled request's last response.
const FINAL: &str = "triton_final_response";

type StreamTx = mpsc::Sender<Result<proto::ModelStreamInferResponse, Status>>;

fn stream_error(e: impl std::fmt::Display) -> proto::ModelStreamInferResponse {
    proto::ModelStreamInferResponse {
        error_message: e.to_string(),
        infer_response: None,
    }
}

/// Answers one request of a ModelStreamInfer stream on `tx`.
async fn stream_one(app: &AppState, r: proto::ModelInferRequest, tx: &StreamTx) {
    // a model whose own input is called text_input (a tokenizer, say) is inferred, not asked
    // to generate
    let own_input = || {
        app.repo
            .resolve(&r.model_name, opt(&r.model_version))
            .is_ok_and(|lv| lv.inputs().iter().any(|s| s.name == TEXT_INPUT))
    };
    if !r.inputs.iter().any(|i| i.name == TEXT_INPUT) || own_input() {
        let resp = match infer_one(app, r).await {
            Ok(resp) => proto::ModelStreamInferResponse {
                error_message: String::new(),
                infer_response: Some(resp),
            },
            Err(e) => stream_error(e.message()),
        };
        let _ = tx.send(Ok(resp)).await;
        return;
    }
    if let Err(e) = stream_generate(app, r, tx).await {
        let _ = tx.send(Ok(stream_error(e))).await;
    }
}

/// The name of a generation's input (BYTES `[1]`, the prompt) and output (BYTES `[1]`, a piece
/// of text), as Triton's LLM backends name them.
const TEXT_INPUT: &str = "text_input";
const TEXT_OUTPUT: &str = "text_output";

/// The one element of a BYTES `[1]` tensor: Triton's raw form (a 4-byte little-endian length,
/// then the bytes) or `bytes_contents`.
fn one_string(
    input: &proto::model_infer_request::InferInputTensor,
    raw: Option<&Vec<u8>>,
) -> Result<String, ServeError> {
    if input.datatype != "BYTES" {
        return Err(ServeError::Datatype {
            tensor: TEXT_INPUT.into(),
            found: input.datatype.clone(),
            expected: "BYTES",
        });
    }
    if input.shape.iter().product::<i64>() != 1 {
        return Err(ServeError::Shape {
            tensor: TEXT_INPUT.into(),
            shape: input.shape.clone(),
            reason: "a generation takes one prompt".into(),
        });
    }
    let bytes = match (raw, &input.contents) {
        (Some(raw), None) => {
            let (len, rest) = raw.split_at_checked(4).ok_or_else(|| {
                ServeError::malformed("text_input's raw contents lack the 4-byte length")
            })?;
            let n = u32::from_le_bytes(len.try_into().unwrap_or_default()) as usize;
            if n != rest.len() {
                return Err(ServeError::malformed(format!(
                    "text_input's raw contents say {n} bytes and hold {}",
                    rest.len()
                )));
            }
            rest.to_vec()
        }
        (None, Some(c)) if c.bytes_contents.len() == 1 => c.bytes_contents[0].clone(),
        _ => {
            return Err(ServeError::malformed(
                "text_input needs exactly one element, in contents or raw_input_contents",
            ))
        }
    };
    String::from_utf8(bytes).map_err(|_| ServeError::malformed("text_input is not UTF-8"))
}

/// The request's parameters as the generate extension's JSON ones, less the stream's own.
fn generate_params(
    params: &std::collections::HashMap<String, proto::InferParameter>,
) -> (serde_json::Map<String, serde_json::Value>, bool) {
    use proto::infer_parameter::ParameterChoice as P;
    let mut out = serde_json::Map::new();
    let mut empty_final = false;
    for (k, v) in params {
        let value = match &v.parameter_choice {
            Some(P::BoolParam(b)) => (*b).into(),
            Some(P::Int64Param(i)) => (*i).into(),
            Some(P::StringParam(s)) => s.clone().into(),
            Some(P::DoubleParam(d)) => (*d).into(),
            Some(P::Uint64Param(u)) => (*u).into(),
            None => serde_json::Value::Null,
        };
        match k.as_str() {
            EMPTY_FINAL => empty_final = value.as_bool().unwrap_or(false),
            // tritonclient sets these on every streamed request; they mean nothing here
            "sequence_id" | "sequence_start" | "sequence_end" | "priority" | "timeout" => {}
            _ => {
                out.insert(k.clone(), value);
            }
        }
    }
    (out, empty_final)
}

/// A decoupled generation: one response per piece of text, the last flagged final.
async fn stream_generate(
    app: &AppState,
    r: proto::ModelInferRequest,
    tx: &StreamTx,
) -> Result<(), ServeError> {
    let start = Instant::now();
    let lv = app.repo.resolve(&r.model_name, opt(&r.model_version))?;
    let (params, empty_final) = generate_params(&r.parameters);
    let prepared = (|| {
        // a streamed generation takes one input, the prompt text
        let [input] = &r.inputs[..] else {
            return Err(ServeError::InputCount {
                model: lv.model.clone(),
                expected: 1,
                found: r.inputs.len(),
            });
        };
        if r.raw_input_contents.len() > 1 {
            return Err(ServeError::malformed(format!(
                "{} raw_input_contents for 1 input",
                r.raw_input_contents.len()
            )));
        }
        let text = one_string(input, r.raw_input_contents.first())?;
        let g = generate_options(&params, true)?;
        let codec = lv.text.as_ref().map_err(|reason| ServeError::Text {
            model: lv.model.clone(),
            reason: reason.clone(),
        })?;
        let prompt = codec.encode(&text).map_err(|reason| ServeError::Text {
            model: lv.model.clone(),
            reason,
        })?;
        Ok((prompt, g))
    })();
    let (prompt, g) = prepared.map_err(|e| lv.reject(e, start))?;
    let (mut tokens, mut done) = lv.generate(prompt, g.opts, !g.ignore_eos)?;
    let codec = lv.text.as_ref().expect("checked before queueing");
    let mut detok = crate::text::Detokenizer::new(codec);
    let response = |text: Option<&str>, last: bool| {
        let mut resp = proto::ModelInferResponse {
            model_name: lv.model.clone(),
            model_version: lv.version.to_string(),
            id: r.id.clone(),
            ..Default::default()
        };
        resp.parameters.insert(
            FINAL.into(),
            proto::InferParameter {
                parameter_choice: Some(proto::infer_parameter::ParameterChoice::BoolParam(last)),
            },
        );
        if let Some(t) = text {
            resp.outputs
                .push(proto::model_infer_response::InferOutputTensor {
                    name: TEXT_OUTPUT.into(),
                    datatype: "BYTES".into(),
                    shape: vec![1],
                    ..Default::default()
                });
            let mut raw = (t.len() as u32).to_le_bytes().to_vec();
            raw.extend_from_slice(t.as_bytes());
            resp.raw_output_contents.push(raw);
        }
        Ok(proto::ModelStreamInferResponse {
            error_message: String::new(),
            infer_response: Some(resp),
        })
    };
    // one piece is held back, so that the last one can carry the final flag
    let mut held: Option<String> = None;
    loop {
        let id = tokio::select! {
            id = tokens.recv() => id,
            _ = tx.closed() => None,
        };
        let Some(id) = id else { break };
        // The end of text a generation stops at is not text.
        if lv.eos.contains(&id) {
            continue;
        }
        let piece = detok.push(id);
        if piece.is_empty() {
            continue;
        }
        if let Some(prev) = held.replace(piece) {
            if tx.send(response(Some(&prev), false)).await.is_err() {
                break;
            }
        }
    }
    if tx.is_closed() {
        // the client left: dropping the receivers stops the generation after this step
        drop(tokens);
        if let Ok(out) = done.try_recv() {
            lv.account(&out, start);
        }
        return Ok(());
    }
    let out = (&mut done).await.unwrap_or_else(|_| Err(lv.lost()));
    lv.account(&out, start);
    out?;
    let rest = detok.finish();
    if !rest.is_empty() {
        held = Some(held.unwrap_or_default() + &rest);
    }
    if empty_final {
        if let Some(last) = held.take() {
            let _ = tx.send(response(Some(&last), false)).await;
        }
        let _ = tx.send(response(None, true)).await;
    } else {
        let _ = tx.send(response(held.as_deref(), true)).await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_contents_of_the_unsigned_types_are_little_endian_and_fp16_is_refused_by_name() {
        let c = proto::InferTensorContents {
            uint_contents: vec![65535, 1],
            uint64_contents: vec![u64::MAX],
            ..Default::default()
        };
        let (b, n) = typed_contents("U", "UINT16", &c).unwrap();
        assert_eq!((b, n), (vec![0xff, 0xff, 1, 0], 2));
        let (b, n) = typed_contents("U", "UINT32", &c).unwrap();
        assert_eq!((b, n), (vec![0xff, 0xff, 0, 0, 1, 0, 0, 0], 2));
        let (b, n) = typed_contents("U", "UINT64", &c).unwrap();
        assert_eq!((b, n), (u64::MAX.to_le_bytes().to_vec(), 1));
        let err = typed_contents("H", "FP16", &c).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::BadRequest);
        assert!(
            err.to_string()
                .contains("input \"H\": FP16 has no typed contents"),
            "{err}"
        );
    }
}
