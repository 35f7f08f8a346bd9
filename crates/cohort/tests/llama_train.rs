//! A Hugging Face Llama directory through the real binary: a tiny random `LlamaForCausalLM` made
//! by transformers (grouped key/value heads, tied head) beside a cohort tokenizer →
//! `cohort run -n 2 train --init-from` under DDP and under ZeRO-3 with bf16 products,
//! activation checkpointing and accumulation (its sharded checkpoint consolidated) → `cohort sample` → the result loads in transformers as a `LlamaForCausalLM` without a warning. Skipped with a message where
//! python3 cannot import torch and transformers (CI installs them).

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use support::{cohort, python_imports, succeeded};

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn reference(args: &[&str]) -> Value {
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../pretrained/tests/llama_reference.py");
    let out = Command::new("python3")
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    let stdout = succeeded(&out);
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

#[test]
fn a_llama_directory_fine_tunes_on_two_ranks_samples_and_loads_in_transformers() {
    let test = "a_llama_directory_fine_tunes_on_two_ranks_samples_and_loads_in_transformers";
    if !python_imports(
        test,
        &["transformers", "torch"],
        "pip install transformers torch",
    ) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let at = |name: &str| -> PathBuf { tmp.path().join(name) };
    let text = "the llama and the qwen walk to the river. they drink and walk back.\n";
    std::fs::write(at("data.txt"), text.repeat(100)).unwrap();
    let tok = at("tokenizer.json");
    let made = succeeded(
        &cohort()
            .args(["tokenizer", "train", "--corpus", path(&at("data.txt"))])
            .args(["--out", path(&tok)])
            .output()
            .unwrap(),
    );
    let vocab = cohort_tokenizer::Tokenizer::from_file(&tok)
        .unwrap()
        .vocab_size();
    assert!(made.contains(&format!("vocab size {vocab}")), "{made}");
    let base = at("llama");
    reference(&["make", "llama", path(&base), &vocab.to_string()]);
    std::fs::copy(&tok, base.join("tokenizer.json")).unwrap();

    let zero3 = [
        "--precision",
        "bf16",
        "--activation-checkpointing",
        "--grad-accum",
        "2",
    ];
    for (strategy, extra) in [("ddp", &[][..]), ("zero3", &zero3[..])] {
        let out = at(strategy);
        let log = succeeded(
            &cohort()
                .args(["run", "--standalone", "-n", "2", "train", "--init-from"])
                .args([path(&base), "--data", path(&at("data.txt"))])
                .args(["--strategy", strategy, "--steps", "4", "--batch-size", "4"])
                .args([
                    "--seq-len",
                    "16",
                    "--eval-interval",
                    "0",
                    "--out",
                    path(&out),
                ])
                .args(extra)
                .output()
                .unwrap(),
        );
        assert!(
            log.contains("[rank0]: initialized from "),
            "{strategy}: {log}"
        );
        let mut ft = out.join("step-000004");
        if strategy == "zero3" {
            let whole = at("zero3-whole");
            succeeded(
                &cohort()
                    .args(["checkpoint", "consolidate", "--from", path(&ft)])
                    .args(["--out", path(&whole)])
                    .output()
                    .unwrap(),
            );
            ft = whole;
        }
        let config: Value =
            serde_json::from_slice(&std::fs::read(ft.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["architectures"][0], "LlamaForCausalLM", "{strategy}");
        assert_eq!(config["num_key_value_heads"], 2, "{strategy}");

        let sample = succeeded(
            &cohort()
                .args(["sample", "--checkpoint", path(&ft), "--prompt", "the llama"])
                .args(["--temperature", "0", "--max-new-tokens", "8"])
                .output()
                .unwrap(),
        );
        assert!(sample.starts_with("the llama"), "{strategy}: {sample:?}");

        let hf = reference(&["check", path(&ft)]);
        assert_eq!(hf["class"], "LlamaForCausalLM", "{strategy}");
        assert_eq!(
            hf["warnings"],
            Value::Array(vec![]),
            "{strategy}: transformers warned"
        );
    }
}
