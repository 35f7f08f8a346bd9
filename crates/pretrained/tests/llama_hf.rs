//! The Llama family against `transformers` itself: a tiny random `LlamaForCausalLM` (grouped
//! key/value heads, tied head), one with Llama 3's rope scaling (multi-query, untied head, bf16 weights) and a
//! `Qwen2ForCausalLM` (grouped heads, QKV bias, untied head, sharded weights), made and saved by
//! transformers (llama_reference.py), loaded by cohort: the same logits within
//! 1e-4, the same greedy tokens, 5 AdamW steps whose losses match PyTorch's from the same init
//! within 1e-4; and the checkpoint cohort writes back loads in transformers without a warning
//! and computes cohort's logits. Skipped with a message where python3 cannot import
//! transformers (CI installs it).

use std::process::Command;

use cohort_engine::cpu::DecodeFormat;
use cohort_engine::optim::{AdamW, AdamWConfig, Optimizer};
use cohort_gpt::checkpoint::{self, Checkpoint};
use cohort_gpt::sample::{argmax, generate, DecodeWeights, Decoder, KvDtype, SampleOptions};
use cohort_gpt::{optim_groups::decay_mask, Backward, Forward, Labels, GPT};
use serde_json::Value;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/llama_reference.py");

/// The script's JSON answer, or None (with a message) where transformers is missing.
fn reference(args: &[&str]) -> Option<Value> {
    let ok = Command::new("python3")
        .args(["-c", "import torch, transformers"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("llama_hf: skipped: python3 cannot import torch and transformers (pip install torch transformers)");
        return None;
    }
    let out = Command::new("python3")
        .arg(SCRIPT)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "llama_reference.py {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(serde_json::from_slice(&out.stdout).unwrap())
}

fn floats(v: &Value) -> Vec<f32> {
    let a = v.as_array().unwrap();
    a.iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn ints(v: &Value) -> Vec<u32> {
    let flat = |x: &Value| -> Vec<u32> {
        match x.as_array() {
            Some(a) => a.iter().flat_map(ints).collect(),
            None => vec![x.as_u64().unwrap() as u32],
        }
    };
    flat(v)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn logits(model: &mut GPT, ids: &[u32], b: usize) -> Vec<f32> {
    model.forward(Forward::new(ids, b, ids.len() / b)).unwrap();
    model.logits().to_vec()
}

fn check(kind: &str, class: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(kind);
    let Some(r) = reference(&["make", kind, dir.to_str().unwrap()]) else {
        return;
    };
    if kind == "llama3" {
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let header = String::from_utf8_lossy(&bytes[8..200]).into_owned();
        assert!(header.contains("BF16"), "llama3 is saved in bf16: {header}");
    }
    if kind == "qwen2" {
        assert!(
            dir.join(checkpoint::INDEX_FILE).is_file(),
            "qwen2 is saved in shards"
        );
    }
    let (mut model, _) = checkpoint::load_model(&dir).unwrap();
    let ids = ints(&r["ids"]);
    let b = r["ids"].as_array().unwrap().len();
    model.set_training(false);
    let got = logits(&mut model, &ids, b);
    let d = max_diff(&got, &floats(&r["logits"]));
    eprintln!("{kind}: max |logit - transformers'| = {d:e}");
    assert!(d <= 1e-4, "{kind}: logits differ from transformers' by {d}");

    let greedy = SampleOptions {
        max_new_tokens: 8,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        seed: 0,
    };
    let tokens = generate(&model, &ints(&r["prompt"]), &greedy, |_| {}).unwrap();
    assert_eq!(tokens, ints(&r["greedy"]), "{kind}: greedy tokens");
    compact_weights_decode_as_f32(kind, &model, &ints(&r["prompt"]));

    model.set_training(true);
    let labels: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
    let cfg = AdamWConfig {
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(cfg, decay_mask(model.param_views())).unwrap();
    let lr = r["lr"].as_f64().unwrap();
    for (step, want) in floats(&r["losses"]).into_iter().enumerate() {
        model.zero_grad();
        let pass = Forward::new(&ids, b, ids.len() / b).labels(Labels::Aligned(&labels));
        let loss = model.forward(pass).unwrap().unwrap();
        model.backward(Backward::new()).unwrap();
        let (p, g) = model.params_and_grads_mut();
        opt.step(p, g, lr).unwrap();
        eprintln!("{kind}: step {step} loss {loss}, PyTorch's {want}");
        assert!(
            (loss - want).abs() <= 1e-4,
            "{kind}: step {step} loss {loss}, PyTorch's {want}"
        );
    }

    // Written back in Hugging Face's format: transformers loads it as it is, silently.
    let back = tmp.path().join("back");
    let ckpt = Checkpoint {
        model: Some(&model),
        ..Checkpoint::default()
    };
    checkpoint::save_dir(&back, &ckpt).unwrap();
    let config: Value =
        serde_json::from_slice(&std::fs::read(back.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], class);
    let loaded = reference(&["check", back.to_str().unwrap()]).unwrap();
    assert_eq!(loaded["class"], class);
    assert_eq!(loaded["warnings"], Value::Array(vec![]), "{kind}: {loaded}");
    model.set_training(false);
    let ours = logits(&mut model, &ids, b);
    let d = max_diff(&ours, &floats(&loaded["logits"]));
    assert!(
        d <= 1e-4,
        "{kind}: the written model's logits differ by {d}"
    );
    // and cohort reads its own file back to the same bits
    let (again, _) = checkpoint::load_model(&back).unwrap();
    assert!(again.params() == model.params());
}

/// Decoding with bf16 and Q8 copies of the weights against the f32 weights, along the f32
/// greedy tokens: the logits within 1/32 (bf16) and 1/8 (Q8) of their largest magnitude
/// (bf16 keeps 8 significant bits of weights and inputs, Q8 about 7 of each block's largest
/// element), and the bf16 argmax the f32 one at every step but at most one (a random tiny
/// model's logits are close together).
fn compact_weights_decode_as_f32(kind: &str, model: &GPT, prompt: &[u32]) {
    for (format, tol) in [
        (DecodeFormat::Bf16, 1.0 / 32.0),
        (DecodeFormat::Q8, 1.0 / 8.0),
    ] {
        let copy = std::sync::Arc::new(DecodeWeights::new(model, format));
        let mut a = Decoder::new(model);
        let mut b = Decoder::with_weights(model, copy, KvDtype::F32).unwrap();
        let (mut la, mut lb) = (
            a.feed(prompt).unwrap().to_vec(),
            b.feed(prompt).unwrap().to_vec(),
        );
        let (mut worst, mut agree, steps) = (0f32, 0, 12);
        for _ in 0..steps {
            let scale = la.iter().fold(0f32, |m, x| m.max(x.abs()));
            worst = worst.max(max_diff(&la, &lb) / scale);
            let next = argmax(&la) as u32;
            agree += usize::from(argmax(&lb) as u32 == next);
            la = a.feed(&[next]).unwrap().to_vec();
            lb = b.feed(&[next]).unwrap().to_vec();
        }
        eprintln!("{kind}: {format:?} weights: worst |logit diff| {worst:e} of the scale, top-1 {agree}/{steps}");
        assert!(
            worst < tol,
            "{kind}: {format:?} weights move the logits by {worst} of their scale"
        );
        if format == DecodeFormat::Bf16 {
            assert!(agree + 1 >= steps, "{kind}: bf16 top-1 {agree}/{steps}");
        }
    }
}

#[test]
fn a_tiny_llama_with_grouped_heads_and_a_tied_head_matches_transformers() {
    check("llama", "LlamaForCausalLM");
}

#[test]
fn a_tiny_qwen2_with_qkv_bias_and_an_untied_head_matches_transformers() {
    check("qwen2", "Qwen2ForCausalLM");
}

#[test]
fn a_tiny_llama_3_with_rope_scaling_and_one_kv_head_matches_transformers() {
    check("llama3", "LlamaForCausalLM");
}
