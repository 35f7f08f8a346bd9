//! `cohort serve` and `cohort bench serve`: wiring only. Parse the flags (Triton's names where it
//! has one), start `cohort_serve::Server`, print where it listens, wait for Ctrl-C / SIGTERM; or
//! run `cohort_bench::serve` (or, with `--repository`, `cohort_bench::serve_model`; with
//! `--chat`, `cohort_bench::serve_chat`) and print its table.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use cohort_bench::serve::{GenerateLoad, GenerateRow, LoadRow, LoadTest};
use cohort_bench::serve_chat::{run_chat, ChatLoad, ChatRow};
use cohort_bench::serve_model::{ModelLoad, ModelLoadRow, ModelProfile};
use cohort_gpt::sample::KvDtype;
use cohort_gpt::GPTConfig;
use cohort_serve::{Server, ServerOptions};

/// Serve a model repository over Triton's / KServe v2's HTTP and gRPC protocols.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// The model repository: REPO/<model>/config.pbtxt and numbered version directories.
    #[arg(long)]
    model_repository: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0")]
    address: IpAddr,
    /// HTTP port (0: any free port).
    #[arg(long, default_value_t = 8000)]
    http_port: u16,
    /// gRPC port (0: any free port).
    #[arg(long, default_value_t = 8001)]
    grpc_port: u16,
    /// Serve HTTP only.
    #[arg(long)]
    no_grpc: bool,
    /// Metrics port: Prometheus' /metrics alone, as Triton's (0: any free port). The HTTP port
    /// serves /metrics as well.
    #[arg(long, default_value_t = 8002)]
    metrics_port: u16,
    /// Whether to serve the metrics port (Triton's flag): true or false.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    allow_metrics: bool,
    /// Seconds between repository scans for new versions and models (0: no polling).
    #[arg(long, default_value_t = 2.0)]
    repository_poll_secs: f64,
    /// Load only this model (repeatable); default: every model directory.
    #[arg(long = "load-model")]
    load_model: Vec<String>,
    /// Queue bound of models whose config sets no max_queue_size.
    #[arg(long, default_value_t = 1024)]
    max_queue_size: usize,
    /// Engine threads per model instance (default: cores / the model's instance count).
    #[arg(long)]
    instance_threads: Option<usize>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 16 << 20)]
    max_body_bytes: usize,
    /// Logs as one JSON object per line (default: text). Level: COHORT_LOG (default info).
    #[arg(long)]
    log_json: bool,
    /// Serve gRPC (Triton's flag): true or false (false: as --no-grpc).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    allow_grpc: bool,
    /// Serve HTTP (Triton's flag): cohort always serves HTTP (health, the repository API and
    /// OpenAI's routes live there), so false is accepted with a note.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    allow_http: bool,
    /// Address of the HTTP endpoint (Triton's flag; default: --address).
    #[arg(long)]
    http_address: Option<IpAddr>,
    /// Address of the gRPC endpoint (Triton's flag; default: --address).
    #[arg(long)]
    grpc_address: Option<IpAddr>,
    /// Triton's model control: none (read the repository once at start), poll (rescan every
    /// --repository-poll-secs) or explicit (load only --load-model at start; load and unload
    /// through the repository API). Default: poll, every model directory.
    #[arg(long, value_enum)]
    model_control_mode: Option<ControlMode>,
    /// Exit, naming each model and why, when a model asked for fails to load at start
    /// (Triton's flag): true or false.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    exit_on_error: bool,
    /// /v2/health/ready answers ready only while every model asked for is ready (Triton's
    /// flag): true or false.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    strict_readiness: bool,
    /// Refuse a model directory without config.pbtxt / config.toml (Triton's flag) instead of
    /// serving it with the config its files imply: true or false.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    strict_model_config: bool,
    /// Verbose logs (Triton's flag): 0 info, 1 or more debug (COHORT_LOG overrides).
    #[arg(long, default_value_t = 0)]
    log_verbose: u32,
    /// Write the logs to this file (appended; no colour) instead of stderr (Triton's flag).
    #[arg(long, value_name = "PATH")]
    log_file: Option<PathBuf>,
}

/// Triton's `--model-control-mode`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum ControlMode {
    /// The repository is read once at start.
    None,
    /// The repository is rescanned every --repository-poll-secs.
    Poll,
    /// Only --load-model at start; the repository API loads and unloads.
    Explicit,
}

pub fn main(args: ServeArgs) -> anyhow::Result<()> {
    cohort_serve::init_logging_to(args.log_json, args.log_verbose, args.log_file.as_deref())?;
    if !(args.repository_poll_secs >= 0.0 && args.repository_poll_secs.is_finite()) {
        bail!("--repository-poll-secs must be >= 0");
    }
    let mode = args.model_control_mode.unwrap_or(ControlMode::Poll);
    if !args.allow_http {
        eprintln!(
            "cohort serve: --allow-http false: cohort always serves HTTP (health, the \
             repository API and OpenAI's routes live there)"
        );
    }
    if mode == ControlMode::None {
        eprintln!(
            "cohort serve: --model-control-mode none: the repository is read once at start \
             (cohort's repository API still loads and unloads models)"
        );
    }
    let poll = mode == ControlMode::Poll && args.repository_poll_secs > 0.0;
    let load_models = match mode {
        // explicit: nothing but the models named is loaded at start, none when none is named
        ControlMode::Explicit => Some(args.load_model),
        _ => (!args.load_model.is_empty()).then_some(args.load_model),
    };
    let http_ip = args.http_address.unwrap_or(args.address);
    let grpc_ip = args.grpc_address.unwrap_or(args.address);
    let opts = ServerOptions {
        http: SocketAddr::new(http_ip, args.http_port),
        grpc: (args.allow_grpc && !args.no_grpc).then(|| SocketAddr::new(grpc_ip, args.grpc_port)),
        metrics: args
            .allow_metrics
            .then(|| SocketAddr::new(args.address, args.metrics_port)),
        poll_interval: poll.then(|| Duration::from_secs_f64(args.repository_poll_secs)),
        load_models,
        max_body_bytes: args.max_body_bytes,
        default_queue_size: args.max_queue_size,
        instance_threads: args.instance_threads,
        exit_on_error: args.exit_on_error,
        strict_readiness: args.strict_readiness,
        strict_model_config: args.strict_model_config,
        ..ServerOptions::new(args.model_repository.clone())
    };
    let server = Server::start(opts)
        .with_context(|| format!("serving {}", args.model_repository.display()))?;
    let mut line = format!("cohort serve: HTTP on {}", server.http_addr());
    if let Some(g) = server.grpc_addr() {
        line += &format!(", gRPC on {g}");
    }
    if let Some(m) = server.metrics_addr() {
        line += &format!(", metrics on {m}");
    }
    println!("{line}");
    server.wait_for_signal();
    Ok(())
}

/// Load test of the server: throughput and latency with and without dynamic batching, or with
/// `--generate`, token streaming with and without in-flight batching; or with `--repository`
/// and `--model`, any model of a repository with random inputs (as perf_analyzer).
#[derive(clap::Args, Debug)]
pub struct BenchServeArgs {
    /// Model config of the random-weight model: A or B.
    #[arg(long, default_value = "B")]
    config: String,
    /// Serve this checkpoint instead of a random-weight model.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Tokens per request (one row each).
    #[arg(long, default_value_t = 16)]
    seq: usize,
    /// Timed requests per (mode, clients) cell.
    #[arg(long, default_value_t = 256)]
    requests: usize,
    /// Comma-separated concurrent client counts.
    #[arg(long, default_value = "1,8,32")]
    clients: String,
    /// max_batch_size of the models.
    #[arg(long, default_value_t = 32)]
    max_batch_size: usize,
    /// max_queue_delay_microseconds of the batched model.
    #[arg(long, default_value_t = 0)]
    max_queue_delay_us: u64,
    /// Instances per model.
    #[arg(long, default_value_t = 1)]
    instances: usize,
    /// Engine threads per instance (default: cores / instances).
    #[arg(long)]
    threads: Option<usize>,
    /// Seed of the model and the token ids.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// One JSON object per cell instead of a table.
    #[arg(long)]
    json: bool,
    /// Measure generation instead of inference (genai-perf's measures): concurrent token
    /// streams with in-flight batching on and off.
    #[arg(long)]
    generate: bool,
    /// Generation: comma-separated concurrent stream counts.
    #[arg(long, default_value = "1,32")]
    streams: String,
    /// Generation: tokens each request generates.
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    /// Generation: prompt length (random token ids).
    #[arg(long, default_value_t = 16)]
    prompt_tokens: usize,
    /// Generation: timed requests per stream.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Generation: sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Generation: the number format of the models' KV caches (their `kv_cache_dtype`
    /// parameter): fp32 or bf16.
    #[arg(long, default_value = "fp32", value_parser = ["fp32", "bf16"])]
    kv_cache_dtype: String,
    /// Measure chat serving instead: streamed /v1/chat/completions requests over HTTP against
    /// --checkpoint (a model directory with a chat template, e.g. SmolLM2 from `cohort
    /// convert`), in-flight batching on; uses --streams, --rounds, --new-tokens (max_tokens),
    /// --temperature, --max-batch-size, --threads, --kv-cache-dtype, --decode-weights and
    /// --max-prefill-tokens.
    #[arg(long, requires = "checkpoint")]
    chat: bool,
    /// Chat: the decode steps' weights (the model's `decode_weights` parameter): fp32, bf16
    /// or q8.
    #[arg(long, default_value = "fp32", value_parser = ["fp32", "bf16", "q8"])]
    decode_weights: String,
    /// Chat: the most prompt tokens a decode step feeds besides its first prompt (the model's
    /// `max_prefill_tokens` parameter; default: the server's, 32).
    #[arg(long)]
    max_prefill_tokens: Option<usize>,
    /// Load-test a model of this repository (with --model) instead of a GPT: random inputs of
    /// the model's declared shapes and datatypes, like perf_analyzer.
    #[arg(long, requires = "model")]
    repository: Option<PathBuf>,
    /// With --repository: the model to load-test.
    #[arg(long, requires = "repository")]
    model: Option<String>,
    /// With --repository: comma-separated rows per request.
    #[arg(long, default_value = "1")]
    batch_size: String,
    /// With --repository: comma-separated concurrent client counts.
    #[arg(long, default_value = "1")]
    concurrency: String,
    /// With --repository: the size of an input's dynamic dimensions besides the batch,
    /// NAME:D1,D2 (repeatable; default 1 for each).
    #[arg(long)]
    shape: Vec<String>,
    /// With --repository: then time the model's operators at each batch size (an ONNX
    /// model's, on the runtime serving it) beside the request's latency.
    #[arg(long, requires = "repository")]
    profile: bool,
}

/// Timed executions of each batch size's operator profile.
const PROFILE_RUNS: usize = 20;

/// Comma-separated counts of `flag`.
fn counts(flag: &str, text: &str) -> anyhow::Result<Vec<usize>> {
    text.split(',')
        .map(|s| s.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{flag} {text:?}: expected numbers like 1,32"))
}

fn bench_model(a: BenchServeArgs, repository: PathBuf, model: String) -> anyhow::Result<()> {
    let mut shapes = std::collections::BTreeMap::new();
    for s in &a.shape {
        let (name, dims) = s
            .split_once(':')
            .with_context(|| format!("--shape {s:?}: expected NAME:D1,D2"))?;
        shapes.insert(name.to_string(), counts("--shape", dims)?);
    }
    let t = ModelLoad {
        repository,
        model,
        batch_sizes: counts("--batch-size", &a.batch_size)?,
        concurrency: counts("--concurrency", &a.concurrency)?,
        shapes,
        requests: a.requests,
        warmup: 16,
        threads: a.threads,
        seed: a.seed,
        profile_runs: if a.profile { PROFILE_RUNS } else { 0 },
    };
    if !a.json {
        println!(
            "bench serve: model {} of {}, random inputs, {} requests per cell, gRPC on loopback",
            t.model,
            t.repository.display(),
            t.requests
        );
        println!(
            "{:>6} {:>11} {:>11} {:>9} {:>9} {:>10}",
            "batch", "concurrency", "infer/s", "p50 ms", "p99 ms", "mean batch"
        );
    }
    let mut named = false;
    let print = |r: &ModelLoadRow| {
        if a.json {
            println!("{}", serde_json::to_string(r).unwrap_or_default());
        } else {
            if !std::mem::replace(&mut named, true) && !r.backend.is_empty() {
                println!("backend: {}", r.backend);
            }
            println!(
                "{:>6} {:>11} {:>11.1} {:>9.3} {:>9.3} {:>10.2}",
                r.batch_size, r.concurrency, r.infer_per_s, r.p50_ms, r.p99_ms, r.mean_batch
            );
        }
    };
    let report = cohort_bench::serve_model::run(&t, print).context("bench serve")?;
    for p in &report.profiles {
        if a.json {
            println!("{}", serde_json::to_string(p).unwrap_or_default());
        } else {
            print_profile(p);
        }
    }
    Ok(())
}

/// The operator table of one batch size, and the model's time against the request's.
fn print_profile(p: &ModelProfile) {
    let o = &p.profile;
    println!(
        "\nprofile: batch {} on {}, {} runs: model {:.3} ms per request ({:.3} ms in \
         operators), request p50 {:.3} ms, outside the model {:.3} ms",
        p.batch_size, o.runtime, o.runs, p.model_ms, o.op_ms, p.request_ms, p.outside_model_ms
    );
    println!(
        "{:<24} {:>6} {:>7} {:>10} {:>7}",
        "op", "nodes", "calls", "ms total", "share"
    );
    for op in &o.ops {
        println!(
            "{:<24} {:>6} {:>7} {:>10.3} {:>6.1}%",
            op.op,
            op.nodes,
            op.calls,
            op.ms,
            op.share * 100.0
        );
    }
}

/// `--streams` as numbers.
fn stream_counts(a: &BenchServeArgs) -> anyhow::Result<Vec<usize>> {
    a.streams
        .split(',')
        .map(|s| s.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("--streams {:?}: expected numbers like 1,32", a.streams))
}

/// `--kv-cache-dtype` as the KV caches' format.
fn kv_dtype(a: &BenchServeArgs) -> anyhow::Result<KvDtype> {
    a.kv_cache_dtype
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--kv-cache-dtype: {e}"))
}

/// `cohort bench serve --chat`: streamed chat completions against a model directory.
fn bench_chat(a: BenchServeArgs) -> anyhow::Result<()> {
    let t = ChatLoad {
        checkpoint: a.checkpoint.clone().context("--chat needs --checkpoint")?,
        streams: stream_counts(&a)?,
        rounds: a.rounds,
        max_tokens: a.new_tokens,
        temperature: a.temperature,
        seed: a.seed,
        max_batch_size: a.max_batch_size,
        threads: a.threads,
        kv_cache_dtype: kv_dtype(&a)?,
        decode_weights: a.decode_weights.clone(),
        prefill_tokens: a.max_prefill_tokens,
    };
    if !a.json {
        println!(
            "bench serve --chat: {}, streamed /v1/chat/completions over HTTP on loopback, \
             max_tokens {}, {} request(s) per stream, in-flight batching, {} KV cache, {} \
             decode weights",
            t.checkpoint.display(),
            t.max_tokens,
            t.rounds,
            t.kv_cache_dtype,
            t.decode_weights
        );
        println!(
            "{:>8} {:>10} {:>10} {:>8} {:>10} {:>10} {:>9} {:>9} {:>9} {:>8}",
            "streams",
            "tokens/s",
            "per strm",
            "prompt",
            "ttft p50",
            "ttft p99",
            "itl p50",
            "itl p99",
            "mean rows",
            "ms/step"
        );
    }
    let print = |r: &ChatRow| {
        if a.json {
            println!("{}", serde_json::to_string(r).unwrap_or_default());
        } else {
            println!(
                "{:>8} {:>10.1} {:>10.1} {:>8.1} {:>10.1} {:>10.1} {:>9.2} {:>9.2} {:>9.2} {:>8.2}",
                r.streams,
                r.tokens_per_s,
                r.tokens_per_s_per_stream,
                r.prompt_tokens,
                r.ttft_p50_ms,
                r.ttft_p99_ms,
                r.itl_p50_ms,
                r.itl_p99_ms,
                r.mean_inflight,
                r.ms_per_step
            );
        }
    };
    let rows = run_chat(&t, print).context("bench serve --chat")?;
    let least = rows.iter().min_by_key(|r| r.streams);
    let most = rows.iter().max_by_key(|r| r.streams);
    if let (false, Some(one), Some(many)) = (a.json, least, most) {
        if many.streams > one.streams {
            println!(
                "{} streams: {:.2}x the tokens/s of {} stream(s); time to first token p50 {:.3} s",
                many.streams,
                many.tokens_per_s / one.tokens_per_s,
                one.streams,
                many.ttft_p50_ms / 1e3
            );
        }
    }
    Ok(())
}

fn bench_generate(a: BenchServeArgs, model: GPTConfig) -> anyhow::Result<()> {
    let streams = stream_counts(&a)?;
    let t = GenerateLoad {
        checkpoint: a.checkpoint.clone(),
        model,
        prompt_tokens: a.prompt_tokens,
        new_tokens: a.new_tokens,
        streams,
        rounds: a.rounds,
        max_batch_size: a.max_batch_size,
        instances: a.instances,
        threads: a.threads,
        temperature: a.temperature,
        seed: a.seed,
        kv_cache_dtype: kv_dtype(&a)?,
    };
    if !a.json {
        println!(
            "bench serve --generate: config {}, {}-token prompts, {} new tokens, {} request(s) \
             per stream, max_batch_size {}, {} instance(s), {} KV cache, HTTP generate_stream \
             on loopback",
            a.config,
            t.prompt_tokens,
            t.new_tokens,
            t.rounds,
            t.max_batch_size,
            t.instances,
            t.kv_cache_dtype
        );
        println!(
            "{:>9} {:>8} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9}",
            "inflight",
            "streams",
            "tokens/s",
            "ttft p50",
            "ttft p99",
            "itl p50",
            "itl p99",
            "mean rows"
        );
    }
    let print = |r: &GenerateRow| {
        if a.json {
            println!("{}", serde_json::to_string(r).unwrap_or_default());
        } else {
            println!(
                "{:>9} {:>8} {:>10.1} {:>10.2} {:>10.2} {:>9.2} {:>9.2} {:>9.2}",
                if r.inflight_batching { "on" } else { "off" },
                r.streams,
                r.tokens_per_s,
                r.ttft_p50_ms,
                r.ttft_p99_ms,
                r.itl_p50_ms,
                r.itl_p99_ms,
                r.mean_inflight
            );
        }
    };
    let rows = cohort_bench::serve::run_generate(&t, print).context("bench serve --generate")?;
    if !a.json {
        let at = |on: bool, n: usize| {
            rows.iter()
                .find(|r| r.inflight_batching == on && r.streams == n)
        };
        let (least, most) = (
            t.streams.iter().copied().min().unwrap_or(1),
            t.streams.iter().copied().max().unwrap_or(1),
        );
        if let (Some(one), Some(many), Some(off)) =
            (at(true, least), at(true, most), at(false, most))
        {
            println!(
                "in-flight batching at {most} streams: {:.2}x the tokens/s of {least} stream(s), \
                 {:.2}x the same load with it off; p99 inter-token latency {:.2}x that of {least} \
                 stream(s)",
                many.tokens_per_s / one.tokens_per_s,
                many.tokens_per_s / off.tokens_per_s,
                many.itl_p99_ms / one.itl_p99_ms
            );
        }
    }
    Ok(())
}

pub fn bench(a: BenchServeArgs) -> anyhow::Result<()> {
    if let (Some(repository), Some(model)) = (a.repository.clone(), a.model.clone()) {
        return bench_model(a, repository, model);
    }
    if a.chat {
        return bench_chat(a);
    }
    let model = match a.config.as_str() {
        "A" | "a" => GPTConfig::config_a(),
        "B" | "b" => GPTConfig::config_b(),
        other => bail!("--config {other}: expected A or B"),
    };
    if a.generate {
        return bench_generate(a, model);
    }
    let clients = a
        .clients
        .split(',')
        .map(|s| s.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("--clients {:?}: expected numbers like 1,8,32", a.clients))?;
    let t = LoadTest {
        checkpoint: a.checkpoint,
        model,
        seq: a.seq,
        requests: a.requests,
        clients,
        max_batch_size: a.max_batch_size,
        max_queue_delay_us: a.max_queue_delay_us,
        instances: a.instances,
        threads: a.threads,
        seed: a.seed,
        ..LoadTest::default()
    };
    if !a.json {
        println!(
            "bench serve: config {}, {} tokens per request (next_token), {} requests per cell, \
             max_batch_size {}, max_queue_delay {} us, {} instance(s), gRPC on loopback",
            a.config, t.seq, t.requests, t.max_batch_size, t.max_queue_delay_us, t.instances
        );
        println!(
            "{:>9} {:>8} {:>10} {:>9} {:>9} {:>10}",
            "batching", "clients", "req/s", "p50 ms", "p99 ms", "mean batch"
        );
    }
    let print = |r: &LoadRow| {
        if a.json {
            println!("{}", serde_json::to_string(r).unwrap_or_default());
        } else {
            println!(
                "{:>9} {:>8} {:>10.1} {:>9.2} {:>9.2} {:>10.2}",
                if r.dynamic_batching { "dynamic" } else { "off" },
                r.clients,
                r.throughput,
                r.p50_ms,
                r.p99_ms,
                r.mean_batch
            );
        }
    };
    let rows = cohort_bench::serve::run(&t, print).context("bench serve")?;
    if !a.json {
        let at = |batching: bool, c: usize| {
            rows.iter()
                .find(|r| r.dynamic_batching == batching && r.clients == c)
                .map(|r| r.throughput)
        };
        if let Some(&most) = t.clients.iter().max() {
            if let (Some(on), Some(off)) = (at(true, most), at(false, most)) {
                println!(
                    "dynamic batching at {most} clients: {:.2}x the unbatched throughput",
                    on / off
                );
            }
        }
    }
    Ok(())
}
