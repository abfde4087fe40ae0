"""Ranks given different schedules fail fast, naming the hyperparameter (issue 30, item 6d).

Schedules (callables) and 0-d tensors cannot be compared at construction as
constants are: their values at step 0 are, and their later values at the
end of the ``step()`` before (one tiny all-gather): at every step when an
interval is a schedule, else only before factor or inverse update steps.
Two gloo ranks with schedules that differ from some step on must both
raise :class:`~kaisa.distributed.agreement.RankDisagreementError`
naming the hyperparameter, the step and both values, at that step, instead
of drifting apart silently (a different ``lr`` changes KL clipping) or
mismatching their collectives (a different factor interval); ranks with
the same schedules train in step. All cases run in one launch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from harness import average_gradients, run_distributed
from torch import nn

import kaisa
from kaisa.distributed.agreement import RankDisagreementError

STEPS = 5


def _lr_changes_at(at: int, rank: int) -> Callable[[int], float]:
    return lambda step: 0.1 if rank == 0 or step < at else 0.2


def _factor_interval_changes_at_2(rank: int) -> Callable[[int], int]:
    return lambda step: 1 if rank == 0 or step < 2 else 2


def _inverse_interval_at_0(rank: int) -> Callable[[int], int]:
    return lambda step: 1 + rank


EVERY_4 = {"factor_update_steps": 4, "inv_update_steps": 4}

#: name -> (options for a rank, step at which the rank changes its tensor lr, expected text).
CASES: dict[str, tuple[Callable[[int], dict[str, Any]], int | None, str | None]] = {
    "same schedules": (lambda rank: {"lr": lambda step: 0.1 / (1 + step)}, None, None),
    "lr from step 3": (
        lambda rank: {"lr": _lr_changes_at(3, rank)},
        None,
        "ranks disagree on lr at step 3: rank 0 has 0.1, rank 1 has 0.2",
    ),
    # Constant intervals: the values are compared before update steps only
    # (no collective on the others), so a difference from step 1 is named at 4.
    "lr from step 1, updates every 4": (
        lambda rank: {"lr": _lr_changes_at(1, rank), **EVERY_4},
        None,
        "ranks disagree on lr at step 4: rank 0 has 0.1, rank 1 has 0.2",
    ),
    "same lr schedule, updates every 4": (
        lambda rank: {"lr": lambda step: 0.1 / (1 + step), **EVERY_4},
        None,
        None,
    ),
    "factor interval from step 2": (
        lambda rank: {"factor_update_steps": _factor_interval_changes_at_2(rank)},
        None,
        "ranks disagree on factor_update_steps at step 2: rank 0 has 1, rank 1 has 2",
    ),
    "inverse interval at step 0": (
        lambda rank: {"inv_update_steps": _inverse_interval_at_0(rank)},
        None,
        "inv_update_steps (at step 0): rank 0 has 1, rank 1 has 2",
    ),
    "tensor lr changed on one rank": (
        lambda rank: {"lr": torch.tensor(0.1, dtype=torch.float64)},
        1,
        # (A tensor is read at the end of each step: changed after step 1, it
        # is seen at the end of step 2, which used it.)
        "ranks disagree on lr at step 3: rank 0 has 0.1, rank 1 has 0.3",
    ),
}


def _cases(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, (options, changes_at, _) in CASES.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        kwargs = {
            "factor_update_steps": 1,
            "inv_update_steps": 1,
            "factor_decay": 0.9,
            "kl_clip": 1e-3,
            "curvature": "exact",
            "lr": 0.1,  # (the cases that vary lr override it)
            **options(rank),
        }
        result: dict[str, Any] = {"error": None, "steps": 0}
        try:
            pre = kaisa.KFACPreconditioner(model, **kwargs)
        except RankDisagreementError as error:
            out[name] = {**result, "error": str(error), "at": "construction"}
            continue
        try:
            for step in range(STEPS):
                gen = torch.Generator().manual_seed(10 * step + rank)
                model(torch.randn(5, 4, generator=gen)).square().sum().backward()
                average_gradients(model, world_size)
                pre.step()
                opt.step()
                opt.zero_grad()
                if changes_at == step and rank == 1:
                    kwargs["lr"].fill_(0.3)
        except RankDisagreementError as error:
            result.update(error=str(error), at=f"step {pre.steps}")
        result["steps"] = pre.steps
        result["exchanges"] = pre._schedules.exchanges
        result["weights"] = [p.detach().clone() for p in model.parameters()]
        pre.remove_hooks()
        out[name] = result
    return out


def test_different_schedules_fail_fast_on_every_rank_naming_the_option() -> None:
    first, second = run_distributed(_cases, 2, timeout=120)
    for name, (_, _, expected) in CASES.items():
        a, b = first[name], second[name]
        if expected is None:
            assert a["error"] is None and b["error"] is None, (name, a["error"], b["error"])
            assert a["steps"] == b["steps"] == STEPS
            for wa, wb in zip(a["weights"], b["weights"], strict=True):
                assert torch.equal(wa, wb)
            # Updates every step: compared at each; every 4: only before step 4.
            expected_exchanges = 1 if "every 4" in name else STEPS
            assert a["exchanges"] == b["exchanges"] == expected_exchanges, (name, a)
            continue
        for rank, result in enumerate((a, b)):
            assert result["error"] is not None, f"{name}: rank {rank} did not raise"
            assert expected in result["error"], f"{name}: rank {rank}: {result['error']}"
        # The same error at the same point on both ranks, before the step that differs.
        assert a["error"] == b["error"] and a["at"] == b["at"], (a, b)
        if a["at"] != "construction":
            step = int(expected.split(" at step ")[1].split(":")[0])
            assert a["steps"] == b["steps"] == step
