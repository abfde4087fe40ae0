"""``benchmarks/pool_suites.py`` pools the workloads every run directory holds."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from script_loader import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("benchmarks/pool_suites.py", "pool_suites_under_test")


def _run(root: Path, workloads: dict[str, dict[str, list[tuple[int, float, int]]]]) -> Path:
    """A ``kaisa demo`` output directory: per workload, per arm, ``(seed, seconds, steps)``."""
    for workload, arms in workloads.items():
        (root / workload).mkdir(parents=True)
        results = {
            "arms": {
                arm: {
                    "per_seed": [
                        {"seed": seed, "time_to_target_s": t, "steps_to_target": steps}
                        for seed, t, steps in runs
                    ]
                }
                for arm, runs in arms.items()
            },
            "comparisons": {
                "kaisa-adamw": {
                    "vs_best": {
                        "per_seed": {
                            str(seed): t / arms["muon"][i][1]
                            for i, (seed, t, _) in enumerate(arms["kaisa-adamw"])
                        }
                    }
                }
            },
        }
        (root / workload / "results.json").write_text(json.dumps(results))
    return root


def test_only_the_workloads_every_directory_holds_are_pooled(
    bench: ModuleType, tmp_path: Path
) -> None:
    first = _run(
        tmp_path / "a",
        {
            "vit": {"muon": [(0, 40.0, 800)], "kaisa-adamw": [(0, 30.0, 550)]},
            "gpt": {"muon": [(0, 50.0, 500)], "kaisa-adamw": [(0, 50.0, 440)]},
        },
    )
    second = _run(
        tmp_path / "b", {"vit": {"muon": [(3, 44.0, 850)], "kaisa-adamw": [(3, 22.0, 500)]}}
    )
    assert bench.common_workloads([first, second]) == ["vit"]
    pooled = bench.pool([first, second], "vit")
    assert pooled["best_other"] == "muon"
    kaisa = pooled["arms"]["kaisa-adamw"]
    assert kaisa["seeds"] == [0, 3] and kaisa["steps"] == [550, 500]
    assert kaisa["ratio_of_medians"] == pytest.approx(26.0 / 42.0)
    assert kaisa["median_per_seed_ratio"] == pytest.approx((30 / 40 + 22 / 44) / 2)
