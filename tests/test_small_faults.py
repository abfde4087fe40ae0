"""Issue 30, item 6: the smaller faults, in one process (the distributed ones are in
``tests/distributed/test_schedule_agreement.py`` and ``test_disagreement_exit.py``;
``kaisa plan``'s in ``tests/distributed/test_plan_cli.py``).

* Gradient checkpointing (``torch.utils.checkpoint``, either kind) gives the
  factors of the model without it, and no "forward without a backward"
  warning: a recomputation is not a pass.
* A 0-d tensor ``lr`` (compiled optimizers) is accepted and followed in
  place; a schedule may return one; other tensors are refused by name.
* Pickling or copying a preconditioner is a ``TypeError`` naming
  ``state_dict()``.
* ``KAISA_*_TIMEOUT_S`` beyond a week (``1e300``, ``inf``) is a
  ``ValueError`` naming the variable, not an ``OverflowError``.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import kaisa

D = torch.float64


class Net(nn.Module):
    """Two linear layers and a convolution; ``mode`` checkpoints the middle of it."""

    def __init__(self, mode: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.hidden = nn.Linear(3 * 4 * 4, 8)
        self.out = nn.Linear(8, 3)
        self.mode = mode
        self.to(D)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.hidden(torch.tanh(self.conv(x)).flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode is None:
            h = self.body(x)
        else:
            h = checkpoint(self.body, x, use_reentrant=self.mode == "reentrant")
        return self.out(h)


def _train(mode: str | None, **options: Any) -> tuple[list[torch.Tensor], list[str]]:
    """Three factor-update steps; every layer's factors and the warnings kaisa gave."""
    model = Net(mode)
    options = {
        "factor_update_steps": 1,
        "inv_update_steps": 1,
        "curvature": "exact",
        "factor_decay": 0.5,
        "lr": 0.1,
        **options,
    }
    pre = kaisa.KFACPreconditioner(model, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    passes = options.get("accumulation_steps", 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            opt.zero_grad()
            for micro in range(passes):
                gen = torch.Generator().manual_seed(10 * step + micro)
                x = torch.randn(6, 2, 4, 4, generator=gen, dtype=D)
                # (The reentrant kind needs an input that requires a gradient.)
                x.requires_grad_(mode == "reentrant")
                y = torch.randint(0, 3, (6,), generator=gen)
                F.cross_entropy(model(x), y).backward()
            pre.step()
            opt.step()
    factors = [f.clone() for layer in pre.layers for f in (layer.block.a, layer.block.g)]
    return factors, [str(w.message) for w in caught if "kaisa" in str(w.message)]


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize(
    "options",
    [{}, {"update_factors_in_hook": False}, {"accumulation_steps": 2}],
    ids=["hook", "at-step", "accumulation"],
)
def test_gradient_checkpointing_gives_the_factors_without_it(
    mode: str, options: dict[str, Any]
) -> None:
    reference, clean = _train(None, **options)
    factors, caught = _train(mode, **options)
    assert clean == []
    # Before: "1 layer(s) ran forward without a backward pass" at every factor step.
    assert caught == []
    assert len(factors) == len(reference) == 6
    for got, want in zip(factors, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_a_forward_without_backward_inside_checkpointing_is_still_reported() -> None:
    """A real forward whose backward never runs is still dropped and reported."""
    model = Net("non-reentrant")
    pre = kaisa.KFACPreconditioner(
        model,
        factor_update_steps=1,
        inv_update_steps=1,
        curvature="exact",
        lr=0.1,
    )
    x = torch.randn(4, 2, 4, 4, dtype=D)
    model(x)  # never backpropagated
    F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long)).backward()
    with pytest.warns(RuntimeWarning, match="3 layer.s. ran forward without a backward pass"):
        pre.step()


# -- a 0-d tensor lr ---------------------------------------------------------------


def _preconditioned(lr: object, steps: int = 2) -> list[torch.Tensor]:
    """The gradients after ``step()``, with KL clipping active (a large ``lr``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)).to(D)
    pre = kaisa.KFACPreconditioner(
        model, lr=lr, kl_clip=1e-4, factor_update_steps=1, inv_update_steps=1, curvature="exact"
    )
    grads = []
    for step in range(steps):
        model.zero_grad()
        gen = torch.Generator().manual_seed(step)
        model(torch.randn(8, 5, generator=gen, dtype=D)).square().sum().backward()
        pre.step()
        grads += [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return grads


def test_a_0d_tensor_lr_is_the_same_as_the_number() -> None:
    reference = _preconditioned(0.5)
    # (The lr matters: KL clipping is active.)
    assert not torch.allclose(_preconditioned(0.05)[0], reference[0])
    for lr in (
        torch.tensor(0.5),
        torch.tensor(0.5, dtype=D),
        lambda step: torch.tensor(0.5),  # a schedule returning a tensor
    ):
        for got, want in zip(_preconditioned(lr), reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)


def test_a_tensor_lr_is_followed_in_place() -> None:
    """A compiled optimizer's scheduler writes its lr tensor in place: kaisa reads it each step."""
    model = nn.Linear(3, 2)
    lr = torch.tensor(0.01)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    pre = kaisa.KFACPreconditioner(model, lr=opt.param_groups[0]["lr"])
    seen = []
    for _ in range(3):
        model(torch.randn(4, 3)).sum().backward()
        seen.append(pre.hyperparameter("lr"))
        pre.step()
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.01, 0.005, 0.0025])
    assert "lr=tensor(" in repr(pre)


@pytest.mark.parametrize(
    ("lr", "error", "fragment"),
    [
        (torch.tensor([0.1, 0.2]), ValueError, "or a 0-d real tensor; got a tensor of shape (2,)"),
        (torch.tensor([[0.1]]), ValueError, "got a tensor of shape (1, 1)"),
        (torch.tensor(float("nan")), ValueError, "lr must be a number >= 0; got nan"),
        (torch.tensor(float("inf")), ValueError, "lr must be a number >= 0; got inf"),
        (torch.tensor(-0.1), ValueError, "lr must be a number >= 0; got -0.1"),
        (torch.tensor(True), TypeError, "got a tensor of dtype bool"),
        (torch.tensor(1 + 1j), TypeError, "got a tensor of dtype complex64"),
    ],
)
def test_other_tensors_are_refused_by_name(lr: torch.Tensor, error: type, fragment: str) -> None:
    with pytest.raises(error, match=r"^lr must be") as raised:
        kaisa.KFACPreconditioner(nn.Linear(3, 2), lr=lr)
    assert fragment in str(raised.value)


def test_a_tensor_lr_turned_bad_raises_at_the_step_and_changes_nothing() -> None:
    model = nn.Linear(3, 2)
    lr = torch.tensor(0.1)
    pre = kaisa.KFACPreconditioner(
        model, lr=lr, factor_update_steps=1, inv_update_steps=1, curvature="exact"
    )
    model(torch.randn(4, 3)).sum().backward()
    pre.step()
    a_before = pre.layers[0].block.a.clone()
    lr.fill_(float("nan"))
    model(torch.randn(4, 3)).sum().backward()
    grad = model.weight.grad.clone()
    with pytest.raises(
        ValueError, match=r"lr must be .* \(the tensor's value at step 1\); got nan"
    ):
        pre.step()
    assert pre.steps == 1 and torch.equal(pre.layers[0].block.a, a_before)
    assert torch.equal(model.weight.grad, grad)
    schedule: Callable[[int], object] = lambda step: torch.ones(2)  # noqa: E731
    with pytest.raises(ValueError, match=r"the schedule returned it at step 0\); got a tensor"):
        kaisa.KFACPreconditioner(nn.Linear(3, 2), damping=schedule, lr=0.1).step()


# -- pickle ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "copier",
    [pickle.dumps, copy.deepcopy, copy.copy, lambda pre: torch.save(pre, io.BytesIO())],
    ids=["pickle", "deepcopy", "copy", "torch.save"],
)
def test_pickling_the_preconditioner_points_at_state_dict(copier: Callable[[Any], Any]) -> None:
    model = nn.Linear(3, 2)
    pre = kaisa.KFACPreconditioner(model, factor_update_steps=1, lr=0.1)
    with pytest.raises(TypeError, match="cannot be pickled or copied") as raised:
        copier(pre)
    assert "state_dict()" in str(raised.value) and "load_state_dict()" in str(raised.value)
    assert "local" not in str(raised.value)
    # Nothing changed: it still works, and its state dict pickles.
    model(torch.randn(4, 3)).sum().backward()
    pre.step()
    assert pickle.loads(pickle.dumps(pre.state_dict()))["steps"] == 1


# -- timeouts from the environment -------------------------------------------------


@pytest.mark.parametrize("variable", ["KAISA_AGREEMENT_TIMEOUT_S", "KAISA_COLLECTIVE_TIMEOUT_S"])
def test_timeouts_beyond_a_week_name_the_variable(
    variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kaisa.distributed.agreement import MAX_TIMEOUT_S, agreement_timeout
    from kaisa.distributed.comm import collective_timeout

    read = agreement_timeout if variable.startswith("KAISA_AGREEMENT") else collective_timeout
    monkeypatch.setenv(variable, "604800")
    assert read() == MAX_TIMEOUT_S == 7 * 24 * 3600
    for bad in ("1e300", "604801", "inf", "-inf", "nan", "0", "1e-400", "soon"):
        monkeypatch.setenv(variable, bad)
        with pytest.raises(ValueError, match=f"^{variable} must be a number of seconds > 0 and"):
            read()
