"""``benchmarks/refresh_overlap.py``: its arms do what its table says they do.

The overlapped arm's refresh, run on a second thread, must decompose exactly
as on the main thread (the comparison is of the same work), and the step arm
must be the model's and AdamW's alone (kaisa's hooks removed).
"""

from __future__ import annotations

import threading
from types import ModuleType

import pytest
import torch
from script_loader import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("benchmarks/refresh_overlap.py", "refresh_overlap_under_test")


def _states(pre: object) -> list[torch.Tensor]:
    return [
        t.clone()
        for layer in pre._roster  # type: ignore[attr-defined]
        if layer.active
        for which in ("a", "g")
        for t in layer.state_tensors(which)
    ]


def test_a_refresh_on_a_thread_decomposes_as_on_the_main_thread(bench: ModuleType) -> None:
    torch.set_num_threads(1)
    step, refresh_here, here = bench.build(warmup=6)
    _, refresh_there, there = bench.build(warmup=6)
    for a, b in zip(_states(here), _states(there), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same start
    refresh_here()
    worker = threading.Thread(target=refresh_there)
    worker.start()
    worker.join()
    first, second = _states(here), _states(there)
    assert len(first) == len(second) > 0
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    steps_before = here.steps
    step()
    assert here.steps == steps_before  # kaisa does no work in the step arm
    hooked = [m for m in here.model.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert hooked == []  # nor do its hooks: they were removed
