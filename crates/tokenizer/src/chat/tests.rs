use super::*;

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fn chat(json: &str) -> Chat {
    Chat::from_json(json).unwrap()
}

const TWO_TURNS: &str = r#"[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "See you"}]"#;

#[test]
fn chatml_renders_with_and_without_the_generation_prompt() {
    let t = ChatTemplate::new(CHATML, &[("eos_token", "<|im_end|>")]).unwrap();
    let c = chat(r#"[{"role": "user", "content": "Hi"}]"#);
    assert_eq!(
        t.render(&c, false).unwrap().text,
        "<|im_start|>user\nHi<|im_end|>\n"
    );
    assert_eq!(
        t.render(&c, true).unwrap().text,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(t.special_token("eos_token"), Some("<|im_end|>"));
}

#[test]
fn prefix_rendering_finds_each_assistant_turn() {
    let t = ChatTemplate::new(CHATML, &[]).unwrap();
    let r = t.assistant_spans(&chat(TWO_TURNS)).unwrap();
    let spans: Vec<&str> = r.generation.iter().map(|s| &r.text[s.clone()]).collect();
    assert_eq!(spans, ["Hello!<|im_end|>\n", "See you<|im_end|>\n"]);
}

#[test]
fn generation_blocks_mark_the_assistant_text_and_keep_whitespace_control() {
    let src = "{% for m in messages %}\n{% if m.role == 'assistant' %}\n<a>{% generation %}\n{{ m.content }}</s>{% endgeneration %}\n\n{% else %}\n<u>{{ m.content }}\n{% endif %}\n{% endfor %}";
    let t = ChatTemplate::new(src, &[]).unwrap();
    assert!(t.has_generation_blocks());
    let r = t.render(&chat(TWO_TURNS), false).unwrap();
    assert_eq!(r.text, "<u>Hi\n<a>Hello!</s>\n<u>Bye\n<a>See you</s>\n");
    let spans: Vec<&str> = r.generation.iter().map(|s| &r.text[s.clone()]).collect();
    assert_eq!(spans, ["Hello!</s>", "See you</s>"]);
    // assistant_spans uses the blocks as they are.
    assert_eq!(t.assistant_spans(&chat(TWO_TURNS)).unwrap(), r);
    // A conversation holding a marker is refused, not silently mis-spanned.
    let bad = chat("[{\"role\": \"assistant\", \"content\": \"x\u{FDD1}\"}]");
    assert!(t.render(&bad, false).is_err());
}

#[test]
fn python_environment_tojson_raise_loop_controls_and_string_methods() {
    let src = "{{ messages[0] | tojson }}|{{ tools | tojson(indent=2) }}|{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content.strip().upper() }}{% endfor %}|{{ none }}{{ true }}|{{ bos_token }}|{{ flag }}";
    let t = ChatTemplate::new(src, &[("bos_token", "<s>")]).unwrap();
    let c = chat(
        r#"{"messages": [{"role": "user", "content": "  a<b> ü ", "z": null}, {"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "n": 1.0}}],
            "chat_template_kwargs": {"flag": "on"}}"#,
    );
    let text = t.render(&c, false).unwrap().text;
    assert_eq!(
        text,
        "{\"role\": \"user\", \"content\": \"  a<b> ü \"}|[\n  {\n    \"type\": \"function\",\n    \"function\": {\n      \"name\": \"f\",\n      \"n\": 1.0\n    }\n  }\n]|A<B> Ü|NoneTrue|<s>|on"
    );
    let raising = ChatTemplate::new("{{ raise_exception('no system role') }}", &[]).unwrap();
    let e = raising.render(&c, false).unwrap_err().to_string();
    assert!(e.contains("no system role"), "{e}");
}

#[test]
fn a_template_list_picks_default_or_tool_use() {
    let dir = tempfile::tempdir().unwrap();
    let config = serde_json::json!({
        "eos_token": {"content": "</s>", "__type": "AddedToken"},
        "chat_template": [
            {"name": "tool_use", "template": "T{{ eos_token }}"},
            {"name": "default", "template": "D{{ eos_token }}"},
        ],
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let t = ChatTemplate::from_dir(dir.path()).unwrap();
    assert_eq!(t.render(&chat("[]"), false).unwrap().text, "D</s>");
    let with_tools = chat(r#"{"messages": [], "tools": [{"name": "f"}]}"#);
    assert_eq!(t.render(&with_tools, false).unwrap().text, "T</s>");
    // chat_template.jinja wins over the config, as in transformers.
    std::fs::write(dir.path().join("chat_template.jinja"), "J").unwrap();
    let t = ChatTemplate::from_dir(dir.path()).unwrap();
    assert_eq!(t.render(&chat("[]"), false).unwrap().text, "J");
    let empty = tempfile::tempdir().unwrap();
    let e = ChatTemplate::from_dir(empty.path())
        .unwrap_err()
        .to_string();
    assert!(e.contains("no chat template"), "{e}");
}

#[test]
fn bad_templates_and_conversations_are_one_line_errors() {
    let e = ChatTemplate::new("{% for %}", &[]).unwrap_err().to_string();
    assert!(e.contains("does not compile"), "{e}");
    assert!(!e.contains('\n'), "{e}");
    for (json, want) in [
        ("{", "invalid JSON"),
        ("[1]", "message 0 is not an object"),
        ("{\"msgs\": []}", "no \"messages\""),
        ("3", "expected a list"),
    ] {
        let e = Chat::from_json(json).unwrap_err().to_string();
        assert!(e.contains(want), "{json}: {e}");
    }
}

#[test]
fn tokens_overlapping_a_span_are_assistant_tokens() {
    let mut tok = Tokenizer::char_level("abcdefghijklmnopqrstuvwxyz HYSB!\n".chars());
    tok.add_special_tokens(&["<|im_start|>", "<|im_end|>"])
        .unwrap();
    let t = ChatTemplate::new(CHATML, &[]).unwrap();
    let r = t.assistant_spans(&chat(TWO_TURNS)).unwrap();
    let out = encode_chat(&tok, &r).unwrap();
    assert_eq!(out.ids, tok.encode(&r.text).unwrap());
    let marked: String = out
        .ids
        .iter()
        .zip(&out.assistant_mask)
        .filter(|(_, &m)| m == 1)
        .map(|(&id, _)| tok.decode(&[id]).unwrap())
        .collect();
    assert_eq!(marked, "Hello!<|im_end|>\nSee you<|im_end|>\n");
}
