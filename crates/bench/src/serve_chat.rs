//! `cohort bench serve --chat --checkpoint DIR`: the chat serving load test, as genai-perf
//! measures an OpenAI endpoint. A model directory with a chat template (e.g. SmolLM2-135M
//! converted from its GGUF with `cohort convert`) is served in process with in-flight
//! batching; `streams` concurrent clients each send `rounds` streamed chat requests, one after
//! another, to the real HTTP `POST /v1/chat/completions` (`"stream": true`,
//! `stream_options.include_usage`), every request one user turn from a fixed list of
//! questions, rendered by the model's template on the server. Reports per stream count the
//! aggregate output tokens/s (the `usage` chunk's completion tokens), the tokens/s per
//! stream, time to first token (the first chunk with content; the role chunk the server sends
//! at once does not count) p50 / p99, the gap between content chunks p50 / p99, the mean
//! generations per decode step and the wall time per step.
//!
//! The streams start together, so the first request of each stream arrives in one burst
//! (every prompt waiting to be fed); later rounds arrive as earlier answers end. Each cell is
//! preceded by an untimed round of 8-token answers at the same concurrency. The load test
//! never writes to the model directory and never talks to anything but the server it starts.

use std::path::PathBuf;
use std::time::Instant;

use cohort_gpt::sample::KvDtype;
use cohort_gpt::GPTConfig;
use serde::Serialize;
use serde_json::Value;

use cohort_serve::{ServeError, Server, ServerOptions};

use crate::serve::{join_streams, percentile, stream_events, write_models, StreamSample};

/// The user turns the streams ask, in turn: short questions with answers of a few sentences.
const QUESTIONS: [&str; 16] = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain photosynthesis in simple words.",
    "Write a haiku about the sea.",
    "How do I boil an egg?",
    "What is the difference between weather and climate?",
    "Suggest a name for a friendly robot.",
    "Why is the sky blue?",
    "What are the benefits of regular exercise?",
    "Summarize the story of Cinderella in two sentences.",
    "How does a rainbow form?",
    "What should I pack for a weekend hiking trip?",
    "Tell me a fun fact about octopuses.",
    "How do plants drink water?",
    "What is a prime number?",
    "Write a short thank-you note to a teacher.",
];

/// The model's name in the load test's repository.
const MODEL: &str = "chat";

/// What to measure.
#[derive(Debug, Clone)]
pub struct ChatLoad {
    /// The model directory (or checkpoint) to serve; it must hold a chat template.
    pub checkpoint: PathBuf,
    /// Concurrent stream counts to run, one cell each.
    pub streams: Vec<usize>,
    /// Timed requests per stream in each cell.
    pub rounds: usize,
    /// `max_tokens` of each request (an answer may end sooner, at the end of turn).
    pub max_tokens: usize,
    /// Sampling temperature (0: greedy); each request's `seed` is fixed by stream and round.
    pub temperature: f32,
    /// Seed of the requests' sampling.
    pub seed: u64,
    /// max_batch_size: the most generations stepped together.
    pub max_batch_size: usize,
    /// Engine threads of the instance; None: all cores.
    pub threads: Option<usize>,
    /// The KV caches' number format (the `kv_cache_dtype` parameter).
    pub kv_cache_dtype: KvDtype,
    /// The decode steps' weights (the `decode_weights` parameter): fp32, bf16 or q8.
    pub decode_weights: String,
    /// The prompt tokens a decode step feeds besides its first prompt (the
    /// `max_prefill_tokens` parameter); None: the server's default.
    pub prefill_tokens: Option<usize>,
}

/// One measured cell.
#[derive(Debug, Clone, Serialize)]
pub struct ChatRow {
    /// Concurrent streams.
    pub streams: usize,
    /// Requests completed.
    pub requests: usize,
    /// Wall time of the cell.
    pub seconds: f64,
    /// Completion tokens, all streams (the servers' usage counts).
    pub output_tokens: usize,
    /// Aggregate output tokens per second.
    pub tokens_per_s: f64,
    /// `tokens_per_s` / streams.
    pub tokens_per_s_per_stream: f64,
    /// Mean prompt tokens (the rendered conversation).
    pub prompt_tokens: f64,
    /// Time to first token (first content chunk), median.
    pub ttft_p50_ms: f64,
    /// Time to first token, 99th percentile.
    pub ttft_p99_ms: f64,
    /// Gap between consecutive content chunks of a stream, median.
    pub itl_p50_ms: f64,
    /// The gap, 99th percentile.
    pub itl_p99_ms: f64,
    /// Mean generations per decode step during the cell.
    pub mean_inflight: f64,
    /// Decode steps during the cell (each one forward over every generation in flight).
    pub decode_steps: u64,
    /// Wall time per decode step (the cell's time over its steps): with `mean_inflight`, where
    /// the tokens/s comes from.
    pub ms_per_step: f64,
    /// The KV cache's format.
    pub kv_cache_dtype: String,
    /// The decode weights' format.
    pub decode_weights: String,
    /// The prefill budget set (`max_prefill_tokens`); null: the server's default.
    pub max_prefill_tokens: Option<usize>,
}

/// Runs every stream count's cell, calling `on_row` as each finishes.
pub fn run_chat(
    t: &ChatLoad,
    mut on_row: impl FnMut(&ChatRow),
) -> Result<Vec<ChatRow>, ServeError> {
    if t.max_tokens == 0 || t.rounds == 0 || t.streams.is_empty() || t.streams.contains(&0) {
        return Err(ServeError::parameter(
            "chat load test",
            "max tokens, rounds and streams must be at least 1",
        ));
    }
    if t.prefill_tokens == Some(0) {
        return Err(ServeError::parameter(
            "max_prefill_tokens",
            "must be at least 1",
        ));
    }
    if !matches!(t.decode_weights.as_str(), "fp32" | "bf16" | "q8") {
        return Err(ServeError::parameter(
            "decode_weights",
            format!("{:?}: expected fp32, bf16 or q8", t.decode_weights),
        ));
    }
    let repo = tempfile::tempdir().map_err(|source| ServeError::Io {
        op: "create a temporary repository in",
        path: std::env::temp_dir(),
        source,
    })?;
    let most = t.streams.iter().copied().max().unwrap_or(1);
    let mut config = format!(
        "max_batch_size: {}\ninstance_group [ {{ count: 1 kind: KIND_CPU }} ]\n\
         parameters {{ key: \"kv_cache_dtype\" value: {{ string_value: \"{}\" }} }}\n\
         parameters {{ key: \"decode_weights\" value: {{ string_value: \"{}\" }} }}\n",
        t.max_batch_size.max(most),
        t.kv_cache_dtype,
        t.decode_weights
    );
    if let Some(n) = t.prefill_tokens {
        config += &format!(
            "parameters {{ key: \"max_prefill_tokens\" value: {{ string_value: \"{n}\" }} }}\n"
        );
    }
    // with a checkpoint, write_models reads its config and uses neither this nor the seed
    let unused = GPTConfig::default();
    write_models(
        repo.path(),
        Some(&t.checkpoint),
        &unused,
        t.seed,
        &[(MODEL, config)],
    )?;
    let mut opts = ServerOptions::loopback(repo.path().to_path_buf());
    opts.poll_interval = None;
    opts.grpc = None;
    opts.instance_threads = t.threads;
    opts.io_threads = 1;
    opts.default_queue_size = most * 2;
    let server = Server::start(opts)?;
    if !server.is_model_ready(MODEL) {
        let why = server.index();
        server.shutdown();
        return Err(ServeError::NotReady {
            model: t.checkpoint.display().to_string(),
            reason: format!("the load test's model did not load: {why:?}"),
        });
    }
    let addr = server.http_addr();
    let result = (|| {
        let mut rows = Vec::new();
        for &streams in &t.streams {
            let metrics = server.metrics().version(MODEL, 1);
            drive_chats(addr, t, streams, 1, 8)?;
            let before = metrics.decode_steps();
            let started = Instant::now();
            let samples = drive_chats(addr, t, streams, t.rounds, t.max_tokens)?;
            let seconds = started.elapsed().as_secs_f64();
            let after = metrics.decode_steps();
            let (mut ttft, mut itl, mut tokens, mut prompt) = (Vec::new(), Vec::new(), 0, 0);
            for (s, p) in &samples {
                ttft.push(s.ttft_ms);
                itl.extend_from_slice(&s.gaps_ms);
                tokens += s.tokens;
                prompt += p;
            }
            let steps = after.0 - before.0;
            let tokens_per_s = tokens as f64 / seconds;
            let row = ChatRow {
                streams,
                requests: samples.len(),
                seconds,
                output_tokens: tokens,
                tokens_per_s,
                tokens_per_s_per_stream: tokens_per_s / streams as f64,
                prompt_tokens: prompt as f64 / samples.len().max(1) as f64,
                ttft_p50_ms: percentile(&mut ttft, 0.50),
                ttft_p99_ms: percentile(&mut ttft, 0.99),
                itl_p50_ms: percentile(&mut itl, 0.50),
                itl_p99_ms: percentile(&mut itl, 0.99),
                mean_inflight: if steps == 0 {
                    0.0
                } else {
                    (after.1 - before.1) as f64 / steps as f64
                },
                decode_steps: steps,
                ms_per_step: seconds * 1e3 / steps.max(1) as f64,
                kv_cache_dtype: t.kv_cache_dtype.to_string(),
                decode_weights: t.decode_weights.clone(),
                max_prefill_tokens: t.prefill_tokens,
            };
            on_row(&row);
            rows.push(row);
        }
        Ok::<_, ServeError>(rows)
    })();
    server.shutdown();
    result
}

/// `streams` threads, each sending `rounds` streamed chat requests one after another; each
/// request's sample and prompt tokens.
fn drive_chats(
    addr: std::net::SocketAddr,
    t: &ChatLoad,
    streams: usize,
    rounds: usize,
    max_tokens: usize,
) -> Result<Vec<(StreamSample, usize)>, ServeError> {
    let handles: Vec<_> = (0..streams)
        .map(|s| {
            let (temperature, seed) = (t.temperature, t.seed);
            std::thread::spawn(move || {
                (0..rounds)
                    .map(|r| {
                        let question = QUESTIONS[(s + r * 5) % QUESTIONS.len()];
                        let body = serde_json::json!({
                            "model": MODEL,
                            "messages": [{"role": "user", "content": question}],
                            "max_tokens": max_tokens,
                            "temperature": temperature,
                            "seed": seed.wrapping_add((s * 1000 + r) as u64),
                            "stream": true,
                            "stream_options": {"include_usage": true},
                        });
                        chat_one(addr, &body.to_string())
                    })
                    .collect::<Result<Vec<_>, String>>()
            })
        })
        .collect();
    join_streams(handles, MODEL)
}

/// One streamed chat request: the arrival of each content chunk, and the usage chunk's
/// completion and prompt tokens.
fn chat_one(addr: std::net::SocketAddr, body: &str) -> Result<(StreamSample, usize), String> {
    let events = stream_events(addr, "/v1/chat/completions", body)?;
    let (mut times, mut usage) = (Vec::new(), None);
    for (at, data) in &events {
        if data.as_slice() == b"[DONE]" {
            break;
        }
        let v: Value = serde_json::from_slice(data).map_err(|e| {
            format!(
                "a chunk is not JSON ({e}): {}",
                String::from_utf8_lossy(data)
            )
        })?;
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0) as usize;
            usage = Some((n("completion_tokens"), n("prompt_tokens")));
        }
        let content = v["choices"][0]["delta"]["content"].as_str();
        if content.is_some_and(|c| !c.is_empty()) {
            times.push(*at);
        }
    }
    let (tokens, prompt) = usage.ok_or("the stream ended without a usage chunk")?;
    let Some(&first) = times.first() else {
        return Err("the stream ended without content".into());
    };
    let sample = StreamSample {
        ttft_ms: first,
        gaps_ms: times.windows(2).map(|w| w[1] - w[0]).collect(),
        tokens,
    };
    Ok((sample, prompt))
}
