"""``benchmarks/refresh_cost.py``: the refresh before and after session 26, side by side.

The script's reference for "before" must be what the library did: session
25's low-rank refresh (it captures the top of a known spectrum as the library
does) and the entrywise checks, patched in only inside its block.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from script_loader import load_script

import kaisa.curvature.linalg as linalg
import kaisa.curvature.representations as representations
from kaisa.curvature.costs import SideSpec
from kaisa.curvature.representations import LowRankSide, make_side

D = torch.float64


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("benchmarks/refresh_cost.py", "refresh_cost_under_test")


def _side(n: int, k: int) -> LowRankSide:
    side = make_side(
        SideSpec("lowrank", k), "layer.a", n, method="eigen", device=torch.device("cpu"),
        factor_dtype=D, inv_dtype=D, relative=False,
    )  # fmt: skip
    assert isinstance(side, LowRankSide)
    return side


def test_previous_refresh_captures_the_top_as_the_library_does(bench: ModuleType) -> None:
    n, k = 30, 4
    values = torch.cat(
        [torch.tensor([10.0, 7.0, 5.0, 3.0], dtype=D), torch.linspace(0.5, 0.01, n - k, dtype=D)]
    )
    q = torch.linalg.qr(torch.randn(n, n, dtype=D, generator=torch.Generator().manual_seed(1))).Q
    factor = (q * values) @ q.T
    library, previous = _side(n, k), _side(n, k)
    previous.__class__ = bench.PreviousLowRankSide
    for side in (library, previous):
        side.factor.copy_(factor)
        for _ in range(5):  # (the library's warm refreshes iterate once each)
            side.refresh(0.1)
        u, got, sigma = side.state
        torch.testing.assert_close(got, values[:k], rtol=0, atol=1e-8)
        torch.testing.assert_close(sigma[0], values[k:].mean(), rtol=0, atol=1e-8)
        torch.testing.assert_close(u @ u.T, q[:, :k] @ q[:, :k].T, rtol=0, atol=1e-6)


def test_previous_refresh_is_patched_in_only_inside_its_block(bench: ModuleType) -> None:
    saved = (linalg.all_finite, representations.all_finite, LowRankSide._compute_state)
    with bench.previous_refresh():
        assert linalg.all_finite is bench.entrywise_finite
        assert representations.all_finite is bench.entrywise_finite
        assert LowRankSide._compute_state is bench.previous_state
    assert (linalg.all_finite, representations.all_finite, LowRankSide._compute_state) == saved
    with pytest.raises(RuntimeError, match="inside"), bench.previous_refresh():
        raise RuntimeError("inside")
    assert (linalg.all_finite, representations.all_finite, LowRankSide._compute_state) == saved
    bad = torch.ones(3)
    bad[1] = float("nan")
    assert bench.entrywise_finite(torch.ones(2), bad) is False
    assert bench.entrywise_finite(torch.ones(2)) is True


def test_part_sides_times_both_ways(bench: ModuleType) -> None:
    (row,) = bench.part_sides([(24, 3)], repeats=2, warmup=1)
    assert row["n"] == 24 and row["rank"] == 3 and row["device"] == "cpu"
    for key in ("check_sum_ms", "check_entrywise_ms", "refresh_library_ms", "refresh_previous_ms"):
        assert row[key] > 0.0
    assert row["refresh_ratio"] == row["refresh_library_ms"] / row["refresh_previous_ms"]
