//! The running server: binds the endpoints (HTTP with the OpenAI routes, gRPC, metrics), owns
//! the async runtime, the repository and its poller, and shuts all of it down gracefully. It is
//! where the front ends meet the core: it builds the [`Repository`] and hands both to each
//! front end through [`AppState`].
//!
//! This module never parses a request and never runs a model: it only wires and stops what
//! does.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::backend::profile::OpProfile;
use crate::error::ServeError;
use crate::frontend::{grpc, http, openai, AppState};
use crate::metrics::Metrics;
use crate::model::BuildOptions;
use crate::proto;
use crate::repository::{IndexEntry, Repository};
use crate::tensor::Tensor;

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
    /// Fail [`Server::start`] when a model asked for (named in `load_models`, or any model
    /// directory) is not ready after the first load, naming each and why (Triton's
    /// `--exit-on-error`; `cohort serve` sets it by default).
    pub exit_on_error: bool,
    /// `/v2/health/ready` answers ready only while every model asked for is ready (Triton's
    /// `--strict-readiness`; `cohort serve` sets it by default); otherwise once the server
    /// answers requests.
    pub strict_readiness: bool,
    /// A model directory without a config file fails to load (Triton's
    /// `--strict-model-config`) instead of being served with the config its files imply.
    pub strict_model_config: bool,
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
            exit_on_error: false,
            strict_readiness: false,
            strict_model_config: false,
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
            opts.strict_model_config,
            metrics.clone(),
        )?);
        repo.poll();
        // Triton's startup table: what loaded, and why the rest did not.
        tracing::info!("models of {}:\n{}", opts.repository.display(), repo.table());
        let failed = repo.not_ready();
        if opts.exit_on_error && !failed.is_empty() {
            repo.close();
            return Err(ServeError::ModelsNotReady {
                models: (failed.iter())
                    .map(|(model, why)| format!("{model:?}: {why}"))
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        }
        let app = Arc::new(AppState {
            repo: repo.clone(),
            metrics,
            ready: AtomicBool::new(false),
            strict_readiness: opts.strict_readiness,
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
            let (http_addr, task) = serve_http(
                "HTTP",
                opts.http,
                http::router(app.clone(), openai::routes()),
            )
            .await?;
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
        let or_off = |a: Option<SocketAddr>| a.map_or_else(|| "off".to_string(), |a| a.to_string());
        tracing::info!(http = %http_addr, grpc = %or_off(grpc_addr), metrics = %or_off(metrics_addr),
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

    /// What executes the latest version of model `name` (an ONNX model's runtime and threads),
    /// if it is loaded; empty where its backend has one way only.
    pub fn backend_of(&self, name: &str) -> Option<String> {
        self.app.repo.resolve(name, None).ok().map(|v| v.describe())
    }

    /// Where the latest version of model `name` spends its time, per operator type: `runs`
    /// executions of one batch of `inputs` (its inputs in the model's order, batch dimension
    /// first) on a private copy of the model, beside the instances serving requests (an ONNX
    /// model's; other backends do not time their operators).
    pub fn profile(
        &self,
        name: &str,
        inputs: &[Tensor],
        runs: usize,
    ) -> Result<OpProfile, ServeError> {
        self.app.repo.resolve(name, None)?.profile(inputs, runs)
    }

    /// Whether `/v2/health/ready` answers ready: see [`ServerOptions::strict_readiness`].
    pub fn is_ready(&self) -> bool {
        self.app.is_ready()
    }

    /// The models asked for that are not ready, with why (what `--exit-on-error` and
    /// `--strict-readiness` look at).
    pub fn not_ready(&self) -> Vec<(String, String)> {
        self.app.repo.not_ready()
    }

    /// The model table logged at start: every model and version, its state and why.
    pub fn model_table(&self) -> String {
        self.app.repo.table()
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
    let _ = init_logging_to(json, 0, None);
}

/// [`init_logging`], more verbose with `verbose` > 0 (debug; Triton's `--log-verbose`) where
/// `COHORT_LOG` does not set the level, written to `file` (appended) instead of stderr when
/// given (Triton's `--log-file`). Colour codes only where the logs reach a terminal.
pub fn init_logging_to(
    json: bool,
    verbose: u32,
    file: Option<&std::path::Path>,
) -> Result<(), ServeError> {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let level = if verbose > 0 { "debug" } else { "info" };
    let filter = EnvFilter::try_from_env("COHORT_LOG").unwrap_or_else(|_| EnvFilter::new(level));
    let (writer, ansi) = match file {
        Some(path) => {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|source| ServeError::Io {
                    op: "open the log file",
                    path: path.to_path_buf(),
                    source,
                })?;
            (
                tracing_subscriber::fmt::writer::BoxMakeWriter::new(Arc::new(f)),
                false,
            )
        }
        None => (
            tracing_subscriber::fmt::writer::BoxMakeWriter::new(std::io::stderr),
            std::io::stderr().is_terminal(),
        ),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(writer);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    Ok(())
}
