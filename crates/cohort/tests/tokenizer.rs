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
