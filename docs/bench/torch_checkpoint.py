"""PyTorch's activation checkpointing beside `cohort bench train --activation-checkpointing`:
the reference GPT's training step with each block under `torch.utils.checkpoint`
(non-reentrant, as recommended) or not, in fp32 or under bf16 autocast, reporting the median
step time and the process's peak RSS.

    python3 docs/bench/torch_checkpoint.py --config G --threads 1 [--checkpoint] [--amp bf16]

Peak RSS is the process's high-water mark, so each setting runs in a process of its own. The
model is the reference GPT of model.py beside this script (`--reference DIR` to take
another). Prints one JSON line.
"""
import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="G")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--checkpoint", action="store_true", help="recompute each block in backward")
    ap.add_argument("--amp", choices=["none", "bf16"], default="none")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--reference", default=here, help="the directory holding model.py")
    args = ap.parse_args()
    sys.path.insert(0, args.reference)
    from model import CONFIGS, GPT

    torch.set_num_threads(args.threads)
    torch.manual_seed(1234)
    cfg, batch = CONFIGS[args.config]
    model = GPT(cfg)
    model.train()
    if args.checkpoint:
        for blk in model.blocks:
            plain = blk.forward
            blk.forward = lambda x, f=plain: checkpoint(f, x, use_reentrant=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = (torch.autocast("cpu", dtype=torch.bfloat16) if args.amp == "bf16"
           else contextlib.nullcontext())
    n = args.warmup + args.steps
    data = torch.randint(0, cfg.vocab_size, (n, batch, cfg.block_size + 1))
    times = []
    for i in range(n):
        x, y = data[i, :, :-1].contiguous(), data[i, :, 1:].contiguous()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with amp:
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    print(json.dumps({
        "bench": "torch_checkpoint", "config": args.config, "threads": args.threads,
        "amp": args.amp, "checkpoint": args.checkpoint, "steps": args.steps,
        "median_ms": statistics.median(times) * 1e3, "final_loss": loss.item(),
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }))


if __name__ == "__main__":
    main()
