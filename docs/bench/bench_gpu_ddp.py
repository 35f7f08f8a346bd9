"""Data parallel with two ranks on one GPU: PyTorch's DDP beside cohort's, GPT-2 124M
(docs/bench/model.py, T=1024) under bf16 autocast. scripts/gpu-check.sh runs each part as its
own process under a hard timeout, then prints the table.

Parts (each prints one JSON line; --out appends it to a file):
  python bench_gpu_ddp.py torch --backend gloo --batch 4   # 2 processes on cuda:0, DDP over gloo
  python bench_gpu_ddp.py cohort RUN_LOG_DIR --label "cohort host-staged"
                                                           # a `cohort run -n 2 train` run log
  python bench_gpu_ddp.py table results.jsonl              # the DDP rows
  python bench_gpu_ddp.py torch --smoke                    # a tiny model on the CPU: checks the script

tokens/s is the job's (both ranks). The exposed all-reduce share is the part of a step spent
waiting for the gradients' collectives: for PyTorch, 1 - (step time under `no_sync`, which runs
the same forward, backward and optimizer with no communication) / (step time under DDP), both
measured here with both ranks running; for cohort, its run log's `comm_wait` over the sum of
its phases (rank 0's, over the last log window).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import GPT, GPTConfig  # noqa: E402

GPT2_124M = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
SMOKE = GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=64)


def emit(rec, out):
    line = json.dumps(rec)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def torch_rank(rank, world, args, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda:0" if cuda else "cpu")  # both ranks on one GPU
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    cfg = SMOKE if args.smoke else GPT2_124M
    torch.manual_seed(1234)
    model = GPT(cfg).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if cuda else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=6e-4, fused=cuda)
    batch = 2 if args.smoke else args.batch
    g = torch.Generator().manual_seed(rank)
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g).to(dev)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    amp = torch.autocast(dev.type, dtype=torch.bfloat16)

    def step(sync):
        opt.zero_grad(set_to_none=True)
        ctx = ddp.no_sync() if not sync else torch.enable_grad()
        with ctx:
            with amp:
                _, loss = ddp(x, y)
            loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()

    def timed(sync, n):
        times = []
        for _ in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            step(sync)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    start = time.perf_counter()
    step(True)
    step(True)
    n = 2 if args.smoke else args.steps
    # Alternate, so that both figures see the same GPU clocks and neighbours.
    ddp_t, local_t = [], []
    while len(ddp_t) < n:
        ddp_t.append(timed(True, 1))
        local_t.append(timed(False, 1))
        if time.perf_counter() - start > args.budget_s and len(ddp_t) >= 2:
            break
    if rank == 0:
        queue.put({
            "part": "ddp", "who": "PyTorch", "how": f"DDP backend={args.backend}",
            "device": str(dev), "world": world, "batch_per_rank": batch, "seq": cfg.block_size,
            "steps": len(ddp_t), "ms_per_step": statistics.median(ddp_t) * 1e3,
            "ms_per_step_no_sync": statistics.median(local_t) * 1e3,
            "tokens_per_s": world * batch * cfg.block_size / statistics.median(ddp_t),
            "exposed_comm_share": max(0.0, 1 - statistics.median(local_t) / statistics.median(ddp_t)),
            "smoke": args.smoke,
        })
    dist.destroy_process_group()


def part_torch(args):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(torch_rank, args=(args.world, args, port, queue), nprocs=args.world,
                       join=True, start_method="spawn")
    emit(queue.get(), args.out)


def part_cohort(args):
    """The last log window of a `cohort run -n N train --log-dir DIR` run (rank 0's phases)."""
    last = None
    try:
        with open(os.path.join(args.log_dir, "metrics.jsonl")) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    r = json.loads(line)
                    if "ms_per_step" in r and "tokens_per_s" in r:
                        last = r
    except OSError as e:
        print(f"cohort: {e}")
        sys.exit(1)
    if last is None:
        print(f"cohort: no logged step in {args.log_dir}/metrics.jsonl")
        sys.exit(1)
    phases = last["ms_per_step"]
    total = sum(v for v in phases.values() if v is not None)
    emit({
        "part": "ddp", "who": "cohort", "how": args.label, "step": last.get("step"),
        "world": len(last.get("rank_ms_per_step", [])) or None, "batch_per_rank": args.batch,
        "seq": args.seq, "ms_per_step": total, "tokens_per_s": last["tokens_per_s"],
        "exposed_comm_share": (phases.get("comm_wait", 0.0) / total) if total else None,
    }, args.out)


def part_table(args):
    recs = []
    with open(args.results) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                r = json.loads(line)
                if r.get("part") == "ddp":
                    recs.append(r)
    hdr = (f"{'DDP, 2 ranks on one device':<46} {'T':>5} {'B/rank':>6} {'ms/step':>9} {'tokens/s':>10} "
           f"{'exposed comm':>13}")
    print(hdr)
    print("-" * len(hdr))
    for r in recs:
        share = r.get("exposed_comm_share")
        what = f"{r['who']} {r['how']}"
        print(f"{what:<46} {r.get('seq') or '-':>5} {r.get('batch_per_rank') or '-':>6} {r['ms_per_step']:>9.1f} "
              f"{r['tokens_per_s']:>10.0f} {('%.1f%%' % (100 * share)) if share is not None else '-':>13}")
    for want in args.expect:
        if not any(f"{r['who']} {r['how']}" == want for r in recs):
            print(f"{want:<46}  did not run (see its part above)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)
    t = sub.add_parser("torch")
    t.add_argument("--backend", default="gloo")
    t.add_argument("--world", type=int, default=2)
    t.add_argument("--batch", type=int, default=4, help="sequences per rank")
    t.add_argument("--steps", type=int, default=6)
    t.add_argument("--budget-s", type=float, default=40, help="stop timing steps after this long")
    t.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, to check the script")
    t.add_argument("--out")
    c = sub.add_parser("cohort")
    c.add_argument("log_dir")
    c.add_argument("--label", required=True)
    c.add_argument("--batch", type=int, default=4)
    c.add_argument("--seq", type=int, default=1024)
    c.add_argument("--out")
    tb = sub.add_parser("table")
    tb.add_argument("results")
    tb.add_argument("--expect", nargs="*", default=[], help="'who how' rows that should be there")
    args = ap.parse_args()
    {"torch": part_torch, "cohort": part_cohort, "table": part_table}[args.part](args)


if __name__ == "__main__":
    main()
