"""Generation (and a training step) of SmolLM2-135M in transformers: the anchor of `cohort sample`.

Usage: python bench_llama_generate.py --generate 128 --threads 2 --model DIR [--amp none|bf16]
       python bench_llama_generate.py --threads 2 [--seq 512 --batch 4 --steps 5 --warmup 2]
(bench_llama.py is the training-step anchor the README quotes.)
Compared with: COHORT_NUM_THREADS=2 cohort sample --checkpoint DIR --prompt P --max-new-tokens 128
       --ignore-eos --temperature 0 --weights fp32|bf16|q8 (docs/PERFORMANCE.md, the generation row)

Training: a step of LlamaForCausalLM built from SmolLM2-135M's config (random init; the weights do
not change the time), forward under torch.autocast("cpu", torch.bfloat16) with --amp bf16, AdamW.
Generation: one stream, greedy, `model.generate(max_new_tokens=N)` from a 16-token prompt, from the
model directory given (e.g. a converted SmolLM2) or a random init.
Prints one JSON line: median step ms, tokens/s, peak RSS MB (ru_maxrss of this process).
"""
import argparse
import contextlib
import json
import resource
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, attention_bias=False, mlp_bias=False)


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--amp", choices=["none", "bf16"], default="bf16")
    ap.add_argument("--generate", type=int, default=0, help="new tokens; 0 = time training")
    ap.add_argument("--model", help="a Hugging Face directory (generation only)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1234)
    if args.model:
        model = LlamaForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    else:
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))
    cfg = model.config
    amp = (torch.autocast("cpu", dtype=torch.bfloat16) if args.amp == "bf16"
           else contextlib.nullcontext())
    if args.generate:
        model.eval()
        prompt = torch.randint(0, cfg.vocab_size, (1, 16))
        with torch.no_grad(), amp:
            model.generate(prompt, max_new_tokens=4, do_sample=False)  # warm-up
            t0 = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=args.generate, min_new_tokens=args.generate,
                                 do_sample=False)
            dt = time.perf_counter() - t0
        n = out.shape[1] - prompt.shape[1]
        print(json.dumps({"system": "transformers", "mode": "generate", "amp": args.amp,
                          "threads": args.threads, "new_tokens": n, "tokens_per_s": n / dt,
                          "peak_rss_mb": peak_rss_mb()}))
        return
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for i in range(args.warmup + args.steps):
        data = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1))
        x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with amp:
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, cfg.vocab_size), y.view(-1))
        loss.backward()
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    print(json.dumps({"system": "transformers", "mode": "train", "amp": args.amp,
                      "threads": args.threads, "seq": args.seq, "batch": args.batch,
                      "step_ms": ms, "tokens_per_s": args.batch * args.seq / ms * 1e3,
                      "peak_rss_mb": peak_rss_mb()}))


if __name__ == "__main__":
    main()
