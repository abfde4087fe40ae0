"""K-FAC helps on real data: scikit-learn's digits, fixed seed, same lr and steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa

sklearn_datasets = pytest.importorskip("sklearn.datasets")


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    data = sklearn_datasets.load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    return (x - x.mean(0)) / (x.std(0) + 1e-3), torch.tensor(data.target)


def train(use_kfac: bool, steps: int = 150, lr: float = 0.05) -> float:
    torch.manual_seed(0)
    x, y = digits()
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    pre = (
        kaisa.KFACPreconditioner(
            model, lr=lr, damping=0.01, factor_update_steps=1, inv_update_steps=10, kl_clip=None
        )
        if use_kfac
        else None
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (64,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        if pre is not None:
            pre.step()
        opt.step()
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def test_kfac_reaches_lower_training_loss_than_sgd() -> None:
    sgd = train(use_kfac=False)
    kfac = train(use_kfac=True)
    print(f"training loss after 150 steps: SGD {sgd:.4f}, SGD+K-FAC {kfac:.4f}")
    assert kfac < 0.5 * sgd, (sgd, kfac)
