"""Pool several ``kaisa demo`` runs (different seeds) into one comparison per workload.

For each workload present in every given output directory, the script
collects every arm's per-seed time and steps to the target from each run's
``<workload>/results.json`` and prints, per kaisa arm, the median of its
times against the median of the best other arm's (the arm without K-FAC
with the smallest median time), and the median of the per-seed ratios each
run recorded (arms of a seed ran in lockstep, so those ratios compare like
with like). A seed that did not reach the target counts as infinitely slow.
Nothing is asserted; the runs should use distinct seeds. ::

    python benchmarks/pool_suites.py benchmarks/results/suite benchmarks/results/suite-seeds345
    python benchmarks/pool_suites.py benchmarks/results/suite-s33 \
        benchmarks/results/suite-s33-seeds345 --workloads vit
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any


def _median(values: list[float | None]) -> float:
    return statistics.median(math.inf if v is None else v for v in values)


def pool(directories: list[Path], workload: str) -> dict[str, Any]:
    """Per arm: seeds, steps and times over all runs; per kaisa arm: the ratios."""
    arms: dict[str, dict[str, list[Any]]] = {}
    per_seed_ratios: dict[str, list[float | None]] = {}
    for directory in directories:
        results = json.loads((directory / workload / "results.json").read_text())
        for arm, data in results["arms"].items():
            pooled = arms.setdefault(arm, {"seeds": [], "steps": [], "times": []})
            for run in data["per_seed"]:
                pooled["seeds"].append(run["seed"])
                pooled["steps"].append(run.get("steps_to_target"))
                pooled["times"].append(run.get("time_to_target_s"))
        for arm, comparison in results["comparisons"].items():
            if arm.startswith("kaisa"):
                ratios = comparison["vs_best"]["per_seed"].values()
                per_seed_ratios.setdefault(arm, []).extend(ratios)
    medians = {arm: _median(p["times"]) for arm, p in arms.items()}
    others = {arm: t for arm, t in medians.items() if not arm.startswith("kaisa")}
    best = min(others, key=lambda arm: others[arm])
    out: dict[str, Any] = {"best_other": best, "arms": {}}
    for arm, p in arms.items():
        row: dict[str, Any] = {**p, "median_time_s": medians[arm]}
        if arm in per_seed_ratios:
            row["ratio_of_medians"] = medians[arm] / others[best]
            row["median_per_seed_ratio"] = _median(per_seed_ratios[arm])
        out["arms"][arm] = row
    return out


def common_workloads(directories: list[Path]) -> list[str]:
    """The workloads with a ``<workload>/results.json`` in every one of ``directories``."""
    held = [{p.parent.name for p in directory.glob("*/results.json")} for directory in directories]
    return sorted(set.intersection(*held)) if held else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directories", nargs="+", type=Path, help="kaisa demo output dirs")
    parser.add_argument(
        "--workloads", default=None, help="comma-separated; default: those every directory has"
    )
    args = parser.parse_args()
    workloads = args.workloads.split(",") if args.workloads else common_workloads(args.directories)
    if not workloads:
        parser.error("no workload has a results.json in every directory given")
    for workload in workloads:
        pooled = pool(args.directories, workload)
        print(f"{workload} (best other arm: {pooled['best_other']})")
        for arm, row in pooled["arms"].items():
            steps = "/".join("-" if s is None else str(s) for s in row["steps"])
            median = row["median_time_s"]
            line = f"  {arm:12} seeds {row['seeds']} steps {steps} median {median:.1f} s"
            if "ratio_of_medians" in row:
                line += (
                    f"  vs best other {row['ratio_of_medians']:.2f}x"
                    f" (median per-seed ratio {row['median_per_seed_ratio']:.2f})"
                )
            print(line)


if __name__ == "__main__":
    main()
