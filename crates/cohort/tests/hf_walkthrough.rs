//! Adding special tokens to a model and fine-tuning it, end to end with the real binary, as
//! docs/guides/special-tokens.md walks it: a GPT-2-format model directory → `cohort tokenizer add-tokens --model`
//! (resize with the mean init) → `cohort run -n 2 train --init-from` (DDP) → the result loads
//! in Hugging Face `transformers` without a warning and generates what `cohort sample` does
//! (when `transformers` is importable; CI installs it), and `cohort serve` serves it.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};
use support::{cohort, post_json, python_imports, serve, succeeded};

const STEPS: &str = "60";

fn write_lines(path: &Path, line: &str) {
    std::fs::write(path, format!("{line}\n").repeat(200)).unwrap();
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn run(args: &[&str]) -> String {
    succeeded(&cohort().args(args).output().unwrap())
}

#[test]
fn special_tokens_added_resized_fine_tuned_loaded_by_transformers_and_served() {
    let tmp = tempfile::tempdir().unwrap();
    let at = |name: &str| -> PathBuf { tmp.path().join(name) };
    write_lines(
        &at("base.txt"),
        "two cars collided in a tunnel. the driver was fine and the car was towed.",
    );
    write_lines(
        &at("ent.txt"),
        "two [ENT_START]cars[ENT_END] collided in a tunnel. the [ENT_START]driver[ENT_END] was fine.",
    );
    // A GPT-2-format model directory (config.json, model.safetensors, tokenizer.json).
    let (text, base) = (at("base.txt"), at("base"));
    let shape = ["--seq-len", "48", "--n-layers", "2", "--d-model", "48"];
    let mut args = vec!["train", "--data", path(&text), "--steps", STEPS];
    args.extend(shape);
    args.extend(["--n-heads", "2", "--d-ff", "96", "--eval-interval", "0"]);
    args.extend(["--out", path(&base)]);
    run(&args);

    let added = run(&[
        "tokenizer",
        "add-tokens",
        "--model",
        path(&at("base")),
        "--special",
        "[ENT_START],[ENT_END]",
        "--init",
        "mean",
        "--out",
        path(&at("base-ent")),
    ]);
    assert!(added.contains("embeddings 19 -> 21 rows"), "{added}");

    let tuned = run(&[
        "run",
        "--standalone",
        "-n",
        "2",
        "train",
        "--init-from",
        path(&at("base-ent")),
        "--data",
        path(&at("ent.txt")),
        "--steps",
        STEPS,
        "--batch-size",
        "8",
        "--eval-interval",
        "0",
        "--out",
        path(&at("ft")),
    ]);
    assert!(tuned.contains("[rank0]: initialized from "), "{tuned}");
    let ft = at(&format!("ft/step-{:0>6}", STEPS));

    // The new tokens are one id each, and the tuned model writes them where they belong.
    let prompt = "two [ENT_START]";
    let ids = run(&[
        "tokenizer",
        "encode",
        "--tokenizer",
        path(&ft),
        "--text",
        prompt,
    ]);
    assert_eq!(
        ids.trim(),
        "15 18 12 1 19",
        "the char ids, then [ENT_START] = 19"
    );
    let sample = run(&[
        "sample",
        "--checkpoint",
        path(&ft),
        "--prompt",
        prompt,
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
    ]);
    let greedy = sample.trim_end_matches('\n').strip_prefix(prompt).unwrap();
    assert!(greedy.starts_with("ca"), "{sample:?}");

    let test = "special_tokens_added_resized_fine_tuned_loaded_by_transformers_and_served";
    if python_imports(
        test,
        &["transformers", "torch"],
        "pip install transformers torch",
    ) {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/hf_load_check.py");
        let out = Command::new("python3")
            .arg(script)
            .arg(&ft)
            .arg(prompt)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let hf: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        assert_eq!(hf["warnings"], json!([]), "transformers warned");
        assert_eq!(hf["ids"], json!([15, 18, 12, 1, 19]));
        assert_eq!(hf["greedy"], greedy, "transformers' greedy tokens");
    }

    let repo = at("repo");
    std::fs::create_dir_all(repo.join("ent")).unwrap();
    std::fs::rename(&ft, repo.join("ent/1")).unwrap();
    std::fs::write(repo.join("ent/config.pbtxt"), "name: \"ent\"\n").unwrap();
    let server = serve(&repo);
    let http = server.http.clone();
    let (status, got) = post_json(
        &http,
        "/v2/models/ent/generate",
        &json!({"text_input": prompt, "parameters": {"max_tokens": 12, "temperature": 0}}),
    );
    drop(server);
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["text_output"], sample.trim_end_matches('\n'));
}
