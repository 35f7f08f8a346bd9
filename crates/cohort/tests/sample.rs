//! `cohort sample` end to end: a checkpoint written by the library, the real binary reading it.

use std::path::Path;
use std::process::{Command, Output};

use cohort_engine::cpu::DecodeFormat;
use cohort_gpt::checkpoint::{self, Checkpoint};
use cohort_gpt::sample::{
    generate, generate_while_in, DecodeWeights, KvDtype, SampleOptions, Workspace,
};
use cohort_gpt::{GPTConfig, GPT};
use cohort_tokenizer::char_vocab::{CharVocab, VOCAB_FILE};
use cohort_tokenizer::{Tokenizer, TOKENIZER_FILE};

fn tiny() -> GPTConfig {
    GPTConfig {
        vocab_size: 12,
        max_position_embeddings: 16,
        n_layers: 2,
        n_heads: 2,
        d_model: 16,
        d_ff: 32,
        dropout: 0.0,
        ..GPTConfig::default()
    }
}

fn model() -> GPT {
    let mut m = GPT::new(tiny(), 5).unwrap();
    // sharper logits than the init's near-uniform ones, so greedy text varies
    for p in m.params_mut() {
        *p *= 10.0;
    }
    m
}

fn sample(root: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cohort"))
        .arg("sample")
        .arg("--checkpoint")
        .arg(root)
        .args(args)
        .env("COHORT_NUM_THREADS", "1")
        .output()
        .unwrap()
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "cohort sample failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn samples_text_with_the_checkpoints_vocab() {
    let root = tempfile::tempdir().unwrap();
    let vocab = CharVocab::new("\nabcdefgh ,.".chars()).unwrap();
    let m = model();
    let json = vocab.to_json();
    checkpoint::save(
        root.path(),
        "step-1",
        &Checkpoint {
            model: Some(&m),
            extra_files: vec![(VOCAB_FILE, &json)],
            ..Default::default()
        },
    )
    .unwrap();

    let greedy = SampleOptions {
        max_new_tokens: 25,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        seed: 0,
    };
    let want = generate(&m, &vocab.encode("ab").unwrap(), &greedy, |_| {}).unwrap();
    let want = format!("ab{}\n", vocab.decode(&want).unwrap());
    let out = sample(
        root.path(),
        &[
            "--prompt",
            "ab",
            "--max-new-tokens",
            "25",
            "--temperature",
            "0",
        ],
    );
    assert_eq!(stdout(&out), want);

    // seeded sampling: the same seed twice gives the same text, another seed other text
    let args = |seed: &'static str| {
        [
            "--prompt",
            "a",
            "--max-new-tokens",
            "40",
            "--temperature",
            "1.0",
            "--top-k",
            "5",
            "--seed",
            seed,
        ]
    };
    let a = stdout(&sample(root.path(), &args("7")));
    assert_eq!(a, stdout(&sample(root.path(), &args("7"))));
    assert_ne!(a, stdout(&sample(root.path(), &args("8"))));
    assert_eq!(a.chars().count(), 1 + 40 + 1);

    // a prompt character outside the vocabulary
    let out = sample(root.path(), &["--prompt", "aZ"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("'Z'") && err.contains(VOCAB_FILE), "{err}");
}

#[test]
fn samples_ids_without_a_vocab_and_reports_bad_input() {
    let root = tempfile::tempdir().unwrap();
    let m = model();
    let dir = checkpoint::save(
        root.path(),
        "only-model",
        &Checkpoint {
            model: Some(&m),
            ..Default::default()
        },
    )
    .unwrap();
    let greedy = SampleOptions {
        max_new_tokens: 30,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        seed: 0,
    };
    let want = generate(&m, &[1, 2, 3], &greedy, |_| {}).unwrap();
    let want: Vec<String> = [1, 2, 3].iter().chain(&want).map(u32::to_string).collect();
    let out = sample(
        &dir,
        &[
            "--prompt",
            "1 2 3",
            "--max-new-tokens",
            "30",
            "--temperature",
            "0",
        ],
    );
    assert_eq!(stdout(&out), format!("{}\n", want.join(" ")));

    // --weights bf16 / q8: the tokens of the library's decode over the same copy
    for (flag, format) in [("bf16", DecodeFormat::Bf16), ("q8", DecodeFormat::Q8)] {
        let copy = std::sync::Arc::new(DecodeWeights::new(&m, format));
        let mut ws = Workspace::with_weights(&m, copy).unwrap();
        let go = |_| std::ops::ControlFlow::Continue(());
        let want = generate_while_in(&mut ws, &m, &[1, 2, 3], &greedy, KvDtype::F32, go).unwrap();
        let want: Vec<String> = [1, 2, 3].iter().chain(&want).map(u32::to_string).collect();
        let args = [
            "--prompt",
            "1 2 3",
            "--max-new-tokens",
            "30",
            "--temperature",
            "0",
        ];
        let out = sample(&dir, &[&args[..], &["--weights", flag]].concat());
        assert_eq!(stdout(&out), format!("{}\n", want.join(" ")), "{flag}");
    }
    let out = sample(&dir, &["--prompt", "1", "--weights", "q4"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("fp32, bf16 or q8"),
        "{err}"
    );

    for (prompt, needle) in [("1 x", "token ids"), ("1 99", "outside the vocabulary")] {
        let out = sample(&dir, &["--prompt", prompt]);
        assert!(!out.status.success(), "{prompt}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{prompt}: {err}");
    }
    let missing = root.path().join("nope");
    let out = sample(&missing, &["--prompt", "1"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("nope") && err.contains("not a checkpoint"),
        "{err}"
    );
}

#[test]
fn samples_text_with_a_tokenizer_json() {
    let root = tempfile::tempdir().unwrap();
    let tok = Tokenizer::char_level("\nabcdefgh ,.".chars());
    assert_eq!(tok.vocab_size(), tiny().vocab_size);
    let m = model();
    let json = tok.to_json().unwrap();
    checkpoint::save(
        root.path(),
        "step-1",
        &Checkpoint {
            model: Some(&m),
            extra_files: vec![(TOKENIZER_FILE, json.as_bytes())],
            ..Default::default()
        },
    )
    .unwrap();
    let greedy = SampleOptions {
        max_new_tokens: 20,
        temperature: 0.0,
        top_k: None,
        top_p: 1.0,
        seed: 0,
    };
    let want = generate(&m, &tok.encode("ba").unwrap(), &greedy, |_| {}).unwrap();
    let want = format!("ba{}\n", tok.decode(&want).unwrap());
    let args = [
        "--prompt",
        "ba",
        "--max-new-tokens",
        "20",
        "--temperature",
        "0",
    ];
    assert_eq!(stdout(&sample(root.path(), &args)), want);
    let out = sample(root.path(), &["--prompt", "bZ"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(TOKENIZER_FILE), "{err}");
}
