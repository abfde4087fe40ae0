"""Join the workloads of several ``kaisa demo`` output directories into one summary.

For a suite run in parts (an interrupted ``make demo`` and a second run of
the workloads it had not finished): each workload's ``results.json`` is read
from the directory that holds it, and the summary over workloads is written
(``summary.json``, ``summary.md``) exactly as a whole ``make demo`` writes it
at its end. A workload found in two directories is an error: name the run
to use. Nothing is re-measured; the load averages in the summary are those
recorded by the first and last workload. ::

    python benchmarks/join_suites.py --out benchmarks/results/suite-s17 \\
        runs/suite-s17 runs/suite-s17b
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from kaisa.demo.compare import summarize_suite
from kaisa.demo.config import WORKLOADS
from kaisa.demo.report import format_summary, write_summary


def collect(directories: list[Path]) -> dict[str, Path]:
    """Workload name -> the directory of its ``results.json``, in suite order."""
    found: dict[str, Path] = {}
    for directory in directories:
        for name in WORKLOADS:
            path = directory / name / "results.json"
            if not path.exists():
                continue
            if name in found:
                raise SystemExit(
                    f"join_suites: workload {name!r} is in both {found[name].parent} and "
                    f"{directory}; pass only the run to use"
                )
            found[name] = path.parent
    if not found:
        raise SystemExit(f"join_suites: no <workload>/results.json under {directories}")
    return {name: found[name] for name in WORKLOADS if name in found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directories", nargs="+", type=Path, help="kaisa demo output dirs")
    parser.add_argument("--out", type=Path, required=True, help="where the joined suite goes")
    args = parser.parse_args()
    workloads = collect(args.directories)
    results: list[dict[str, Any]] = []
    for name, source in workloads.items():
        results.append(json.loads((source / "results.json").read_text()))
        target = args.out / name
        if source.resolve() != target.resolve():
            shutil.copytree(source, target, dirs_exist_ok=True)
    summary = summarize_suite(results, results[0]["machine"].get("at_start"))
    summary["machine"]["at_end"] = results[-1]["machine"].get("at_end")
    summary["joined_from"] = {name: str(source) for name, source in workloads.items()}
    for path in write_summary(summary, args.out):
        print(f"wrote {path}")
    print(format_summary(summary))


if __name__ == "__main__":
    main()
