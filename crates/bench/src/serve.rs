//! The serving load test behind `cohort bench serve`: a bounded number of inference requests
//! from N concurrent gRPC clients on loopback, against the same model served with and without
//! dynamic batching; reports throughput and p50 / p99 latency per (mode, clients).
//!
//! Setup: a temporary repository holding one checkpoint (given, or a randomly initialised model
//! of the given config) under two models, `batched` (dynamic batching) and `unbatched` (each
//! request alone), with the same instances and threads. Every request is one row of `seq`
//! random token ids asking only for `next_token`; each client keeps one request in flight on
//! its own connection (Triton perf_analyzer's concurrency mode). The load test never talks to
//! anything but the server it starts, and it stops after the fixed request count.

use cohort_rng::{SplitMix64, GOLDEN_GAMMA};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_gpt::checkpoint::{self, Checkpoint};
use cohort_gpt::{GPTConfig, GPT};
use serde::Serialize;

use cohort_serve::proto::grpc_inference_service_client::GrpcInferenceServiceClient;
use cohort_serve::proto::{model_infer_request, ModelInferRequest};
use cohort_serve::{ServeError, Server, ServerOptions, INPUT_IDS, INT64, NEXT_TOKEN, PBTXT_FILE};

/// What to measure.
#[derive(Debug, Clone)]
pub struct LoadTest {
    /// Checkpoint to serve; None: a model of `model` with random weights.
    pub checkpoint: Option<PathBuf>,
    /// Config of the random model when no checkpoint is given.
    pub model: GPTConfig,
    /// Tokens per request (one row).
    pub seq: usize,
    /// Timed requests per (mode, clients) cell.
    pub requests: usize,
    /// Client counts to run.
    pub clients: Vec<usize>,
    /// max_batch_size of both models.
    pub max_batch_size: usize,
    /// max_queue_delay_microseconds of the batched model.
    pub max_queue_delay_us: u64,
    /// Instances per model.
    pub instances: usize,
    /// Engine threads per instance; None: cores / instances.
    pub threads: Option<usize>,
    /// Untimed requests per cell first (connections, arenas, caches).
    pub warmup: usize,
    /// Seed of the random model and the token ids.
    pub seed: u64,
}

impl Default for LoadTest {
    /// Config B, 16-token requests, 256 requests per cell at 1, 8 and 32 clients, batches of up
    /// to 32 with no added delay, one instance.
    fn default() -> Self {
        LoadTest {
            checkpoint: None,
            model: GPTConfig::config_b(),
            seq: 16,
            requests: 256,
            clients: vec![1, 8, 32],
            max_batch_size: 32,
            max_queue_delay_us: 0,
            instances: 1,
            threads: None,
            warmup: 8,
            seed: 1234,
        }
    }
}

/// One measured cell.
#[derive(Debug, Clone, Serialize)]
pub struct LoadRow {
    /// Whether the model batched dynamically.
    pub dynamic_batching: bool,
    /// Concurrent clients.
    pub clients: usize,
    /// Requests timed.
    pub requests: usize,
    /// Wall time of the cell.
    pub seconds: f64,
    /// Requests per second.
    pub throughput: f64,
    /// Median latency.
    pub p50_ms: f64,
    /// 99th percentile latency.
    pub p99_ms: f64,
    /// Mean rows per model execution during the cell.
    pub mean_batch: f64,
}

/// Runs every (mode, clients) cell, calling `on_row` as each finishes.
pub fn run(t: &LoadTest, mut on_row: impl FnMut(&LoadRow)) -> Result<Vec<LoadRow>, ServeError> {
    if t.seq == 0 || t.requests == 0 || t.clients.contains(&0) {
        return Err(ServeError::parameter(
            "load test",
            "seq, requests and clients must be at least 1",
        ));
    }
    let repo = tempfile::tempdir().map_err(|source| ServeError::Io {
        op: "create a temporary repository in",
        path: std::env::temp_dir(),
        source,
    })?;
    let vocab = write_repository(repo.path(), t)?;
    let mut opts = ServerOptions::loopback(repo.path().to_path_buf());
    opts.poll_interval = None;
    opts.instance_threads = t.threads;
    opts.default_queue_size = t.clients.iter().copied().max().unwrap_or(1) * 2;
    let server = Server::start(opts)?;
    for (model, _) in MODELS {
        if !server.is_model_ready(model) {
            let why = server.index();
            server.shutdown();
            return Err(ServeError::NotReady {
                model: model.to_string(),
                reason: format!("the load test's model did not load: {why:?}"),
            });
        }
    }
    let addr = server.grpc_addr().expect("loopback options serve gRPC");
    let clients_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|source| ServeError::Io {
            op: "start the client runtime for",
            path: repo.path().to_path_buf(),
            source,
        })?;
    let mut rows = Vec::new();
    let result = (|| {
        for (model, batching) in MODELS {
            for &clients in &t.clients {
                let metrics = server.metrics().version(model, 1);
                let cell = Cell {
                    url: format!("http://{addr}"),
                    model,
                    seq: t.seq,
                    vocab,
                    clients,
                    seed: t.seed,
                };
                clients_rt.block_on(cell.drive(t.warmup.max(clients)))?;
                let before = metrics.batches();
                let started = Instant::now();
                let mut lat = clients_rt.block_on(cell.drive(t.requests))?;
                let seconds = started.elapsed().as_secs_f64();
                let after = metrics.batches();
                lat.sort_by(|a, b| a.total_cmp(b));
                let pct =
                    |p: f64| lat[((lat.len() as f64 * p).ceil() as usize).clamp(1, lat.len()) - 1];
                let execs = (after.0 - before.0).max(1);
                let row = LoadRow {
                    dynamic_batching: batching,
                    clients,
                    requests: t.requests,
                    seconds,
                    throughput: t.requests as f64 / seconds,
                    p50_ms: pct(0.50),
                    p99_ms: pct(0.99),
                    mean_batch: (after.1 - before.1) as f64 / execs as f64,
                };
                on_row(&row);
                rows.push(row);
            }
        }
        Ok::<_, ServeError>(())
    })();
    clients_rt.shutdown_timeout(Duration::from_secs(1));
    server.shutdown();
    result.map(|_| rows)
}

/// The two models of the test, and whether each batches dynamically.
const MODELS: [(&str, bool); 2] = [("unbatched", false), ("batched", true)];

/// Writes the checkpoint once and both model directories; returns the vocabulary size.
fn write_repository(repo: &Path, t: &LoadTest) -> Result<usize, ServeError> {
    let io = |op: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| ServeError::Io { op, path, source }
    };
    let (ckpt_dir, vocab) = match &t.checkpoint {
        Some(path) => {
            let load = |source| ServeError::Load {
                model: "load test".into(),
                version: 1,
                source: Box::new(source),
            };
            let dir = checkpoint::resolve(path).map_err(load)?;
            let cfg = checkpoint::load_config(&dir).map_err(load)?;
            let dir = std::fs::canonicalize(&dir).map_err(io("resolve", &dir))?;
            (dir, cfg.vocab_size)
        }
        None => {
            let model = GPT::new(t.model.clone(), t.seed).map_err(|e| ServeError::Instance {
                model: "load test".into(),
                reason: e.to_string(),
            })?;
            let root = repo.join(".checkpoint");
            let dir = checkpoint::save(
                &root,
                "random",
                &Checkpoint {
                    model: Some(&model),
                    ..Default::default()
                },
            )
            .map_err(|source| ServeError::Load {
                model: "load test".into(),
                version: 1,
                source: Box::new(source),
            })?;
            (dir, t.model.vocab_size)
        }
    };
    for (model, batching) in MODELS {
        let dir = repo.join(model);
        std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
        let mut cfg = format!(
            "max_batch_size: {}\ninstance_group [ {{ count: {} kind: KIND_CPU }} ]\n",
            t.max_batch_size, t.instances
        );
        if batching {
            cfg += &format!(
                "dynamic_batching {{ max_queue_delay_microseconds: {} }}\n",
                t.max_queue_delay_us
            );
        }
        let file = dir.join(PBTXT_FILE);
        std::fs::write(&file, cfg).map_err(io("write", &file))?;
        let version = dir.join("1");
        std::os::unix::fs::symlink(&ckpt_dir, &version).map_err(io("link", &version))?;
    }
    Ok(vocab)
}

/// One (model, clients) measurement.
struct Cell {
    url: String,
    model: &'static str,
    seq: usize,
    vocab: usize,
    clients: usize,
    seed: u64,
}

impl Cell {
    /// Sends `total` requests from `clients` concurrent clients; returns each latency in ms.
    async fn drive(&self, total: usize) -> Result<Vec<f64>, ServeError> {
        let next = Arc::new(AtomicUsize::new(0));
        let mut handles = Vec::with_capacity(self.clients);
        for c in 0..self.clients {
            let channel = tonic::transport::Endpoint::from_shared(self.url.clone())
                .map_err(|e| ServeError::malformed(format!("endpoint {}: {e}", self.url)))?
                .connect()
                .await
                .map_err(|e| ServeError::NotReady {
                    model: self.model.into(),
                    reason: format!("connecting client {c} to {}: {e}", self.url),
                })?;
            let mut client = GrpcInferenceServiceClient::new(channel);
            let (next, model, seq, vocab) = (next.clone(), self.model, self.seq, self.vocab);
            let mut rng = SplitMix64::new(self.seed ^ (c as u64).wrapping_mul(GOLDEN_GAMMA));
            handles.push(tokio::spawn(async move {
                let mut lat = Vec::new();
                while next.fetch_add(1, Ordering::Relaxed) < total {
                    let raw: Vec<u8> = (0..seq)
                        .flat_map(|_| (rng.below(vocab) as i64).to_le_bytes())
                        .collect();
                    let req = ModelInferRequest {
                        model_name: model.into(),
                        inputs: vec![model_infer_request::InferInputTensor {
                            name: INPUT_IDS.into(),
                            datatype: INT64.into(),
                            shape: vec![1, seq as i64],
                            ..Default::default()
                        }],
                        outputs: vec![model_infer_request::InferRequestedOutputTensor {
                            name: NEXT_TOKEN.into(),
                            ..Default::default()
                        }],
                        raw_input_contents: vec![raw],
                        ..Default::default()
                    };
                    let t0 = Instant::now();
                    client
                        .model_infer(req)
                        .await
                        .map_err(|s| s.message().to_string())?;
                    lat.push(t0.elapsed().as_secs_f64() * 1e3);
                }
                Ok::<_, String>(lat)
            }));
        }
        let mut all = Vec::with_capacity(total);
        for h in handles {
            let lat = h
                .await
                .map_err(|e| ServeError::malformed(format!("client task: {e}")))?
                .map_err(|reason| ServeError::Execution {
                    model: self.model.into(),
                    version: 1,
                    reason,
                })?;
            all.extend(lat);
        }
        Ok(all)
    }
}
