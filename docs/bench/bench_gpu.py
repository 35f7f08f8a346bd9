"""PyTorch's anchors on one GPU: GPT-2 124M (docs/bench/model.py, T=1024) training steps under
bf16 autocast, eager and torch.compile, and the bf16 matrix-product rate their MFU is measured
against. scripts/gpu-check.sh runs each part as its own process under a hard timeout, so a
slow torch.compile cannot eat the other parts' time, then prints the table.

Parts (each prints one JSON line; --out appends it to a file):
  python bench_gpu.py matmul                      # bf16 GEMM TFLOP/s, 8192^3, CUDA events
  python bench_gpu.py train --batch 8 --mode eager --budget-s 40
  python bench_gpu.py train --batch 16 --mode compile --budget-s 110
  python bench_gpu.py table results.jsonl         # the closing table, MFU included
  python bench_gpu.py compare CPU_LOGS DEV_LOGS   # two `cohort train` runs' losses, step by step
  python bench_gpu.py train --smoke               # a tiny model on the CPU: checks the script

MFU = tokens/s x FLOPs per token / the measured bf16 GEMM rate, with llm.c's count of FLOPs per
token: 6 N + 6 L C T (N parameters, L layers, width C, sequence T; 803.5 MFLOP for GPT-2 124M at
T = 1024). The optimizer is torch.optim.AdamW (fused on CUDA), fp32 master weights.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

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


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def flops_per_token(cfg, n_params):
    return 6 * n_params + 6 * cfg.n_layer * cfg.n_embd * cfg.block_size


def part_matmul(args):
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    n = 512 if dev.type == "cpu" else args.size
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(dev)
    reps, t0 = 0, time.perf_counter()
    deadline = t0 + args.budget_s
    while reps < 5 or (time.perf_counter() < deadline and reps < 200):
        a @ b
        reps += 1
        if reps % 10 == 0:
            sync(dev)
    sync(dev)
    dt = time.perf_counter() - t0
    emit({"part": "matmul", "device": str(dev), "n": n, "reps": reps,
          "tflops": 2 * n ** 3 * reps / dt / 1e12}, args.out)


def part_train(args):
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    cfg = SMOKE if args.smoke else GPT2_124M
    batch = 2 if args.smoke else args.batch
    start = time.perf_counter()
    torch.manual_seed(1234)
    model = GPT(cfg).to(dev)
    model.train()
    n_params = model.num_params()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=dev.type == "cuda")
    step_fn = model
    if args.mode == "compile":
        step_fn = torch.compile(model)
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), device=dev)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    amp = torch.autocast(dev.type, dtype=torch.bfloat16)

    def step():
        opt.zero_grad(set_to_none=True)
        with amp:
            _, loss = step_fn(x, y)
        loss.backward()
        opt.step()
        return loss

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    # Warm-up: the first step compiles (torch.compile) and picks kernels; two more settle.
    t0 = time.perf_counter()
    step()
    sync(dev)
    first_s = time.perf_counter() - t0
    for _ in range(2):
        step()
    sync(dev)
    times = []
    deadline = start + args.budget_s
    max_steps = 3 if args.smoke else args.steps
    while len(times) < max_steps:
        t0 = time.perf_counter()
        loss = step()
        sync(dev)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() + times[-1] > deadline and len(times) >= 3:
            break
    med = statistics.median(times)
    tokens = batch * cfg.block_size
    emit({
        "part": "train", "mode": args.mode, "device": str(dev),
        "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "batch": batch, "seq": cfg.block_size, "params": n_params,
        "flops_per_token": flops_per_token(cfg, n_params),
        "first_step_s": first_s, "steps": len(times),
        "ms_per_step": med * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3,
        "tokens_per_s": tokens / med,
        "peak_mem_gib": (torch.cuda.max_memory_allocated() / 2 ** 30) if dev.type == "cuda" else None,
        "loss": loss.item(), "smoke": args.smoke,
    }, args.out)


def read_losses(log_dir):
    """(step, train_loss) of a cohort run log's metrics.jsonl, in step order."""
    losses = {}
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if "train_loss" in r and r["train_loss"] is not None:
                losses[r["step"]] = float(r["train_loss"])
    return sorted(losses.items())


def part_compare(args):
    """The losses of `cohort train --device cpu` and of the same run on a device, side by side."""
    try:
        cpu = dict(read_losses(args.cpu))
        dev = dict(read_losses(args.device))
    except OSError as e:
        print(f"compare: {e}")
        sys.exit(1)
    steps = sorted(set(cpu) | set(dev))
    print(f"{'step':>5} {'cpu loss':>12} {args.label + ' loss':>14} {'|diff|':>10} {'rel':>9}")
    diffs = []
    for s in steps:
        a, b = cpu.get(s), dev.get(s)
        if a is None or b is None:
            print(f"{s:>5} {a if a is not None else '-':>12} {b if b is not None else '-':>14}")
            continue
        d = abs(a - b)
        diffs.append((d, d / max(abs(a), 1e-12)))
        print(f"{s:>5} {a:>12.6f} {b:>14.6f} {d:>10.2e} {d / max(abs(a), 1e-12):>9.2e}")
    ok = bool(diffs) and len(diffs) == len(steps)
    rec = {"part": "compare", "label": args.label, "steps": len(steps), "compared": len(diffs),
           "max_abs_diff": max((d for d, _ in diffs), default=None),
           "max_rel_diff": max((r for _, r in diffs), default=None),
           "final_cpu": cpu.get(steps[-1]) if steps else None,
           "final_device": dev.get(steps[-1]) if steps else None, "complete": ok}
    emit(rec, args.out)
    sys.exit(0 if ok else 1)


def part_table(args):
    recs = []
    with open(args.results) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                recs.append(json.loads(line))
    rate = next((r["tflops"] for r in recs if r.get("part") == "matmul"), None)
    print(f"bf16 GEMM rate measured here: {rate:.1f} TFLOP/s" if rate else "bf16 GEMM rate: not measured")
    hdr = f"{'what':<34} {'batch':>5} {'ms/step':>9} {'tokens/s':>10} {'peak GiB':>9} {'MFU':>6}"
    print(hdr)
    print("-" * len(hdr))
    for r in recs:
        if r.get("part") != "train":
            continue
        mfu = (r["tokens_per_s"] * r["flops_per_token"] / (rate * 1e12)) if rate else None
        peak = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "-"
        what = f"PyTorch {r['mode']} bf16 autocast ({r['device']})"
        print(f"{what:<34} {r['batch']:>5} {r['ms_per_step']:>9.1f} {r['tokens_per_s']:>10.0f} "
              f"{peak:>9} {('%.1f%%' % (100 * mfu)) if mfu else '-':>6}")
    for want in args.expect:
        mode, batch = want.split(":")
        if not any(r.get("part") == "train" and r["mode"] == mode and str(r["batch"]) == batch for r in recs):
            print(f"{'PyTorch ' + mode + ' bf16 autocast':<34} {batch:>5}  did not finish in its time budget")
    # `cohort bench train --json` lines: "bench": "train"; no device memory figure yet.
    for r in recs:
        if r.get("bench") != "train":
            continue
        fpt = r["flops_per_step"] / (r["batch"] * r["seq"])
        mfu = (r["tokens_per_s"] * fpt / (rate * 1e12)) if rate else None
        what = f"cohort {r['config']} T={r['seq']} {r['precision']} ({r['device']})"
        print(f"{what:<34} {r['batch']:>5} {r['ms_per_step']:>9.1f} {r['tokens_per_s']:>10.0f} "
              f"{'-':>9} {('%.1f%%' % (100 * mfu)) if mfu else '-':>6}")
    for want in args.expect_cohort:
        config, seq, batch, prec = want.split(":")
        if not any(r.get("bench") == "train" and r["config"] == config and str(r["seq"]) == seq
                   and str(r["batch"]) == batch and r["precision"] == prec for r in recs):
            what = f"cohort {config} T={seq} {prec}"
            print(f"{what:<34} {batch:>5}  did not run (see its part above)")
    for r in recs:
        if r.get("part") == "compare":
            verdict = "complete" if r["complete"] else "INCOMPLETE"
            mx = r["max_abs_diff"]
            print(f"cohort train, {r['compared']} steps {r['label']} vs cpu: max |loss diff| "
                  f"{mx if mx is None else '%.2e' % mx} ({verdict})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)
    m = sub.add_parser("matmul")
    m.add_argument("--size", type=int, default=8192)
    m.add_argument("--budget-s", type=float, default=10)
    t = sub.add_parser("train")
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--mode", choices=["eager", "compile"], default="eager")
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--budget-s", type=float, default=40, help="stop timing steps after this long (from start)")
    for p in (m, t):
        p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, to check the script")
        p.add_argument("--out", help="append the JSON line to this file")
    tb = sub.add_parser("table")
    tb.add_argument("results")
    tb.add_argument("--expect", nargs="*", default=[], help="mode:batch parts that should be there")
    tb.add_argument("--expect-cohort", nargs="*", default=[],
                    help="config:seq:batch:precision cohort rows that should be there")
    c = sub.add_parser("compare")
    c.add_argument("cpu", help="the --log-dir of the cpu run")
    c.add_argument("device", help="the --log-dir of the device run")
    c.add_argument("--label", default="cuda")
    c.add_argument("--out", help="append the JSON line to this file")
    args = ap.parse_args()
    parts = {"matmul": part_matmul, "train": part_train, "table": part_table, "compare": part_compare}
    parts[args.part](args)


if __name__ == "__main__":
    main()
