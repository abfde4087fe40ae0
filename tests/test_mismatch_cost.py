"""``benchmarks/mismatch_cost.py``: the library's measure against session 40's power iteration.

The script's comparison arm must be the power iteration the library used
(converged, it is the dense eigenvalue), its counts must be the products
each arm made, and a run must write every field it reports.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from script_loader import load_script

from kaisa import autochoice
from kaisa.autochoice import diagonal_mismatch


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("benchmarks/mismatch_cost.py", "mismatch_cost_under_test")


def test_power_iteration_converges_to_the_dense_eigenvalue_on_a_dominant_mean(
    bench: ModuleType,
) -> None:
    factor = bench.make_rows("mean", 200, 50, seed=1)
    factor = factor.T @ factor / 200
    value = bench.power_mismatch(factor, 1e-3)
    assert value == pytest.approx(bench.dense_mismatch(factor, 1e-3), rel=1e-5)
    assert value == pytest.approx(diagonal_mismatch(factor, 1e-3), rel=1e-5)
    products = bench.products_with(factor, bench.power_mismatch, 1e-3)
    assert 1 <= products < bench.POWER_ITERATIONS


def test_on_a_clustered_top_the_library_is_closer_in_fewer_products(bench: ModuleType) -> None:
    row = bench.measure("wishart", 300, rows=600, repeat=1, damping=1e-3, dense_up_to=300)
    assert row["power_products"] == bench.POWER_ITERATIONS
    assert 0 < row["library_products"] <= autochoice.MISMATCH_ITERATIONS
    assert row["library_error"] < 1e-5 < row["power_error"]
    assert row["library_value"] == pytest.approx(row["dense_value"], rel=1e-5)


def test_empty_and_zero_factors_leave_nothing(bench: ModuleType) -> None:
    assert bench.power_mismatch(torch.zeros(4, 4), 1e-3) == 1.0
    assert bench.power_mismatch(torch.zeros(0, 0), 1e-3) == 1.0
    with pytest.raises(ValueError, match="kind must be one of"):
        bench.make_rows("gaussian", 4, 4, seed=0)


def test_a_run_writes_every_reported_field(bench: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    result = bench.main(
        ["--threads", "1", "--sizes", "16,40", "--rows", "64", "--repeat", "2",
         "--dense-up-to", "16", "--json", str(out)]
    )  # fmt: skip
    saved = json.loads(out.read_text())
    assert [(r["n"], r["kind"]) for r in saved["rows"]] == [
        (n, k) for n in (16, 40) for k in bench.KINDS
    ]
    for row in saved["rows"]:
        assert row["gram_ms"] > 0 and row["library_ms"] > 0 and row["power_ms"] > 0
        assert row["library_products"] >= 1 and row["power_products"] >= 1
        assert (row["dense_value"] is None) == (row["n"] > 16)
    assert saved["load"]["cpus"] >= 1 and result["settings"]["rows"] == 64


def test_bad_arguments_are_refused(bench: ModuleType) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--kinds", "gaussian"])
    with pytest.raises(SystemExit):
        bench.main(["--repeat", "0"])
