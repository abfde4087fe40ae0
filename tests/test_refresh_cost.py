"""``benchmarks/refresh_cost.py``: a refresh with session 26's checks and with session 25's.

The script's "previous" arm must be session 25's entrywise checks, patched
in only inside its block, and must refresh exactly as the library does.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from script_loader import load_script

import kaisa.curvature.linalg as linalg
import kaisa.curvature.representations as representations
import kaisa.curvature.shared as shared
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


def test_previous_checks_refresh_exactly_as_the_library_does(bench: ModuleType) -> None:
    n, k = 30, 4
    g = torch.Generator().manual_seed(1)
    x = torch.randn(60, n, dtype=D, generator=g)
    factor = x.T @ x / 60
    library, previous = _side(n, k), _side(n, k)
    for side in (library, previous):
        side.factor.copy_(factor)
    for _ in range(3):
        library.refresh(0.1)
        with bench.entrywise_checks():
            previous.refresh(0.1)
    for a, b in zip(library.state, previous.state, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    bad = factor.clone()
    bad[2, 3] = float("nan")
    previous.factor.copy_(bad)
    with bench.entrywise_checks(), pytest.raises(linalg.DecompositionError, match="NaN or Inf"):
        previous.refresh(0.1)


def test_entrywise_checks_are_patched_in_only_inside_their_block(bench: ModuleType) -> None:
    saved = (linalg.all_finite, representations.all_finite, shared.all_finite)
    with bench.entrywise_checks():
        assert linalg.all_finite is bench.entrywise_finite
        assert representations.all_finite is bench.entrywise_finite
        assert shared.all_finite is bench.entrywise_finite
    assert (linalg.all_finite, representations.all_finite, shared.all_finite) == saved
    with pytest.raises(RuntimeError, match="inside"), bench.entrywise_checks():
        raise RuntimeError("inside")
    assert (linalg.all_finite, representations.all_finite, shared.all_finite) == saved
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


def test_part_steps_runs_the_options_it_is_given(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    import kaisa.demo.data as demo_data

    g = torch.Generator().manual_seed(0)
    images = types.SimpleNamespace(
        train_x=torch.randn(256, 1, 28, 28, generator=g), train_y=torch.randint(0, 10, (256,))
    )
    monkeypatch.setattr(demo_data, "load_fashion_mnist", lambda: images)
    made: list[dict[str, object]] = []
    real = bench.kaisa.KFACPreconditioner

    def recording(model: object, **kw: object) -> object:
        made.append(kw)
        return real(model, **kw)

    monkeypatch.setattr(bench.kaisa, "KFACPreconditioner", recording)
    given = {
        "curvature": {r"classifier\.1$": ["diagonal", "exact"], ".*": "exact"},
        "factor_update_steps": 1,
        "inv_update_steps": 1,
    }
    result = bench.part_steps("small_cnn", rounds=1, steps=1, warmup=1, kfac=given)
    assert result["kfac"] == given and len(made) == 2  # both arms, the options given
    assert all({k: kw[k] for k in given} == given for kw in made)
    assert all(arm["ms_per_step"] > 0 for arm in result["arms"].values())
    made.clear()
    assert bench.part_steps("small_cnn", 1, 1, 1)["kfac"] == bench.CONFIGS["small_cnn"]
    assert all({k: kw[k] for k in bench.CONFIGS["small_cnn"]} == bench.CONFIGS["small_cnn"]
               for kw in made)  # fmt: skip
