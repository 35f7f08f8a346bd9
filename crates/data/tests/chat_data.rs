//! Chat JSONL (`{"messages": [...]}`) as training data: the targets of every batch are exactly the
//! assistant's tokens, as computed here from the template's pieces (the ChatML turns tokenized
//! one by one with a character-level tokenizer, which is compositional); with generation blocks
//! only the blocks; a line without an assistant token is an error naming it; the token-budget
//! sampler shares conversations among two ranks, every batch with something to train, and a
//! resumed plan is the rest of the uninterrupted one.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

use cohort_data::{
    collate, BudgetConfig, Corpus, CorpusOptions, Documents, Samples, TokenBudgetSampler,
    IGNORE_INDEX,
};
use cohort_tokenizer::{ChatTemplate, Tokenizer};

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// ChatML whose assistant text and end of turn (not the newline after it) are a generation block.
const CHATML_GENERATION: &str = "{% for message in messages %}{% if message.role == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}{{ message.content + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endif %}{% endfor %}";

fn tokenizer() -> Tokenizer {
    let mut tok = Tokenizer::char_level("abcdefghijklmnopqrstuvwxyz ?!.,0123456789\n".chars());
    tok.add_special_tokens(&["<|im_start|>", "<|im_end|>"])
        .unwrap();
    tok
}

/// Conversation i: a user question and one or two assistant answers.
fn conversation(i: usize) -> Vec<(&'static str, String)> {
    let mut turns = vec![
        ("user", format!("what is {i} plus {i}?")),
        ("assistant", format!("it is {}.", 2 * i)),
    ];
    if i.is_multiple_of(3) {
        turns.push(("user", "and twice that?".into()));
        turns.push(("assistant", format!("{}!", 4 * i)));
    }
    turns
}

fn line(turns: &[(&str, String)]) -> String {
    let messages: Vec<serde_json::Value> = turns
        .iter()
        .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
        .collect();
    serde_json::json!({"id": 7, "messages": messages}).to_string()
}

/// Ids and per-token trained flags of a conversation, from the template's pieces: with
/// `generation`, the assistant's content and `<|im_end|>`; without, also the newline after it
/// (what rendering the message adds after the generation prompt).
fn expected(tok: &Tokenizer, turns: &[(&str, String)], generation: bool) -> (Vec<u32>, Vec<bool>) {
    let (mut ids, mut trained) = (Vec::new(), Vec::new());
    let mut piece = |text: &str, yes: bool| {
        let p = tok.encode(text).unwrap();
        trained.extend(std::iter::repeat_n(yes, p.len()));
        ids.extend(p);
    };
    for (role, content) in turns {
        let a = *role == "assistant";
        piece(&format!("<|im_start|>{role}\n"), false);
        piece(&format!("{content}<|im_end|>"), a);
        piece("\n", a && !generation);
    }
    (ids, trained)
}

fn open(path: &Path, template: &str) -> Result<(Documents, Documents), cohort_data::DataError> {
    let opts = CorpusOptions {
        seq_len: 8,
        max_len: 256,
        val_fraction: 0.0,
        chat: Some(Arc::new(ChatTemplate::new(template, &[]).unwrap())),
        ..CorpusOptions::default()
    };
    match Corpus::open(path, Some(&tokenizer()), &opts)? {
        Corpus::Documents { train, val } => Ok((train, val)),
        Corpus::Stream { .. } => panic!("JSONL is documents"),
    }
}

fn write_chats(dir: &Path, n: usize) -> std::path::PathBuf {
    let body: String = (0..n).map(|i| line(&conversation(i)) + "\n").collect();
    let path = dir.join("chat.jsonl");
    std::fs::write(&path, body).unwrap();
    path
}

#[test]
fn targets_are_the_assistant_tokens_with_and_without_generation_blocks() {
    let tok = tokenizer();
    for (template, generation) in [(CHATML, false), (CHATML_GENERATION, true)] {
        let dir = tempfile::tempdir().unwrap();
        let path = write_chats(dir.path(), 12);
        let (train, _) = open(&path, template).unwrap();
        assert_eq!(train.len(), 12);
        let indices: Vec<usize> = (0..12).collect();
        let batch = collate(&train, &indices);
        for (row, &i) in indices.iter().enumerate() {
            let (ids, trained) = expected(&tok, &conversation(i), generation);
            let positions = ids.len() - 1;
            let r = row * batch.seq..row * batch.seq + positions;
            assert_eq!(&batch.input_ids[r.clone()], &ids[..positions], "row {i}");
            let want: Vec<i32> = (0..positions)
                .map(|p| {
                    if trained[p + 1] {
                        ids[p + 1] as i32
                    } else {
                        IGNORE_INDEX
                    }
                })
                .collect();
            assert_eq!(
                &batch.targets[r],
                &want[..],
                "conversation {i} gen {generation}"
            );
        }
        // A second open reuses the cache, mask included.
        let (again, _) = open(&path, template).unwrap();
        assert_eq!(collate(&again, &indices), batch);
    }
}

#[test]
fn a_conversation_without_an_assistant_turn_is_an_error_naming_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let body = format!(
        "{}\n{}\n{}\n",
        line(&conversation(1)),
        line(&conversation(2)),
        line(&[("user", "hello?".to_string())])
    );
    let path = dir.path().join("chat.jsonl");
    std::fs::write(&path, body).unwrap();
    let e = open(&path, CHATML).unwrap_err().to_string();
    assert!(
        e.contains("chat.jsonl:3") && e.contains("no assistant token"),
        "{e}"
    );
    // Without a template, the first conversation's line says what is missing.
    let opts = CorpusOptions {
        max_len: 256,
        ..CorpusOptions::default()
    };
    let e = Corpus::open(&path, Some(&tokenizer()), &opts)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("chat.jsonl:1") && e.contains("chat template"),
        "{e}"
    );
}

#[test]
fn two_ranks_share_the_conversations_and_resume_mid_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_chats(dir.path(), 40);
    let (train, _) = open(&path, CHATML).unwrap();
    let cfg = BudgetConfig {
        batch_tokens: 160,
        max_samples: 160,
        sort_size: 16,
        shuffle: true,
        seed: 3,
    };
    let mut seen = BTreeSet::new();
    for rank in 0..2 {
        let sampler = TokenBudgetSampler::new(&train, cfg.clone(), 2, rank).unwrap();
        let plan = sampler.batches(1, 0);
        assert!(!plan.is_empty());
        for batch in &plan {
            seen.extend(batch.iter().copied());
            let b = collate(&train, batch);
            assert!(b.batch * (b.seq + 1) <= 160 + b.batch, "budget");
            assert!(
                b.targets.iter().any(|&y| y != IGNORE_INDEX),
                "every batch trains something"
            );
        }
        // Resuming at step 2 reads the rest of the same plan.
        assert_eq!(sampler.batches(1, 2), plan[2..].to_vec());
    }
    // Both ranks together read (nearly) every conversation once: the sampler drops at most
    // the tail that does not fill a batch on every rank.
    assert!(seen.len() >= 30, "{} of 40 conversations read", seen.len());
}
