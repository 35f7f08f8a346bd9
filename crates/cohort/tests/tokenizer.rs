//! `cohort tokenizer`: build a char-level tokenizer.json, add tokens, check the counts and ids;
//! encode and decode.

use std::process::Command;

fn cohort(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(args)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn train_then_add_tokens_reports_new_ones() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("c.txt");
    std::fs::write(&corpus, "hello world\n").unwrap();
    let tok = dir.path().join("tokenizer.json");
    let p = |x: &std::path::Path| x.to_str().unwrap().to_string();
    let (ok, out) = cohort(&[
        "tokenizer",
        "train",
        "--corpus",
        &p(&corpus),
        "--out",
        &p(&tok),
    ]);
    assert!(ok && out.contains("char tokenizer, vocab size 9"), "{out}");
    let out2 = dir.path().join("t2.json");
    let (ok, out) = cohort(&[
        "tokenizer",
        "add-tokens",
        "--tokenizer",
        &p(&tok),
        "--tokens",
        "h,new_tok",
        "--special",
        "[ENT_START],[ENT_END]",
        "--out",
        &p(&out2),
    ]);
    assert!(
        ok && out.contains("added 3 tokens (1 normal, 2 special); vocab size 9 -> 12"),
        "{out}"
    );
    let t = cohort_tokenizer::Tokenizer::from_file(&out2).unwrap();
    assert_eq!(t.token_to_id("[ENT_END]"), Some(11));
    assert!(t.is_special("[ENT_START]"));
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{not json").unwrap();
    let (ok, out) = cohort(&[
        "tokenizer",
        "add-tokens",
        "--tokenizer",
        &p(&bad),
        "--tokens",
        "x",
        "--out",
        &p(&out2),
    ]);
    assert!(
        !ok && out.contains("bad.json") && out.contains("does not parse"),
        "{out}"
    );
}

#[test]
fn encode_then_decode_gives_the_text_back_and_bad_input_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("c.txt");
    std::fs::write(&corpus, "hello world\n").unwrap();
    let p = |x: &std::path::Path| x.to_str().unwrap().to_string();
    let (ok, out) = cohort(&[
        "tokenizer",
        "train",
        "--corpus",
        &p(&corpus),
        "--out",
        &p(&dir.path().join("tokenizer.json")),
    ]);
    assert!(ok, "{out}");
    // A directory holding tokenizer.json works like the file.
    let tok = p(dir.path());
    let (ok, ids) = cohort(&[
        "tokenizer",
        "encode",
        "--tokenizer",
        &tok,
        "--text",
        "hello",
    ]);
    assert!(ok, "{ids}");
    let want = cohort_tokenizer::Tokenizer::from_file(dir.path().join("tokenizer.json"))
        .unwrap()
        .encode("hello")
        .unwrap();
    let got: Vec<u32> = ids.split_whitespace().map(|s| s.parse().unwrap()).collect();
    assert_eq!(got, want);
    let (ok, text) = cohort(&[
        "tokenizer",
        "decode",
        "--tokenizer",
        &tok,
        "--ids",
        ids.trim(),
    ]);
    assert!(ok && text.trim_end() == "hello", "{text}");
    let (ok, json) = cohort(&[
        "tokenizer",
        "encode",
        "--tokenizer",
        &tok,
        "--text",
        "lo",
        "--json",
    ]);
    assert!(ok && json.trim_start().starts_with('['), "{json}");
    let (ok, err) = cohort(&["tokenizer", "encode", "--tokenizer", &tok, "--text", "hex"]);
    assert!(!ok && err.contains('x'), "{err}");
    let (ok, err) = cohort(&["tokenizer", "decode", "--tokenizer", &tok, "--ids", "1 99"]);
    assert!(
        !ok && err.contains("99") && err.contains("vocabulary"),
        "{err}"
    );
}

/// `cohort tokenizer chat`: the model directory's template renders the conversation; the text,
/// then its ids (with `--add-generation-prompt` the assistant's header ends it); `--json` adds
/// the assistant mask; a directory without a template and a bad conversation are named.
#[test]
fn chat_renders_a_conversation_with_the_models_template() {
    let dir = tempfile::tempdir().unwrap();
    let mut tok = cohort_tokenizer::Tokenizer::char_level("abcdehilnorstuy!\n".chars());
    tok.add_special_tokens(&["<|im_start|>", "<|im_end|>"])
        .unwrap();
    tok.save(dir.path().join("tokenizer.json")).unwrap();
    let p = |x: &std::path::Path| x.to_str().unwrap().to_string();
    let messages = dir.path().join("chat.json");
    std::fs::write(
        &messages,
        r#"[{"role": "user", "content": "hi!"}, {"role": "assistant", "content": "hello"}]"#,
    )
    .unwrap();
    let model = p(dir.path());
    let (ok, err) = cohort(&[
        "tokenizer",
        "chat",
        "--model",
        &model,
        "--messages",
        &p(&messages),
    ]);
    assert!(!ok && err.contains("no chat template"), "{err}");
    let template = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
    let config = serde_json::json!({"eos_token": "<|im_end|>", "chat_template": template});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let (ok, out) = cohort(&[
        "tokenizer",
        "chat",
        "--model",
        &model,
        "--messages",
        &p(&messages),
        "--add-generation-prompt",
    ]);
    let text = "<|im_start|>user\nhi!<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>assistant\n";
    assert!(ok && out.starts_with(text), "{out}");
    let ids: Vec<String> = tok
        .encode(text)
        .unwrap()
        .iter()
        .map(u32::to_string)
        .collect();
    assert!(out.contains(&format!("ids: {}", ids.join(" "))), "{out}");
    let (ok, out) = cohort(&[
        "tokenizer",
        "chat",
        "--model",
        &model,
        "--messages",
        &p(&messages),
        "--json",
    ]);
    assert!(ok, "{out}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let mask: Vec<u64> = serde_json::from_value(v["assistant_mask"].clone()).unwrap();
    let ids: Vec<u32> = serde_json::from_value(v["ids"].clone()).unwrap();
    let marked: Vec<u32> = ids
        .iter()
        .zip(&mask)
        .filter(|(_, &m)| m == 1)
        .map(|(&id, _)| id)
        .collect();
    assert_eq!(tok.decode(&marked).unwrap(), "hello<|im_end|>\n");
    std::fs::write(&messages, r#"[{"role": "user"}, 3]"#).unwrap();
    let (ok, err) = cohort(&[
        "tokenizer",
        "chat",
        "--model",
        &model,
        "--messages",
        &p(&messages),
    ]);
    assert!(
        !ok && err.contains("chat.json") && err.contains("message 1 is not an object"),
        "{err}"
    );
}
