"""PyTorch's sharded data parallel on CPU (gloo) beside `cohort bench ddp --strategy S`:
DDP, DDP + ZeroRedundancyOptimizer (ZeRO-1) and FSDP2's `fully_shard` per block (ZeRO-3),
on the reference GPT (configs B and G), reporting tokens/s and each rank's peak RSS.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 docs/bench/torch_sharded.py \
        --strategy ddp|zero1|fsdp --config B|G [--steps N --warmup W]

The model is the reference GPT of model.py beside this script (`--reference DIR` to take
another). Rank 0 prints one JSON line.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="ddp", choices=["ddp", "zero1", "fsdp"])
    ap.add_argument("--config", default="B")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--reference", default=here, help="the directory holding model.py")
    args = ap.parse_args()
    sys.path.insert(0, args.reference)
    from model import CONFIGS, GPT

    torch.set_num_threads(args.threads)
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, batch = CONFIGS[args.config]
    torch.manual_seed(1234)
    model = GPT(cfg)
    params = model.num_params()
    if args.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        if args.strategy == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3
            )
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(42 + rank)
    n = args.warmup + args.steps
    data = torch.randint(0, cfg.vocab_size, (n, batch, cfg.block_size + 1), generator=g)
    times = []
    for i in range(n):
        x, y = data[i][:, :-1].contiguous(), data[i][:, 1:].contiguous()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    got = [None] * world
    dist.all_gather_object(got, (med, rss_mb))
    if rank == 0:
        slow = max(m for m, _ in got)
        print(json.dumps({
            "bench": "torch_sharded", "strategy": args.strategy, "config": args.config,
            "world": world, "threads": args.threads, "params": params,
            "steps": args.steps, "median_ms": slow * 1e3,
            "tokens_per_s": world * batch * cfg.block_size / slow,
            "peak_rss_mb_per_rank": [r for _, r in got],
            "final_loss_rank0": loss.item(),
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
