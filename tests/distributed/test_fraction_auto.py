"""``grad_worker_fraction='auto'`` on 4 gloo processes: every rank chooses alike.

One launch runs every case (process start-up dominates the cost):

* the probe: every rank measures, the ranks reduce, and every rank holds the
  same speeds and the same choice;
* speeds given (:data:`~kaisa.distributed.fraction.LINK_ENV`): the choice is
  the one :func:`~kaisa.distributed.fraction.choose_stable` makes in this
  process for the same shapes, with and without a budget, and each rank's
  measured memory is the model's and within the budget;
* a budget no fraction meets: the same error on every rank;
* a rank given another fraction than ``'auto'``, or speeds given on one rank
  only: every rank raises
  :class:`~kaisa.distributed.agreement.RankDisagreementError` naming it;
* a checkpoint's choice wins over a new preconditioner's (same world size),
  and the restored run continues bit-identically; one that does not fit the
  new budget is refused, leaving the preconditioner unchanged.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from harness import run_distributed
from torch import nn

import kaisa
from kaisa.cli.shapes import module_layer_shapes
from kaisa.distributed.fraction import LINK_ENV, FractionModel, Link, choose_stable

WORLD = 4
#: Slow messages: COMM-OPT's one broadcast per ten steps beats a gradient broadcast per step.
SLOW = "latency=1e-3,bandwidth=1e9,compute=1e9"
#: Fast messages: HYBRID-OPT (m = 2) wins: half the preconditioning, a one-round broadcast.
FAST = "latency=1e-6,bandwidth=1e9,compute=1e9"
#: A budget between MEM-OPT's memory (32004 bytes) and COMM-OPT's (47012).
BUDGET = 40_000
OPTIONS: dict[str, Any] = {
    "grad_worker_fraction": "auto",
    "curvature": "exact",
    "factor_update_steps": 1,
    "inv_update_steps": 10,
    "lr": 0.1,
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 10)
    )


def _train(model: nn.Module, pre: kaisa.KFACPreconditioner, rank: int, steps: int) -> list[Any]:
    grads = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 * step + rank)
        model.zero_grad()
        model(torch.randn(8, 20, generator=generator)).pow(2).mean().backward()
        for p in model.parameters():  # gradients averaged over the ranks, as DDP would
            assert p.grad is not None
            torch.distributed.all_reduce(p.grad)
            p.grad.div_(WORLD)
        pre.step()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    return grads


def _choice(pre: kaisa.KFACPreconditioner) -> tuple[int, dict[str, float] | None]:
    link = pre.grad_worker_choice.link
    return pre.grad_worker_choice.grad_workers, None if link is None else link.to_dict()


def _cases(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = _model()
    os.environ.pop(LINK_ENV, None)
    pre = kaisa.KFACPreconditioner(model, **OPTIONS)
    out["probe"] = _choice(pre)
    pre.remove_hooks()

    for name, link, budget in (
        ("slow", SLOW, None),
        ("fast", FAST, None),
        ("slow_budget", SLOW, BUDGET),
    ):
        os.environ[LINK_ENV] = link
        pre = kaisa.KFACPreconditioner(model, memory_budget=budget, **OPTIONS)
        _train(model, pre, rank, 1)
        usage = pre.memory_usage()
        out[name] = (*_choice(pre), usage["factors"] + usage["second_order"], pre.plan.grad_workers)
        pre.remove_hooks()

    try:
        kaisa.KFACPreconditioner(model, memory_budget=30_000, **OPTIONS)
        out["too_small"] = "constructed"
    except ValueError as error:
        out["too_small"] = str(error)

    try:
        given = {**OPTIONS, "grad_worker_fraction": "auto" if rank == 0 else "comm-opt"}
        kaisa.KFACPreconditioner(model, **given).remove_hooks()
        out["disagree"] = "constructed"
    except RuntimeError as error:
        out["disagree"] = f"{type(error).__name__}: {error}"

    # Speeds given on one rank only: the others would probe (collectives the
    # first would not join); every rank refuses, naming the variable.
    if rank == 0:
        os.environ[LINK_ENV] = SLOW
    else:
        os.environ.pop(LINK_ENV, None)
    try:
        kaisa.KFACPreconditioner(model, **OPTIONS).remove_hooks()
        out["link_disagree"] = "constructed"
    except RuntimeError as error:
        out["link_disagree"] = f"{type(error).__name__}: {error}"

    # A checkpoint written under the slow link (COMM-OPT) restored where the fast
    # link would choose HYBRID-OPT: the checkpoint's choice wins.
    os.environ[LINK_ENV] = SLOW
    first = _model()
    pre = kaisa.KFACPreconditioner(first, **OPTIONS)
    _train(first, pre, rank, 3)
    state = copy.deepcopy(pre.state_dict())
    second = copy.deepcopy(first)
    continued = _train(first, pre, rank, 2)
    os.environ[LINK_ENV] = FAST
    restored = kaisa.KFACPreconditioner(second, **OPTIONS)
    before = restored.grad_worker_choice.grad_workers
    restored.load_state_dict(state)
    after = restored.grad_worker_choice
    out["restore"] = (before, after.grad_workers, after.restored, restored.plan.grad_workers)
    resumed = _train(second, restored, rank, 2)
    out["restore_identical"] = all(
        torch.equal(a, b)
        for x, y in zip(continued, resumed, strict=True)
        for a, b in zip(x, y, strict=True)
    )
    # The same checkpoint into a preconditioner whose budget it does not fit.
    third = copy.deepcopy(second)
    small = kaisa.KFACPreconditioner(third, memory_budget=BUDGET, **OPTIONS)
    try:
        small.load_state_dict(state)
        out["restore_refused"] = "loaded"
    except ValueError as error:
        out["restore_refused"] = str(error)
    out["after_refusal"] = (small.grad_worker_choice.grad_workers, small.plan.grad_workers)
    os.environ.pop(LINK_ENV, None)
    return out


def _expected(link: str, budget: int | None) -> int:
    model = FractionModel(factor_update_steps=1, inv_update_steps=10)
    shapes = module_layer_shapes(_model())
    return choose_stable(shapes, WORLD, Link.parse(link), budget, model).grad_workers


def test_auto_on_four_ranks_agrees_fits_refuses_and_restores() -> None:
    results = run_distributed(_cases, WORLD, timeout=240)
    # The probe: one set of speeds and one choice on every rank.
    assert len({repr(r["probe"]) for r in results}) == 1, [r["probe"] for r in results]
    assert results[0]["probe"][1] is not None
    # Given speeds: the choice this process makes, on every rank.
    slow, fast = _expected(SLOW, None), _expected(FAST, None)
    budgeted = _expected(SLOW, BUDGET)
    assert (slow, fast, budgeted) == (4, 2, 2)
    model = FractionModel(factor_update_steps=1, inv_update_steps=10)
    costs = {
        p.grad_workers: model.cost(p, Link.parse(SLOW).rounded())
        for p in model.plans(module_layer_shapes(_model()), WORLD)
    }
    assert costs[1].memory_bytes < BUDGET < costs[4].memory_bytes
    for rank, r in enumerate(results):
        for name, expected in (("slow", slow), ("fast", fast), ("slow_budget", budgeted)):
            m, _, held, plan_m = r[name]
            assert (m, plan_m) == (expected, expected), (rank, name)
            # Measured factors + second-order state: the model's for this rank's column
            # (every column alike here) and, with a budget, within it.
            assert held <= costs[expected].memory_bytes, (rank, name, held)
            if name == "slow_budget":
                assert held <= BUDGET
        assert "no grad_worker_fraction fits memory_budget=30000 bytes" in r["too_small"]
        assert "the smallest is 32004 bytes" in r["too_small"]
        assert r["disagree"].startswith("RankDisagreementError")
        assert "grad_worker_fraction: rank 0 has auto, rank 1 has given" in r["disagree"]
        assert r["link_disagree"].startswith("RankDisagreementError")
        assert f"{LINK_ENV}: rank 0 has given, rank 1 has probed" in r["link_disagree"]
        assert r["restore"] == (2, 4, True, 4)
        assert r["restore_identical"] is True
        assert "needs 47012 bytes" in r["restore_refused"]
        assert "memory_budget of 40000 bytes" in r["restore_refused"]
        assert r["after_refusal"] == (2, 2)
    assert {r["slow"][2] for r in results} == {costs[4].memory_bytes}
