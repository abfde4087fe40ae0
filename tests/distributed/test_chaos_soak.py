"""The chaos soak, short (issue 30, item 7; the long one: ``benchmarks/chaos_soak.py``).

A loop that injects, at random (seeded), every fault of issue 30 and of the
older fault table (exceptions at each point of an iteration, a
``KeyboardInterrupt`` in the backward pass, a schedule raising in ``step()``,
skipped batches, double backward, evaluation mode, a frozen layer, 0-row,
NaN and x1e6 batches, ``step()`` twice, a checkpoint and a rebuilt
preconditioner) under non-reentrant gradient checkpointing and a 0-d tensor
``lr``, on one process and on two gloo ranks: nothing wedges (the clean tail
steps run), nothing leaks (hooks as after construction, one live
preconditioner, no capture held between steps), the ranks stay identical,
and the final loss is within 10% of a clean run's on the same data.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from harness import run_distributed
from script_loader import load_script


def _benchmark() -> ModuleType:
    return load_script("benchmarks/chaos_soak.py", "chaos_soak")


def _check(results: list[dict[str, dict[str, Any]]], steps: int) -> None:
    chaos = _benchmark()
    injected: set[str] = set()
    for result in results:
        clean, faulty = result["clean"], result["faulty"]
        injected |= set(faulty["faults"])
        assert clean["faults_total"] == 0 and clean["preconditioner_steps"] == steps
        # Nothing wedged: steps after every fault completed, the clean tail included.
        assert steps // 2 < faulty["preconditioner_steps"] < steps
        # Nothing leaked.
        assert faulty["hooks_at_end"] == faulty["hooks_after_construction"] > 0
        assert faulty["live_preconditioners"] == 1
        assert faulty["captures_held_between_steps"] == 0
        assert all(bool(w.isfinite().all()) for w in faulty["weights"])
        assert faulty["final_loss"] <= 1.1 * clean["final_loss"], (
            faulty["final_loss"],
            clean["final_loss"],
        )
        assert clean["final_loss"] < 1.0  # (the clean run learned: chance is log 4 = 1.39)
    assert injected == {name for name, _ in chaos.FAULTS}, sorted(injected)
    for other in results[1:]:
        for a, b in zip(results[0]["faulty"]["weights"], other["faulty"]["weights"], strict=True):
            assert torch.equal(a, b)


def test_chaos_soak_one_process() -> None:
    steps = 300
    _check([_benchmark().clean_and_faulty(steps)], steps)


def _soak_rank(rank: int, world_size: int, steps: int) -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = _benchmark().clean_and_faulty(
        steps, rank=rank, world_size=world_size
    )
    return result


def test_chaos_soak_two_ranks() -> None:
    steps = 250
    _check(run_distributed(_soak_rank, 2, steps, timeout=150), steps)
