//! A hand-made two-layer Llama GGUF converted to a Hugging Face directory: every tensor under its
//! HF name and shape with its values where HF expects them (q/k rows un-permuted), config.json
//! from the metadata, a tokenizer.json that tokenizes as the vocabulary says; and a file that
//! cannot be converted leaves nothing behind. (The real model, against transformers' own GGUF
//! loader, is checked in crates/cohort/tests/gguf_convert.rs.)

mod support;

use std::collections::BTreeMap;
use std::path::Path;

use cohort_gguf::hf::permute_rows;
use cohort_gguf::{convert_to_hf, GgufError};
use support::Writer;

const LAYERS: usize = 2;
const HIDDEN: usize = 8;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const HEAD_DIM: usize = HIDDEN / HEADS;
const FFN: usize = 12;
const TOKENS: [&str; 9] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "h",
    "i",
    "Ġ",
    "hi",
    "Ġhi",
    "<think>",
];
const TYPES: [i32; 9] = [3, 3, 3, 1, 1, 1, 1, 1, 4];
const VOCAB: usize = TOKENS.len();

/// Distinct values for tensor number `k` of `n` elements.
fn values(k: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (k * 1000 + i) as f32).collect()
}

/// (GGUF name, HF name, HF shape, HF values) of every tensor; the file gets llama.cpp's layout.
fn model(tied: bool) -> Vec<(String, String, Vec<usize>, Vec<f32>)> {
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    let mut t = vec![
        (
            "token_embd.weight".to_string(),
            "model.embed_tokens.weight".to_string(),
            vec![VOCAB, HIDDEN],
        ),
        (
            "output_norm.weight".into(),
            "model.norm.weight".into(),
            vec![HIDDEN],
        ),
    ];
    if !tied {
        t.push((
            "output.weight".into(),
            "lm_head.weight".into(),
            vec![VOCAB, HIDDEN],
        ));
    }
    for l in 0..LAYERS {
        let b = |g: &str, h: &str, shape: Vec<usize>| {
            (
                format!("blk.{l}.{g}.weight"),
                format!("model.layers.{l}.{h}.weight"),
                shape,
            )
        };
        t.extend([
            b("attn_norm", "input_layernorm", vec![HIDDEN]),
            b("attn_q", "self_attn.q_proj", vec![q, HIDDEN]),
            b("attn_k", "self_attn.k_proj", vec![kv, HIDDEN]),
            b("attn_v", "self_attn.v_proj", vec![kv, HIDDEN]),
            b("attn_output", "self_attn.o_proj", vec![HIDDEN, q]),
            b("ffn_norm", "post_attention_layernorm", vec![HIDDEN]),
            b("ffn_gate", "mlp.gate_proj", vec![FFN, HIDDEN]),
            b("ffn_up", "mlp.up_proj", vec![FFN, HIDDEN]),
            b("ffn_down", "mlp.down_proj", vec![HIDDEN, FFN]),
        ]);
    }
    t.into_iter()
        .enumerate()
        .map(|(k, (g, h, shape))| {
            let n = shape.iter().product();
            (g, h, shape, values(k, n))
        })
        .collect()
}

/// The file, with tokenizer.ggml.pre `pre`, tensor `wide` (if any) stored as F64 (a type ggml has but cohort does not dequantise), and `tweak`'s
/// additions.
fn write_gguf(
    path: &Path,
    tied: bool,
    pre: &str,
    wide: Option<&str>,
    tweak: impl FnOnce(&mut Writer),
) {
    let mut w = Writer::default();
    w.kv_str("general.architecture", "llama")
        .kv_str("general.name", "tiny")
        .kv_u32("llama.block_count", LAYERS as u32)
        .kv_u32("llama.context_length", 64)
        .kv_u32("llama.embedding_length", HIDDEN as u32)
        .kv_u32("llama.feed_forward_length", FFN as u32)
        .kv_u32("llama.attention.head_count", HEADS as u32)
        .kv_u32("llama.attention.head_count_kv", KV_HEADS as u32)
        .kv_f32("llama.rope.freq_base", 100000.0)
        .kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .kv_u32("llama.rope.dimension_count", HEAD_DIM as u32)
        .kv_str("tokenizer.ggml.model", "gpt2")
        .kv_str("tokenizer.ggml.pre", pre)
        .kv_strs("tokenizer.ggml.tokens", &TOKENS)
        .kv_i32s("tokenizer.ggml.token_type", &TYPES)
        .kv_strs("tokenizer.ggml.merges", &["h i", "Ġ hi"])
        .kv_u32("tokenizer.ggml.bos_token_id", 1)
        .kv_u32("tokenizer.ggml.eos_token_id", 2)
        .kv_u32("tokenizer.ggml.padding_token_id", 2)
        .kv_bool("tokenizer.ggml.add_bos_token", false)
        .kv_str("tokenizer.chat_template", "{{ messages[0]['content'] }}");
    for (gguf, _, shape, mut v) in model(tied) {
        // llama.cpp permuted the rows of q (by query heads) and k (by key/value heads).
        if gguf.ends_with("attn_q.weight") {
            permute_rows(&mut v, shape[0], shape[1], HEADS);
        } else if gguf.ends_with("attn_k.weight") {
            permute_rows(&mut v, shape[0], shape[1], KV_HEADS);
        }
        let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        if wide == Some(gguf.as_str()) {
            w.tensor(&gguf, &dims, 28, &vec![0; v.len() * 8]);
        } else {
            w.tensor_f32(&gguf, &dims, &v);
        }
    }
    tweak(&mut w);
    std::fs::write(path, w.bytes()).unwrap();
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn a_tiny_llama_converts_to_a_hugging_face_directory() {
    let tmp = tempfile::tempdir().unwrap();
    for tied in [true, false] {
        let gguf = tmp.path().join(format!("tiny-{tied}.gguf"));
        write_gguf(&gguf, tied, "smollm", None, |_| {});
        let out = tmp.path().join(format!("hf-{tied}"));
        if !tied {
            // An empty directory is replaced.
            std::fs::create_dir(&out).unwrap();
        }
        let c = convert_to_hf(&gguf, &out).unwrap();
        assert_eq!(
            (c.config.layers, c.config.vocab, c.config.tied),
            (LAYERS, VOCAB, tied)
        );
        assert_eq!(
            c.tensor_types,
            BTreeMap::from([("F32".to_string(), model(tied).len())])
        );

        let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.len(), model(tied).len());
        for (gguf_name, hf, shape, want) in model(tied) {
            let t = st
                .tensor(&hf)
                .unwrap_or_else(|e| panic!("{hf} (from {gguf_name}): {e}"));
            assert_eq!(t.dtype(), safetensors::Dtype::F32);
            assert_eq!(t.shape(), shape, "{hf}");
            let got: Vec<f32> = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            assert_eq!(got, want, "{hf}");
        }

        let cfg = json(&out.join("config.json"));
        assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
        assert_eq!(cfg["num_key_value_heads"], KV_HEADS);
        assert_eq!(cfg["rms_norm_eps"], 1e-5);
        assert_eq!(cfg["rope_theta"], 100000.0);
        assert_eq!(cfg["max_position_embeddings"], 64);
        assert_eq!(cfg["tie_word_embeddings"], tied);
        assert_eq!(
            (cfg["bos_token_id"].clone(), cfg["eos_token_id"].clone()),
            (1.into(), 2.into())
        );
        assert_eq!(json(&out.join("generation_config.json"))["eos_token_id"], 2);
        let tc = json(&out.join("tokenizer_config.json"));
        assert_eq!(tc["chat_template"], "{{ messages[0]['content'] }}");
        assert_eq!(
            (tc["bos_token"].as_str(), tc["eos_token"].as_str()),
            (Some("<|im_start|>"), Some("<|im_end|>"))
        );

        let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
        let ids = tok
            .encode("hi<|im_end|>hi hi<think>", false)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(ids, [6, 2, 6, 7, 8]);
        assert_eq!(tok.decode(&[6, 7], true).unwrap(), "hi hi");
        // Control tokens are special (skipped), user-defined ones are not.
        assert_eq!(tok.decode(&[1, 6, 8], true).unwrap(), "hi<think>");
    }
    // Nothing but the outputs and inputs: no temporary directory left.
    let names: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 4, "{names:?}");
}

#[test]
fn a_file_that_cannot_be_converted_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("hf");
    let check = |pre: &str, wide: Option<&str>, tweak: fn(&mut Writer), want: &str| {
        let gguf = tmp.path().join("bad.gguf");
        write_gguf(&gguf, true, pre, wide, tweak);
        let e: GgufError = convert_to_hf(&gguf, &out).unwrap_err();
        assert!(e.to_string().contains(want), "expected {want:?} in: {e}");
        let left: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["bad.gguf"], "after: {e}");
    };
    let extra_layer = |w: &mut Writer| {
        w.tensor("blk.9.attn_q.weight", &[HIDDEN as u64, 8], 0, &[0; 256]);
    };
    check(
        "smollm",
        None,
        extra_layer,
        "tensor blk.9.attn_q.weight: not in a 2-layer Llama",
    );
    let bias = |w: &mut Writer| {
        w.tensor("blk.0.attn_q.bias", &[HIDDEN as u64], 0, &[0; 32]);
    };
    check(
        "smollm",
        None,
        bias,
        "tensor blk.0.attn_q.bias: not a tensor of Llama",
    );
    check(
        "jais",
        None,
        |_| {},
        "tokenizer.ggml.pre = \"jais\" is not supported",
    );
    // Found after the small files are written, before model.safetensors is: they go too.
    let wide = Some("blk.1.ffn_up.weight");
    check(
        "smollm",
        wide,
        |_| {},
        "tensor blk.1.ffn_up.weight has type F64, which cannot be dequantised",
    );
    let gguf = tmp.path().join("bad.gguf");
    let mut w = Writer::default();
    w.kv_str("general.architecture", "qwen3");
    std::fs::write(&gguf, w.bytes()).unwrap();
    let e = convert_to_hf(&gguf, &out).unwrap_err();
    assert!(e.to_string().contains("architecture \"qwen3\""), "{e}");

    // An existing output directory with something in it is never touched.
    write_gguf(&gguf, true, "smollm", None, |_| {});
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep"), "x").unwrap();
    let e = convert_to_hf(&gguf, &out).unwrap_err();
    assert!(e.to_string().contains("exists and is not empty"), "{e}");
    assert!(out.join("keep").exists());
}
