"""The plain loop the framework integrations stand for, shared by their tests.

``DDP(model)`` (with a process group) or the bare model, SGD with momentum
and a step schedule that halves the learning rate every two steps,
``KFACPreconditioner`` with exact Kronecker blocks and KL clipping on (its
``lr`` read from the optimizer, so a stale one would be caught); with
accumulation each micro-batch loss is divided by the passes and the
non-final passes run under ``no_sync``; under AMP a CPU ``GradScaler``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import kaisa

SEED = 7
LR = 0.2
STEPS = 4  # optimizer steps per run
BATCH = 8
#: Exact Kronecker blocks, inverses every other step, KL clipping on
#: (kl_clipped_steps > 0 is checked).
OPTIONS: dict[str, Any] = {
    "curvature": "exact",
    "factor_update_steps": 1,
    "inv_update_steps": 2,
    "kl_clip": 1e-3,
}
TOL64 = 1e-10
TOL32 = 1e-6

Batches = list[tuple[torch.Tensor, torch.Tensor]]
#: ``loss(model, x, y, amp)``: one micro-batch's loss as the framework computes it.
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def net(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def batches(rank: int, count: int, dtype: torch.dtype) -> Batches:
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (
            torch.randn(BATCH, 8, generator=g, dtype=dtype),
            torch.randint(0, 4, (BATCH,), generator=g),
        )
        for _ in range(count)
    ]


def optimizer_and_schedule(
    params: Any,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=tol, rtol=0, msg=name)


def moved(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def reference(
    data: Batches,
    accumulation: int,
    loss_fn: LossFn,
    dtype: torch.dtype = torch.float64,
    *,
    kfac: bool = True,
    amp: bool = False,
    unscale_first: bool = True,
    clip: float = 0.0,
) -> tuple[dict[str, torch.Tensor], int]:
    """The plain loop: weights after it and the number of KL-clipped steps.

    ``clip > 0``: the preconditioned gradients are clipped to that norm.
    """
    module = net(dtype)
    model: nn.Module = DistributedDataParallel(module) if dist.is_initialized() else module
    optimizer, schedule = optimizer_and_schedule(model.parameters())
    scaler = torch.amp.GradScaler("cpu") if amp else None
    pre = (
        kaisa.KFACPreconditioner(
            model,
            lr=lambda step: optimizer.param_groups[0]["lr"],
            accumulation_steps=accumulation,
            grad_scaler=scaler,
            **OPTIONS,
        )
        if kfac
        else None
    )
    for start in range(0, len(data), accumulation):
        optimizer.zero_grad()
        for i, (x, y) in enumerate(data[start : start + accumulation]):
            last = i == accumulation - 1
            sync = (
                model.no_sync() if isinstance(model, DistributedDataParallel) and not last else None
            )
            with sync or contextlib.nullcontext():
                loss = loss_fn(model, x, y, amp) / accumulation
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None and unscale_first:
            scaler.unscale_(optimizer)
        if pre is not None:
            with warnings.catch_warnings():
                if not unscale_first:
                    warnings.simplefilter("ignore")  # kaisa: "call scaler.unscale_ first"
                pre.step()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        schedule.step()
    clipped = pre.telemetry.kl_clipped_steps if pre is not None else 0
    return weights(module), clipped


def lightning_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, amp: bool) -> torch.Tensor:
    """Lightning's '16-mixed': the training step (forward and loss) under autocast."""
    autocast = torch.autocast("cpu", dtype=torch.float16, cache_enabled=False)
    with autocast if amp else contextlib.nullcontext():
        return F.cross_entropy(model(x), y)


def accelerate_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, amp: bool) -> torch.Tensor:
    """accelerate's prepared model: forward under autocast, outputs in float32, loss outside."""
    autocast = torch.autocast("cpu", dtype=torch.float16)
    with autocast if amp else contextlib.nullcontext():
        out = model(x)
    return F.cross_entropy(out.float() if amp else out, y)
