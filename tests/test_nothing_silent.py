"""Nothing silent (issue 30, item 4), in one process.

* The model left in evaluation mode while gradients exist: one warning that
  names the cause and the fix (``model.train()``); an evaluation loop between
  training steps says nothing.

(On several ranks, one rank in evaluation mode: ``tests/distributed/test_eval_mode.py``.)
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(6, 4, generator=gen), torch.randint(0, 3, (6,), generator=gen)


def make(net: nn.Module, **options: object) -> kaisa.KFACPreconditioner:
    settings: dict[str, object] = {
        "curvature": "exact",
        "factor_update_steps": 1,
        "inv_update_steps": 1,
    }
    settings.update(options)
    return kaisa.KFACPreconditioner(net, **settings)  # type: ignore[arg-type]


def backward(net: nn.Module, seed: int = 0) -> None:
    x, y = batch(seed)
    F.cross_entropy(net(x), y).backward()


def hooks(net: nn.Module) -> int:
    """Forward and forward-pre hooks on every module of ``net``."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules())


def messages(caught: list[warnings.WarningMessage], text: str) -> list[str]:
    return [str(w.message) for w in caught if text in str(w.message)]


# -- evaluation mode -----------------------------------------------------------------


def test_eval_mode_with_gradients_warns_once() -> None:
    net = model()
    pre = make(net)
    net.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            net.zero_grad()
            backward(net, step)
            raw = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
            pre.step()
            # Nothing was captured: the gradients stay raw.
            assert all(torch.equal(p.grad, r) for p, r in zip(net.parameters(), raw, strict=True))
    found = messages(caught, "evaluation mode")
    assert len(found) == 1, [str(w.message) for w in caught]
    assert "model.train()" in found[0]
    # Back in training mode, kaisa preconditions again.
    net.train()
    net.zero_grad()
    backward(net)
    raw = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    pre.step()
    assert not torch.equal(net[0].weight.grad, raw[0])


def test_eval_mode_of_the_registered_layers_is_reported_too() -> None:
    """A wrapper whose own flag says training while every registered layer evaluates."""
    net = model()
    wrapper = nn.Sequential(net)
    pre = make(wrapper)
    net.eval()
    with pytest.warns(RuntimeWarning, match=r"evaluation mode.*model\.train\(\)"):
        backward(wrapper)
        pre.step()


def test_evaluation_between_training_steps_is_silent() -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    pre = make(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            optimizer.zero_grad()
            backward(net, step)
            pre.step()
            optimizer.step()
            net.eval()
            with torch.no_grad():
                net(batch(10 + step)[0])
            net.train()
        # step() with no forward at all in training mode (twice after one backward).
        pre.step()
