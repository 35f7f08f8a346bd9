//! Training on data files (`--data PATH`): text with a char tokenizer,
//! nanoGPT's directory with its `meta.pkl`, and JSON lines of documents
//! batched by token budget, end to end through `cohort_train::train`.

use cohort_tokenizer::Tokenizer;
use cohort_train::TrainConfig;

/// `--data text --tokenizer char`: trains, the loss falls, every checkpoint has the
/// tokenizer.json, and a second run reuses the token cache.
#[test]
fn trains_on_a_text_file_and_saves_the_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let text = "to be or not to be, that is the question.\n".repeat(200);
    let src = dir.path().join("input.txt");
    std::fs::write(&src, &text).unwrap();
    let out = dir.path().join("out");
    let cfg = TrainConfig {
        data: src.to_str().unwrap().into(),
        seq_len: 16,
        n_layers: 1,
        d_model: 32,
        d_ff: 64,
        n_heads: 2,
        batch_size: 4,
        steps: 30,
        lr: 1e-2,
        warmup_steps: 2,
        eval_interval: 30,
        log_interval: 10,
        out: Some(out.clone()),
        ..TrainConfig::default()
    };
    let pg = cohort_train::process_group_from_env().unwrap();
    let mut log = Vec::new();
    let outcome = cohort_train::train(&cfg, &pg, &mut log).unwrap();
    let log = String::from_utf8(log).unwrap();
    assert!(log.contains("char tokenizer, vocab 16"), "{log}");
    let val = outcome.val_losses.last().unwrap().1;
    assert!(val < 0.8 * 16f32.ln(), "learns: val loss {val}\n{log}");
    let saved = Tokenizer::from_file(out.join("step-000030").join("tokenizer.json")).unwrap();
    assert_eq!(saved.vocab_size(), 16);
    let cache = out.join("data-cache");
    assert!(cache.join("input.txt.char.tokenizer.json").is_file());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        2,
        "nothing beside the data"
    );
    // A missing file is a config error naming it.
    let bad = TrainConfig {
        data: dir.path().join("nope.txt").to_str().unwrap().into(),
        ..cfg
    };
    let err = cohort_train::train(&bad, &pg, &mut Vec::new())
        .unwrap_err()
        .to_string();
    assert!(err.contains("nope.txt"), "{err}");
}

/// nanoGPT's directory with a character-level `meta.pkl`: the run's vocabulary and
/// tokenizer come from it (checkpoints decode text), and an id the data holds beyond it is
/// an error naming the file.
#[test]
fn a_nanogpt_directory_brings_its_vocabulary_from_meta_pkl() {
    let dir = tempfile::tempdir().unwrap();
    let text = "first citizen: before we proceed any further, hear me speak.\n".repeat(60);
    let chars: std::collections::BTreeSet<char> = text.chars().collect();
    let stoi: std::collections::HashMap<String, u32> = chars
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i as u32))
        .collect();
    let ids: Vec<u16> = text.chars().map(|c| stoi[&c.to_string()] as u16).collect();
    let write_bins = |ids: &[u16]| {
        let bytes: Vec<u8> = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
        let cut = bytes.len() * 9 / 10 / 2 * 2;
        std::fs::write(dir.path().join("train.bin"), &bytes[..cut]).unwrap();
        std::fs::write(dir.path().join("val.bin"), &bytes[cut..]).unwrap();
    };
    write_bins(&ids);
    #[derive(serde::Serialize)]
    struct Meta {
        vocab_size: usize,
        stoi: std::collections::HashMap<String, u32>,
    }
    let meta = Meta {
        vocab_size: stoi.len(),
        stoi,
    };
    let pickle = serde_pickle::to_vec(&meta, serde_pickle::SerOptions::new()).unwrap();
    std::fs::write(dir.path().join("meta.pkl"), pickle).unwrap();
    let out = dir.path().join("out");
    let cfg = TrainConfig {
        data: dir.path().to_str().unwrap().into(),
        seq_len: 16,
        n_layers: 1,
        d_model: 16,
        d_ff: 32,
        n_heads: 2,
        batch_size: 2,
        steps: 2,
        eval_interval: 2,
        out: Some(out.clone()),
        ..TrainConfig::default()
    };
    let pg = cohort_train::process_group_from_env().unwrap();
    let mut log = Vec::new();
    cohort_train::train(&cfg, &pg, &mut log).unwrap();
    let log = String::from_utf8(log).unwrap();
    let vocab = chars.len();
    assert!(
        log.contains(&format!("char tokenizer, vocab {vocab}")),
        "{log}"
    );
    let saved = Tokenizer::from_file(out.join("step-000002").join("tokenizer.json")).unwrap();
    assert_eq!(saved.encode("hear me").unwrap(), {
        let t = cohort_tokenizer::Tokenizer::char_level(chars.iter().copied());
        t.encode("hear me").unwrap()
    });
    // An id past meta.pkl's vocabulary is an error naming the file.
    let mut bad = ids.clone();
    bad[3] = vocab as u16;
    write_bins(&bad);
    let cfg = TrainConfig { out: None, ..cfg };
    let err = cohort_train::train(&cfg, &pg, &mut Vec::new())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("train.bin") && err.contains("outside the vocabulary"),
        "{err}"
    );
}

/// `--data docs.jsonl`: one sample per document, batched by token budget with padding; the
/// loss falls, and a document longer than the context is an error naming file and line.
#[test]
fn trains_on_jsonl_documents_of_different_lengths() {
    let dir = tempfile::tempdir().unwrap();
    let words = [
        "to be",
        "or not to be",
        "that is the question",
        "whether tis nobler",
    ];
    let lines: Vec<String> = (0..400)
        .map(|i| {
            let text = words[..1 + i % words.len()].join(", ");
            serde_json::json!({ "text": text }).to_string()
        })
        .collect();
    let src = dir.path().join("docs.jsonl");
    std::fs::write(&src, lines.join("\n")).unwrap();
    let cfg = TrainConfig {
        data: src.to_str().unwrap().into(),
        seq_len: 64,
        n_layers: 1,
        d_model: 32,
        d_ff: 64,
        n_heads: 2,
        batch_size: 4,
        steps: 40,
        lr: 1e-2,
        warmup_steps: 2,
        eval_interval: 40,
        log_interval: 10,
        out: Some(dir.path().join("out")),
        ..TrainConfig::default()
    };
    let pg = cohort_train::process_group_from_env().unwrap();
    let mut log = Vec::new();
    let outcome = cohort_train::train(&cfg, &pg, &mut log).unwrap();
    let log = String::from_utf8(log).unwrap();
    assert!(log.contains("360 train documents"), "{log}");
    let val = outcome.val_losses.last().unwrap().1;
    assert!(val < 0.6 * 30f32.ln(), "learns: val loss {val}\n{log}");

    let long = TrainConfig {
        seq_len: 16,
        out: Some(dir.path().join("out-short")),
        ..cfg
    };
    let err = cohort_train::train(&long, &pg, &mut Vec::new())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("docs.jsonl:") && err.contains("longer than 17, the most a sample holds"),
        "{err}"
    );
}

/// `--data chat.jsonl --tokenizer DIR`: conversations rendered with the chat template in DIR's
/// tokenizer_config.json, trained on the assistant's tokens only (the loss is over those alone,
/// so it falls far below the uniform guess on a small answer set), on a tiny GPT-2-style model.
#[test]
fn trains_on_chat_conversations_with_the_tokenizers_template() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    let mut tok = Tokenizer::char_level("abcdefghijklmnopqrstuvwxyz ?.0123456789\n".chars());
    tok.add_special_tokens(&["<|im_start|>", "<|im_end|>"])
        .unwrap();
    tok.save(model.join("tokenizer.json")).unwrap();
    let template = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
    let config = serde_json::json!({"eos_token": "<|im_end|>", "chat_template": template});
    std::fs::write(model.join("tokenizer_config.json"), config.to_string()).unwrap();
    let lines: Vec<String> = (0..300)
        .map(|i| {
            let n = i % 10;
            serde_json::json!({"messages": [
                {"role": "user", "content": format!("what is {n} times two?")},
                {"role": "assistant", "content": format!("it is {}.", 2 * n)},
            ]})
            .to_string()
        })
        .collect();
    let src = dir.path().join("chat.jsonl");
    std::fs::write(&src, lines.join("\n")).unwrap();
    let cfg = TrainConfig {
        data: src.to_str().unwrap().into(),
        tokenizer: model.to_str().unwrap().into(),
        seq_len: 64,
        n_layers: 1,
        d_model: 32,
        d_ff: 64,
        n_heads: 2,
        batch_size: 4,
        steps: 60,
        lr: 1e-2,
        warmup_steps: 2,
        eval_interval: 60,
        log_interval: 20,
        out: Some(dir.path().join("out")),
        ..TrainConfig::default()
    };
    let pg = cohort_train::process_group_from_env().unwrap();
    let mut log = Vec::new();
    let outcome = cohort_train::train(&cfg, &pg, &mut log).unwrap();
    let log = String::from_utf8(log).unwrap();
    assert!(log.contains("270 train documents"), "{log}");
    let vocab = tok.vocab_size() as f32;
    let val = outcome.val_losses.last().unwrap().1;
    assert!(
        val < 0.4 * vocab.ln(),
        "learns the answers: val loss {val}\n{log}"
    );
    // The checkpoint keeps the template and its end of turn, so it chats as it was taught.
    let step = dir.path().join("out").join("step-000060");
    let saved = cohort_tokenizer::ChatTemplate::from_dir(&step).unwrap();
    assert_eq!(saved.special_token("eos_token"), Some("<|im_end|>"));
    let generation: serde_json::Value =
        serde_json::from_slice(&std::fs::read(step.join("generation_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        generation["eos_token_id"],
        serde_json::json!(tok.token_to_id("<|im_end|>").unwrap())
    );

    // A conversation with nothing for the assistant stops the run, naming its line.
    std::fs::write(
        &src,
        format!(
            "{}\n{}\n",
            lines[0],
            serde_json::json!({"messages": [{"role": "user", "content": "hi"}]})
        ),
    )
    .unwrap();
    let err = cohort_train::train(&cfg, &pg, &mut Vec::new())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("chat.jsonl:2") && err.contains("no assistant token"),
        "{err}"
    );
}

/// `--init-from DIR` of a model that names its own special tokens (SmolLM2's bos
/// `<|im_start|>`, eos and pad `<|im_end|>`, a chat template, generation_config.json's list of
/// eos ids): a run on plain text keeps all of them in every checkpoint, so the fine-tuned model
/// stops where its origin did.
#[test]
fn a_fine_tuned_model_keeps_its_origins_special_tokens_and_eos_ids() {
    use serde_json::{json, Value};
    let dir = tempfile::tempdir().unwrap();
    let mut tok = Tokenizer::char_level("abcdefghijklmnopqrstuvwxyz .\n".chars());
    tok.add_special_tokens(&["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        .unwrap();
    let (start, end) = (
        tok.token_to_id("<|im_start|>").unwrap(),
        tok.token_to_id("<|im_end|>").unwrap(),
    );
    let tokenizer_dir = dir.path().join("tok");
    std::fs::create_dir_all(&tokenizer_dir).unwrap();
    tok.save(tokenizer_dir.join("tokenizer.json")).unwrap();
    let src = dir.path().join("input.txt");
    std::fs::write(&src, "the cat sat on the mat.\n".repeat(100)).unwrap();
    let mut cfg = TrainConfig {
        data: src.to_str().unwrap().into(),
        tokenizer: tokenizer_dir.to_str().unwrap().into(),
        seq_len: 16,
        n_layers: 1,
        d_model: 32,
        d_ff: 64,
        n_heads: 2,
        batch_size: 2,
        steps: 2,
        warmup_steps: 1,
        eval_interval: 2,
        log_interval: 1,
        out: Some(dir.path().join("first")),
        ..TrainConfig::default()
    };
    let pg = cohort_train::process_group_from_env().unwrap();
    cohort_train::train(&cfg, &pg, &mut Vec::new()).unwrap();
    // The "pretrained" model: that checkpoint, with a model's own files as SmolLM2 has them.
    let base = dir.path().join("base");
    std::fs::create_dir_all(&base).unwrap();
    for e in std::fs::read_dir(dir.path().join("first").join("step-000002")).unwrap() {
        let e = e.unwrap();
        if e.file_name() != cohort_gpt::checkpoint::CHECKSUMS_FILE {
            std::fs::copy(e.path(), base.join(e.file_name())).unwrap();
        }
    }
    let template = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}";
    std::fs::write(
        base.join("tokenizer_config.json"),
        json!({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
               "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>",
               "chat_template": template})
        .to_string(),
    )
    .unwrap();
    std::fs::write(
        base.join("generation_config.json"),
        json!({"bos_token_id": start, "eos_token_id": [end], "pad_token_id": end}).to_string(),
    )
    .unwrap();
    cfg.init_from = Some(base.clone());
    cfg.tokenizer = base.join("tokenizer.json").to_str().unwrap().into();
    cfg.out = Some(dir.path().join("tuned"));
    cohort_train::train(&cfg, &pg, &mut Vec::new()).unwrap();
    let step = dir.path().join("tuned").join("step-000002");
    let read = |name: &str| -> Value {
        serde_json::from_slice(&std::fs::read(step.join(name)).unwrap()).unwrap()
    };
    let config = read("tokenizer_config.json");
    assert_eq!(
        (
            &config["bos_token"],
            &config["eos_token"],
            &config["pad_token"],
            &config["unk_token"]
        ),
        (
            &json!("<|im_start|>"),
            &json!("<|im_end|>"),
            &json!("<|im_end|>"),
            &json!("<|endoftext|>")
        )
    );
    assert_eq!(config["chat_template"], json!(template));
    let generation = read("generation_config.json");
    assert_eq!(generation["eos_token_id"], json!([end]));
    assert_eq!(generation["bos_token_id"], json!(start));
    assert_eq!(read("config.json")["eos_token_id"], json!([end]));
    assert_eq!(read("special_tokens_map.json")["eos_token"], "<|im_end|>");
    assert_eq!(
        cohort_tokenizer::ChatTemplate::from_dir(&step)
            .unwrap()
            .special_token("eos_token"),
        Some("<|im_end|>")
    );
}
