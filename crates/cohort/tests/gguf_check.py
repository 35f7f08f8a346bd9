"""Checks the Hugging Face directory `cohort convert` wrote from a GGUF file against transformers'
own reading of that file (`from_pretrained(dir, gguf_file=...)`, dequantised to f32 by the `gguf`
package): a reference no one in cohort wrote.

Usage: gguf_check.py CONVERTED_DIR GGUF_FILE [LOGITS_DIR]

Prints one JSON object: every warning transformers logged or raised while loading the converted
directory, load info (missing/unexpected/mismatched keys), the largest logit difference per prompt,
whether two prompts' 32 greedy tokens agree, and for 20 strings whether the converted
tokenizer.json (through AutoTokenizer and through `tokenizers` directly) gives the gguf-loaded
tokenizer's ids. For cohort's own forward and sampler, each prompt's ids and the reference's
greedy tokens as `generate` gives them by default (stopping at the end-of-sequence id), and with
LOGITS_DIR the reference's logits of prompt i as LOGITS_DIR/logits-i.f32 (little-endian f32,
tokens x vocabulary). The Rust test decides what passes."""

import io
import json
import logging
import os
import sys
import warnings

import torch
import transformers
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

converted, gguf_path = sys.argv[1], sys.argv[2]
logits_dir = sys.argv[3] if len(sys.argv) > 3 else None
torch.manual_seed(0)

log = io.StringIO()
transformers.logging.set_verbosity_warning()
handler = logging.StreamHandler(log)
transformers.logging.add_handler(handler)
with warnings.catch_warnings(record=True) as raised:
    warnings.simplefilter("always")
    tok = AutoTokenizer.from_pretrained(converted)
    model, info = AutoModelForCausalLM.from_pretrained(
        converted, dtype=torch.float32, output_loading_info=True
    )
transformers.logging.remove_handler(handler)
load_warnings = [l for l in log.getvalue().splitlines() if l.strip()] + [str(w.message) for w in raised]
# The reference's own loading warnings are not ours to judge.
transformers.logging.set_verbosity_error()
gguf_dir, gguf_name = os.path.split(os.path.abspath(gguf_path))
ref_tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
ref = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
model.eval()
ref.eval()

chat = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
prompts = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a village by the sea, there lived",
    ref_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
]
logits = []
greedy = []
with torch.no_grad():
    for i, p in enumerate(prompts):
        ids = torch.tensor([ref_tok(p)["input_ids"]])
        a, b = model(ids).logits, ref(ids).logits
        logits.append({"max_abs_diff": (a - b).abs().max().item(), "max_abs": b.abs().max().item(),
                       "ids": ids[0].tolist()})
        if logits_dir:
            b[0].numpy().astype("<f4").tofile(os.path.join(logits_dir, f"logits-{i}.f32"))
        # Generation is the slow part on a busy CPU: two prompts, plain text and chat.
        if i not in (0, 3):
            continue
        kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=ref_tok.pad_token_id)
        ga = model.generate(ids, **kw)[0, ids.shape[1]:].tolist()
        gb = ref.generate(ids, **kw)[0, ids.shape[1]:].tolist()
        # What a user's generate gives: up to 32 tokens, stopping at (and keeping) the eos id.
        stopped = ref.generate(ids, max_new_tokens=32, do_sample=False,
                               pad_token_id=ref_tok.pad_token_id)[0, ids.shape[1]:].tolist()
        shown = stopped[:-1] if stopped[-1] == ref_tok.eos_token_id else stopped
        greedy.append({"same": ga == gb, "n": len(gb), "converted": ga, "reference": gb,
                       "text": ref_tok.decode(gb), "prompt": p, "stopped": stopped,
                       "stopped_text": ref_tok.decode(shown)})

strings = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "In 2024, 12345 apples cost $3.14 each (or 1,000,000 in total).",
    "  leading spaces and\ttabs\nand new lines\n\n",
    "naïve café résumé — “quotes” and ‘apostrophes’",
    "日本語のテキストと中文文本",
    "emoji: 🤗🚀👍🏽 and symbols ∑∫√∞ ≠ ≤",
    "Привет, мир! Γειά σου κόσμε",
    "def f(x):\n    return [i**2 for i in range(x) if i % 2 == 0]\n",
    "fn main() { println!(\"{}\", 1 + 2); } // Rust",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "<repo_name>cohort<file_sep>src/main.rs<filename>",
    "don't won't I'm you're we've they'll she'd",
    "UPPER lower MiXeD CaSe 123abc abc123",
    "https://example.com/path?query=1&other=two#frag",
    "x" * 50 + " " + "ab" * 20,
    "   ",
    "",
    ref_tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sum 17 and 25."},
         {"role": "assistant", "content": "42"}], tokenize=False),
]
raw = Tokenizer.from_file(os.path.join(converted, "tokenizer.json"))
tokenizer = []
for s in strings:
    want = ref_tok(s)["input_ids"]
    got = tok(s)["input_ids"]
    got_raw = raw.encode(s).ids
    tokenizer.append({"text": s, "same": got == want and got_raw == want,
                      "reference": want, "converted": got, "tokenizers": got_raw})
template_same = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == prompts[3]

print(json.dumps({
    "warnings": load_warnings,
    "missing": list(info["missing_keys"]),
    "unexpected": list(info["unexpected_keys"]),
    "mismatched": [list(map(str, m)) for m in info["mismatched_keys"]],
    "logits": logits,
    "greedy": greedy,
    "tokenizer": tokenizer,
    "chat_template_same": template_same,
}))
