"""Single-process CPU training-step benchmark of config S: transformers' own LlamaForCausalLM
of SmolLM2-135M's shape, the reference `cohort bench train --config S` is compared with.

Usage: python bench_llama.py --threads 1 [--steps 10 --warmup 2] [--amp bf16]
Prints one JSON line as bench_single.py does (median step time, tokens/s, phases, peak RSS).
Random init, random token ids, AdamW lr 1e-3 with PyTorch's defaults, no dropout.
"""
import argparse
import contextlib
import json
import resource
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# SmolLM2-135M: 30 layers, d 576, 9 heads over 3 key/value heads, SwiGLU 1536, RoPE 1e5,
# RMSNorm 1e-5, tied embeddings, vocabulary 49152; the benchmark's context is 512, batch 4.
CONFIG = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
              num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512,
              rms_norm_eps=1e-5, rope_theta=1e5, tie_word_embeddings=True)
BATCH, SEQ = 4, 512


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--amp", choices=["none", "bf16"], default="none")
    args = ap.parse_args()
    amp = (torch.autocast("cpu", dtype=torch.bfloat16) if args.amp == "bf16"
           else contextlib.nullcontext())
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = args.warmup + args.steps
    data = torch.randint(0, CONFIG["vocab_size"], (n, BATCH, SEQ))
    times, t_fwd, t_bwd, t_opt = [], [], [], []
    for i in range(n):
        x = data[i]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = model(x, labels=x).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i >= args.warmup:
            times.append(t3 - t0)
            t_fwd.append(t1 - t0)
            t_bwd.append(t2 - t1)
            t_opt.append(t3 - t2)
    med = statistics.median(times)
    print(json.dumps({
        "bench": "single", "config": "S", "threads": args.threads, "amp": args.amp,
        "params": sum(p.numel() for p in model.parameters()), "batch": BATCH, "seq": SEQ,
        "steps": args.steps, "warmup": args.warmup, "median_ms": med * 1e3,
        "tokens_per_s": BATCH * SEQ / med,
        "fwd_ms": statistics.median(t_fwd) * 1e3,
        "bwd_ms": statistics.median(t_bwd) * 1e3,
        "opt_ms": statistics.median(t_opt) * 1e3,
        "final_loss": loss.item(),
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }))


if __name__ == "__main__":
    main()
