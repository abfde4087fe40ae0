"""Does the outlier guard refuse anything on clean data? (issue 17, item 8)

Trains each suite workload's network for three epochs' worth of steps (1400,
batch 128) on Fashion-MNIST with SGD + kaisa at its defaults and prints how
many factor updates the outlier guard refused (and how many were skipped as
non-finite). Zero refusals means the guard changed nothing on that run: the
same factors, bit for bit, as without it.

    python benchmarks/outlier_guard_clean.py
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

import kaisa
from kaisa.demo.data import load_fashion_mnist
from kaisa.models import build_model

WORKLOADS = (("gap_cnn", 0.05), ("small_cnn", 0.0125), ("vit", 0.05))  # suite kaisa-sgd LRs
STEPS = 1400


def main() -> None:
    warnings.simplefilter("ignore")  # the budget's notes are not the point here
    data = load_fashion_mnist()
    for name, lr in WORKLOADS:
        torch.manual_seed(0)
        model = build_model(name, in_channels=1)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        pre = kaisa.KFACPreconditioner(model, lr=lr)
        batches = torch.Generator().manual_seed(0)
        for _ in range(STEPS):
            idx = torch.randint(0, data.train_x.shape[0], (128,), generator=batches)
            opt.zero_grad()
            F.cross_entropy(model(data.train_x[idx]), data.train_y[idx]).backward()
            pre.step()
            opt.step()
        interval = pre.hyperparameter("factor_update_steps")
        assert interval is not None
        print(
            f"{name}: {STEPS // int(interval)} factor updates, "
            f"{pre.telemetry.outlier_factor_updates} refused as outliers, "
            f"{pre.telemetry.skipped_factor_updates} skipped as non-finite"
        )


if __name__ == "__main__":
    main()
