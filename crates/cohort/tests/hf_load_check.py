"""Loads a model directory cohort wrote with Hugging Face transformers, as a user would
(AutoTokenizer, AutoModelForCausalLM), and prints one JSON object: every warning transformers
logged or raised while loading, the tokenizer's ids for a text, and 12 greedy tokens after it
(decoded), so the test can compare them with cohort's own tokenizer and sampler."""

import io
import json
import logging
import sys
import warnings

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, text = sys.argv[1], sys.argv[2]
log = io.StringIO()
transformers.logging.set_verbosity_warning()
transformers.logging.add_handler(logging.StreamHandler(log))
with warnings.catch_warnings(record=True) as raised:
    warnings.simplefilter("always")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
ids = tokenizer(text)["input_ids"]
with torch.no_grad():
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0
    )
print(json.dumps({
    "warnings": [l for l in log.getvalue().splitlines() if l.strip()]
    + [str(w.message) for w in raised],
    "ids": ids,
    "greedy": tokenizer.decode(out[0][len(ids):].tolist()),
}))
