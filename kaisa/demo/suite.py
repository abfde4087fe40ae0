"""The whole benchmark: every workload in turn, its outputs, then the summary.

Shared by the one-process path (:mod:`kaisa.demo.cli`) and the workers of a
``--nproc`` run (:mod:`kaisa.demo.dist`): every rank trains, rank 0 writes
and prints. Each workload writes ``OUT/<workload>/{results.json,
evaluations.csv, accuracy.png}`` (``val_loss.png`` for the language model)
and prints its table as soon as it is done,
so an interrupted suite keeps the workloads it finished; the summary over
workloads (``OUT/summary.json``, ``OUT/summary.md``) comes last.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

from kaisa.demo.compare import machine_info, run_comparison, summarize, summarize_suite
from kaisa.demo.config import SuiteConfig
from kaisa.demo.datasets import Dataset, DatasetKey
from kaisa.demo.report import format_summary, format_table, write_outputs, write_summary
from kaisa.demo.train import DistContext

__all__ = ["run_suite"]


def run_suite(
    suite: SuiteConfig,
    data: Dataset | dict[DatasetKey, Dataset],
    dist: DistContext | None = None,
) -> dict[str, Any] | None:
    """Run every workload of ``suite``; the summary document on rank 0, ``None`` elsewhere.

    ``data`` maps each workload's ``(dataset, data_dir)`` to its loaded data
    (:func:`~kaisa.demo.datasets.load_suite_data`); a single data set serves
    every workload.
    """
    dist = dist or DistContext()
    suite_start = machine_info()
    start = time.perf_counter()
    results: list[dict[str, Any]] = []
    for i, config in enumerate(suite.workloads):
        if dist.is_main and len(suite.workloads) > 1:
            print(f"\n== workload {i + 1}/{len(suite.workloads)}: {config.name}", flush=True)
        before = machine_info()
        w_start = time.perf_counter()
        mine = data[(config.dataset, config.data_dir)] if isinstance(data, dict) else data
        runs = run_comparison(config, mine, dist)
        if dist.is_main:
            res = summarize(config, runs, before, time.perf_counter() - w_start, mine)
            paths = write_outputs(runs, res, Path(config.out_dir))
            print()
            print(format_table(res))
            for p in paths:
                print(f"wrote {p}")
            results.append(res)
        del runs
        gc.collect()
    if not dist.is_main:
        return None
    summary = summarize_suite(results, suite_start, time.perf_counter() - start)
    paths = write_summary(summary, Path(suite.out_dir))
    print()
    print(format_summary(summary))
    for p in paths:
        print(f"wrote {p}")
    return summary
