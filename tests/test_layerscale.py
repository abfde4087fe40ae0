"""The outlier guard against a LayerScale (ConvNeXt, CaiT): genuine growth is taken in.

A LayerScale ``γ`` starts at 1e-6; the output gradients of the layers it
scales, and so their ``G`` factors, are proportional to ``γ²`` and grow by
orders of magnitude in the first optimizer steps. That growth lasts: it must
be folded (at the cost of at most one held factor update per layer), never
refused as an outlier batch, while a single outlier batch among ordinary
ones is still refused.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.curvature.block import OUTLIER_RATIO


class LayerScaleNet(nn.Module):
    """A residual MLP block whose branch is scaled by ``γ`` (init 1e-6), as in ConvNeXt."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.gamma = nn.Parameter(torch.full((16,), 1e-6))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.gamma * self.fc2(F.gelu(self.fc1(h)))
        return self.head(h)


def _batch(seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)


def _g_trace(pre: kaisa.KFACPreconditioner, name: str) -> float:
    block = next(layer.block for layer in pre.layers if layer.name == name)
    return float(block.g.diagonal().sum())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("interval", [1, 3])
def test_layer_scale_growth_is_taken_in_and_a_spike_is_still_refused(interval: int) -> None:
    model = LayerScaleNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    pre = kaisa.KFACPreconditioner(
        model,
        optimizer=opt,
        curvature="exact",
        factor_update_steps=interval,
        inv_update_steps=interval,
    )
    traces: list[float] = []
    held_in_a_row = {layer.name: 0 for layer in pre.layers}

    def step(seed: int, scale: float = 1.0) -> None:
        x, y = _batch(seed, scale)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
        for layer in pre.layers:
            held_in_a_row[layer.name] = max(held_in_a_row[layer.name], layer.block.outliers)
        assert torch.isfinite(model.fc2.weight).all()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no outlier warning, nothing else either
        for seed in range(12 * interval):
            step(seed)
            if seed % interval == 0:
                traces.append(_g_trace(pre, "fc2"))
    gamma = float(model.gamma.detach().abs().mean())
    assert gamma > 1e-3  # γ grew by three orders of magnitude ...
    assert traces[-1] > 1e6 * traces[0]  # ... and fc2's G followed it (γ²)
    assert pre.telemetry.outlier_factor_updates == 0
    assert max(held_in_a_row.values()) <= 1  # at most one update held at a time
    # After the one held update the average follows the growth step by step.
    assert all(later < OUTLIER_RATIO * earlier for earlier, later in itertools.pairwise(traces[2:]))

    # One outlier batch (inputs x 1e4) among ordinary ones is still refused.
    embed = next(layer.block for layer in pre.layers if layer.name == "embed")
    before = float(embed.a.diagonal().sum())
    for k in range(interval):
        step(1000 + k, scale=1e4 if k == 0 else 1.0)
    assert embed.outliers == 1  # held back
    assert float(embed.a.diagonal().sum()) == pytest.approx(before)
    with pytest.warns(RuntimeWarning, match="outlier batch"):
        for k in range(interval):
            step(2000 + k)
    # Every layer's A took the spike (all are downstream of the inputs).
    assert pre.telemetry.outlier_factor_updates == len(pre.layers)
    assert float(embed.a.diagonal().sum()) < 10 * before  # the spike never entered


@pytest.mark.timeout(60)
def test_layer_scale_with_the_defaults_warns_of_no_outlier() -> None:
    """kaisa's defaults (automatic representations and intervals) over 60 steps."""
    model = LayerScaleNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    pre = kaisa.KFACPreconditioner(model, optimizer=opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(60):
            x, y = _batch(seed)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            opt.step()
    assert float(model.gamma.detach().abs().mean()) > 1e-3
    assert pre.telemetry.outlier_factor_updates == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
