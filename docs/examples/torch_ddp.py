"""A torch.distributed program as a user writes it: env:// rendezvous with
gloo, a DistributedSampler, all_reduce and a few DDP steps.

    cohort run -n 2 -- python3 docs/examples/torch_ddp.py
    torchrun --nproc-per-node 2 docs/examples/torch_ddp.py

The tests run it under both launchers and compare their outputs.
Every line it prints starts with its rank and is the same under any launcher
that sets torchrun's environment."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


@record
def main():
    if os.environ.get("FAIL_ON_RANK") == os.environ["RANK"]:
        raise ValueError(f"rank {os.environ['RANK']} was told to fail")
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    # One write(2) per line (print may make two), so that two ranks sharing one pipe, as
    # under torchrun, never interleave within a line.
    def out(*a):
        sys.stdout.flush()
        os.write(1, (f"rank {rank}/{world}: " + " ".join(map(str, a)) + "\n").encode())
    out("local rank", os.environ["LOCAL_RANK"], "of", os.environ["LOCAL_WORLD_SIZE"],
        "restart", os.environ.get("TORCHELASTIC_RESTART_COUNT"),
        "max restarts", os.environ.get("TORCHELASTIC_MAX_RESTARTS"),
        "launched by torchelastic", dist.is_torchelastic_launched())

    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    out("all_reduce sum", x.item())

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 8), torch.randn(40, 1))
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    sampler.set_epoch(1)
    out("sampler indices", list(sampler))

    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for xb, yb in DataLoader(data, batch_size=5, sampler=sampler):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
    total = sum(p.detach().double().sum().item() for p in model.parameters())
    out(f"parameters after DDP: {total:.6f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every line is already written (one write(2) each). Skip the interpreter's teardown:
    # torch's C++ threads sometimes abort the process there ("terminate called without an
    # active exception"), which would fail a run that did all its work.
    os._exit(0)
