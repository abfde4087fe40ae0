"""Run both arms over all seeds and summarise them as ``results.json`` holds them.

For each seed the arms train in lockstep, one step of each in turn
(:func:`~kaisa.demo.train.train_arms_in_lockstep`), so that a change in the
machine's load during the comparison slows both arms alike; with
``DemoConfig.lockstep`` off they run one after the other (``sgd`` seed 0,
``kaisa`` seed 0, ``sgd`` seed 1, ...), each with the process to itself.

Summaries are medians over seeds; a seed that never reached the target
counts as an infinite time, so the median time to target is ``null`` when
fewer than half the seeds reached it.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from kaisa.demo.config import DemoConfig
from kaisa.demo.data import FashionMNIST
from kaisa.demo.train import DistContext, RunResult, train_arm, train_arms_in_lockstep

__all__ = ["machine_info", "run_comparison", "summarize"]


def run_comparison(
    config: DemoConfig, data: FashionMNIST, dist: DistContext | None = None
) -> list[RunResult]:
    """Train every arm of ``config`` for every seed; the runs in the order made."""
    runs: list[RunResult] = []
    for seed in config.seeds:
        if config.lockstep:
            runs += train_arms_in_lockstep(
                data, config, config.arms, seed, dist, progress=config.progress
            )
            continue
        for arm in config.arms:
            runs.append(train_arm(data, config, arm, seed, dist, progress=config.progress))
    return runs


def _median(values: Sequence[float | None]) -> float | None:
    """Median with ``None`` as +infinity; ``None`` if the median is infinite."""
    if not values:
        return None
    finite = [math.inf if v is None else float(v) for v in values]
    m = statistics.median(finite)
    return None if math.isinf(m) else m


def _median_known(values: Sequence[float | None]) -> float | None:
    known = [float(v) for v in values if v is not None]
    return statistics.median(known) if known else None


def _paired_ratios(
    sgd: Sequence[dict[str, Any]], kaisa: Sequence[dict[str, Any]]
) -> dict[str, float | None]:
    """KAISA's time to the target over SGD's, seed by seed (same seed, same data order).

    Keyed by the seed as a string (JSON keys are strings). A seed that only
    SGD reached gives ``None`` (an infinite ratio, as in the medians); one
    that KAISA reached and SGD did not gives ``0.0``; one neither reached is
    left out.
    """
    times = {row["seed"]: row["time_to_target_s"] for row in sgd}
    out: dict[str, float | None] = {}
    for row in kaisa:
        seed, k = row["seed"], row["time_to_target_s"]
        if seed not in times:
            continue
        s = times[seed]
        if s is None and k is None:
            continue
        if k is None:
            out[str(seed)] = None
        elif s is None:
            out[str(seed)] = 0.0
        elif s > 0:
            out[str(seed)] = k / s
    return out


def machine_info() -> dict[str, Any]:
    """The machine and its load, for the record."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load: list[float] | None = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15": load,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def summarize(
    config: DemoConfig,
    runs: Sequence[RunResult],
    machine_before: dict[str, Any] | None = None,
    wall_seconds: float | None = None,
) -> dict[str, Any]:
    """The ``results.json`` document for ``runs`` made with ``config``."""
    target = config.target_accuracy
    arms: dict[str, Any] = {}
    for arm in config.arms:
        mine = [r for r in runs if r.arm == arm.name]
        per_seed = [r.summary(target) for r in mine]

        def col(key: str, rows: list[dict[str, Any]] = per_seed) -> list[Any]:
            return [row[key] for row in rows]

        reached = sum(1 for v in col("time_to_target_s") if v is not None)
        arms[arm.name] = {
            "time_to_target_s": _median(col("time_to_target_s")),
            "steps_to_target": _median(col("steps_to_target")),
            "epochs_to_target": _median(col("epochs_to_target")),
            "final_test_accuracy": _median_known(col("final_test_accuracy")),
            "best_test_accuracy": _median_known(col("best_test_accuracy")),
            "seconds_per_step": _median_known(col("seconds_per_step")),
            "kfac_seconds_per_step": _median_known(col("kfac_seconds_per_step")),
            "peak_memory_mb": _median_known(col("peak_memory_mb")),
            "peak_memory_increase_mb": _median_known(col("peak_memory_increase_mb")),
            "seeds_reaching_target": reached,
            "seeds": len(mine),
            "hyperparameters": arm.hyperparameters(),
            "per_seed": per_seed,
        }
    ratio = None
    paired: dict[str, float | None] = {}
    names = [a.name for a in config.arms]
    if "sgd" in arms and "kaisa" in arms:
        s, k = arms["sgd"]["time_to_target_s"], arms["kaisa"]["time_to_target_s"]
        if s is not None and k is not None and s > 0:
            ratio = k / s
        paired = _paired_ratios(arms["sgd"]["per_seed"], arms["kaisa"]["per_seed"])
    steps_per_epoch = runs[0].steps_per_epoch if runs else None
    return {
        "target_accuracy": target,
        "kaisa_time_ratio": ratio,
        "kaisa_time_ratio_per_seed": paired,
        "kaisa_time_ratio_per_seed_median": _median(list(paired.values())) if paired else None,
        "arms": arms,
        "arm_order": names,
        "shared": {
            "model": config.model,
            "epochs": config.epochs,
            "batch_size": config.batch_size,
            "steps_per_epoch": steps_per_epoch,
            "warmup_epochs": config.warmup_epochs,
            "lr_schedule": "linear warm-up, then cosine to 0 (per step)",
            "eval_every_steps": config.eval_every,
            "eval_every_steps_near_target": config.eval_every_near
            or max(1, config.eval_every // 4),
            "near_target_margin": config.near_margin,
            "seeds": list(config.seeds),
            "threads_per_process": config.threads,
            "nproc": config.nproc,
            "data_dir": config.data_dir,
            "quick": config.quick,
            "channels_last": config.channels_last,
            "lockstep": config.lockstep,
        },
        "machine": {
            "at_start": machine_before,
            "at_end": machine_info(),
        },
        "wall_seconds": wall_seconds,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
