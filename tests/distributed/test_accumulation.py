"""Gradient accumulation under data parallelism: passes beyond accumulation_steps (issue 17)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from harness import run_distributed
from torch import nn

import kaisa


def _passes(rank: int, world_size: int, passes: int) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    pre = kaisa.KFACPreconditioner(model, accumulation_steps=2, factor_update_steps=1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(passes):
        x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
        F.cross_entropy(model(x), y).backward()
    try:
        pre.step()
    except RuntimeError as error:
        return f"refused: {error}"
    return f"stepped, updates {[layer.block.updates for layer in pre.layers]}"


def test_passes_beyond_accumulation_steps_are_refused_on_every_rank() -> None:
    """Three passes with accumulation_steps=2: refused alike on both ranks, as in one process."""
    results = run_distributed(_passes, 2, 3, timeout=60)
    assert all(r.startswith("refused: ") and "accumulation_steps=2 (1 more)" in r for r in results)
    assert _passes(0, 1, 3) == results[0]  # one process says the same
    # Exactly accumulation_steps passes: stepped on every rank.
    assert run_distributed(_passes, 2, 2, timeout=60) == ["stepped, updates [1, 1]"] * 2
