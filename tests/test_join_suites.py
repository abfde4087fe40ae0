"""``benchmarks/join_suites.py``: a suite run in parts joined into one summary."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
from script_loader import load_script

from kaisa.demo.compare import summarize_suite

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "suite-s17"


@pytest.fixture(scope="module")
def join_suites() -> ModuleType:
    return load_script("benchmarks/join_suites.py", "join_suites_under_test")


def _part(tmp: Path, name: str, workloads: list[str]) -> Path:
    part = tmp / name
    for workload in workloads:
        shutil.copytree(RESULTS / workload, part / workload)
    return part


def test_two_parts_give_the_summary_of_the_whole(
    join_suites: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _part(tmp_path, "first", ["gap_cnn"])
    second = _part(tmp_path, "second", ["gpt", "vit"])
    out = tmp_path / "joined"
    argv = ["join_suites.py", "--out", str(out), str(second), str(first)]
    monkeypatch.setattr(sys, "argv", argv)
    join_suites.main()
    summary = json.loads((out / "summary.json").read_text())
    results = [
        json.loads((RESULTS / w / "results.json").read_text()) for w in ("gap_cnn", "vit", "gpt")
    ]
    expected = summarize_suite(results)
    # In the suite's order whatever the order of the directories; rows as a whole run's.
    assert list(summary["workloads"]) == ["gap_cnn", "vit", "gpt"]
    assert summary["rows"] == json.loads(json.dumps(expected["rows"]))
    assert summary["machine"]["at_start"] == results[0]["machine"]["at_start"]
    assert summary["machine"]["at_end"] == results[-1]["machine"]["at_end"]
    assert summary["joined_from"] == {
        "gap_cnn": str(first / "gap_cnn"),
        "vit": str(second / "vit"),
        "gpt": str(second / "gpt"),
    }
    for workload in ("gap_cnn", "vit", "gpt"):
        assert (out / workload / "results.json").exists()
    assert "| gpt | AdamW + KAISA | 3/3 | 784 |" in (out / "summary.md").read_text()


def test_a_workload_in_two_parts_is_refused(join_suites: ModuleType, tmp_path: Path) -> None:
    first = _part(tmp_path, "first", ["gap_cnn"])
    second = _part(tmp_path, "second", ["gap_cnn", "vit"])
    with pytest.raises(SystemExit, match="'gap_cnn' is in both"):
        join_suites.collect([first, second])
    with pytest.raises(SystemExit, match=r"no <workload>/results\.json"):
        join_suites.collect([tmp_path / "empty"])
