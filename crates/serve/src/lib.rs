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
//!   or not; see the `openai` module for what is refused).
//! - Metrics (Prometheus text) alone on their own port, as Triton's 8002.
//!
//! A model is served by the backend its config names (`platform` / `backend`, as Triton's; see
//! the `backend` module): cohort's GPT checkpoints (`cohort_gpt`: `input_ids` INT64
//! `[batch, seq]` in, `logits` FP32 `[batch, seq, vocab]` and `next_token` INT64 `[batch]`
//! out), ONNX models (`onnxruntime_onnx`: `model.onnx`, executed by tract, tensors read from
//! the file), or an ensemble of other models (`ensemble`; see the `ensemble` module). Requests
//! go to a bounded per-version queue served by `instance_group` instances, whatever the
//! backend; with `dynamic_batching`, an instance runs queued requests of the same shapes as one
//! batch (see the `batcher` module). Generation uses `cohort_gpt::sample`, the code behind
//! `cohort sample`, so the same seed gives the same text; concurrent generations share batched
//! decode steps (in-flight batching, switched by the config parameter `inflight_batching`; see
//! the `model` module) without changing any of their tokens.
//!
//! The crate never trains and never writes to the repository.
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
mod ensemble;
mod error;
mod grpc;
mod http;
mod metrics;
mod model;
mod openai;
mod pbtxt;
mod repository;
mod tensor;
mod text;

/// The KServe v2 protobuf messages and the tonic client and server of
/// `inference.GRPCInferenceService`, generated from `proto/grpc_service.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("inference");
}

pub use backend::{Kind, ENSEMBLE_PLATFORM, GPT_PLATFORM, ONNX_PLATFORM};
pub use config::{
    DynamicBatching, EnsembleScheduling, EnsembleStep, InstanceGroup, ModelConfig, QueuePolicy,
    TensorConfig, VersionPolicy, INFLIGHT_BATCHING, PBTXT_FILE, TOML_FILE,
};
pub use error::{ErrorKind, ServeError};
pub use metrics::{Metrics, VersionMetrics};
pub use repository::IndexEntry;
pub use tensor::{DataType, Tensor, TensorSpec, FP32, INPUT_IDS, INT64, LOGITS, NEXT_TOKEN};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cohort_gpt::sample::SampleOptions;
use serde_json::{json, Map, Value};
use tokio::sync::watch;

use crate::model::{BuildOptions, LoadedVersion};
use crate::repository::Repository;

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

/// How to run a [`Server`].
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// The model repository.
    pub repository: PathBuf,
    /// HTTP listen address (port 0: any free port).
    pub http: SocketAddr,
    /// gRPC listen address; None: no gRPC endpoint.
    pub grpc: Option<SocketAddr>,
    /// Metrics listen address (`/metrics` only); None: no metrics port. The HTTP port serves
    /// `/metrics` either way.
    pub metrics: Option<SocketAddr>,
    /// How often to rescan the repository; None: only at start and on API calls.
    pub poll_interval: Option<Duration>,
    /// Models to load at start (and to pick up while polling); None: every model directory.
    pub load_models: Option<Vec<String>>,
    /// Largest request body accepted (HTTP; gRPC messages likewise).
    pub max_body_bytes: usize,
    /// Queue bound of a model whose config sets none.
    pub default_queue_size: usize,
    /// Engine threads per model instance; None: the cores this process may use divided by the
    /// model's instance count.
    pub instance_threads: Option<usize>,
    /// Threads of the async runtime that parses requests and encodes answers.
    pub io_threads: usize,
}

impl ServerOptions {
    /// Triton's default ports (HTTP 8000, gRPC 8001, metrics 8002) on all interfaces, polling
    /// every 2 s.
    pub fn new(repository: PathBuf) -> ServerOptions {
        ServerOptions {
            repository,
            http: SocketAddr::from(([0, 0, 0, 0], 8000)),
            grpc: Some(SocketAddr::from(([0, 0, 0, 0], 8001))),
            metrics: Some(SocketAddr::from(([0, 0, 0, 0], 8002))),
            poll_interval: Some(Duration::from_secs(2)),
            load_models: None,
            max_body_bytes: 16 << 20,
            default_queue_size: 1024,
            instance_threads: None,
            io_threads: 2,
        }
    }

    /// Every endpoint on loopback ports the OS picks (tests, benchmarks).
    pub fn loopback(repository: PathBuf) -> ServerOptions {
        ServerOptions {
            http: SocketAddr::from(([127, 0, 0, 1], 0)),
            grpc: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            metrics: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            ..ServerOptions::new(repository)
        }
    }
}

/// What the front ends share.
pub(crate) struct AppState {
    pub repo: Arc<Repository>,
    pub metrics: Arc<Metrics>,
    pub ready: AtomicBool,
    pub max_body_bytes: usize,
}

/// A running server: its async runtime, endpoints, repository poller and model instances.
pub struct Server {
    runtime: tokio::runtime::Runtime,
    app: Arc<AppState>,
    http_addr: SocketAddr,
    grpc_addr: Option<SocketAddr>,
    metrics_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Server {
    /// Loads the repository's models, binds the endpoints and starts serving. Returns once
    /// the server answers requests.
    pub fn start(opts: ServerOptions) -> Result<Server, ServeError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(opts.io_threads.max(1))
            .thread_name("serve-io")
            .enable_all()
            .build()
            .map_err(|source| ServeError::Io {
                op: "start the async runtime for",
                path: opts.repository.clone(),
                source,
            })?;
        let metrics = Arc::new(Metrics::default());
        let repo = Arc::new(Repository::new(
            opts.repository.clone(),
            opts.load_models.clone(),
            BuildOptions {
                default_queue_size: opts.default_queue_size,
                instance_threads: opts.instance_threads,
            },
            metrics.clone(),
        )?);
        repo.poll();
        let app = Arc::new(AppState {
            repo: repo.clone(),
            metrics,
            ready: AtomicBool::new(false),
            max_body_bytes: opts.max_body_bytes,
        });
        let (stop, stopped) = watch::channel(false);
        let mut tasks = Vec::new();
        let (http_addr, grpc_addr, metrics_addr) = runtime.block_on(async {
            let serve_http = |what: &'static str, addr: SocketAddr, router: axum::Router| {
                let mut rx = stopped.clone();
                async move {
                    let bind_err = |source| ServeError::Bind { what, addr, source };
                    let listener = tokio::net::TcpListener::bind(addr)
                        .await
                        .map_err(bind_err)?;
                    let bound = listener.local_addr().map_err(bind_err)?;
                    let task = tokio::spawn(async move {
                        let shutdown = async move {
                            let _ = rx.wait_for(|s| *s).await;
                        };
                        // no Nagle delay (see the gRPC listener below)
                        let listener = axum::serve::ListenerExt::tap_io(
                            listener,
                            |tcp: &mut tokio::net::TcpStream| {
                                let _ = tcp.set_nodelay(true);
                            },
                        );
                        if let Err(e) = axum::serve(listener, router)
                            .with_graceful_shutdown(shutdown)
                            .await
                        {
                            tracing::error!(error = %e, "{what} server failed");
                        }
                    });
                    Ok::<_, ServeError>((bound, task))
                }
            };
            let (http_addr, task) =
                serve_http("HTTP", opts.http, http::router(app.clone())).await?;
            tasks.push(task);
            let mut metrics_addr = None;
            if let Some(addr) = opts.metrics {
                let (bound, task) =
                    serve_http("metrics", addr, http::metrics_router(app.clone())).await?;
                metrics_addr = Some(bound);
                tasks.push(task);
            }
            let mut grpc_addr = None;
            if let Some(addr) = opts.grpc {
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|source| ServeError::Bind {
                        what: "gRPC",
                        addr,
                        source,
                    })?;
                grpc_addr = Some(listener.local_addr().map_err(|source| ServeError::Bind {
                    what: "gRPC",
                    addr,
                    source,
                })?);
                use tonic::codec::CompressionEncoding::{Deflate, Gzip};
                // compressed answers go only to clients that announce they accept them
                let svc = proto::grpc_inference_service_server::GrpcInferenceServiceServer::new(
                    grpc::Service { app: app.clone() },
                )
                .accept_compressed(Gzip)
                .accept_compressed(Deflate)
                .send_compressed(Gzip)
                .send_compressed(Deflate)
                .max_decoding_message_size(opts.max_body_bytes)
                .max_encoding_message_size(usize::MAX);
                // no Nagle delay: an answer of a few frames (headers, data, trailers) must not
                // wait for the client's delayed ACK (40 ms) before its last frames leave
                let incoming = tokio_stream::StreamExt::map(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    |conn| {
                        if let Ok(c) = &conn {
                            let _ = c.set_nodelay(true);
                        }
                        conn
                    },
                );
                let mut rx = stopped.clone();
                tasks.push(tokio::spawn(async move {
                    let shutdown = async move {
                        let _ = rx.wait_for(|s| *s).await;
                    };
                    if let Err(e) = tonic::transport::Server::builder()
                        .layer(tower::layer::layer_fn(grpc::Protocol::new))
                        .add_service(svc)
                        .serve_with_incoming_shutdown(incoming, shutdown)
                        .await
                    {
                        tracing::error!(error = %e, "gRPC server failed");
                    }
                }));
            }
            if let Some(every) = opts.poll_interval {
                let (repo, mut rx) = (repo.clone(), stopped.clone());
                tasks.push(tokio::spawn(async move {
                    let mut tick = tokio::time::interval(every);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    tick.tick().await;
                    loop {
                        tokio::select! {
                            _ = tick.tick() => {}
                            _ = rx.wait_for(|s| *s) => break,
                        }
                        let repo = repo.clone();
                        let _ = tokio::task::spawn_blocking(move || repo.poll()).await;
                    }
                }));
            }
            Ok::<_, ServeError>((http_addr, grpc_addr, metrics_addr))
        })?;
        app.ready.store(true, Ordering::Release);
        tracing::info!(http = %http_addr, grpc = ?grpc_addr, metrics = ?metrics_addr,
            repository = %opts.repository.display(), "serving");
        Ok(Server {
            runtime,
            app,
            http_addr,
            grpc_addr,
            metrics_addr,
            stop,
            tasks,
        })
    }

    /// The bound HTTP address.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// The bound gRPC address, if gRPC is served.
    pub fn grpc_addr(&self) -> Option<SocketAddr> {
        self.grpc_addr
    }

    /// The bound metrics address, if the metrics port is served.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// The server's metrics (what `/metrics` renders).
    pub fn metrics(&self) -> &Metrics {
        &self.app.metrics
    }

    /// Whether the latest version of model `name` is loaded and serving (what
    /// `/v2/models/{name}/ready` answers).
    pub fn is_model_ready(&self, name: &str) -> bool {
        self.app.repo.resolve(name, None).is_ok()
    }

    /// The repository index (what `/v2/repository/index` answers).
    pub fn index(&self) -> Vec<IndexEntry> {
        self.app.repo.index(false)
    }

    /// Rescans the repository now (blocking), as the poller does.
    pub fn poll_repository(&self) {
        self.app.repo.poll();
    }

    /// Blocks until SIGINT or SIGTERM, then shuts down gracefully.
    pub fn wait_for_signal(self) {
        self.runtime.block_on(async {
            #[cfg(unix)]
            {
                use tokio::signal::unix::{signal, SignalKind};
                match signal(SignalKind::terminate()) {
                    Ok(mut term) => {
                        tokio::select! {
                            _ = tokio::signal::ctrl_c() => {}
                            _ = term.recv() => {}
                        }
                    }
                    Err(_) => {
                        let _ = tokio::signal::ctrl_c().await;
                    }
                }
            }
            #[cfg(not(unix))]
            {
                let _ = tokio::signal::ctrl_c().await;
            }
        });
        tracing::info!("signal received; finishing in-flight requests");
        self.shutdown();
    }

    /// Stops accepting connections, lets in-flight requests finish, unloads every model.
    pub fn shutdown(self) {
        self.app.ready.store(false, Ordering::Release);
        let _ = self.stop.send(true);
        let tasks = self.tasks;
        self.runtime.block_on(async {
            for t in tasks {
                let _ = tokio::time::timeout(Duration::from_secs(30), t).await;
            }
        });
        self.app.repo.close();
        self.runtime.shutdown_timeout(Duration::from_secs(1));
    }
}

/// Sets up structured logs on stderr: human-readable or one JSON object per line. The level
/// comes from `COHORT_LOG` (e.g. `debug`, `cohort_serve=debug`), default `info`. A second call
/// does nothing.
pub fn init_logging(json: bool) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("COHORT_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

/// Model metadata, shared by the HTTP and gRPC answers.
pub(crate) struct ModelMeta<'a> {
    pub name: String,
    pub versions: Vec<String>,
    pub platform: &'static str,
    pub inputs: &'a [TensorSpec],
    pub outputs: &'a [TensorSpec],
}

pub(crate) fn metadata(lv: &LoadedVersion, versions: Vec<String>) -> ModelMeta<'_> {
    ModelMeta {
        name: lv.model.clone(),
        versions,
        platform: lv.kind.platform(),
        inputs: lv.inputs(),
        outputs: lv.outputs(),
    }
}

/// The configuration `lv` is served with, as Triton's ModelConfig: what the config file (or a
/// load override) says, with Triton's effective defaults filled in (the tensors, CPU instance
/// groups). The HTTP `/config` answer is [`config_json`] of the same message, so both protocols
/// always agree.
pub(crate) fn model_config(lv: &LoadedVersion) -> proto::ModelConfig {
    use proto::model_config::SchedulingChoice;
    use proto::model_instance_group::Kind;
    use proto::model_version_policy::{self as vp, PolicyChoice};
    use proto::DataType;
    use tensor::DataType as Dt;
    let cfg = &lv.config;
    let policy = match &cfg.version_policy {
        VersionPolicy::Latest { num_versions } => PolicyChoice::Latest(vp::Latest {
            num_versions: *num_versions,
        }),
        VersionPolicy::All {} => PolicyChoice::All(vp::All {}),
        VersionPolicy::Specific { versions } => PolicyChoice::Specific(vp::Specific {
            versions: versions.iter().map(|&v| v as i64).collect(),
        }),
    };
    let counts: Vec<usize> = if cfg.instance_group.is_empty() {
        vec![1]
    } else {
        cfg.instance_group.iter().map(|g| g.count).collect()
    };
    let dtype = |d: Dt| DataType::from_str_name(d.triton()).unwrap_or(DataType::TypeInvalid) as i32;
    // without the batch dimension, as Triton writes a batching model's tensors; a tensor with
    // no other dimension is [1] reshaped to []
    let reshape =
        |t: &TensorSpec| (t.shape.len() == 1).then(|| proto::ModelTensorReshape { shape: vec![] });
    proto::ModelConfig {
        name: lv.model.clone(),
        platform: lv.kind.platform().into(),
        backend: lv.kind.backend().into(),
        version_policy: Some(proto::ModelVersionPolicy {
            policy_choice: Some(policy),
        }),
        max_batch_size: cfg.max_batch_size as i32,
        input: lv
            .inputs()
            .iter()
            .map(|t| proto::ModelInput {
                name: t.name.clone(),
                data_type: dtype(t.datatype),
                dims: t.config_dims(),
            })
            .collect(),
        output: lv
            .outputs()
            .iter()
            .map(|t| proto::ModelOutput {
                name: t.name.clone(),
                data_type: dtype(t.datatype),
                dims: t.config_dims(),
                reshape: reshape(t),
            })
            .collect(),
        scheduling_choice: cfg.dynamic_batching.as_ref().map(|d| {
            SchedulingChoice::DynamicBatching(proto::ModelDynamicBatching {
                preferred_batch_size: d.preferred_batch_size.iter().map(|&p| p as i32).collect(),
                max_queue_delay_microseconds: d.max_queue_delay_microseconds,
                preserve_ordering: d.preserve_ordering,
                default_queue_policy: d.default_queue_policy.as_ref().map(|q| {
                    proto::ModelQueuePolicy {
                        max_queue_size: q.max_queue_size as u32,
                    }
                }),
            })
        }),
        instance_group: counts
            .iter()
            .enumerate()
            .map(|(i, &count)| proto::ModelInstanceGroup {
                name: format!("{}_{i}", lv.model),
                kind: Kind::Cpu as i32,
                count: count as i32,
            })
            .collect(),
        parameters: cfg
            .parameters
            .iter()
            .map(|(k, v)| {
                let p = proto::ModelParameter {
                    string_value: v.clone(),
                };
                (k.clone(), p)
            })
            .collect(),
    }
}

/// Triton's HTTP JSON of a ModelConfig: the message's fields by their proto names.
pub(crate) fn config_json(c: &proto::ModelConfig) -> Value {
    use proto::model_config::SchedulingChoice;
    use proto::model_version_policy::PolicyChoice;
    let dtype = |t: i32| {
        proto::DataType::try_from(t)
            .unwrap_or(proto::DataType::TypeInvalid)
            .as_str_name()
    };
    let policy = match c
        .version_policy
        .as_ref()
        .and_then(|p| p.policy_choice.as_ref())
    {
        Some(PolicyChoice::Latest(l)) => json!({"latest": {"num_versions": l.num_versions}}),
        Some(PolicyChoice::All(_)) => json!({"all": {}}),
        Some(PolicyChoice::Specific(s)) => json!({"specific": {"versions": s.versions}}),
        None => json!({}),
    };
    let mut v = json!({
        "name": c.name,
        "platform": c.platform,
        "backend": c.backend,
        "version_policy": policy,
        "max_batch_size": c.max_batch_size,
        "input": c.input.iter().map(|t| json!({
            "name": t.name, "data_type": dtype(t.data_type), "dims": t.dims,
        })).collect::<Vec<_>>(),
        "output": c.output.iter().map(|t| {
            let mut o = json!({"name": t.name, "data_type": dtype(t.data_type), "dims": t.dims});
            if let Some(r) = &t.reshape {
                o["reshape"] = json!({"shape": r.shape});
            }
            o
        }).collect::<Vec<_>>(),
        "instance_group": c.instance_group.iter().map(|g| json!({
            "name": g.name,
            "kind": proto::model_instance_group::Kind::try_from(g.kind)
                .unwrap_or(proto::model_instance_group::Kind::Auto)
                .as_str_name(),
            "count": g.count,
        })).collect::<Vec<_>>(),
    });
    if let Some(SchedulingChoice::DynamicBatching(d)) = &c.scheduling_choice {
        let mut db = json!({
            "preferred_batch_size": d.preferred_batch_size,
            "max_queue_delay_microseconds": d.max_queue_delay_microseconds,
            "preserve_ordering": d.preserve_ordering,
        });
        if let Some(q) = &d.default_queue_policy {
            db["default_queue_policy"] = json!({"max_queue_size": q.max_queue_size});
        }
        v["dynamic_batching"] = db;
    }
    if !c.parameters.is_empty() {
        let p: Map<String, Value> = c
            .parameters
            .iter()
            .map(|(k, p)| (k.clone(), json!({ "string_value": p.string_value })))
            .collect();
        v["parameters"] = Value::Object(p);
    }
    v
}

/// A repository load parameter cohort does not take, refused by name (never ignored: an
/// ignored parameter would load something other than what the caller asked for).
pub(crate) fn unsupported_load_parameter(name: &str) -> ServeError {
    let why = if name.starts_with("file:") {
        "override files are not supported; put the checkpoint in the repository's version \
         directory and pass the configuration as the config parameter"
    } else {
        "unknown; load takes config (a JSON model configuration)"
    };
    ServeError::parameter(name, why)
}

/// The sampling options of a generate request's parameters, with `cohort sample`'s defaults
/// (100 tokens, temperature 0.8, no top-k, seed 1337), and whether the prompt is left out of
/// `text_output`.
pub(crate) fn generate_options(
    params: &Map<String, Value>,
    streaming: bool,
) -> Result<(SampleOptions, bool), ServeError> {
    let mut opts = SampleOptions {
        max_new_tokens: 100,
        temperature: 0.8,
        top_k: None,
        seed: 1337,
    };
    let mut exclude_input = false;
    for (k, v) in params {
        let int = || {
            v.as_i64()
                .ok_or_else(|| ServeError::parameter(k, format!("{v} is not an integer")))
        };
        match k.as_str() {
            "max_tokens" => {
                let n = int()?;
                if n < 1 || n as usize > MAX_GENERATE_TOKENS {
                    return Err(ServeError::parameter(
                        k,
                        format!("{n} is outside 1..={MAX_GENERATE_TOKENS}"),
                    ));
                }
                opts.max_new_tokens = n as usize;
            }
            "temperature" => {
                let t = v
                    .as_f64()
                    .ok_or_else(|| ServeError::parameter(k, format!("{v} is not a number")))?;
                if !(t >= 0.0 && t.is_finite()) {
                    return Err(ServeError::parameter(
                        k,
                        format!("{t} must be >= 0 (0 = greedy)"),
                    ));
                }
                opts.temperature = t as f32;
            }
            // 0 and -1 mean "no top-k", as Hugging Face's and vLLM's conventions
            "top_k" => opts.top_k = usize::try_from(int()?).ok().filter(|&k| k > 0),
            "seed" => {
                opts.seed = v
                    .as_u64()
                    .ok_or_else(|| ServeError::parameter(k, format!("{v} is not a u64")))?
            }
            "exclude_input_in_output" => {
                exclude_input = v
                    .as_bool()
                    .ok_or_else(|| ServeError::parameter(k, format!("{v} is not a boolean")))?
            }
            "stream" => {
                if v.as_bool() != Some(streaming) {
                    return Err(ServeError::parameter(
                        k,
                        format!(
                            "{v} does not match the endpoint (generate_stream streams, generate \
                             does not)"
                        ),
                    ));
                }
            }
            _ => {
                return Err(ServeError::parameter(
                    k,
                    "unknown; generate takes max_tokens, temperature, top_k, seed, \
                     exclude_input_in_output, stream",
                ))
            }
        }
    }
    Ok((opts, exclude_input))
}
