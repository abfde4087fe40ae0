"""``stale_refresh`` on several ranks: the ranks agree, and reproduce one process.

Each rank measures the drift on the gradients it holds after the step's
broadcasts and the ranks agree by an all-reduce (two flags per step: whether
any rank refreshed its inverses, whether any found the curvature stale), so
every rank cuts its intervals at the same step. Two gloo ranks,
MEM-OPT and COMM-OPT, a model whose head starts at zero (its first factors go
stale at once) must train as one process on the whole batch does, with the
same refreshes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import average_gradients, run_distributed
from torch import nn

import kaisa

STEPS = 24
GLOBAL_BATCH = 32


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    with torch.no_grad():
        model[2].weight.zero_()
    return model


def _train(rank: int, world_size: int, fraction: float) -> dict[str, object]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    pre = kaisa.KFACPreconditioner(
        model,
        lr=0.05,
        curvature="exact",
        factor_update_steps=8,
        inv_update_steps=8,
        stale_refresh=True,
        grad_worker_fraction=fraction,
    )
    teacher = torch.randn(6, 3, generator=torch.Generator().manual_seed(7))
    share = GLOBAL_BATCH // world_size
    intervals, flags = [], []
    for step in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 6, generator=torch.Generator().manual_seed(100 + step))
        x = x[rank * share : (rank + 1) * share]
        optimizer.zero_grad()
        F.cross_entropy(model(x), (x @ teacher).argmax(dim=1)).backward()
        if world_size > 1:
            average_gradients(model, world_size)
        captured = pre.capturing
        pre.step()
        optimizer.step()
        intervals.append(pre.hyperparameters().factor_update_steps)
        flags.append((captured, pre.telemetry.last_step_elements["layer_flags"]))
    return {
        "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "intervals": intervals,
        "stale_refreshes": pre.telemetry.stale_refreshes,
        "flags": flags,
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_ranks_agree_and_reproduce_one_process(fraction: float) -> None:
    reference = _train(0, 1, 1.0)
    assert reference["stale_refreshes"] >= 1 and 1 in reference["intervals"]
    ranks = run_distributed(_train, 2, fraction, timeout=120)
    for result in ranks:
        assert result["intervals"] == reference["intervals"]
        assert result["stale_refreshes"] == reference["stale_refreshes"]
        torch.testing.assert_close(result["weights"], reference["weights"], rtol=1e-4, atol=1e-5)
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])
    # Its cost in traffic: two flags per step (refreshed, stale) beside the two
    # layers' flags and, on factor-update steps, the three that agree on the step.
    for captured, sent in ranks[0]["flags"]:
        assert sent == 2 + (3 if captured else 0) + 2
