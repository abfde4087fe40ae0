"""Two-line K-FAC in an ordinary training loop; runs alone or under torchrun.

    python examples/ddp_digits.py
    torchrun --standalone --nproc-per-node 2 examples/ddp_digits.py --fraction 0.5

Trains a small MLP on scikit-learn's digits with SGD + KAISA and prints the
training loss. Under torchrun the model is wrapped in DDP (gloo) and each rank
sees its own shard of every batch.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import kaisa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fraction", type=float, default=1.0, help="grad_worker_fraction")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.set_num_threads(1 if distributed else 2)
    torch.manual_seed(0)

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    model: nn.Module = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    preconditioner = kaisa.KFACPreconditioner(  # line one
        model,
        optimizer=optimizer,  # KL clipping reads its lr at every step
        damping=0.01,
        factor_update_steps=1,
        inv_update_steps=10,
        grad_worker_fraction=args.fraction,
    )

    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        batch = torch.randint(0, len(x), (64 * world,), generator=gen)
        mine = batch[rank::world]  # this rank's shard of the global batch
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[mine]), y[mine])
        loss.backward()
        preconditioner.step()  # line two
        optimizer.step()
        if rank == 0 and step % 50 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    if rank == 0:
        with torch.no_grad():
            print(f"final training loss {F.cross_entropy(model(x), y).item():.4f}")
        print(
            f"plan: {preconditioner.plan.strategy_name}, {preconditioner.plan.grad_workers} "
            f"gradient worker(s) per layer; memory {preconditioner.memory_usage()}"
        )
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
