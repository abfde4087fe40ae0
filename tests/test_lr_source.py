"""KL clipping's learning rate: given (``lr=``), read from the optimizer, or refused.

The published implementation's ``lr=0.1`` default made KL clipping assume a
rate the optimizer may not use, silently; kaisa takes ``optimizer=`` (its
current ``param_groups[0]['lr']`` at every step) or ``lr=``, and refuses
neither while clipping is on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.options import OptimizerLR


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double()


def _train(how: str, steps: int = 6) -> tuple[dict[str, torch.Tensor], kaisa.KFACPreconditioner]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    lr_source = {
        "optimizer": {"optimizer": opt},
        "callable": {"lr": lambda step: opt.param_groups[0]["lr"]},
        "constant": {"lr": 0.5},
    }[how]
    pre = kaisa.KFACPreconditioner(
        model, curvature="exact", factor_update_steps=1, inv_update_steps=1, **lr_source
    )
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
        schedule.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, pre


def test_kl_clipping_without_a_learning_rate_is_refused_naming_the_ways_out() -> None:
    model = _net()
    with pytest.raises(ValueError) as caught:
        kaisa.KFACPreconditioner(model)
    message = str(caught.value)
    for needed in ("kl_clip=0.003", "optimizer=", "lr=", "kl_clip=None"):
        assert needed in message
    with pytest.raises(ValueError, match=r"KL clipping \(kl_clip=0.01\)"):
        kaisa.KFACPreconditioner.with_reference_defaults(model, kl_clip=0.01)
    # A wrong argument is named before the missing one.
    with pytest.raises(ValueError, match="damping"):
        kaisa.KFACPreconditioner(model, damping=-1.0)


def test_without_kl_clipping_no_learning_rate_is_needed() -> None:
    model = _net()
    pre = kaisa.KFACPreconditioner(model, kl_clip=None)
    F.cross_entropy(
        model(torch.randn(4, 6, dtype=torch.float64)), torch.tensor([0, 1, 2, 0])
    ).backward()
    pre.step()
    assert pre.steps == 1 and "lr=" not in repr(pre) and "kl_clip=None" in repr(pre)


def test_the_optimizer_s_learning_rate_is_read_at_every_step() -> None:
    via_optimizer, pre = _train("optimizer")
    via_callable, _ = _train("callable")
    stale, _ = _train("constant")
    assert pre.telemetry.kl_clipped_steps > 0
    for name in via_callable:
        torch.testing.assert_close(via_optimizer[name], via_callable[name], rtol=0, atol=0)
    # Teeth: KL clipping at the initial rate throughout (the scheduler cut it
    # by 10 and 100) ends elsewhere.
    assert max(float((stale[k] - via_optimizer[k]).abs().max()) for k in stale) > 1e-3
    assert "<SGD.param_groups[0]['lr']>" in repr(pre)


def test_lr_and_optimizer_together_or_a_non_optimizer_are_refused() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"either as lr= or as optimizer=.*not both"):
        kaisa.KFACPreconditioner(model, lr=0.1, optimizer=opt)
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer.*got Linear"):
        kaisa.KFACPreconditioner(model, optimizer=nn.Linear(2, 2))  # type: ignore[arg-type]

    class NoRate:
        def __init__(self) -> None:
            self.param_groups = [{"params": []}]

    with pytest.raises(ValueError, match="has no 'lr' in param_groups"):
        OptimizerLR(NoRate())
