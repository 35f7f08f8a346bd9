//! `cohort serve` end to end: the real binary serving a repository written by the library,
//! checked with Triton's own Python client (crates/serve/tests/tritonclient_check.py) when
//! `tritonclient` is importable, and generate compared with `cohort sample` in any case; ONNX
//! models and an ensemble checked against onnxruntime (crates/serve/tests/onnx_check.py) when
//! `onnx`, `onnxruntime` and `tritonclient` are importable; the ensemble tokenizer -> GPT ->
//! detokenizer checked against its steps and cohort's forward pass
//! (crates/serve/tests/tokenizer_check.py) when `tritonclient` is.

mod support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use cohort_gpt::checkpoint::{self, Checkpoint};
use cohort_gpt::{Forward, GPTConfig, GPT};
use cohort_tokenizer::{Chat, ChatTemplate, Tokenizer, TOKENIZER_FILE};
use serde_json::json;
use support::{post_json, python_imports};

const CHARS: &str = "\nabcdefgh ,.";

fn tiny() -> GPTConfig {
    GPTConfig {
        vocab_size: 12,
        max_position_embeddings: 32,
        n_layers: 2,
        n_heads: 2,
        d_model: 16,
        d_ff: 32,
        dropout: 0.0,
        ..GPTConfig::default()
    }
}

fn model(seed: u64) -> GPT {
    let mut m = GPT::new(tiny(), seed).unwrap();
    for p in m.params_mut() {
        *p *= 10.0;
    }
    m
}

/// A checkpoint root at `root` holding `m` and a character tokenizer.
fn save(root: &Path, m: &GPT) {
    let json = Tokenizer::char_level(CHARS.chars()).to_json().unwrap();
    checkpoint::save(
        root,
        "step-1",
        &Checkpoint {
            model: Some(m),
            extra_files: vec![(TOKENIZER_FILE, json.as_bytes())],
            ..Default::default()
        },
    )
    .unwrap();
}

/// The server process, killed if the test fails before stopping it.
struct Serving {
    child: Child,
    http: String,
    grpc: String,
    metrics: String,
}

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Serving {
    fn start(repo: &Path) -> Serving {
        Serving::start_with(repo, &[])
    }

    /// [`Serving::start`] with more flags.
    fn start_with(repo: &Path, extra: &[&str]) -> Serving {
        Serving::start_env(repo, extra, &[])
    }

    /// [`Serving::start_with`] with more environment variables.
    fn start_env(repo: &Path, extra: &[&str], env: &[(&str, &str)]) -> Serving {
        let mut child = Command::new(env!("CARGO_BIN_EXE_cohort"))
            .args(["serve", "--model-repository"])
            .arg(repo)
            .args([
                "--address",
                "127.0.0.1",
                "--http-port",
                "0",
                "--grpc-port",
                "0",
                "--metrics-port",
                "0",
            ])
            .args(["--repository-poll-secs", "0.2", "--max-body-bytes", "65536"])
            .args(["--instance-threads", "1"])
            .args(extra)
            .env("COHORT_LOG", "warn")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let mut s = Serving {
            child,
            http: String::new(),
            grpc: String::new(),
            metrics: String::new(),
        };
        // "cohort serve: HTTP on 127.0.0.1:P, gRPC on 127.0.0.1:Q, metrics on 127.0.0.1:R"
        let addrs: Vec<&str> = line
            .split_whitespace()
            .filter(|w| w.starts_with("127.0.0.1:"))
            .map(|w| w.trim_end_matches(','))
            .collect();
        assert_eq!(addrs.len(), 3, "unexpected first line {line:?}");
        s.http = addrs[0].to_string();
        s.grpc = addrs[1].to_string();
        s.metrics = addrs[2].to_string();
        s
    }

    /// SIGTERM, and the server must exit cleanly.
    fn stop(mut self) {
        // safety: kill(2) on our own child's pid
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        for _ in 0..200 {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "cohort serve exited with {status}");
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("cohort serve did not exit within 10 s of SIGTERM");
    }
}

/// What `cohort sample` prints for these flags, without the final newline.
fn cohort_sample(ckpt: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .arg("sample")
        .arg("--checkpoint")
        .arg(ckpt)
        .args(args)
        .env("COHORT_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut s = String::from_utf8(out.stdout).unwrap();
    assert_eq!(s.pop(), Some('\n'));
    s
}

fn tritonclient_available() -> bool {
    Command::new("python3")
        .args(["-c", "import tritonclient.http, tritonclient.grpc, numpy"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs `crates/serve/tests/SCRIPT SPEC` (a Python client's checks against the server the
/// spec describes), which must pass every check.
fn python_check(script: &str, spec: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../serve/tests")
        .join(script);
    let out = Command::new("python3")
        .arg(&script)
        .arg(spec)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{} failed:\n{text}", script.display());
    assert!(text.contains(" passed, 0 failed"), "{text}");
}

#[test]
fn triton_clients_and_cohort_sample_agree_with_cohort_serve() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let (mut v1, mut v2) = (model(5), model(6));
    save(&repo.join("gpt/1"), &v1);
    std::fs::write(
        repo.join("gpt/config.pbtxt"),
        "name: \"gpt\"\nmax_batch_size: 4\n\
         dynamic_batching { preferred_batch_size: [2, 4] max_queue_delay_microseconds: 2000 }\n\
         instance_group [ { count: 2 kind: KIND_CPU } ]\n",
    )
    .unwrap();
    // version 2 is prepared aside and renamed into the repository while serving
    let staging = dir.path().join("staging/2");
    save(&staging, &v2);

    let server = Serving::start(&repo);

    // generate answers what `cohort sample` prints, for the same prompt, seed and settings
    let ckpt = repo.join("gpt/1");
    let cases = [
        (
            "bad cafe",
            json!({"max_tokens": 30, "temperature": 0.9, "top_k": 5, "seed": 7}),
            vec![
                "--max-new-tokens",
                "30",
                "--temperature",
                "0.9",
                "--top-k",
                "5",
                "--seed",
                "7",
            ],
        ),
        (
            "a",
            json!({"max_tokens": 40, "temperature": 0}),
            vec!["--max-new-tokens", "40", "--temperature", "0"],
        ),
        ("head", json!({}), vec![]),
    ];
    let mut generate = Vec::new();
    for (prompt, params, flags) in &cases {
        let mut args = vec!["--prompt", prompt];
        args.extend(flags);
        let want = cohort_sample(&ckpt, &args);
        let (status, got) = post_json(
            &server.http,
            "/v2/models/gpt/generate",
            &json!({"text_input": prompt, "parameters": params}),
        );
        assert_eq!(status, 200, "{got}");
        assert_eq!(got["text_output"], want, "prompt {prompt:?} {params}");
        generate.push(json!({"text_input": prompt, "parameters": params, "text_output": want}));
    }

    if !tritonclient_available() {
        eprintln!(
            "skipping the tritonclient checks: python3 cannot import tritonclient and numpy \
             (pip install 'tritonclient[http,grpc]' numpy)"
        );
        server.stop();
        return;
    }
    let (rows, seq) = (2, 7);
    let ids: Vec<u32> = (0..rows * seq).map(|i| (i * 5 % 12) as u32).collect();
    let logits = |m: &mut GPT| {
        m.forward(Forward::new(&ids, rows, seq)).unwrap();
        m.logits().to_vec()
    };
    let spec = json!({
        "http": server.http,
        "grpc": server.grpc,
        "metrics": server.metrics,
        "model": "gpt",
        "vocab": tiny().vocab_size,
        "ids": ids.chunks(seq).collect::<Vec<_>>(),
        "logits_v1": logits(&mut v1),
        "logits_v2": logits(&mut v2),
        "generate": generate,
        "max_body_bytes": 65536,
        "new_version": {"from": staging, "to": repo.join("gpt/2")},
    });
    let spec_file = dir.path().join("spec.json");
    std::fs::write(&spec_file, spec.to_string()).unwrap();
    python_check("tritonclient_check.py", &spec_file);
    server.stop();
}

#[test]
fn allow_metrics_false_serves_no_metrics_port() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    save(&repo.join("gpt/1"), &model(5));
    let mut child = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(["serve", "--model-repository"])
        .arg(&repo)
        .args(["--address", "127.0.0.1", "--http-port", "0", "--no-grpc"])
        .args(["--allow-metrics", "false", "--repository-poll-secs", "0"])
        .env("COHORT_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        line.starts_with("cohort serve: HTTP on 127.0.0.1:"),
        "{line:?}"
    );
    assert!(
        !line.contains("metrics") && !line.contains("gRPC"),
        "{line:?}"
    );
    let bad = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(["serve", "--model-repository"])
        .arg(&repo)
        .args(["--allow-metrics", "maybe"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("--allow-metrics"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}

fn openai_available() -> bool {
    Command::new("python3")
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn the_openai_client_gets_what_cohort_sample_prints() {
    if !openai_available() {
        eprintln!(
            "skipping the OpenAI client checks: python3 cannot import openai (pip install openai)"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    save(&repo.join("gpt/1"), &model(5));
    let server = Serving::start(&repo);
    let ckpt = repo.join("gpt/1");
    // (prompt, max_tokens, temperature, top_k, seed)
    let cases = [
        ("bad cafe", 30, "0.9", 5, 7),
        ("a", 40, "0", 0, 0),
        ("head", 12, "1.0", 0, 3),
    ];
    let mut spec_cases = Vec::new();
    for (prompt, n, t, k, seed) in cases {
        let (n_s, seed_s, k_s) = (n.to_string(), seed.to_string(), k.to_string());
        let mut args = vec!["--prompt", prompt, "--max-new-tokens", &n_s];
        args.extend(["--temperature", t, "--seed", &seed_s]);
        if k > 0 {
            args.extend(["--top-k", &k_s]);
        }
        let printed = cohort_sample(&ckpt, &args);
        // `cohort sample` prints the prompt, then the completion
        let completion = printed
            .strip_prefix(prompt)
            .expect("the prompt comes first");
        spec_cases.push(json!({
            "prompt": prompt, "max_tokens": n, "temperature": t.parse::<f64>().unwrap(),
            "top_k": k, "seed": seed, "completion": completion,
        }));
    }
    let spec = json!({"http": server.http, "model": "gpt", "cases": spec_cases});
    let spec_file = dir.path().join("openai.json");
    std::fs::write(&spec_file, spec.to_string()).unwrap();
    python_check("openai_check.py", &spec_file);
    server.stop();
}

/// The characters of the chat test's vocabulary (ChatML's role names among them), before the
/// two special tokens.
const CHAT_CHARS: &str = "\nabcdefghilmnorstuy ,.";
const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// What `/v1/chat/completions` must answer: `cohort sample` on the rendered conversation, cut
/// at the end-of-turn token and at the first stop string.
fn chat_answer(
    ckpt: &Path,
    template: &ChatTemplate,
    case: &serde_json::Value,
) -> (String, &'static str) {
    let chat = Chat::from_json(&case["messages"].to_string()).unwrap();
    let prompt = template.render(&chat, true).unwrap().text;
    let n = case["max_tokens"].to_string();
    let t = case["temperature"].to_string();
    let seed = case["seed"].to_string();
    let k = case["top_k"].to_string();
    let top_p = case["top_p"].as_f64().unwrap_or(1.0).to_string();
    // All the tokens, the end of turn printed, so that this cuts where the server must.
    let mut args = vec![
        "--ignore-eos",
        "--top-p",
        &top_p,
        "--prompt",
        &prompt,
        "--max-new-tokens",
        &n,
        "--temperature",
        &t,
    ];
    args.extend(["--seed", &seed]);
    if case["top_k"].as_u64().unwrap_or(0) > 0 {
        args.extend(["--top-k", &k]);
    }
    let printed = cohort_sample(ckpt, &args);
    let mut text = printed.strip_prefix(prompt.as_str()).unwrap().to_string();
    let mut cuts: Vec<usize> = text.find("<|im_end|>").into_iter().collect();
    for stop in case["stop"].as_array().into_iter().flatten() {
        cuts.extend(text.find(stop.as_str().unwrap()));
    }
    match cuts.into_iter().min() {
        Some(at) => {
            text.truncate(at);
            (text, "stop")
        }
        None => (text, "length"),
    }
}

#[test]
fn the_openai_client_chats_with_the_models_template() {
    if !openai_available() {
        eprintln!(
            "skipping the OpenAI chat checks: python3 cannot import openai (pip install openai)"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let ckpt = repo.join("chat/1");
    let mut tok = Tokenizer::char_level(CHAT_CHARS.chars());
    tok.add_special_tokens(&["<|im_start|>", "<|im_end|>"])
        .unwrap();
    let cfg = GPTConfig {
        vocab_size: tok.vocab_size(),
        max_position_embeddings: 128,
        ..tiny()
    };
    let mut m = GPT::new(cfg, 11).unwrap();
    for p in m.params_mut() {
        *p *= 6.0;
    }
    let json = tok.to_json().unwrap();
    let config = json!({"eos_token": "<|im_end|>", "chat_template": CHATML}).to_string();
    // The model's own end of text, which completions and Triton's generate stop at too.
    let end = tok.token_to_id("<|im_end|>").unwrap();
    let generation = json!({"eos_token_id": [end]}).to_string();
    checkpoint::save(
        &ckpt,
        "step-1",
        &Checkpoint {
            model: Some(&m),
            extra_files: vec![
                (TOKENIZER_FILE, json.as_bytes()),
                ("tokenizer_config.json", config.as_bytes()),
                ("generation_config.json", generation.as_bytes()),
            ],
            ..Default::default()
        },
    )
    .unwrap();
    let template = ChatTemplate::from_dir(ckpt.join("step-1")).unwrap();
    let user = json!([{"role": "user", "content": "hello there"}]);
    let turns = json!([
        {"role": "system", "content": "be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello."},
        {"role": "user", "content": "tell a story"}
    ]);
    let mut cases = vec![
        json!({"messages": user, "max_tokens": 40, "temperature": 1.0, "seed": 7, "top_k": 0}),
        json!({"messages": turns, "max_tokens": 30, "temperature": 0.9, "seed": 3, "top_k": 5}),
        json!({"messages": turns, "max_tokens": 24, "temperature": 0.0, "seed": 0, "top_k": 0}),
    ];
    // A seed whose answer ends at the end-of-turn token, so that stopping there is checked.
    let eos_case = (0..60)
        .map(|seed| json!({"messages": user, "max_tokens": 60, "temperature": 1.0, "seed": seed, "top_k": 0}))
        .find(|c| chat_answer(&ckpt, &template, c).1 == "stop")
        .expect("some seed ends its answer with <|im_end|>");
    cases.push(eos_case);
    // A stop string taken from the middle of the first answer.
    let (first, _) = chat_answer(&ckpt, &template, &cases[0]);
    let chars: Vec<char> = first.chars().collect();
    assert!(
        chars.len() >= 8,
        "answer too short for a stop string: {first:?}"
    );
    let stop: String = chars[4..6].iter().collect();
    let mut stopped = cases[0].clone();
    stopped["stop"] = json!([stop, "zz"]);
    cases.push(stopped);
    // Nucleus sampling, alone and after top-k.
    cases.push(json!({"messages": turns, "max_tokens": 30, "temperature": 1.0, "seed": 5, "top_k": 0, "top_p": 0.7}));
    cases.push(json!({"messages": user, "max_tokens": 30, "temperature": 1.2, "seed": 9, "top_k": 6, "top_p": 0.5}));
    for case in &mut cases {
        let chat = Chat::from_json(&case["messages"].to_string()).unwrap();
        case["prompt"] = json!(template.render(&chat, true).unwrap().text);
        let (content, finish) = chat_answer(&ckpt, &template, case);
        case["content"] = json!(content);
        case["finish_reason"] = json!(finish);
    }
    assert_eq!(cases[4]["finish_reason"], "stop");
    let server = Serving::start(&repo);
    let spec = json!({"http": server.http, "model": "chat", "cases": cases});
    let spec_file = dir.path().join("openai_chat.json");
    std::fs::write(&spec_file, spec.to_string()).unwrap();
    python_check("openai_chat_check.py", &spec_file);
    server.stop();
}

#[test]
fn onnx_models_and_an_ensemble_answer_tritonclient_as_onnxruntime_does() {
    let test = "onnx_models_and_an_ensemble_answer_tritonclient_as_onnxruntime_does";
    let modules = [
        "onnx",
        "onnxruntime",
        "tritonclient.http",
        "tritonclient.grpc",
        "numpy",
    ];
    let pip = "pip install onnx onnxruntime 'tritonclient[http,grpc]' numpy";
    if !python_imports(test, &modules, pip) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../serve/tests/onnx_check.py");
    let made = Command::new("python3")
        .arg(&script)
        .arg("make")
        .arg(&repo)
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    // The repository holds a model that must fail to load (an unsupported operator), which
    // the check expects to find unavailable: the server must not exit on it. Both ONNX
    // runtimes: the ONNX Runtime library where it loads (auto), and tract.
    for backend in ["auto", "tract"] {
        let env = [("COHORT_ONNX_BACKEND", backend)];
        let server = Serving::start_env(&repo, &["--exit-on-error", "false"], &env);
        let spec = json!({"http": server.http, "grpc": server.grpc, "repo": repo});
        let spec_file = dir.path().join("onnx.json");
        std::fs::write(&spec_file, spec.to_string()).unwrap();
        python_check("onnx_check.py", &spec_file);
        server.stop();
    }
}

/// The convolutional and attention models of onnx_runtimes_check.py on both ONNX runtimes
/// (the ONNX Runtime library, found in the onnxruntime wheel, and tract), each equal to
/// onnxruntime in process through tritonclient; each load names its runtime in one line, and a
/// library that does not load is one line naming its path: a failed load when onnxruntime is
/// asked for, tract serving under auto.
#[test]
fn onnx_models_answer_tritonclient_as_onnxruntime_does_on_both_runtimes() {
    let test = "onnx_models_answer_tritonclient_as_onnxruntime_does_on_both_runtimes";
    let modules = [
        "onnx",
        "onnxruntime",
        "tritonclient.http",
        "tritonclient.grpc",
        "numpy",
    ];
    let pip = "pip install onnx onnxruntime 'tritonclient[http,grpc]' numpy";
    if !python_imports(test, &modules, pip) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../serve/tests/onnx_runtimes_check.py");
    let made = Command::new("python3")
        .arg(&script)
        .arg("make")
        .arg(&repo)
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let log = dir.path().join("serve.log");
    let log_s = log.to_str().unwrap();
    let flags = ["--exit-on-error", "false", "--log-file", log_s];
    let serve = |env: &[(&str, &str)]| {
        std::fs::write(&log, "").unwrap();
        let mut env = env.to_vec();
        env.push(("COHORT_LOG", "info"));
        Serving::start_env(&repo, &flags, &env)
    };
    let loads = |backend: &str| {
        let text = std::fs::read_to_string(&log).unwrap();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("ONNX backend") && l.contains(&format!("backend=\"{backend}\"")))
            .collect();
        (lines.len(), text.clone())
    };
    for backend in ["onnxruntime", "tract"] {
        let server = serve(&[("COHORT_ONNX_BACKEND", backend)]);
        let spec = json!({"http": server.http, "grpc": server.grpc, "repo": repo});
        let spec_file = dir.path().join("runtimes.json");
        std::fs::write(&spec_file, spec.to_string()).unwrap();
        python_check("onnx_runtimes_check.py", &spec_file);
        server.stop();
        let (n, text) = loads(backend);
        assert_eq!(n, 3, "one load line per model naming {backend}:\n{text}");
        if backend == "onnxruntime" {
            assert!(
                text.contains("libonnxruntime.so"),
                "the library path:\n{text}"
            );
        }
    }
    // `cohort bench serve` names the runtime, and --profile splits the model's time by
    // operator (both convolutions in the Conv rows) beside the request's
    for (backend, named) in [
        ("onnxruntime", "onnxruntime 1."),
        ("tract", "tract, 1 thread"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_cohort"))
            .args(["bench", "serve", "--repository", repo.to_str().unwrap()])
            .args([
                "--model",
                "cnn",
                "--batch-size",
                "2",
                "--requests",
                "3",
                "--threads",
                "1",
                "--profile",
            ])
            .env("COHORT_ONNX_BACKEND", backend)
            .env("COHORT_LOG", "warn")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains(&format!("backend: {named}")),
            "{backend}:\n{text}"
        );
        let runtime = format!("profile: batch 2 on {backend}, 20 runs: model ");
        assert!(
            text.contains(&runtime) && text.contains("outside the model"),
            "{backend}:\n{text}"
        );
        let convs: usize = text
            .lines()
            .filter(|l| l.starts_with("Conv") || l.starts_with("FusedConv"))
            .map(|l| {
                l.split_whitespace()
                    .nth(1)
                    .unwrap()
                    .parse::<usize>()
                    .unwrap()
            })
            .sum();
        assert_eq!(convs, 2, "{backend}: two Conv nodes:\n{text}");
    }
    let bad = "/nonexistent/libonnxruntime.so";
    let server = serve(&[("ORT_DYLIB_PATH", bad), ("COHORT_ONNX_BACKEND", "auto")]);
    assert!(server_ready(&server, "cnn"), "tract serves under auto");
    server.stop();
    let (n, text) = loads("tract");
    assert_eq!(n, 3, "tract serves each model under auto:\n{text}");
    assert!(
        text.lines()
            .any(|l| l.contains("WARN") && l.contains(bad) && l.contains("tract serves")),
        "a warning naming the library:\n{text}"
    );
    let server = serve(&[
        ("ORT_DYLIB_PATH", bad),
        ("COHORT_ONNX_BACKEND", "onnxruntime"),
    ]);
    assert!(
        !server_ready(&server, "cnn"),
        "no fallback when onnxruntime is asked for"
    );
    server.stop();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.lines()
            .any(|l| l.contains("load failed") && l.contains(bad) && l.contains("ORT_DYLIB_PATH")),
        "the load error names the library:\n{text}"
    );
}

/// Whether `server` answers model `name` ready over HTTP.
fn server_ready(server: &Serving, name: &str) -> bool {
    let url = format!("http://{}/v2/models/{name}/ready", server.http);
    Command::new("python3")
        .args([
            "-c",
            "import sys, urllib.request as u\ntry:\n    u.urlopen(sys.argv[1])\nexcept Exception:\n    sys.exit(1)",
            &url,
        ])
        .status()
        .is_ok_and(|s| s.success())
}

/// Writes the tokenizer models and the ensemble `textgen` (tokenizer -> gpt -> detokenizer, and
/// the prompt's ids decoded again) beside `repo/gpt`, with the tokenizer of `save`.
fn text_pipeline(repo: &Path) {
    let json = Tokenizer::char_level(CHARS.chars()).to_json().unwrap();
    let tokenizer = |name: &str, tensors: &str| {
        std::fs::create_dir_all(repo.join(name).join("1")).unwrap();
        std::fs::write(repo.join(name).join("1").join(TOKENIZER_FILE), &json).unwrap();
        std::fs::write(
            repo.join(name).join("config.pbtxt"),
            format!("backend: \"cohort_tokenizer\"\nmax_batch_size: 4\n{tensors}"),
        )
        .unwrap();
    };
    tokenizer(
        "tokenizer",
        "input [ { name: \"TEXT\" data_type: TYPE_STRING dims: [ 1 ] } ]\n\
         output [ { name: \"input_ids\" data_type: TYPE_INT64 dims: [ -1 ] } ]\n",
    );
    tokenizer(
        "detokenizer",
        "input [ { name: \"ids\" data_type: TYPE_INT64 dims: [ 1 ] reshape: { shape: [ ] } } ]\n\
         output [ { name: \"TEXT\" data_type: TYPE_STRING dims: [ 1 ] } ]\n",
    );
    tokenizer(
        "detokenizer_seq",
        "input [ { name: \"ids\" data_type: TYPE_INT64 dims: [ -1 ] } ]\n\
         output [ { name: \"TEXT\" data_type: TYPE_STRING dims: [ 1 ] } ]\n\
         dynamic_batching { max_queue_delay_microseconds: 1000 }\n",
    );
    std::fs::create_dir_all(repo.join("textgen/1")).unwrap();
    std::fs::write(
        repo.join("textgen/config.pbtxt"),
        "platform: \"ensemble\"\nmax_batch_size: 4\n\
         input [ { name: \"PROMPT\" data_type: TYPE_STRING dims: [ 1 ] } ]\n\
         output [\n\
           { name: \"NEXT_TEXT\" data_type: TYPE_STRING dims: [ 1 ] },\n\
           { name: \"NEXT_ID\" data_type: TYPE_INT64 dims: [ 1 ] },\n\
           { name: \"ECHO\" data_type: TYPE_STRING dims: [ 1 ] }\n\
         ]\n\
         ensemble_scheduling { step [\n\
           { model_name: \"tokenizer\" model_version: -1\n\
             input_map { key: \"TEXT\" value: \"PROMPT\" }\n\
             output_map { key: \"input_ids\" value: \"ids\" } },\n\
           { model_name: \"gpt\" model_version: -1\n\
             input_map { key: \"input_ids\" value: \"ids\" }\n\
             output_map { key: \"next_token\" value: \"NEXT_ID\" } },\n\
           { model_name: \"detokenizer\" model_version: -1\n\
             input_map { key: \"ids\" value: \"NEXT_ID\" }\n\
             output_map { key: \"TEXT\" value: \"NEXT_TEXT\" } },\n\
           { model_name: \"detokenizer_seq\" model_version: -1\n\
             input_map { key: \"ids\" value: \"ids\" }\n\
             output_map { key: \"TEXT\" value: \"ECHO\" } }\n\
         ] }\n",
    )
    .unwrap();
}

#[test]
fn a_tokenizer_gpt_detokenizer_ensemble_answers_tritonclient_as_its_steps_do() {
    let test = "a_tokenizer_gpt_detokenizer_ensemble_answers_tritonclient_as_its_steps_do";
    let modules = ["tritonclient.http", "tritonclient.grpc", "numpy"];
    if !python_imports(
        test,
        &modules,
        "pip install 'tritonclient[http,grpc]' numpy",
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let mut m = model(8);
    save(&repo.join("gpt/1"), &m);
    std::fs::write(repo.join("gpt/config.pbtxt"), "max_batch_size: 4\n").unwrap();
    text_pipeline(&repo);

    // what the pipeline must answer, by cohort's own tokenizer and forward pass
    let tok = Tokenizer::char_level(CHARS.chars());
    let vocab = tiny().vocab_size;
    let cases: Vec<serde_json::Value> = ["bad cafe", "a", "head, bag.\nfade"]
        .iter()
        .map(|prompt| {
            let ids = tok.encode(prompt).unwrap();
            m.forward(Forward::new(&ids, 1, ids.len())).unwrap();
            let next = cohort_gpt::sample::argmax(&m.logits()[(ids.len() - 1) * vocab..]);
            json!({
                "prompt": prompt,
                "ids": ids,
                "next_id": next,
                "next_text": tok.decode(&[next as u32]).unwrap(),
            })
        })
        .collect();
    assert!(
        cases.iter().any(|c| c["next_id"] != cases[0]["next_id"]),
        "every prompt has the same next token: a row mixed up would go unnoticed"
    );
    let server = Serving::start(&repo);
    let spec = json!({
        "http": server.http,
        "grpc": server.grpc,
        "cases": cases,
        "same_length": ["bad cafe", "fed, ace"],
    });
    let spec_file = dir.path().join("tokenizer.json");
    std::fs::write(&spec_file, spec.to_string()).unwrap();
    python_check("tokenizer_check.py", &spec_file);
    server.stop();
}

/// r43: `cohort serve` never hides a model that failed to load. By default (Triton's
/// `--exit-on-error true`) it exits non-zero naming the model and why, after the model
/// table; Triton's flags are accepted; logs carry no colour codes off a terminal, and say
/// `grpc=off` rather than Rust's `None`.
#[test]
fn cohort_serve_names_models_that_fail_and_takes_tritons_flags() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    save(&repo.join("gpt/1"), &model(5));
    save(&repo.join("versionless/v1"), &model(5));
    save(&repo.join("broken/1"), &model(5));
    std::fs::write(repo.join("broken/config.pbtxt"), "max_batch_size: [[").unwrap();
    let serve = |extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_cohort"));
        cmd.args(["serve", "--model-repository"])
            .arg(&repo)
            .args([
                "--address",
                "127.0.0.1",
                "--http-port",
                "0",
                "--grpc-port",
                "0",
            ])
            .args(["--metrics-port", "0", "--repository-poll-secs", "0"])
            .args(extra)
            .env_remove("COHORT_LOG");
        cmd
    };
    let out = serve(&[]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(!err.contains('\u{1b}'), "colour codes in {err}");
    assert!(err.contains("| versionless |"), "no model table in {err}");
    // Nothing of it was loaded: nothing is kept.
    assert!(
        err.contains("model config unusable; the model is not loaded") && !err.contains("keeping"),
        "{err}"
    );
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.contains("\"versionless\": no version directory")
            && last.contains("it has v1")
            && last.contains("\"broken\": ")
            && last.contains("config.pbtxt"),
        "{err}"
    );

    // Triton's flags; the one model asked for loads and the server starts.
    let log = dir.path().join("serve.log");
    let mut child = serve(&["--allow-grpc", "false", "--allow-http", "true"])
        .args(["--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1"])
        .args(["--model-control-mode", "explicit", "--load-model", "gpt"])
        .args(["--exit-on-error", "true", "--strict-readiness", "true"])
        .args(["--strict-model-config", "false", "--log-verbose", "1"])
        .arg("--log-file")
        .arg(&log)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        line.starts_with("cohort serve: HTTP on 127.0.0.1:"),
        "{line:?}"
    );
    assert!(!line.contains("gRPC"), "{line:?}");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("grpc=off"), "{text}");
    assert!(
        !text.contains("Some(") && !text.contains('\u{1b}'),
        "{text}"
    );
    assert!(text.contains("| gpt "), "{text}");
}
