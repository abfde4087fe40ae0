"""Run every arm over all seeds and summarise them as ``results.json`` holds them.

For each seed the arms train in lockstep, one step of each in turn
(:func:`~kaisa.demo.train.train_arms_in_lockstep`), so that a change in the
machine's load during the comparison slows all arms alike; with
``DemoConfig.lockstep`` off they run one after the other (``sgd`` seed 0,
``adamw`` seed 0, ..., ``sgd`` seed 1, ...), each with the process to itself.

Summaries are medians over seeds; a seed that never reached the target
counts as an infinite time, so the median time to target is ``null`` when
fewer than half the seeds reached it.

Each arm is compared with the best *other* arm (:func:`compare_arms`): a
kaisa arm with the best arm without K-FAC (K-FAC's value is whether it beats
every plain optimizer, not just its own base), any other arm with the best
arm but itself. "Best" is the smallest median time to the target; the
steps to the target are compared with the fewest among the same arms
(``vs_fewest_steps``). The kaisa arms are also compared with their own base
optimizer (``vs_base``).
:func:`summarize_suite` collects these rows over workloads.
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

from kaisa.demo.config import KAISA_ARMS, METRICS, WORKLOADS, DemoConfig
from kaisa.demo.datasets import Dataset
from kaisa.demo.optimizers import native_bfloat16
from kaisa.demo.text import TextCorpus
from kaisa.demo.train import DistContext, RunResult, train_arm, train_arms_in_lockstep

__all__ = [
    "compare_arms",
    "cpu_features",
    "machine_info",
    "run_comparison",
    "summarize",
    "summarize_suite",
]


def run_comparison(
    config: DemoConfig, data: Dataset, dist: DistContext | None = None
) -> list[RunResult]:
    """Train every arm of ``config`` for every seed; the runs in the order made."""
    runs: list[RunResult] = []
    stop = config.stop_at_target
    for seed in config.seeds:
        if config.lockstep:
            runs += train_arms_in_lockstep(
                data, config, config.arms, seed, dist, progress=config.progress, stop_at_target=stop
            )
            continue
        for arm in config.arms:
            runs.append(
                train_arm(
                    data, config, arm, seed, dist, progress=config.progress, stop_at_target=stop
                )
            )
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
    base: Sequence[dict[str, Any]], other: Sequence[dict[str, Any]]
) -> dict[str, float | None]:
    """``other``'s time to the target over ``base``'s, seed by seed (same seed, same data).

    Keyed by the seed as a string (JSON keys are strings). A seed that only
    ``base`` reached gives ``None`` (an infinite ratio, as in the medians); one
    that ``other`` reached and ``base`` did not gives ``0.0``; one neither
    reached, or that ``base`` has no run for, is left out.
    """
    times = {row["seed"]: row["time_to_target_s"] for row in base}
    out: dict[str, float | None] = {}
    for row in other:
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


def _ratio_to(arms: dict[str, Any], name: str, other: str | None) -> dict[str, Any]:
    """``name``'s median time to the target over ``other``'s, and the same seed by seed."""
    if other is None:
        return {"arm": None, "time_ratio": None, "per_seed": {}, "per_seed_median": None}
    mine, theirs = arms[name]["time_to_target_s"], arms[other]["time_to_target_s"]
    ratio = mine / theirs if mine is not None and theirs else None
    paired = _paired_ratios(arms[other]["per_seed"], arms[name]["per_seed"])
    return {
        "arm": other,
        "time_ratio": ratio,
        "per_seed": paired,
        "per_seed_median": _median(list(paired.values())) if paired else None,
    }


def _fewest_steps(arms: dict[str, Any], name: str, candidates: Sequence[str]) -> dict[str, Any]:
    """``name``'s median steps to the target over the fewest among ``candidates``.

    ``arm`` is ``None`` when no candidate reached the target; ``steps_ratio``
    is ``None`` when ``name`` did not (or the record holds no steps).
    """
    known = [(arms[a].get("steps_to_target"), i, a) for i, a in enumerate(candidates)]
    reached = [k for k in known if k[0] is not None]
    if not reached:
        return {"arm": None, "steps_ratio": None}
    fewest, _, other = min(reached)
    mine = arms[name].get("steps_to_target")
    ratio = mine / fewest if mine is not None and fewest > 0 else None
    return {"arm": other, "steps_ratio": ratio}


def compare_arms(arms: dict[str, Any]) -> dict[str, Any]:
    """Each arm against the best other arm (and a kaisa arm against its base optimizer).

    ``arms`` maps an arm's name to at least ``time_to_target_s`` (median over
    seeds, ``None`` if not reached) and ``per_seed`` (rows with ``seed`` and
    ``time_to_target_s``), as in ``results.json``. Returns per arm
    ``{"vs_best": {...}, "vs_base": {...}}`` (``vs_base`` for kaisa arms whose
    base arm ran) where each comparison has ``arm`` (the other arm, ``None``
    if none reached the target), ``time_ratio`` (mine over theirs, ``None`` if
    I did not reach it), ``per_seed`` and ``per_seed_median``. The best other
    arm is the one with the smallest median time among the candidates: for a
    kaisa arm every arm without K-FAC, for any other arm every arm but itself;
    ties go to the earlier arm. ``vs_fewest_steps`` compares the median steps
    to the target (``steps_to_target``, where the arms have it) with the
    fewest among the same candidates: ``arm`` and ``steps_ratio``. On a GPU,
    where a cheap-step optimizer's overhead shrinks, steps are what it
    competes on.
    """
    out: dict[str, Any] = {}
    for name in arms:
        if name in KAISA_ARMS:
            candidates = [a for a in arms if a not in KAISA_ARMS]
        else:
            candidates = [a for a in arms if a != name]
        timed = [(arms[a]["time_to_target_s"], i, a) for i, a in enumerate(candidates)]
        reached = [t for t in timed if t[0] is not None]
        best = min(reached)[2] if reached else None
        entry: dict[str, Any] = {
            "vs_best": _ratio_to(arms, name, best),
            "vs_fewest_steps": _fewest_steps(arms, name, candidates),
        }
        base = KAISA_ARMS.get(name)
        if base is not None and base in arms:
            entry["vs_base"] = _ratio_to(arms, name, base)
        out[name] = entry
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
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        **cpu_features(),
    }


def cpu_features() -> dict[str, Any]:
    """The CPU's vector capability as torch sees it and whether it has native bfloat16.

    Two machines that report the same model name can differ here (AVX2
    against AVX-512 with BF16), and timings with them: bfloat16 work (Muon's
    iteration in ``torch.optim.Muon``, ``factor_product_dtype``) is emulated
    without it.
    """
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_native_bfloat16": native_bfloat16(torch.device("cpu")),
    }


def _phase_medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    phases = sorted({k for row in rows for k in row["kfac_phase_seconds"]})
    return {
        p: statistics.median([float(row["kfac_phase_seconds"].get(p, 0.0)) for row in rows])
        for p in phases
    }


def _data_record(config: DemoConfig, data: Dataset | None) -> dict[str, Any]:
    """What ``results.json`` says about a text workload's data (nothing for images)."""
    if not isinstance(data, TextCorpus):
        return {}
    from kaisa.demo.text import VALIDATION_PERCENT, VALIDATION_WINDOWS

    windows = min(VALIDATION_WINDOWS, int(data.val.numel()) // (config.context + 1))
    return {
        "corpus": {
            "directory": data.directory,
            "files": data.files,
            "records": data.records,
            "train_records": data.train_records,
            "val_records": data.val_records,
            "train_bytes": int(data.train.numel()),
            "val_bytes": int(data.val.numel()),
            "fingerprint": data.fingerprint,
            "validation": f"{VALIDATION_PERCENT}% of records by SHA-256; {windows} fixed "
            f"windows of {config.context} bytes",
        }
    }


def summarize(
    config: DemoConfig,
    runs: Sequence[RunResult],
    machine_before: dict[str, Any] | None = None,
    wall_seconds: float | None = None,
    data: Dataset | None = None,
) -> dict[str, Any]:
    """The ``results.json`` document for ``runs`` made with ``config`` (on ``data``, if given).

    The metric's values per arm are ``final_<key>`` and ``best_<key>``
    (``final_test_accuracy``; ``final_val_loss`` for the language model);
    ``target`` is the target of ``metric`` (an image workload also records it
    as ``target_accuracy``, as before metrics were named).
    """
    target = config.target
    metric = config.metric_spec
    key = metric.key
    arms: dict[str, Any] = {}
    for arm in config.arms:
        mine = [r for r in runs if r.arm == arm.name]
        per_seed = [r.summary(target) for r in mine]

        def col(key: str, rows: list[dict[str, Any]] = per_seed) -> list[Any]:
            return [row[key] for row in rows]

        reached = sum(1 for v in col("time_to_target_s") if v is not None)
        entry: dict[str, Any] = {
            "time_to_target_s": _median(col("time_to_target_s")),
            "steps_to_target": _median(col("steps_to_target")),
            "epochs_to_target": _median(col("epochs_to_target")),
            f"final_{key}": _median_known(col(f"final_{key}")),
            f"best_{key}": _median_known(col(f"best_{key}")),
            "seconds_per_step": _median_known(col("seconds_per_step")),
            "kfac_seconds_per_step": _median_known(col("kfac_seconds_per_step")),
            "peak_memory_mb": _median_known(col("peak_memory_mb")),
            "peak_memory_increase_mb": _median_known(col("peak_memory_increase_mb")),
            "seeds_reaching_target": reached,
            "seeds": len(mine),
            "hyperparameters": arm.hyperparameters(),
            "optimizer_info": mine[0].optimizer_info if mine else {},
        }
        if arm.kfac is not None:
            entry["kfac_share"] = _median_known(col("kfac_share"))
            entry["kfac_phase_seconds"] = _phase_medians(per_seed)
            entry["kfac_options"] = mine[0].kfac_options if mine else {}
            entry["curvature_choice"] = mine[0].kfac_choice if mine else {}
            entry["interval_stretch"] = mine[0].interval_stretch if mine else {}
        entry["per_seed"] = per_seed
        arms[arm.name] = entry
    steps_per_epoch = runs[0].steps_per_epoch if runs else None
    workload = WORKLOADS.get(config.name)
    head: dict[str, Any] = {"workload": config.name}
    if metric.name == "accuracy":
        head["target_accuracy"] = target
    head.update(
        metric=metric.name,
        metric_label=metric.label,
        metric_unit=metric.unit,
        higher_is_better=metric.higher_is_better,
        target=target,
    )
    shared_text: dict[str, Any] = {}
    if config.dataset != "fashion_mnist":
        shared_text = {
            "dataset": config.dataset,
            "max_steps": config.max_steps,
            "warmup_steps": config.warmup_steps,
            "context": config.context,
            "step_limit": config.step_limit,
            **_data_record(config, data),
        }
    return {
        **head,
        "provisional": workload.provisional if workload else None,
        "workload_note": workload.note if workload else "",
        "comparisons": compare_arms(arms),
        "arms": arms,
        "arm_order": [a.name for a in config.arms],
        "shared": {
            "model": config.model,
            "epochs": config.epochs,
            "batch_size": config.batch_size,
            "steps_per_epoch": steps_per_epoch,
            "warmup_epochs": config.warmup_epochs,
            "lr_schedule": "linear warm-up, then cosine to 0 (per step), on each arm's peak",
            "eval_every_steps": config.eval_every,
            "eval_every_steps_near_target": config.eval_every_near
            or max(1, config.eval_every // 4),
            "near_target_margin": config.near_margin,
            "stop_at_target": config.stop_at_target,
            "seeds": list(config.seeds),
            "threads_per_process": config.threads,
            "nproc": config.nproc,
            "device": config.device,
            "data_dir": config.data_dir,
            "quick": config.quick,
            "channels_last": config.channels_last,
            "lockstep": config.lockstep,
            "muon_conv_filters": "Muon (kaisa.demo.optimizers.ConvMuon on (out, in*kh*kw))",
            **shared_text,
        },
        "machine": {
            "at_start": machine_before,
            "at_end": machine_info(),
        },
        "wall_seconds": wall_seconds,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def summarize_suite(
    results: Sequence[dict[str, Any]],
    machine_before: dict[str, Any] | None = None,
    wall_seconds: float | None = None,
) -> dict[str, Any]:
    """``summary.json``: one row per (workload, arm) from the workloads' ``results.json``.

    Each row has the medians over seeds (steps and time to the target, ms per
    step), the ratio to the best other arm (:func:`compare_arms`; ``ratio``
    and ``vs``), and for kaisa arms K-FAC's share of the training clock and
    its per-phase seconds (medians over seeds), plus the ratio to the base
    optimizer (``base_ratio``, ``base``).
    """
    rows: list[dict[str, Any]] = []
    for res in results:
        metric = _metric_of(res)
        # Records made before the steps comparison existed: made from their arms.
        recorded = res["comparisons"]
        if any("vs_fewest_steps" not in recorded[name] for name in res["arm_order"]):
            recorded = {
                name: {**recorded[name], "vs_fewest_steps": made["vs_fewest_steps"]}
                for name, made in compare_arms(res["arms"]).items()
            }
        for name in res["arm_order"]:
            arm = res["arms"][name]
            comp = recorded[name]
            spp = arm["seconds_per_step"]
            row: dict[str, Any] = {"workload": res["workload"], "arm": name}
            if metric == "accuracy":
                row["target_accuracy"] = _target_of(res)
            else:
                row.update(metric=metric, target=_target_of(res))
            row.update({
                "seeds": arm["seeds"],
                "seeds_reaching_target": arm["seeds_reaching_target"],
                "steps_to_target": arm["steps_to_target"],
                "ms_per_step": None if spp is None else 1000.0 * spp,
                "time_to_target_s": arm["time_to_target_s"],
                "ratio": comp["vs_best"]["time_ratio"],
                "vs": comp["vs_best"]["arm"],
                "ratio_per_seed_median": comp["vs_best"]["per_seed_median"],
                "steps_ratio": comp["vs_fewest_steps"]["steps_ratio"],
                "steps_vs": comp["vs_fewest_steps"]["arm"],
                "lr": arm["hyperparameters"]["lr"],
                "lr_source": arm["hyperparameters"].get("lr_source", ""),
            })  # fmt: skip
            if "vs_base" in comp:
                row["base"] = comp["vs_base"]["arm"]
                row["base_ratio"] = comp["vs_base"]["time_ratio"]
            if "kfac_share" in arm:
                row["kfac_share"] = arm["kfac_share"]
                row["kfac_phase_seconds"] = arm["kfac_phase_seconds"]
                row["curvature_choice"] = arm.get("curvature_choice") or {}
                row["interval_stretch"] = arm.get("interval_stretch") or {}
                row["profile"] = (arm.get("kfac_options") or {}).get("profile")
            rows.append(row)
    return {
        "rows": rows,
        "workloads": {r["workload"]: _workload_entry(r) for r in results},
        "seeds": results[0]["shared"]["seeds"] if results else [],
        "stop_at_target": results[0]["shared"]["stop_at_target"] if results else None,
        "device": ", ".join(sorted({str(r["shared"].get("device", "cpu")) for r in results})),
        "machine": {"at_start": machine_before, "at_end": machine_info()},
        "wall_seconds": wall_seconds,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _metric_of(res: dict[str, Any]) -> str:
    """A ``results.json``'s metric (``"accuracy"`` for documents that do not name one)."""
    metric = str(res.get("metric", "accuracy"))
    return metric if metric in METRICS else "accuracy"


def _target_of(res: dict[str, Any]) -> float:
    target = res.get("target", res.get("target_accuracy"))
    return float(target) if target is not None else math.nan


def _workload_entry(res: dict[str, Any]) -> dict[str, Any]:
    """One workload's line of ``summary.json``: its target (and metric), budget and results."""
    metric = _metric_of(res)
    entry: dict[str, Any] = {}
    if metric == "accuracy":
        entry["target_accuracy"] = _target_of(res)
    else:
        entry.update(metric=metric, target=_target_of(res))
    entry["epochs"] = res["shared"]["epochs"]
    if res["shared"].get("max_steps") is not None:
        entry["max_steps"] = res["shared"]["max_steps"]
    entry["provisional"] = res["provisional"]
    entry["results"] = f"{res['workload']}/results.json"
    return entry
