"""Every warning kaisa gives points at the user's line, not into kaisa or torch.

Each case triggers one warning from this file and checks that the warning's
file is this file (``stacklevel`` counted through kaisa's own frames and
torch's ``no_grad`` wrapper).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)


def _loss(model: nn.Module) -> torch.Tensor:
    x, y = _batch()
    return F.cross_entropy(model(x), y)


class _Doubled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def overriding_subclass_at_construction() -> None:
    model = nn.Sequential(_Doubled(6, 4), nn.Linear(4, 2))
    kaisa.KFACPreconditioner(model, lr=0.1)


def forward_without_backward() -> None:
    model = _net()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, curvature="exact")
    _loss(model)  # never backpropagated
    _loss(model).backward()
    pre.step()


def abandoned_iteration() -> None:
    model = _net()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, curvature="exact")
    _loss(model).backward()  # no step(): the batch is skipped
    _loss(model).backward()
    pre.step()


def fewer_passes_than_accumulation_steps() -> None:
    model = _net()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, curvature="exact", accumulation_steps=2)
    _loss(model).backward()
    pre.step()


def failed_decomposition(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _net()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, curvature="exact")

    def broken(*_: object, **__: object) -> None:
        raise torch.linalg.LinAlgError("forced")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    _loss(model).backward()
    pre.step()


def budget_not_met() -> None:
    model = nn.Linear(6, 3)
    pre = kaisa.KFACPreconditioner(model, lr=0.1, time_budget=1e-9)
    F.cross_entropy(model(torch.randn(2, 6)), torch.tensor([0, 1])).backward()
    pre.step()


def no_gradient_anywhere() -> None:
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = kaisa.KFACPreconditioner(model, lr=0.1, curvature="exact")
    _loss(model).backward()
    optimizer.zero_grad()  # before step(): nothing left to precondition
    pre.step()


def idle_layer() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(6, 3)
            self.functional = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # Its weight used outside its module call: it captures nothing.
            return self.used(x) + F.linear(x, self.functional.weight, self.functional.bias)

    model = Branchy()
    pre = kaisa.KFACPreconditioner(model, lr=0.1, curvature="exact")
    _loss(model).backward()
    pre.step()


CASES: dict[str, tuple[Callable[..., None], str]] = {
    "overriding subclass": (overriding_subclass_at_construction, "overrides nn.Linear.forward"),
    "forward without backward": (forward_without_backward, "without a backward pass"),
    "abandoned iteration": (abandoned_iteration, "captures are discarded"),
    "fewer passes": (fewer_passes_than_accumulation_steps, "accumulation_steps=2"),
    "failed decomposition": (failed_decomposition, "could not be decomposed"),
    "budget": (budget_not_met, "cannot be met"),
    "no gradient": (no_gradient_anywhere, "found no gradient"),
    "idle layer": (idle_layer, "captured nothing"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_warning_points_at_the_users_line(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    trigger, text = CASES[case]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if trigger is failed_decomposition:
            trigger(monkeypatch)
        else:
            trigger()
    mine = [w for w in caught if text in str(w.message)]
    assert mine, [str(w.message) for w in caught]
    for w in mine:
        assert w.filename == __file__, (case, w.filename, w.lineno)


def test_decisions_are_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    model = _net()
    with caplog.at_level("INFO", logger="kaisa"):
        pre = kaisa.KFACPreconditioner(model, lr=0.1)
        _loss(model).backward()
        pre.step()
    messages = [r.getMessage() for r in caplog.records if r.name == "kaisa"]
    assert any("2 layer(s) registered on rank 0 of 1" in m for m in messages), messages
    assert any("automatic curvature choice at step 0" in m for m in messages), messages
