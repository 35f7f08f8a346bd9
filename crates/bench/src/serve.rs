//! The serving load tests behind `cohort bench serve`. Inference: a bounded number of requests
//! from N concurrent gRPC clients on loopback, against the same model served with and without
//! dynamic batching; reports throughput and p50 / p99 latency per (mode, clients). Generation
//! ([`run_generate`], genai-perf's measures): N concurrent token streams against the same model
//! with in-flight batching on and off; reports aggregate output tokens/s, time to first token and
//! inter-token latency. Both generation models keep their KV caches in the load test's
//! `kv_cache_dtype` (fp32 or bf16), which each row reports.
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
use cohort_gpt::sample::KvDtype;
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
    let configs: Vec<(&str, String)> = MODELS
        .iter()
        .map(|&(model, batching)| {
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
            (model, cfg)
        })
        .collect();
    write_models(repo, t.checkpoint.as_deref(), &t.model, t.seed, &configs)
}

/// Writes one checkpoint (`checkpoint`, or a random model of `cfg`) and a model directory per
/// (name, config.pbtxt) linking to it; returns the vocabulary size.
pub(crate) fn write_models(
    repo: &Path,
    checkpoint: Option<&Path>,
    cfg: &GPTConfig,
    seed: u64,
    configs: &[(&str, String)],
) -> Result<usize, ServeError> {
    let io = |op: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| ServeError::Io { op, path, source }
    };
    let (ckpt_dir, vocab) = match checkpoint {
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
            let model = GPT::new(cfg.clone(), seed).map_err(|e| ServeError::Instance {
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
            (dir, cfg.vocab_size)
        }
    };
    for (model, text) in configs {
        let dir = repo.join(model);
        std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
        let file = dir.join(PBTXT_FILE);
        std::fs::write(&file, text).map_err(io("write", &file))?;
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
        let (model, seq, vocab) = (self.model, self.seq, self.vocab);
        drive_infer(&self.url, model, 1, self.clients, total, |c| {
            let mut rng = SplitMix64::new(self.seed ^ (c as u64).wrapping_mul(GOLDEN_GAMMA));
            Box::new(move || {
                let raw: Vec<u8> = (0..seq)
                    .flat_map(|_| (rng.below(vocab) as i64).to_le_bytes())
                    .collect();
                ModelInferRequest {
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
                }
            })
        })
        .await
    }
}

/// A gRPC client of the server at `url`, on its own connection; failures name `model`.
pub(crate) async fn connect(
    url: &str,
    model: &str,
) -> Result<GrpcInferenceServiceClient<tonic::transport::Channel>, ServeError> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .map_err(|e| ServeError::malformed(format!("endpoint {url}: {e}")))?
        .connect()
        .await
        .map_err(|e| ServeError::NotReady {
            model: model.into(),
            reason: format!("connecting to {url}: {e}"),
        })?;
    Ok(GrpcInferenceServiceClient::new(channel))
}

/// Makes one client's requests, one call per request.
pub(crate) type RequestMaker = Box<dyn FnMut() -> ModelInferRequest + Send>;

/// `clients` concurrent gRPC clients of the server at `url`, each on its own connection and
/// sending the requests `maker(client index)` makes, `total` requests in all; each latency in
/// ms. Failures name `model` (version `version`).
pub(crate) async fn drive_infer(
    url: &str,
    model: &str,
    version: u64,
    clients: usize,
    total: usize,
    mut maker: impl FnMut(usize) -> RequestMaker,
) -> Result<Vec<f64>, ServeError> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::with_capacity(clients);
    for c in 0..clients {
        let mut client = connect(url, model).await?;
        let (next, mut make) = (next.clone(), maker(c));
        handles.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let req = make();
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
                model: model.into(),
                version,
                reason,
            })?;
        all.extend(lat);
    }
    Ok(all)
}

/// A generation load test in the style of genai-perf: `streams` concurrent clients, each
/// streaming completions of `new_tokens` tokens (HTTP `generate_stream`, one event per token)
/// after a prompt of `prompt_tokens` random ids, against the same model with in-flight batching
/// on and off.
#[derive(Debug, Clone)]
pub struct GenerateLoad {
    /// Checkpoint to serve; None: a model of `model` with random weights.
    pub checkpoint: Option<PathBuf>,
    /// Config of the random model when no checkpoint is given.
    pub model: GPTConfig,
    /// Prompt length (random token ids).
    pub prompt_tokens: usize,
    /// Tokens each request generates.
    pub new_tokens: usize,
    /// Concurrent stream counts to run.
    pub streams: Vec<usize>,
    /// Timed requests per stream in each cell (each stream sends the next when one ends).
    pub rounds: usize,
    /// max_batch_size: the most generations stepped together.
    pub max_batch_size: usize,
    /// Instances per model.
    pub instances: usize,
    /// Engine threads per instance; None: cores / instances.
    pub threads: Option<usize>,
    /// Sampling temperature (0: greedy).
    pub temperature: f32,
    /// Seed of the random model, prompts and sampling.
    pub seed: u64,
    /// The number format of the generations' KV caches (the models' `kv_cache_dtype`).
    pub kv_cache_dtype: KvDtype,
}

impl Default for GenerateLoad {
    /// Config B, 16-token prompts, 128 new tokens, 1 and 32 streams, one round, f32 KV caches.
    fn default() -> Self {
        GenerateLoad {
            checkpoint: None,
            model: GPTConfig::config_b(),
            prompt_tokens: 16,
            new_tokens: 128,
            streams: vec![1, 32],
            rounds: 1,
            max_batch_size: 32,
            instances: 1,
            threads: None,
            temperature: 0.8,
            seed: 1234,
            kv_cache_dtype: KvDtype::F32,
        }
    }
}

/// One measured generation cell.
#[derive(Debug, Clone, Serialize)]
pub struct GenerateRow {
    /// Whether concurrent generations shared decode steps.
    pub inflight_batching: bool,
    /// The KV caches' number format: "fp32" or "bf16".
    pub kv_cache_dtype: String,
    /// Concurrent streams.
    pub streams: usize,
    /// Requests completed.
    pub requests: usize,
    /// Wall time of the cell.
    pub seconds: f64,
    /// Tokens received, all streams.
    pub output_tokens: usize,
    /// Aggregate output tokens per second.
    pub tokens_per_s: f64,
    /// Time to first token, median and 99th percentile.
    pub ttft_p50_ms: f64,
    /// Time to first token, 99th percentile.
    pub ttft_p99_ms: f64,
    /// Inter-token latency (gap between consecutive tokens of a stream), median.
    pub itl_p50_ms: f64,
    /// Inter-token latency, 99th percentile.
    pub itl_p99_ms: f64,
    /// Mean generations per decode step (in-flight batching only; 0 when off).
    pub mean_inflight: f64,
}

/// The generation models: name and whether in-flight batching is on.
const GEN_MODELS: [(&str, bool); 2] = [("inflight", true), ("alone", false)];

/// Runs every (mode, streams) cell, calling `on_row` as each finishes.
pub fn run_generate(
    t: &GenerateLoad,
    mut on_row: impl FnMut(&GenerateRow),
) -> Result<Vec<GenerateRow>, ServeError> {
    if t.prompt_tokens == 0 || t.new_tokens == 0 || t.rounds == 0 || t.streams.contains(&0) {
        return Err(ServeError::parameter(
            "generation load test",
            "prompt tokens, new tokens, rounds and streams must be at least 1",
        ));
    }
    let repo = tempfile::tempdir().map_err(|source| ServeError::Io {
        op: "create a temporary repository in",
        path: std::env::temp_dir(),
        source,
    })?;
    let mut configs = Vec::new();
    for (model, inflight) in GEN_MODELS {
        let mut cfg = format!(
            "max_batch_size: {}\ninstance_group [ {{ count: {} kind: KIND_CPU }} ]\n",
            t.max_batch_size, t.instances
        );
        if !inflight {
            cfg += "parameters { key: \"inflight_batching\" value: { string_value: \"false\" } }\n";
        }
        cfg += &format!(
            "parameters {{ key: \"kv_cache_dtype\" value: {{ string_value: \"{}\" }} }}\n",
            t.kv_cache_dtype
        );
        configs.push((model, cfg));
    }
    let vocab = write_models(
        repo.path(),
        t.checkpoint.as_deref(),
        &t.model,
        t.seed,
        &configs,
    )?;
    let mut opts = ServerOptions::loopback(repo.path().to_path_buf());
    opts.poll_interval = None;
    opts.grpc = None;
    opts.instance_threads = t.threads;
    opts.io_threads = 1;
    opts.default_queue_size = t.streams.iter().copied().max().unwrap_or(1) * 2;
    let server = Server::start(opts)?;
    for (model, _) in GEN_MODELS {
        if !server.is_model_ready(model) {
            let why = server.index();
            server.shutdown();
            return Err(ServeError::NotReady {
                model: model.to_string(),
                reason: format!("the load test's model did not load: {why:?}"),
            });
        }
    }
    let addr = server.http_addr();
    let mut rows = Vec::new();
    let result = (|| {
        for (model, inflight) in GEN_MODELS {
            for &streams in &t.streams {
                let metrics = server.metrics().version(model, 1);
                // warm-up: one short round at this concurrency (arenas, connections)
                drive_streams(addr, model, t, vocab, streams, 1, 8)?;
                let before = metrics.decode_steps();
                let started = Instant::now();
                let samples =
                    drive_streams(addr, model, t, vocab, streams, t.rounds, t.new_tokens)?;
                let seconds = started.elapsed().as_secs_f64();
                let after = metrics.decode_steps();
                let (mut ttft, mut itl, mut tokens) = (Vec::new(), Vec::new(), 0);
                for s in &samples {
                    ttft.push(s.ttft_ms);
                    itl.extend_from_slice(&s.gaps_ms);
                    tokens += s.tokens;
                }
                let steps = after.0 - before.0;
                let row = GenerateRow {
                    inflight_batching: inflight,
                    kv_cache_dtype: t.kv_cache_dtype.to_string(),
                    streams,
                    requests: samples.len(),
                    seconds,
                    output_tokens: tokens,
                    tokens_per_s: tokens as f64 / seconds,
                    ttft_p50_ms: percentile(&mut ttft, 0.50),
                    ttft_p99_ms: percentile(&mut ttft, 0.99),
                    itl_p50_ms: percentile(&mut itl, 0.50),
                    itl_p99_ms: percentile(&mut itl, 0.99),
                    mean_inflight: if steps == 0 {
                        0.0
                    } else {
                        (after.1 - before.1) as f64 / steps as f64
                    },
                };
                on_row(&row);
                rows.push(row);
            }
        }
        Ok::<_, ServeError>(())
    })();
    server.shutdown();
    result.map(|_| rows)
}

/// The `p` quantile (nearest rank) of `v`; 0 when empty.
pub(crate) fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1]
}

/// What one streamed request saw.
pub(crate) struct StreamSample {
    pub(crate) ttft_ms: f64,
    pub(crate) gaps_ms: Vec<f64>,
    pub(crate) tokens: usize,
}

/// `streams` threads, each sending `rounds` streamed requests one after another.
fn drive_streams(
    addr: std::net::SocketAddr,
    model: &str,
    t: &GenerateLoad,
    vocab: usize,
    streams: usize,
    rounds: usize,
    new_tokens: usize,
) -> Result<Vec<StreamSample>, ServeError> {
    let handles: Vec<_> = (0..streams)
        .map(|s| {
            let mut rng = SplitMix64::new(t.seed ^ (s as u64 + 1).wrapping_mul(GOLDEN_GAMMA));
            let (model, prompt_tokens, temperature) =
                (model.to_string(), t.prompt_tokens, t.temperature);
            let seed = t.seed.wrapping_add(s as u64);
            std::thread::spawn(move || {
                let mut out = Vec::new();
                for _ in 0..rounds {
                    let prompt: Vec<String> = (0..prompt_tokens)
                        .map(|_| rng.below(vocab).to_string())
                        .collect();
                    let body = serde_json::json!({
                        "text_input": prompt.join(" "),
                        "parameters": {"max_tokens": new_tokens, "temperature": temperature,
                                       "seed": seed},
                    });
                    out.push(stream_one(addr, &model, &body.to_string())?);
                }
                Ok::<_, String>(out)
            })
        })
        .collect();
    join_streams(handles, model)
}

/// Every stream thread's samples in thread order; a thread's failure is the load test's,
/// named as `model`'s.
pub(crate) fn join_streams<T>(
    handles: Vec<std::thread::JoinHandle<Result<Vec<T>, String>>>,
    model: &str,
) -> Result<Vec<T>, ServeError> {
    let mut all = Vec::new();
    for h in handles {
        let samples = h
            .join()
            .map_err(|_| ServeError::malformed("a stream thread panicked"))?
            .map_err(|reason| ServeError::Execution {
                model: model.into(),
                version: 1,
                reason,
            })?;
        all.extend(samples);
    }
    Ok(all)
}

/// One `generate_stream` request on its own connection, timing each event as it arrives.
fn stream_one(addr: std::net::SocketAddr, model: &str, body: &str) -> Result<StreamSample, String> {
    let path = format!("/v2/models/{model}/generate_stream");
    let times: Vec<f64> = stream_events(addr, &path, body)?
        .into_iter()
        .map(|(t, _)| t)
        .collect();
    let Some(&first) = times.first() else {
        return Err("the stream ended without a token".into());
    };
    Ok(StreamSample {
        ttft_ms: first,
        gaps_ms: times.windows(2).map(|w| w[1] - w[0]).collect(),
        tokens: times.len(),
    })
}

/// POSTs `body` (JSON) to `path` on its own connection and reads the server-sent events of the
/// answer: each `data: ...` line's payload with the ms since the request was sent. An event
/// holding an `"error":` key or a status other than 200 is an error.
pub(crate) fn stream_events(
    addr: std::net::SocketAddr,
    path: &str,
    body: &str,
) -> Result<Vec<(f64, Vec<u8>)>, String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(600)))
        .map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| format!("send: {e}"))?;
    let mut events = Vec::new();
    let mut pending = Vec::new();
    let mut buf = [0u8; 16 << 10];
    let mut refused: Option<String> = None;
    loop {
        let n = s.read(&mut buf).map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            break;
        }
        let now = t0.elapsed().as_secs_f64() * 1e3;
        pending.extend_from_slice(&buf[..n]);
        // each event is one `data: {...}` line; chunk framing lines never start with "data: "
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let text = || String::from_utf8_lossy(&line).trim().to_string();
            if let Some(why) = refused.as_mut() {
                // a refusal: its body says why
                if line.starts_with(b"{") {
                    why.push_str(&format!(": {}", text()));
                }
            } else if let Some(data) = line.strip_prefix(b"data: ") {
                if data.windows(8).any(|w| w == b"\"error\":") {
                    return Err(String::from_utf8_lossy(data).trim().to_string());
                }
                events.push((now, data.trim_ascii_end().to_vec()));
            } else if line.starts_with(b"HTTP/1.1 ") && !line.starts_with(b"HTTP/1.1 200") {
                refused = Some(text());
            }
        }
    }
    if let Some(why) = refused {
        let body = String::from_utf8_lossy(&pending);
        return Err(if body.trim().is_empty() {
            why
        } else {
            format!("{why}: {}", body.trim())
        });
    }
    Ok(events)
}
