"""The multi-process harness itself: results come back, failures and hangs are loud."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from harness import DistributedTestError, run_distributed


def _sum_of_ranks(rank: int, world_size: int, offset: float) -> torch.Tensor:
    t = torch.tensor([float(rank) + offset])
    dist.all_reduce(t)
    return t


def _rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 waits here for a peer that never comes


def _hangs(rank: int, world_size: int) -> None:
    time.sleep(60)


def test_results_come_back_in_rank_order() -> None:
    results = run_distributed(_sum_of_ranks, 2, 0.5)
    assert [r.item() for r in results] == [2.0, 2.0]


def test_a_failing_rank_fails_the_test_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="boom on rank one") as info:
        run_distributed(_rank_one_raises, 2, timeout=60)
    assert "ValueError" in str(info.value)
    assert time.monotonic() - start < 30  # not the gloo or harness timeout


def test_a_hanging_run_is_killed_at_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="still running"):
        run_distributed(_hangs, 2, timeout=3)
    assert time.monotonic() - start < 20
