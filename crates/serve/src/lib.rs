//! Inference serving for cohort's GPT checkpoints, ONNX models and ensembles of them, speaking
//! Triton Inference Server's protocol (KServe v2 over HTTP and gRPC) so that Triton's own
//! clients work against it unchanged.
//!
//! A [`Server`] serves a model repository laid out as Triton's (`REPO/<model>/config.pbtxt`,
//! numbered version directories holding checkpoints or `model.onnx`; see the `repository`
//! module), polls it for
//! new versions, and answers:
//!
//! - HTTP (axum): `/v2/health/{live,ready}`, `/v2`, `/v2/models/<m>[/versions/<v>]` (metadata,
//!   `/ready`, `/config`, `/infer`, `/stats`), `/v2/models/stats`, `/v2/models/<m>/generate` and
//!   `/generate_stream` (server-sent events), `/v2/repository/{index, models/<m>/load,
//!   models/<m>/unload}` (load may carry a JSON configuration override), `/metrics`; gzip and
//!   deflate bodies both ways.
//! - gRPC (tonic, `inference.GRPCInferenceService`): ServerLive, ServerReady, ServerMetadata,
//!   ModelReady, ModelMetadata, ModelConfig, ModelStatistics, ModelInfer, ModelStreamInfer,
//!   RepositoryIndex, RepositoryModelLoad / Unload; gzip and deflate messages; the caller's
//!   deadline is enforced (DEADLINE_EXCEEDED).
//! - OpenAI-compatible, on the HTTP port: `GET /v1/models`, `POST /v1/completions` (streaming
//!   or not; see the `frontend::openai` module for what is refused).
//! - Metrics (Prometheus text) alone on their own port, as Triton's 8002.
//!
//! A model is served by the backend its config names (`platform` / `backend`, as Triton's; see
//! the `backend` module): cohort's GPT checkpoints (`cohort_gpt`: `input_ids` INT64
//! `[batch, seq]` in, `logits` FP32 `[batch, seq, vocab]` and `next_token` INT64 `[batch]`
//! out), ONNX models (`onnxruntime_onnx`: `model.onnx`, executed by tract, tensors read from
//! the file), or an ensemble of other models (`ensemble`; see the `model::ensemble` module).
//! Requests go to a bounded per-version queue served by `instance_group` instances, whatever
//! the backend; with `dynamic_batching`, an instance runs queued requests of the same shapes as
//! one batch (see the `batcher` module). Generation uses `cohort_gpt::sample`, the code behind
//! `cohort sample`, so the same seed gives the same text; concurrent generations share batched
//! decode steps (in-flight batching, switched by the config parameter `inflight_batching`; see
//! the `model` module) without changing any of their tokens.
//!
//! The crate never trains and never writes to the repository.
//!
//! # Layout
//!
//! Three layers, each importing only from the ones below it (no module imports one that
//! imports it back):
//!
//! - **Front ends** (`frontend`): `http` (KServe v2 REST), `grpc` (KServe v2 gRPC) and
//!   `openai` (OpenAI completions on the HTTP port) parse requests and encode answers; what
//!   more than one of them needs sits below them in the same folder (`AppState`, `metadata`,
//!   `params`, `body`, `sse`). `server` binds them to their ports over the core.
//! - **Core**: `repository` (what is loaded, polls the disk, loads and unloads) over `model`
//!   (a loaded version: its queue, its instance threads, in-flight generation; its children
//!   `ensemble` and `config_check`), `batcher` (the queue and dynamic batching), `metrics`,
//!   `tensor` (typed tensors; its child `wire` checks a request's inputs) and `text` (a
//!   model's text codec).
//! - **Backends** (`backend`): `gpt`, `onnx` (with `onnx_dense`), `onnx_ort`, `tokenizer`,
//!   behind the `Backend` / `Instance` seam; each also checks the part of a config only it can
//!   judge. `profile` sums a backend's operator times ([`OpProfile`]).
//!
//! At the bottom, `config` (with `pbtxt`, `platform`, `spellings`) reads a model's
//! configuration and names none of the above, and `error` is [`ServeError`].
//!
//! ```no_run
//! use cohort_serve::{Server, ServerOptions};
//!
//! let server = Server::start(ServerOptions::new("models".into())).unwrap();
//! println!("HTTP on {}", server.http_addr());
//! server.wait_for_signal(); // Ctrl-C: stop accepting, finish in-flight requests, exit
//! ```

#![deny(missing_docs)]

mod backend;
mod batcher;
mod config;

mod error;
mod frontend;
mod metrics;
mod model;

mod repository;
mod server;
mod tensor;
mod text;

/// The KServe v2 protobuf messages and the tonic client and server of
/// `inference.GRPCInferenceService`, generated from `proto/grpc_service.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("inference");
}

pub use backend::profile::{OpProfile, OpTime};
pub use config::{
    DynamicBatching, EnsembleScheduling, EnsembleStep, InstanceGroup, Kind, ModelConfig,
    QueuePolicy, TensorConfig, VersionPolicy, ENSEMBLE_PLATFORM, GPT_PLATFORM, INFLIGHT_BATCHING,
    ONNX_BACKEND, ONNX_PLATFORM, PBTXT_FILE, TOML_FILE,
};
pub use error::{ErrorKind, ServeError};
pub use metrics::{Metrics, VersionMetrics};
pub use repository::IndexEntry;
pub use server::{init_logging, init_logging_to, Server, ServerOptions};
pub use tensor::{DataType, Tensor, TensorSpec, FP32, INPUT_IDS, INT64, LOGITS, NEXT_TOKEN};

/// The server's name in metadata responses.
pub const SERVER_NAME: &str = "cohort";
/// The `platform` of cohort's GPT models (see [`Kind`] for the others).
pub const PLATFORM: &str = GPT_PLATFORM;
/// The KServe / Triton protocol extensions served.
pub const EXTENSIONS: &[&str] = &[
    "binary_tensor_data",
    "model_repository",
    "model_configuration",
    "statistics",
    "generate",
];
/// Most tokens one generate request may ask for.
pub const MAX_GENERATE_TOKENS: usize = 4096;
