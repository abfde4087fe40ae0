"""Gradient accumulation under data parallelism: passes beyond accumulation_steps."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from harness import run_distributed
from torch import nn

import kaisa


def _passes(rank: int, world_size: int, passes: int) -> tuple[list[int], list[str], list[float]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    pre = kaisa.KFACPreconditioner(model, lr=0.1, accumulation_steps=2, factor_update_steps=1)
    g = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(passes):
            x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
            F.cross_entropy(model(x), y).backward()
        pre.step()
    said = sorted(
        what
        for what in ("captures are discarded", "1 forward/backward pass(es) before this step()")
        if any(what in str(w.message) for w in caught)
    )
    updates = [layer.block.updates for layer in pre.layers]
    return updates, said, [layer.block.a.sum().item() for layer in pre.layers]


def test_a_pass_beyond_accumulation_steps_begins_a_new_iteration_on_every_rank() -> None:
    """Three passes with accumulation_steps=2: the first two are discarded alike on both
    ranks (their factor all-reduce had left), the third is folded alone, as in one process."""
    results = run_distributed(_passes, 2, 3, timeout=60)
    assert results[0] == results[1]  # factors included: the ranks stayed in step
    discarded = ["1 forward/backward pass(es) before this step()", "captures are discarded"]
    assert results[0][:2] == ([1, 1], discarded)
    assert _passes(0, 1, 3)[:2] == ([1, 1], discarded)  # one process says the same
    # Exactly accumulation_steps passes: stepped on every rank, nothing said.
    assert [r[:2] for r in run_distributed(_passes, 2, 2, timeout=60)] == [([1, 1], [])] * 2
