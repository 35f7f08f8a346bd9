"""The PyTorch side of llama_hf.rs: transformers' own LlamaForCausalLM / Qwen2ForCausalLM as
the reference cohort's Llama family is checked against.

  make KIND DIR [VOCAB]
                  builds a tiny random model of KIND (llama: grouped heads, tied head; qwen2:
                  grouped heads, QKV bias, untied head, saved in shards with an index; llama3:
                  Llama 3's rope scaling, multi-query, untied head, saved in bf16), saves it to
                  DIR with
                  save_pretrained,
                  and prints one JSON object: the ids it used, the logits of a batch, 8 greedy
                  tokens after a prompt, and the losses of 5 AdamW steps from the saved init.
  check DIR       loads DIR as a user would (AutoModelForCausalLM) and prints every warning
                  transformers logged or raised, and the logits of the same batch.
"""

import io
import json
import logging
import sys
import warnings

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

B, T = 2, 12
LR, STEPS = 3e-3, 5


def ids_of(vocab):
    """The batch (B, T) every mode runs, within a vocabulary of `vocab` ids."""
    return [[(7 * i + 3 * b + 1) % vocab for i in range(T)] for b in range(B)]


def build(kind, vocab):
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, initializer_range=0.2)
    if kind == "llama":
        cfg = LlamaConfig(rms_norm_eps=1e-5, rope_theta=1e5, tie_word_embeddings=True, **common)
    elif kind == "llama3":
        # wavelengths 6.3, 63, 628, 6283 against 16 / 4 and 16 / 1: one smoothed, three scaled
        common["num_key_value_heads"] = 1
        scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                       high_freq_factor=4.0, original_max_position_embeddings=16)
        cfg = LlamaConfig(rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=scaling,
                          tie_word_embeddings=False, **common)
    else:
        cfg = Qwen2Config(rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Norm weights and biases away from 1 and 0, so that a swapped or ignored one shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return model


def logits_of(model):
    with torch.no_grad():
        ids = ids_of(model.config.vocab_size)
        return model(torch.tensor(ids)).logits.flatten().tolist()


def make(kind, out, vocab):
    ids = ids_of(vocab)
    prompt = [x % vocab for x in (5, 17, 33, 2)]
    model = build(kind, vocab).eval()
    # qwen2's weights in shards with a model.safetensors.index.json, as large models come;
    # llama3's in bf16, as most hub models are (its f32 values bf16-exact, so nothing is lost)
    if kind == "llama3":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
        # (a copy: casting the model would round its rotary frequencies too)
        state = {k: v.bfloat16() for k, v in model.state_dict().items()}
        model.save_pretrained(out, state_dict=state)
    else:
        model.save_pretrained(out, max_shard_size="30KB" if kind == "qwen2" else "5GB")
    logits = logits_of(model)
    # all 8 tokens, as cohort's sampler gives them: no stop at the config's eos id
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                pad_token_id=0)[0][len(prompt):].tolist()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(torch.tensor(ids), labels=torch.tensor(ids)).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"ids": ids, "prompt": prompt, "lr": LR, "logits": logits, "greedy": greedy,
            "losses": losses}


def check(path):
    log = io.StringIO()
    transformers.logging.set_verbosity_warning()
    transformers.logging.add_handler(logging.StreamHandler(log))
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        model = AutoModelForCausalLM.from_pretrained(path).eval()
    return {"warnings": [l for l in log.getvalue().splitlines() if l.strip()]
            + [str(w.message) for w in raised],
            "class": type(model).__name__, "logits": logits_of(model)}


if __name__ == "__main__":
    if sys.argv[1] == "make":
        result = make(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 96)
    else:
        result = check(sys.argv[2])
    print(json.dumps(result))
