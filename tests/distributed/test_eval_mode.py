"""One rank in evaluation mode while the others train (issue 30, item 4).

The rank left in ``model.eval()`` captures nothing, but its ``step()`` must
issue the collectives the training ranks issue: on a factor-update step it
takes the factors the others all-reduced, folds them as they do (and makes the
automatic choice with them), and warns once that its model is in evaluation
mode. The ranks stay in step and bit-identical; nothing dies by a signal,
nothing hangs (before: a hang in the automatic choice's collective, or
factors silently apart).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import average_gradients, run_distributed
from torch import nn

import kaisa

STEPS = 4


def _train(rank: int, world_size: int, eval_step: int, options: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = kaisa.KFACPreconditioner(model, lr=0.1, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            model.train(not (rank == 1 and step == eval_step))
            gen = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(5, 4, generator=gen), torch.randint(0, 3, (5,), generator=gen)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            average_gradients(model, world_size)
            pre.step()
            optimizer.step()
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "factors": [(layer.block.a.clone(), layer.block.g.clone()) for layer in pre.layers],
        "warnings": [str(w.message) for w in caught if "evaluation mode" in str(w.message)],
    }


@pytest.mark.parametrize(
    ("eval_step", "options"),
    [
        # The automatic choice pending: its collective must be issued on every rank.
        (0, {}),
        (1, {"curvature": "exact", "factor_update_steps": 1, "inv_update_steps": 1}),
        (
            1,
            {
                "curvature": "exact",
                "factor_update_steps": 1,
                "inv_update_steps": 1,
                "grad_worker_fraction": "mem-opt",
                "update_factors_in_hook": False,
            },
        ),
    ],
    ids=["auto-choice", "exact", "mem-opt-no-hook"],
)
def test_one_rank_in_eval_mode_keeps_the_ranks_together(
    eval_step: int, options: dict[str, Any]
) -> None:
    results = run_distributed(_train, 2, eval_step, options, timeout=120)
    first, second = results
    for a, b in zip(first["weights"], second["weights"], strict=True):
        assert torch.equal(a, b)
    for (a0, g0), (a1, g1) in zip(first["factors"], second["factors"], strict=True):
        assert torch.equal(a0, a1) and torch.equal(g0, g1)
    assert first["warnings"] == []
    assert len(second["warnings"]) == 1 and "model.train()" in second["warnings"][0]
