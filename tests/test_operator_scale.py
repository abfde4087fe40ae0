"""The deterministic operator-count scale of the automatic choice, and reproducible runs.

With ``calibrate_budget=False`` (the default) no clock informs the choice: the
allowance is scaled by the operator calls of the first training forward
(:func:`kaisa.curvature.budget.operator_scale`), so two runs with the same
seed give the same weights (issue 31, item 4).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import kaisa
from kaisa.curvature.budget import MAX_TIME_SCALE, BudgetChoice, operator_scale
from kaisa.curvature.costs import DEFAULT_COST_MODEL, CostModel


def test_operator_scale_rounds_down_to_powers_of_root_two() -> None:
    w = DEFAULT_COST_MODEL.operator
    assert operator_scale(1e9, 0) == 1.0
    assert operator_scale(1e9, 1e9 / w) == 2.0  # twice the work
    assert operator_scale(1e9, 0.9e9 / w) == pytest.approx(math.sqrt(2))
    assert operator_scale(1e9, 1e12) == MAX_TIME_SCALE
    assert operator_scale(0.0, 10) == 1.0  # no registered work: nothing to scale
    assert operator_scale(1e9, float("nan")) == 1.0
    cheap = CostModel(operator=1.0)
    assert operator_scale(1e9, 1e6, cost_model=cheap) == 1.0


class Tower(nn.Module):
    """A small model of many operators (the situation the count exists for)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.norms = nn.ModuleList(nn.LayerNorm(32) for _ in range(4))
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block, norm in zip(self.blocks, self.norms, strict=True):
            h = h + F.gelu(block(norm(h)))
        return self.head(h)


def _run(seed: int, steps: int = 12, **options: object) -> tuple[list[torch.Tensor], object]:
    torch.manual_seed(seed)
    model = Tower()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    pre = kaisa.KFACPreconditioner(model, **{"lr": 0.1, **options})  # type: ignore[arg-type]
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 5, (16,), generator=gen)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], pre.curvature_choice


def test_the_first_choice_is_scaled_by_the_forwards_operator_calls() -> None:
    _, choice = _run(0, steps=1)
    assert isinstance(choice, BudgetChoice)
    assert not choice.calibrated
    # 6 Linear layers, 4 norms, 4 GELUs, 4 additions: the count widens the allowance.
    assert choice.time_scale > 1.0
    free = _run(0, steps=1, cost_model=CostModel(operator=1e-12))[1]
    assert isinstance(free, BudgetChoice) and free.time_scale == 1.0


def test_two_runs_with_the_same_seed_give_the_same_weights() -> None:
    first, choice_a = _run(3)
    second, choice_b = _run(3)
    assert choice_a == choice_b
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_a_forward_that_raises_leaves_no_counting_mode_behind() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.fc(x)
            raise RuntimeError("user error")

    model = Broken()
    kaisa.KFACPreconditioner(model, lr=0.1)
    with pytest.raises(RuntimeError, match="user error"):
        model(torch.randn(3, 4))
    assert _get_current_dispatch_mode() is None


def test_the_choice_is_made_once_and_kept() -> None:
    """No clock: the choice of step 0 stands (no calibration reopens it)."""
    _, first = _run(5, steps=1)
    _, later = _run(5, steps=15)
    assert first == later
