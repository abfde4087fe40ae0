"""``benchmarks/common.py``: the helpers the benchmark scripts share."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from script_loader import load_script


def test_kfac_json_turns_torch_names_into_torch_attributes() -> None:
    common = load_script("benchmarks/common.py", "benchmarks_common_under_test")
    got = common.kfac_json(
        '{"factor_product_dtype": "torch.bfloat16", "damping": 0.01, "curvature": "exact",'
        ' "skip_layers": ["torch.x"]}'
    )
    assert got == {
        "factor_product_dtype": torch.bfloat16,
        "damping": 0.01,
        "curvature": "exact",
        "skip_layers": ["torch.x"],  # only a whole string value is read as a torch name
    }
    assert common.kfac_json("[1, 2]") == [1, 2]


def test_library_commit_names_the_checkout_and_its_changes(tmp_path: Path) -> None:
    common = load_script("benchmarks/common.py", "benchmarks_common_under_test")
    here = common.library_commit()  # the imported kaisa: this checkout
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert here is not None and re.fullmatch(rf"{head}(-dirty)?", here)
    assert common.library_commit(tmp_path) is None  # not a git checkout
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("x = 1\n")
    for args in (
        ["init", "-q"],
        ["add", "."],
        ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one"],
    ):
        subprocess.run(["git", "-C", str(repo), *args], check=True)
    clean = common.library_commit(repo / "pkg")
    assert clean is not None and not clean.endswith("-dirty")
    (repo / "pkg" / "a.py").write_text("x = 2\n")
    assert common.library_commit(repo / "pkg") == f"{clean}-dirty"


def test_each_arm_is_summarized_at_its_best_rate_per_seed() -> None:
    common = load_script("benchmarks/common.py", "benchmarks_common_under_test")

    def row(arm: str, seed: int, lr: float, steps: int | None, time: float | None) -> dict:
        ms = None if steps is None or time is None else 1000 * time / steps
        return dict(arm=arm, seed=seed, lr=lr, steps=steps, time=time, ms_per_step=ms)

    rows = [
        row("a", 0, 0.1, 100, 5.0),
        row("a", 0, 0.2, 80, 6.0),  # fewer steps, more time
        row("a", 1, 0.1, None, None),
        row("a", 1, 0.2, 120, 3.0),
        row("b", 0, 0.1, None, None),
        row("b", 1, 0.1, None, None),
    ]
    assert common.best_rate(rows[:2])["lr"] == 0.2
    assert common.best_rate(rows[:2], by="time")["lr"] == 0.1
    assert common.best_rate(rows[4:]) is None
    tie = [row("a", 0, 0.1, 80, 7.0), rows[1]]  # equal steps: less time wins
    assert common.best_rate(tie) is rows[1]
    with pytest.raises(ValueError, match="by must be 'steps' or 'time'"):
        common.best_rate(rows, by="loss")

    summary = common.arm_summaries(["a", "b"], rows, [0, 1])
    assert summary["a"] == {
        "reached": "2/2",
        "best_lrs": [0.2, 0.2],
        "steps": [80, 120],
        "median_steps": 100,
        "median_ms_per_step": (75.0 + 25.0) / 2,
        "median_time": 4.5,
    }
    assert summary["b"]["reached"] == "0/2" and summary["b"]["median_time"] is None
    by_time = common.arm_summaries(["a"], rows, [0, 1], by="time")["a"]
    assert by_time["best_lrs"] == [0.1, 0.2] and by_time["median_time"] == 4.0
    table = common.arm_summary_table(summary, decimals=1)
    assert table == [
        ["a", "2/2", "0.2/0.2", "80/120", "100", "50.0", "4.5 s"],
        ["b", "0/2", "-/-", "-/-", "-", "-", "-"],
    ]
    assert len(common.ARM_SUMMARY_HEADERS) == len(table[0])
    assert common.floats("0.1,,3") == [0.1, 3.0]
