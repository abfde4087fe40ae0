"""The sweep report of ``benchmarks/lr_sweep.py``: grouping, ranking, CSV."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from script_loader import load_script


@pytest.fixture(scope="module")
def lr_sweep() -> ModuleType:
    return load_script("benchmarks/lr_sweep.py", "lr_sweep_under_test")


def _record(
    lr: float,
    seed: int,
    steps: int | None,
    seconds: float | None,
    *,
    to_target: bool,
    threads: int = 1,
    final: float = 0.91,
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model": "gap_cnn",
        "epochs": 3,
        "batch_size": 128,
        "warmup_epochs": 0.25,
        "target_accuracy": 0.91,
        "eval_every": 100,
        "threads": threads,
    }
    if to_target:
        config["stop_at_target"] = True
    return {
        "arm": "kaisa",
        "seed": seed,
        "hyperparameters": {"optimizer": "SGD", "lr": lr, "momentum": 0.9, "weight_decay": 5e-4},
        "config": config,
        "result": {
            "time_to_target_s": seconds,
            "steps_to_target": steps,
            "final_test_accuracy": final,
            "best_test_accuracy": final,
            "seconds_per_step": 0.1,
        },
    }


def test_to_target_rows_rank_by_steps_and_stay_apart(lr_sweep: ModuleType) -> None:
    runs = [
        # lr 0.1: fewer steps but, under a heavier load, more seconds.
        *(_record(0.1, s, n, 90.0, to_target=True) for s, n in enumerate((600, 650, 625))),
        *(_record(0.05, s, n, 70.0, to_target=True) for s, n in enumerate((700, 700, 675))),
        # The same lr run to the end and with 2 threads: separate rows.
        _record(0.1, 0, 600, 60.0, to_target=False),
        _record(0.1, 0, 600, 50.0, to_target=True, threads=2),
    ]
    rows = lr_sweep.summarize(runs, 0.91)
    assert len(rows) == 4
    to_target_1 = [r for r in rows if r["stop_at_target"] and r["threads"] == 1]
    assert [r["hyperparameters"]["lr"] for r in to_target_1] == [0.1, 0.05]
    assert to_target_1[0]["steps_to_target"] == 625
    assert to_target_1[0]["steps_per_seed"] == "600/650/625"
    assert to_target_1[1]["steps_per_seed"] == "700/700/675"
    full = [r for r in rows if not r["stop_at_target"]]
    assert len(full) == 1 and full[0]["time_to_target_s"] == 60.0


def test_a_seed_that_missed_the_target_counts_as_infinite(lr_sweep: ModuleType) -> None:
    runs = [
        _record(0.2, 0, None, None, to_target=True, final=0.905),
        _record(0.2, 1, None, None, to_target=True, final=0.905),
        _record(0.2, 2, 500, 40.0, to_target=True),
        _record(0.05, 0, 700, 70.0, to_target=True),
    ]
    rows = lr_sweep.summarize(runs, 0.91)
    assert [r["hyperparameters"]["lr"] for r in rows] == [0.05, 0.2]
    missed = rows[1]
    assert missed["reached"] == 1 and missed["time_to_target_s"] is None
    assert missed["steps_per_seed"] == "-/-/500"


def test_report_prints_the_best_and_writes_the_csv(
    lr_sweep: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = [
        *(_record(0.1, s, n, 90.0, to_target=True) for s, n in enumerate((600, 650, 625))),
        *(_record(0.05, s, n, 70.0, to_target=True) for s, n in enumerate((700, 700, 675))),
    ]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"description": "test", "runs": runs}))
    assert lr_sweep.report(path, None) == 0
    out = capsys.readouterr().out
    best = out.split("best per arm", 1)[1]
    assert "lr=0.1 [to target] (steps 600/650/625)" in best
    with path.with_suffix(".csv").open() as f:
        table = list(csv.DictReader(f))
    assert [row["steps_per_seed"] for row in table] == ["600/650/625", "700/700/675"]


def test_channels_last_runs_are_their_own_rows(lr_sweep: ModuleType) -> None:
    layout_runs = [_record(0.05, s, 700, 50.0, to_target=True) for s in range(2)]
    for rec in layout_runs:
        rec["config"]["channels_last"] = True
    runs = [*layout_runs, _record(0.05, 0, 750, 70.0, to_target=True)]
    rows = lr_sweep.summarize(runs, 0.91)
    labels = sorted(r["settings"] for r in rows)
    assert labels == ["lr=0.05 [channels_last] [to target]", "lr=0.05 [to target]"]
    assert lr_sweep._key(layout_runs[0]) != lr_sweep._key(runs[2])


def _suite_record(
    arm: str,
    lr: float,
    steps: int | None,
    acc: float,
    *,
    workload: str = "gap_cnn",
    epochs: int = 3,
) -> dict[str, Any]:
    return {
        "suite": True,
        "arm": arm,
        "seed": 0,
        "hyperparameters": {"lr": lr},
        "config": {"workload": workload, "model": workload, "epochs": epochs, "threads": 2},
        "kfac_options": {},
        "result": {
            "steps_to_target": steps,
            "time_to_target_s": None if steps is None else steps / 10,
            "final_test_accuracy": acc,
            "best_test_accuracy": acc,
        },
    }


def test_suite_best_ranks_by_steps_then_accuracy_and_flags_the_grid_edge(
    lr_sweep: ModuleType, tmp_path: Path
) -> None:
    from kaisa.demo.config import read_lr_table, resolve_lr

    settings = {"workload": "gap_cnn", "model": "gap_cnn", "epochs": 3, "threads": 1}
    runs = [
        _suite_record("adamw", 5e-4, None, 0.90),
        _suite_record("adamw", 1e-3, 700, 0.911),
        _suite_record("adamw", 2e-3, 600, 0.910),
        _suite_record("adamw", 4e-3, 600, 0.915),  # same steps, higher accuracy: best
        _suite_record("adamw", 8e-3, None, 0.905),
        _suite_record("adamw", 4e-3, 100, 0.95, epochs=1),  # other settings: ignored
        _suite_record("sgd", 0.4, 500, 0.92),
        _suite_record("sgd", 0.1, None, 0.88),
        _suite_record("sgd", 0.025, None, 0.89),
    ]
    best = lr_sweep.suite_best(runs, "gap_cnn", "adamw", settings)
    assert best["lr"] == 4e-3 and best["steps_to_target"] == 600 and not best["at_grid_edge"]
    assert best["by_lr"] == {"0.0005": None, "0.001": 700, "0.002": 600, "0.004": 600,
                             "0.008": None}  # fmt: skip
    sgd = lr_sweep.suite_best(runs, "gap_cnn", "sgd", settings)
    assert sgd["lr"] == 0.4 and sgd["at_grid_edge"]
    assert lr_sweep.suite_best(runs, "resnet20", "sgd", settings) is None
    # Nothing reached the target: the best accuracy wins.
    missed = [_suite_record("muon", lr, None, acc) for lr, acc in ((0.01, 0.8), (0.02, 0.85))]
    assert lr_sweep.suite_best(missed, "gap_cnn", "muon", settings)["lr"] == 0.02

    path = tmp_path / "lrs.json"
    lr_sweep._write_lrs(path, {("gap_cnn", "adamw"): best})
    lr_sweep._write_lrs(path, {("gap_cnn", "sgd"): sgd})  # merged, not replaced
    table = read_lr_table(path)
    assert {arm: lr for arm, (lr, _) in table["gap_cnn"].items()} == {"sgd": 0.4, "adamw": 4e-3}
    lr, source = resolve_lr("gap_cnn", "sgd", {}, table, "sweep file x")
    assert lr == 0.4 and source == "sweep file x (3 epoch(s), at the grid's edge)"
