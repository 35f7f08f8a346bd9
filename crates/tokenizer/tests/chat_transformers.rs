//! Chat templates rendered by cohort-tokenizer against transformers' `apply_chat_template` on the
//! same directory: the same text and the same ids for every conversation, with and without the
//! generation prompt, and the same assistant mask (`return_assistant_tokens_mask`) for a template
//! with `{% generation %}` blocks. Templates: SmolLM2-135M-Instruct's (as its GGUF carries it), a
//! Llama-3.1-style one (date via `strftime_now`, tools as `tojson(indent=4)`, `raise_exception`,
//! a tool call) and a Qwen2.5-style one (tools, tool calls, tool responses), and ChatML with
//! generation blocks. The tokenizer is a byte-level BPE trained in the test with the templates'
//! special tokens. Needs python3 with transformers (CI installs it); skips with a message
//! without, except under CI=true.

use std::path::Path;
use std::process::Command;

use cohort_tokenizer::{encode_chat, Chat, ChatTemplate, Tokenizer};
use serde_json::{json, Value};

pub const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const LLAMA3: &str = r#"{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"#;

const QWEN2: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

/// ChatML with the assistant's text (and its end of turn) in a generation block, as TRL's
/// assistant-only templates write it.
const CHATML_GENERATION: &str = "{%- for message in messages %}\n{%- if message.role == 'assistant' %}\n{{- '<|im_start|>assistant\n' }}{% generation %}{{ message.content + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}\n{%- else %}\n{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}\n{%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const SPECIAL: [&str; 7] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
];

fn conversations() -> Vec<Value> {
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city, now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Its name, e.g. \"Paris\""}, "unit": {"type": "string", "enum": ["C", "F"]}}, "required": ["city"]}}}]);
    vec![
        json!([{"role": "user", "content": "Hi!"}]),
        json!([
            {"role": "system", "content": "You are terse.  "},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3?\n"},
            {"role": "assistant", "content": "6, of course."}
        ]),
        json!([
            {"role": "user", "content": "Écris « bonjour » — avec des \"guillemets\" et un \\ !\n\n  "},
            {"role": "assistant", "content": "  bonjour 🙂 <b>ok</b>", "name": null}
        ]),
        json!({"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}]},
            {"role": "tool", "content": "{\"temperature\": 21.5}"},
            {"role": "assistant", "content": "It is 21.5 °C in Paris."}
        ], "tools": tools}),
    ]
}

/// python3 can import transformers, or the test skips (fails under CI=true).
fn transformers_available(test: &str) -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import transformers, jinja2"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("{test}: python3 cannot import transformers (CI=true: this check must run)");
        }
        eprintln!("{test}: skipping: python3 cannot import transformers");
    }
    ok
}

/// A model directory with the test tokenizer and `template`.
fn model_dir(root: &Path, name: &str, tok: &Tokenizer, template: &str, bos: &str, eos: &str) {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    tok.save(dir.join("tokenizer.json")).unwrap();
    let config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "clean_up_tokenization_spaces": false,
        "chat_template": template,
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

const SCRIPT: &str = r#"
import json, sys
from transformers import AutoTokenizer
spec = json.load(open(sys.argv[1]))
out = []
for case in spec:
    tok = AutoTokenizer.from_pretrained(case["dir"])
    conv = case["conversation"]
    messages, tools = (conv["messages"], conv.get("tools")) if isinstance(conv, dict) else (conv, None)
    gen = case["add_generation_prompt"]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
    enc = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                  add_generation_prompt=gen, return_assistant_tokens_mask=case["mask"])
    out.append({"text": text, "ids": list(enc["input_ids"]),
                "mask": list(enc["assistant_masks"]) if case["mask"] else None})
print(json.dumps(out))
"#;

#[test]
fn templates_render_and_tokenize_as_transformers_does() {
    let test = "templates_render_and_tokenize_as_transformers_does";
    if !transformers_available(test) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let corpus = tmp.path().join("corpus.txt");
    let text: String = (0..200)
        .map(|i| format!("The assistant answers question {i}: what is the weather in Paris? It is sunny, {i} degrees.\n"))
        .collect();
    std::fs::write(&corpus, text).unwrap();
    let tok = Tokenizer::train_bpe(&[&corpus], 400, &SPECIAL).unwrap();
    let templates = [
        ("smollm2", SMOLLM2, "<|im_start|>", "<|im_end|>", false),
        ("llama3", LLAMA3, "<|begin_of_text|>", "<|eot_id|>", false),
        ("qwen2", QWEN2, "<|endoftext|>", "<|im_end|>", false),
        (
            "chatml-gen",
            CHATML_GENERATION,
            "<|im_start|>",
            "<|im_end|>",
            true,
        ),
    ];
    let mut cases = Vec::new();
    for (name, template, bos, eos, mask) in templates {
        model_dir(tmp.path(), name, &tok, template, bos, eos);
        for (c, conversation) in conversations().into_iter().enumerate() {
            // SmolLM2's and the generation template know no tools.
            if c == 3 && matches!(name, "smollm2" | "chatml-gen") {
                continue;
            }
            for gen in [false, true] {
                cases.push(json!({
                    "dir": tmp.path().join(name), "name": name, "conversation": conversation,
                    "add_generation_prompt": gen, "mask": mask && !gen,
                }));
            }
        }
    }
    let spec = tmp.path().join("spec.json");
    std::fs::write(&spec, serde_json::to_string(&cases).unwrap()).unwrap();
    let script = tmp.path().join("reference.py");
    std::fs::write(&script, SCRIPT).unwrap();
    let out = Command::new("python3")
        .arg(&script)
        .arg(&spec)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let want: Vec<Value> = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(want.len(), cases.len());
    let mut marked = 0;
    for (case, want) in cases.iter().zip(&want) {
        let dir = case["dir"].as_str().unwrap();
        let template = ChatTemplate::from_dir(dir).unwrap();
        let chat = Chat::from_json(&case["conversation"].to_string()).unwrap();
        let gen = case["add_generation_prompt"].as_bool().unwrap();
        let rendered = template.render(&chat, gen).unwrap();
        let what = format!(
            "{} conversation {} gen {gen}",
            case["name"], case["conversation"]
        );
        assert_eq!(rendered.text, want["text"].as_str().unwrap(), "{what}");
        let ours = encode_chat(&tok, &rendered).unwrap();
        let ids: Vec<u32> = serde_json::from_value(want["ids"].clone()).unwrap();
        assert_eq!(ours.ids, ids, "{what}");
        if let Some(mask) = want["mask"].as_array() {
            let mask: Vec<u8> = mask.iter().map(|m| m.as_u64().unwrap() as u8).collect();
            marked += mask.iter().filter(|&&m| m == 1).count();
            assert_eq!(ours.assistant_mask, mask, "{what}");
        }
    }
    assert!(marked > 0, "transformers marked no assistant token");
    eprintln!("{} renders identical to transformers", cases.len());
}
