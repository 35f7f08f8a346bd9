//! `cohort bench ...` end to end: every benchmark that lives in cohort-bench still runs from the
//! command line and reports the JSON keys that scripts and docs/PERFORMANCE.md read. (`bench ddp` is
//! checked in train.rs.) Each run is kept to a few steps or calls: these check the reports, not
//! the speed.

mod support;

use serde_json::Value;
use support::{run, succeeded};

/// The JSON objects of the output's lines, with any `[rankN]: ` prefix removed.
fn json_lines(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| {
            let l = l.strip_prefix("[rank0]: ").unwrap_or(l);
            l.starts_with('{').then(|| serde_json::from_str(l).unwrap())
        })
        .collect()
}

/// The JSON rows rank 0 prints for `cohort run -n 2 bench ARGS --json`.
fn bench_on_two_ranks(args: &[&str]) -> Vec<Value> {
    let mut all = vec!["run", "--standalone", "-n", "2", "bench"];
    all.extend_from_slice(args);
    all.push("--json");
    json_lines(&succeeded(&run(&all)))
}

/// The `bytes` of each row, in order.
fn sizes(rows: &[Value]) -> Vec<u64> {
    rows.iter().filter_map(|r| r["bytes"].as_u64()).collect()
}

fn assert_positive(v: &Value, keys: &[&str]) {
    for key in keys {
        let x = v[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing in {v}"));
        assert!(x > 0.0 && x.is_finite(), "{key} = {x} in {v}");
    }
}

#[test]
fn bench_train_reports_the_step_and_its_phases() {
    let out = run(&[
        "bench",
        "train",
        "--config",
        "A",
        "--threads",
        "1",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--json",
    ]);
    let rows = json_lines(&succeeded(&out));
    assert_eq!(rows.len(), 1, "{rows:?}");
    let v = &rows[0];
    assert_eq!(v["bench"], "train");
    assert_eq!(v["config"], "A");
    assert_positive(
        v,
        &["ms_per_step", "fwd_ms", "bwd_ms", "tokens_per_s", "rss_mb"],
    );
    assert!(
        v["kernels_ms"].as_array().is_some_and(|k| !k.is_empty()),
        "{v}"
    );
    // Config A's step: 768 tokens of llm.c's 6N + 6LCT = 4,965,120 FLOPs each.
    assert_eq!(
        v["flops_per_step"].as_f64(),
        Some(768.0 * 4_965_120.0),
        "{v}"
    );
    assert_positive(v, &["gflops"]);
    // The peak and MFU wherever the CPU has FMA (every x86-64 CPU with AVX2).
    if v["peak_gflops"].is_number() {
        assert_positive(v, &["peak_gflops", "mfu"]);
        assert!(v["peak_instruction"].is_string(), "{v}");
    }
    let o = &v["outside_products"];
    for phase in ["fwd", "bwd", "opt", "total", "attention"] {
        let x = o[phase]
            .as_f64()
            .unwrap_or_else(|| panic!("outside_products.{phase} missing in {v}"));
        assert!((0.0..=1.0).contains(&x), "outside_products.{phase} = {x}");
    }
}

#[test]
fn bench_collectives_reports_a_row_per_size() {
    let rows = bench_on_two_ranks(&[
        "collectives",
        "-b",
        "4K",
        "-e",
        "64K",
        "-f",
        "16",
        "-n",
        "5",
    ]);
    assert_eq!(sizes(&rows), [4096, 65536], "{rows:?}");
    for r in &rows {
        assert_eq!(r["op"], "all_reduce");
        assert_eq!(r["world"], 2);
        assert_positive(r, &["time_us", "algbw_gbps", "busbw_gbps"]);
    }
}

#[test]
fn bench_rpc_reports_round_trips_and_calls_per_second() {
    let rows = bench_on_two_ranks(&["rpc", "--sizes", "8,1K", "--iters", "20", "--calls", "100"]);
    assert_eq!(sizes(&rows), [8, 1024], "{rows:?}");
    for r in &rows {
        assert_eq!(r["bench"], "rpc");
        assert_positive(r, &["rtt_us_median", "rtt_us_p99", "calls_per_s"]);
    }
}

#[test]
fn bench_serve_reports_every_mode_and_client_count() {
    let out = run(&[
        "bench",
        "serve",
        "--config",
        "A",
        "--requests",
        "16",
        "--clients",
        "1,2",
        "--json",
    ]);
    let rows = json_lines(&succeeded(&out));
    let cells: Vec<(bool, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["dynamic_batching"].as_bool().unwrap(),
                r["clients"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        cells,
        [(false, 1), (false, 2), (true, 1), (true, 2)],
        "{rows:?}"
    );
    for r in &rows {
        assert_eq!(r["requests"], 16);
        assert_positive(r, &["throughput", "p50_ms", "p99_ms", "mean_batch"]);
    }
}

#[test]
fn bench_serve_load_tests_a_model_of_a_repository_with_random_inputs() {
    use cohort_gpt::checkpoint::{self, Checkpoint};
    use cohort_gpt::{GPTConfig, GPT};
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let model = GPT::new(GPTConfig::config_a(), 3).unwrap();
    let ckpt = Checkpoint {
        model: Some(&model),
        ..Default::default()
    };
    checkpoint::save(&repo.join("gpt/1"), "step-1", &ckpt).unwrap();
    let repo = repo.to_str().unwrap();
    let args = ["bench", "serve", "--repository", repo, "--model", "gpt"];
    let mut all = args.to_vec();
    all.extend(["--shape", "input_ids:5", "--batch-size", "1,3"]);
    all.extend(["--concurrency", "2", "--requests", "8", "--json"]);
    let rows = json_lines(&succeeded(&run(&all)));
    let cells: Vec<(u64, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["batch_size"].as_u64().unwrap(),
                r["concurrency"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(cells, [(1, 2), (3, 2)], "{rows:?}");
    for r in &rows {
        assert_eq!(
            (r["model"].as_str(), r["requests"].as_u64()),
            (Some("gpt"), Some(8))
        );
        assert_positive(r, &["infer_per_s", "p50_ms", "p99_ms", "mean_batch"]);
    }
    // a dimension that does not fit the model's is refused by name
    let mut bad = args.to_vec();
    bad.extend(["--shape", "input_ids:5,2", "--requests", "1"]);
    let out = run(&bad);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("input_ids: [5, 2] does not fit"), "{err}");
}

#[test]
fn bench_pipeline_reports_the_step_and_the_bubble() {
    let rows = bench_on_two_ranks(&[
        "pipeline",
        "--config",
        "A",
        "--micro-batches",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
    ]);
    assert_eq!(rows.len(), 1, "{rows:?}");
    let v = &rows[0];
    assert_eq!(v["bench"], "pipeline");
    assert_eq!(v["stages"], 2);
    assert_eq!(v["replicas"], 1);
    assert_positive(v, &["ms_per_step", "tokens_per_s", "ideal_bubble_fraction"]);
    assert_eq!(
        v["bubble_per_rank"].as_array().map(Vec::len),
        Some(2),
        "{v}"
    );
    let bubble = v["bubble_fraction"].as_f64().unwrap();
    assert!((0.0..1.0).contains(&bubble), "{v}");
}

#[test]
fn bench_ps_reports_the_update_time_of_both_modes() {
    for mode in ["sync", "async"] {
        let rows = bench_on_two_ranks(&[
            "ps", "--config", "A", "--mode", mode, "--steps", "3", "--warmup", "1",
        ]);
        assert_eq!(rows.len(), 1, "{mode}: {rows:?}");
        let v = &rows[0];
        assert_eq!(v["bench"], "ps");
        assert_eq!(v["mode"], mode);
        assert_eq!(v["workers"], 1);
        assert_eq!(v["steps"], 3);
        assert_positive(v, &["ms_per_update", "tokens_per_s", "params"]);
    }
}

/// `bench serve --chat`: streamed `/v1/chat/completions` against a model directory with a chat
/// template, one row per stream count with the keys docs/PERFORMANCE.md reads.
#[test]
fn bench_serve_chat_streams_chat_completions_of_a_model_directory() {
    use cohort_gpt::checkpoint::{self, Checkpoint};
    use cohort_gpt::{GPTConfig, GPT};
    use cohort_tokenizer::{Tokenizer, TOKENIZER_FILE};
    let chatml = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + \
                  message['content'] + '<|im_end|>' + '\n'}}{% endfor %}\
                  {% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
    let mut tok = Tokenizer::char_level((32u8..127).map(char::from).chain(['\n']));
    tok.add_special_tokens(&["<|im_start|>", "<|im_end|>"])
        .unwrap();
    let cfg = GPTConfig {
        vocab_size: tok.vocab_size(),
        max_position_embeddings: 160,
        n_layers: 2,
        n_heads: 2,
        d_model: 16,
        d_ff: 32,
        dropout: 0.0,
        ..GPTConfig::default()
    };
    let model = GPT::new(cfg, 5).unwrap();
    let json = tok.to_json().unwrap();
    let config = serde_json::json!({"eos_token": "<|im_end|>", "chat_template": chatml});
    let config = config.to_string();
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint {
        model: Some(&model),
        extra_files: vec![
            (TOKENIZER_FILE, json.as_bytes()),
            ("tokenizer_config.json", config.as_bytes()),
        ],
        ..Default::default()
    };
    let at = checkpoint::save(dir.path(), "step-1", &ckpt).unwrap();
    let at = at.to_str().unwrap();
    let mut args = vec!["bench", "serve", "--chat", "--checkpoint", at];
    args.extend(["--streams", "1,3", "--new-tokens", "5", "--rounds", "2"]);
    args.extend(["--temperature", "0", "--decode-weights", "bf16", "--json"]);
    let rows = json_lines(&succeeded(&run(&args)));
    let streams: Vec<u64> = rows
        .iter()
        .map(|r| r["streams"].as_u64().unwrap())
        .collect();
    assert_eq!(streams, [1, 3], "{rows:?}");
    for r in &rows {
        assert_eq!(
            r["requests"].as_u64(),
            Some(2 * r["streams"].as_u64().unwrap())
        );
        assert_eq!(r["decode_weights"], "bf16");
        assert_positive(
            r,
            &[
                "tokens_per_s",
                "tokens_per_s_per_stream",
                "prompt_tokens",
                "ttft_p50_ms",
                "mean_inflight",
                "ms_per_step",
            ],
        );
        assert!(
            r["ttft_p99_ms"].as_f64() >= r["ttft_p50_ms"].as_f64(),
            "{r}"
        );
    }
    // a model directory without a chat template is refused, naming why
    let plain = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint {
        model: Some(&model),
        extra_files: vec![(TOKENIZER_FILE, json.as_bytes())],
        ..Default::default()
    };
    let at = checkpoint::save(plain.path(), "step-1", &ckpt).unwrap();
    let mut args = vec![
        "bench",
        "serve",
        "--chat",
        "--checkpoint",
        at.to_str().unwrap(),
    ];
    args.extend(["--streams", "1", "--new-tokens", "2"]);
    let out = run(&args);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("template"), "{err}");
}
