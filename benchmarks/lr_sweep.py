"""Learning-rate sweeps: the benchmark suite's (``--suite``) and the original two-arm one.

**The suite's sweep** (``--suite``) is the one committed procedure behind the
peak learning rate of every (workload, arm) of ``kaisa demo``. For each
selected workload (``--workloads``, default the demo's) and arm (``--arms``,
default all six) it trains one run per learning rate of the arm's family grid
(:data:`SUITE_GRIDS`: SGD and kaisa-sgd 0.025-0.4; AdamW, kaisa-adamw and SOAP
5e-4-8e-3; Muon's matrix LR 0.005-0.08 with its AdamW group at the demo's
fixed ratio) on seed 0, stopping at the workload's target, with exactly the
demo's settings (each configuration is built by ``kaisa demo``'s own option
parser, so the kaisa arms use the library's K-FAC defaults). Runs are
appended to ``results/suite_sweep.json`` (resumable: runs already there are
skipped; a kaisa run is redone when the library's K-FAC defaults change), and
the best learning rate per (workload, arm) is written to
``results/suite_lrs.json``, which ``kaisa demo`` reads. Best = fewest steps to
the target (steps carry no load noise, and within one arm every LR costs the
same per step), then the higher accuracy at the stop, then the shorter time;
an LR that never reached the target ranks after all that did, by its best
accuracy. An entry whose best LR is at the end of the grid says so
(``at_grid_edge``): the procedure then widens the grid there by a factor of 2
(``--arms ARM --lrs LR``) until the best lies inside. The committed
``suite_lrs.json`` (2026-11-24) came from three points per family around
the fallback table (SGD and kaisa-sgd 0.025-0.1 or 0.05-0.2, AdamW, SOAP and
kaisa-adamw 1e-3-4e-3, Muon 0.01-0.04), widened that way; none is at an
edge.

The language model (``--workloads gpt``) sweeps the same way on its own
data (``--text-dir``, default the ``fortunes`` package's directory) with its
own batch (16 windows of 64 bytes), step budget (1500), evaluation interval
(50) and metric: "the target" is a validation loss in nats per byte reached
at or below it, and ties on steps go to the lower loss at the stop. Its
grids are :data:`SUITE_GRIDS` too (its unswept fallback LRs, SGD 0.3, AdamW,
SOAP and kaisa-adamw 3e-3, Muon 0.02, lie inside them); Muon's AdamW group
runs at the workload's ratio (0.15 for gpt). ``--batch-size``,
``--warmup-epochs`` and ``--eval-every`` replace the workloads' only when
given. ::

    python benchmarks/lr_sweep.py --suite                          # everything (hours)
    python benchmarks/lr_sweep.py --suite --workloads gap_cnn --arms sgd,kaisa-sgd
    python benchmarks/lr_sweep.py --suite --workloads gpt            # the language model
    python benchmarks/lr_sweep.py --suite --write-lrs              # rebuild suite_lrs.json only
    # a smoke check (tiny data, two LRs, one epoch, files under /tmp):
    python benchmarks/lr_sweep.py --suite --data-dir DIR --epochs 1 --lrs 0.01,0.1 \
        --out /tmp/sweep.json --lrs-out /tmp/lrs.json

``--lrs`` replaces every selected arm's grid (for smoke checks or a
refinement of one family); ``--epochs`` and ``--target`` replace the
workloads' (the records keep them, and ``suite_lrs.json`` names them).

**The original sweep** (``--arm sgd|kaisa``, gap_cnn, explicit K-FAC settings)
is kept for its recorded results in ``results/lr_sweep.json``. Each
configuration is one full demo run of one arm (same model, data order, batch,
epoch budget, warm-up + cosine schedule and weight decay as the demo), and
its time to the target, final accuracy and time per step are appended to a
JSON file, so a sweep can be run in pieces and resumed (configurations
already in the file are skipped). ``--report`` prints the table and the best
configuration per arm: the smallest median time to the target, ties broken
by final accuracy; a configuration that never reached the target ranks by
its final accuracy after all that did.

Examples (the original sweep kept in ``benchmarks/results/``)::

    python benchmarks/lr_sweep.py --arm sgd --lrs 0.025,0.05,0.1,0.2,0.4
    python benchmarks/lr_sweep.py --arm kaisa --lrs 0.025,0.05,0.1,0.2,0.4
    python benchmarks/lr_sweep.py --report

``--stop-at-target`` ends each run at the first evaluation that reaches the
target: the time and steps to the target are the same as in a full run (the
evaluation schedule decides them), at about half the cost, but the "final"
accuracy is then the accuracy at the target. Such runs are recorded and
summarised separately from full runs.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kaisa.demo.cli import DemoError, build_config, parse_args
from kaisa.demo.compare import machine_info
from kaisa.demo.config import (
    ARM_NAMES,
    DEFAULT_LR_FILE,
    DEFAULT_WORKLOADS,
    METRICS,
    WORKLOADS,
    ArmConfig,
    DemoConfig,
    KfacConfig,
    base_arm,
)
from kaisa.demo.data import load_fashion_mnist
from kaisa.demo.datasets import Dataset, DatasetKey, default_directory, load_dataset
from kaisa.demo.train import build_demo_model, kfac_options, train_arm

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "lr_sweep.json"
SUITE_OUT = RESULTS / "suite_sweep.json"
SUITE_LRS = DEFAULT_LR_FILE

_SGD_GRID = (0.025, 0.05, 0.1, 0.2, 0.4)
_ADAM_GRID = (5e-4, 1e-3, 2e-3, 4e-3, 8e-3)
SUITE_GRIDS: dict[str, tuple[float, ...]] = {
    "sgd": _SGD_GRID,
    "kaisa-sgd": _SGD_GRID,
    "adamw": _ADAM_GRID,
    "kaisa-adamw": _ADAM_GRID,
    "soap": _ADAM_GRID,
    "muon": (0.005, 0.01, 0.02, 0.04, 0.08),
}
"""Peak learning rates tried per arm (Muon: the matrix LR; its AdamW group at the demo's ratio)."""


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _kl(text: str) -> list[float | None]:
    return [None if v.strip().lower() == "none" else float(v) for v in text.split(",") if v.strip()]


def _intervals(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        factor, _, inverse = item.partition("/")
        pairs.append((int(factor), int(inverse)))
    return pairs


def _settings(rec: dict[str, Any]) -> list[Any]:
    """What makes runs comparable: everything that identifies a run but its seed."""
    c = rec["config"]
    return [c["model"], c["epochs"], c["batch_size"], c["target_accuracy"], rec["arm"],
            rec["hyperparameters"], c.get("stop_at_target", False), c.get("threads"),
            c.get("channels_last", False)]  # fmt: skip


def _key(rec: dict[str, Any]) -> str:
    """One run: its settings and its seed (a sweep skips runs already in the file)."""
    return json.dumps([*_settings(rec), rec["seed"]], sort_keys=True)


def _load(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    data: list[dict[str, Any]] = json.loads(path.read_text())["runs"]
    return data


def _save(path: Path, runs: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "description": "kaisa demo learning-rate sweep; one record per (arm, settings, seed)",
        "runs": runs,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def _label(rec: dict[str, Any]) -> str:
    h = rec["hyperparameters"]
    text = f"lr={h['lr']:g}"
    if h.get("momentum", 0.9) != 0.9:
        text += f" momentum={h['momentum']:g}"
    k = h.get("kfac")
    if k:
        text += (
            f" damping={k.get('damping')} kl_clip={k.get('kl_clip')}"
            f" f/i={k.get('factor_update_steps')}/{k.get('inv_update_steps')}"
        )
        if k.get("factor_decay", 0.95) != 0.95:
            text += f" decay={k['factor_decay']:g}"
        if k.get("conv_factor_estimator", "expand") != "expand":
            text += f" conv={k['conv_factor_estimator']}"
        if k.get("damping_mode", "absolute") != "absolute":
            text += f" {k['damping_mode']}"
        if k.get("factor_init", "identity") != "identity":
            text += f" init={k['factor_init']}"
    return text


def summarize(runs: list[dict[str, Any]], target: float | None) -> list[dict[str, Any]]:
    """One row per (model, epochs, batch, arm, settings): medians over seeds."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for rec in runs:
        groups.setdefault(json.dumps(_settings(rec), sort_keys=True), []).append(rec)
    rows = []
    for recs in groups.values():
        c = recs[0]["config"]
        if target is not None and not math.isclose(c["target_accuracy"], target):
            continue
        recs.sort(key=lambda r: r["seed"])
        times = [r["result"]["time_to_target_s"] for r in recs]
        finite = [math.inf if t is None else t for t in times]
        med = statistics.median(finite)
        rows.append(
            {
                "model": c["model"],
                "epochs": c["epochs"],
                "target": c["target_accuracy"],
                "arm": recs[0]["arm"],
                "settings": _label(recs[0])
                + (" [channels_last]" if c.get("channels_last") else "")
                + (" [to target]" if c.get("stop_at_target") else ""),
                "stop_at_target": bool(c.get("stop_at_target", False)),
                "threads": c.get("threads"),
                "seeds": len(recs),
                "steps_per_seed": "/".join(
                    str(r["result"]["steps_to_target"] or "-") for r in recs
                ),
                "reached": sum(t is not None for t in times),
                "time_to_target_s": None if math.isinf(med) else med,
                "steps_to_target": statistics.median(
                    [r["result"]["steps_to_target"] or math.inf for r in recs]
                ),
                "final_test_accuracy": statistics.median(
                    [r["result"]["final_test_accuracy"] for r in recs]
                ),
                "best_test_accuracy": statistics.median(
                    [r["result"]["best_test_accuracy"] for r in recs]
                ),
                "ms_per_step": 1000
                * statistics.median([r["result"]["seconds_per_step"] for r in recs]),
                "hyperparameters": recs[0]["hyperparameters"],
            }
        )
    rows.sort(key=lambda r: (r["model"], r["epochs"], r["arm"], r["stop_at_target"], _rank(r)))
    return rows


def _rank(row: dict[str, Any]) -> tuple[float, float]:
    """Full runs: time to target, then final accuracy.

    Runs stopped at the target rank by steps to the target first: such sweeps
    are run several at a time on a shared machine, so their times carry the
    load of the moment, while the steps do not (all of an arm's settings cost
    about the same per step unless the intervals differ).
    """
    t = row["time_to_target_s"]
    t = t if t is not None else math.inf
    if row["stop_at_target"]:
        return (row["steps_to_target"], t)
    return (t, -row["final_test_accuracy"])


def report(path: Path, target: float | None) -> int:
    rows = summarize(_load(path), target)
    if not rows:
        print(f"no runs in {path}")
        return 1
    print(f"{'model':<9} {'ep':>2} {'arm':<5} {'settings':<62} {'seeds':>5} {'reached':>7} "
          f"{'t->target':>9} {'steps':>6} {'final':>6} {'best':>6} {'ms/step':>7}  "
          "steps per seed")  # fmt: skip
    best: dict[tuple[str, int, str], dict[str, Any]] = {}
    for r in rows:
        t = r["time_to_target_s"]
        steps = r["steps_to_target"]
        print(
            f"{r['model']:<9} {r['epochs']:>2} {r['arm']:<5} {r['settings']:<62} {r['seeds']:>5} "
            f"{r['reached']:>3}/{r['seeds']:<3} {'-' if t is None else f'{t:.1f}':>9} "
            f"{'-' if math.isinf(steps) else int(steps):>6} {r['final_test_accuracy']:>6.4f} "
            f"{r['best_test_accuracy']:>6.4f} {r['ms_per_step']:>7.1f}  {r['steps_per_seed']}"
        )
        best.setdefault((r["model"], r["epochs"], r["arm"], r["stop_at_target"]), r)
    print(
        "\nbest per arm (full runs: smallest median time to target, then final accuracy;"
        " [to target] runs: fewest median steps to the target):"
    )
    for (model, epochs, arm, _), r in best.items():
        print(f"  {model} {epochs} epochs {arm}: {r['settings']} (steps {r['steps_per_seed']})")
    csv_path = path.with_suffix(".csv")
    with csv_path.open("w", newline="") as f:
        fields = [k for k in rows[0] if k != "hyperparameters"]
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {csv_path}")
    return 0


# --- the benchmark suite's sweep ---------------------------------------------------


def _suite_config(args: argparse.Namespace, workload: str, arm: str, lr: float) -> DemoConfig:
    """The demo's own configuration of ``arm`` on ``workload`` at peak ``lr``, seed loop aside.

    The workload's batch, warm-up and evaluation interval unless the options
    replace them.
    """
    argv = ["--data-dir", args.data_dir, "--text-dir", args.text_dir, "--workload", workload,
            "--arms", arm, "--lr", f"{arm}={lr!r}", "--threads", str(args.threads),
            "--no-progress", "--stop-at-target", "--out", str(args.out.parent)]  # fmt: skip
    for flag, value in (
        ("--eval-every", args.eval_every),
        ("--batch-size", args.batch_size),
        ("--warmup-epochs", args.warmup_epochs),
        ("--epochs", args.epochs),
        ("--target", args.target),
    ):
        if value is not None:
            argv += [flag, str(value)]
    return build_config(parse_args(argv)).workloads[0]


def _resolved_kfac(config: DemoConfig, data: Dataset) -> dict[str, Any]:
    """The K-FAC options a kaisa arm runs with today (library defaults plus overrides)."""
    from kaisa import KFACPreconditioner

    arm = config.arms[0]
    if arm.kfac is None:
        return {}
    if config.dataset == "fortunes":
        model = build_demo_model(config.model, context=config.context)
    else:
        model = build_demo_model(config.model, data.image_shape)  # type: ignore[union-attr]
    pre = KFACPreconditioner(model, lr=arm.lr, **arm.kfac.overrides())
    pre.remove_hooks()
    # The arm's learning rate is in its hyperparameters; here it would tie every
    # run's record to the first learning rate of the grid it was swept with.
    return {k: v for k, v in kfac_options(pre).items() if k != "lr"}


def _suite_settings(config: DemoConfig) -> dict[str, Any]:
    """What identifies a sweep run's settings (an image workload's keys are as they always were)."""
    if config.metric == "accuracy":
        return {
            "workload": config.name,
            "model": config.model,
            "epochs": config.epochs,
            "batch_size": config.batch_size,
            "warmup_epochs": config.warmup_epochs,
            "target_accuracy": config.target,
            "eval_every": config.eval_every,
            "threads": config.threads,
            "stop_at_target": True,
            "channels_last": config.channels_last,
        }
    return {
        "workload": config.name,
        "model": config.model,
        "dataset": config.dataset,
        "epochs": config.epochs,
        "max_steps": config.max_steps,
        "batch_size": config.batch_size,
        "context": config.context,
        "warmup_epochs": config.warmup_epochs,
        "warmup_steps": config.warmup_steps,
        "metric": config.metric,
        "target": config.target,
        "eval_every": config.eval_every,
        "threads": config.threads,
        "stop_at_target": True,
    }


def _suite_key(rec: dict[str, Any]) -> str:
    return json.dumps(
        [rec["arm"], rec["hyperparameters"], rec["config"], rec.get("kfac_options", {}),
         rec["seed"]],
        sort_keys=True,
    )  # fmt: skip


def _suite_rank(row: dict[str, Any]) -> tuple[float, float, float]:
    """Fewest steps to the target, then the better metric at the stop, then less time.

    The metric is the row's ``metric`` (default accuracy, higher is better;
    a loss ranks lower first). A learning rate that never reached the target
    has infinite steps and ranks after all that did, by its best value.
    """
    metric = METRICS[row.get("metric", "accuracy")]
    sign = -1.0 if metric.higher_is_better else 1.0
    key = metric.key
    steps = row["steps_to_target"]
    t = row["time_to_target_s"]
    if steps is None:
        return (math.inf, sign * row[f"best_{key}"], math.inf)
    return (float(steps), sign * row[f"final_{key}"], t if t is not None else math.inf)


def suite_best(
    runs: list[dict[str, Any]],
    workload: str,
    arm: str,
    settings: dict[str, Any],
    kfac: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The best learning rate of ``arm`` on ``workload`` among the suite sweep's ``runs``.

    Only runs made with ``settings`` (see :func:`_suite_settings`; ``threads``
    aside, which changes times, not steps) and, for kaisa arms, the K-FAC
    options ``kfac`` count. Per learning rate the medians over seeds are
    ranked by :func:`_suite_rank`. Returns the ``suite_lrs.json`` entry or
    ``None`` without runs.
    """

    def same(c: dict[str, Any]) -> bool:
        keys = [k for k in settings if k != "threads"]
        return all(c.get(k) == settings[k] for k in keys)

    mine = [
        r
        for r in runs
        if r.get("suite")
        and r["arm"] == arm
        and r["config"].get("workload") == workload
        and same(r["config"])
        and (kfac is None or r.get("kfac_options", {}) == kfac)
    ]
    if not mine:
        return None
    metric = METRICS[str(settings.get("metric", "accuracy"))]
    key = metric.key
    by_lr: dict[float, list[dict[str, Any]]] = {}
    for r in mine:
        by_lr.setdefault(float(r["hyperparameters"]["lr"]), []).append(r)
    rows = []
    for lr, recs in by_lr.items():
        results = [r["result"] for r in recs]
        steps = [r["steps_to_target"] for r in results]
        times = [r["time_to_target_s"] for r in results]
        med_steps = statistics.median([math.inf if v is None else v for v in steps])
        med_time = statistics.median([math.inf if v is None else v for v in times])
        rows.append(
            {
                "lr": lr,
                "metric": metric.name,
                "seeds": sorted(r["seed"] for r in recs),
                "steps_to_target": None if math.isinf(med_steps) else med_steps,
                "time_to_target_s": None if math.isinf(med_time) else med_time,
                f"final_{key}": statistics.median([r[f"final_{key}"] for r in results]),
                f"best_{key}": statistics.median([r[f"best_{key}"] for r in results]),
            }
        )
    rows.sort(key=_suite_rank)
    best = rows[0]
    lrs = sorted(by_lr)
    at_stop = "accuracy_at_stop" if metric.name == "accuracy" else f"{metric.name}_at_stop"
    return {
        "lr": best["lr"],
        "reached": best["steps_to_target"] is not None,
        "steps_to_target": best["steps_to_target"],
        at_stop: best[f"final_{key}"],
        "at_grid_edge": len(lrs) > 1 and best["lr"] in (lrs[0], lrs[-1]),
        "grid": lrs,
        "by_lr": {
            f"{r['lr']:g}": r["steps_to_target"] for r in sorted(rows, key=lambda r: r["lr"])
        },
        "seeds": best["seeds"],
        "settings": {k: v for k, v in settings.items() if k != "threads"},
        "kfac_options": kfac or {},
    }


def _write_lrs(path: Path, entries: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Merge ``entries`` into the learning-rate file (other workloads and arms stay)."""
    doc: dict[str, Any] = {}
    if path.exists():
        doc = json.loads(path.read_text())
    doc["description"] = (
        "Best peak learning rate per (workload, arm) of kaisa demo, from "
        "benchmarks/lr_sweep.py --suite; kaisa demo reads 'lrs.<workload>.<arm>.lr'"
    )
    doc["procedure"] = (
        "per arm, a grid of the arm's family (SUITE_GRIDS in benchmarks/lr_sweep.py, or three "
        "points of it) on seed 0, widened by a factor of 2 at an edge until the best is inside; "
        "each run stopped at the workload's target with the demo's settings; best = fewest "
        "steps to the target, then the metric at the stop (higher accuracy; lower validation "
        "loss for gpt), then time; never reached ranks last, by its best value of the metric"
    )
    lrs = doc.setdefault("lrs", {})
    for (workload, arm), entry in entries.items():
        lrs.setdefault(workload, {})[arm] = entry
    doc["lrs"] = {w: {a: lrs[w][a] for a in ARM_NAMES if a in lrs[w]} for w in sorted(lrs)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def suite_main(args: argparse.Namespace) -> int:
    """``--suite``: sweep the selected (workload, arm) grids, then write the best LRs."""
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(
                f"--workloads: unknown workload {w!r}; allowed: {', '.join(WORKLOADS)}"
            )
    try:
        arms = [base_arm(a.strip()) for a in args.arms.split(",") if a.strip()]
    except ValueError as exc:
        raise SystemExit(f"--arms: {exc}") from None
    seeds = tuple(int(v) for v in args.seeds.split(","))
    torch.set_num_threads(args.threads)
    loaded: dict[DatasetKey, Dataset] = {}
    runs = _load(args.out)
    done = {_suite_key(r) for r in runs if r.get("suite")}
    entries: dict[tuple[str, str], dict[str, Any]] = {}
    for workload in workloads:
        for arm_name in arms:
            grid = args.lrs if args.lrs is not None else SUITE_GRIDS[arm_name]
            settings: dict[str, Any] = {}
            kfac: dict[str, Any] | None = None
            for lr in grid:
                try:
                    config = _suite_config(args, workload, arm_name, lr)
                except DemoError as exc:
                    raise SystemExit(f"lr_sweep.py: {exc}") from None
                arm = config.arms[0]
                settings = _suite_settings(config)
                key = (config.dataset, config.data_dir)
                if key not in loaded:
                    loaded[key] = load_dataset(*key)
                data = loaded[key]
                if kfac is None and arm.kfac is not None:
                    kfac = _resolved_kfac(config, data)
                hyper = {k: v for k, v in arm.hyperparameters().items() if k != "lr_source"}
                for seed in seeds:
                    rec: dict[str, Any] = {
                        "suite": True,
                        "arm": arm_name,
                        "seed": seed,
                        "hyperparameters": hyper,
                        "config": settings,
                        "kfac_options": kfac or {},
                    }
                    if args.write_lrs or _suite_key(rec) in done:
                        continue
                    before = machine_info()["load_average_1_5_15"]
                    run = train_arm(data, config, arm, seed, stop_at_target=True)
                    rec["result"] = run.summary(config.target)
                    rec["result"]["curve"] = [
                        [p.step, round(p.train_seconds, 3), round(p.value(config.metric), 4)]
                        for p in run.points
                    ]
                    rec["optimizer_info"] = run.optimizer_info
                    rec["load_average_before"] = before
                    rec["load_average_after"] = machine_info()["load_average_1_5_15"]
                    rec["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
                    runs.append(rec)
                    done.add(_suite_key(rec))
                    _save(args.out, runs)
                    r = rec["result"]
                    metric = config.metric_spec
                    print(
                        f"{workload} {arm_name} lr={lr:g} seed {seed}: steps to "
                        f"{metric.target_text(config.target)} {r['steps_to_target'] or '-'}, "
                        f"{'accuracy' if metric.name == 'accuracy' else 'loss'} "
                        f"{r[f'final_{metric.key}']:.4f}, "
                        f"{1000 * r['seconds_per_step']:.1f} ms/step, load {before}",
                        flush=True,
                    )
            best = suite_best(runs, workload, arm_name, settings, kfac)
            if best is None:
                print(f"{workload} {arm_name}: no runs with the current settings")
                continue
            entries[(workload, arm_name)] = best
            edge = " (at the edge of the grid)" if best["at_grid_edge"] else ""
            print(
                f"best {workload} {arm_name}: lr={best['lr']:g}{edge}, steps {best['by_lr']}",
                flush=True,
            )
    if entries:
        _write_lrs(args.lrs_out, entries)
        print(f"wrote {args.lrs_out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--suite", action="store_true", help="the benchmark suite's sweep (see above)")
    p.add_argument(
        "--workloads", default=",".join(DEFAULT_WORKLOADS), help="--suite: workloads to sweep"
    )
    p.add_argument("--arms", default=",".join(ARM_NAMES), help="--suite: arms to sweep")
    p.add_argument(
        "--write-lrs",
        action="store_true",
        help="--suite: only rebuild the learning-rate file from the runs already recorded",
    )
    p.add_argument(
        "--lrs-out", type=Path, default=SUITE_LRS, help="--suite: the learning-rate file"
    )
    p.add_argument("--arm", choices=("sgd", "kaisa"), help="the original sweep: one arm")
    p.add_argument(
        "--lrs", type=_floats, help="learning rates [--suite: the arm's grid; else 0.025-0.4]"
    )
    p.add_argument("--dampings", type=_floats, default=[0.003])
    p.add_argument("--kl-clips", type=_kl, default=[0.001])
    p.add_argument(
        "--intervals",
        type=_intervals,
        default=[(10, 100)],
        help="factor/inverse update intervals to sweep, e.g. 10/100,5/50",
    )
    p.add_argument("--damping-mode", choices=("absolute", "relative"), default="absolute")
    p.add_argument("--factor-init", choices=("identity", "first_batch"), default="identity")
    p.add_argument("--factor-decay", type=float, default=0.95)
    p.add_argument("--conv-factor-estimator", choices=("expand", "reduce"), default="expand")
    p.add_argument("--model", default="gap_cnn")
    p.add_argument("--epochs", type=int, help="[--suite: the workload's; else 3]")
    p.add_argument("--batch-size", type=int, help="[--suite: the workload's; else 128]")
    p.add_argument("--warmup-epochs", type=float, help="[--suite: the workload's; else 0.25]")
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--target", type=float, help="[--suite: the workload's; else 0.91]")
    p.add_argument("--eval-every", type=int, help="[--suite: the workload's; else 100]")
    p.add_argument("--seeds", default="0")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default=default_directory("fashion_mnist"))
    p.add_argument(
        "--text-dir", default=default_directory("fortunes"), help="--suite: gpt's corpus"
    )
    p.add_argument(
        "--out", type=Path, help="runs file [--suite: results/suite_sweep.json; else lr_sweep.json]"
    )
    p.add_argument(
        "--stop-at-target",
        action="store_true",
        help="end each run when it reaches the target (ranks by time/steps to target only)",
    )
    p.add_argument("--report", action="store_true", help="print the table and the best settings")
    args = p.parse_args(argv)
    if args.suite:
        args.out = args.out or SUITE_OUT
        return suite_main(args)
    args.out = args.out or DEFAULT_OUT
    if args.report or args.arm is None:
        return report(args.out, None)
    args.lrs = args.lrs or [0.025, 0.05, 0.1, 0.2, 0.4]
    args.epochs = args.epochs or 3
    args.target = args.target or 0.91
    args.batch_size = args.batch_size or 128
    args.warmup_epochs = 0.25 if args.warmup_epochs is None else args.warmup_epochs
    args.eval_every = args.eval_every or 100

    torch.set_num_threads(args.threads)
    data = load_fashion_mnist(args.data_dir)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    runs = _load(args.out)
    done = {_key(r) for r in runs}
    arms: list[ArmConfig] = []
    for lr in args.lrs:
        if args.arm == "sgd":
            arms.append(ArmConfig("sgd", lr, args.momentum, args.weight_decay))
            continue
        for damping, kl, (factor_steps, inv_steps) in itertools.product(
            args.dampings, args.kl_clips, args.intervals
        ):
            kfac = KfacConfig(
                factor_update_steps=factor_steps,
                inv_update_steps=inv_steps,
                damping=damping,
                kl_clip=kl,
                factor_decay=args.factor_decay,
                conv_factor_estimator=args.conv_factor_estimator,
                damping_mode=args.damping_mode,
                factor_init=args.factor_init,
            )
            arms.append(ArmConfig("kaisa", lr, args.momentum, args.weight_decay, kfac))
    for arm in arms:
        config = DemoConfig(
            data_dir=args.data_dir,
            out_dir=str(args.out.parent),
            arms=(arm,),
            model=args.model,
            epochs=args.epochs,
            batch_size=args.batch_size,
            warmup_epochs=args.warmup_epochs,
            eval_every=args.eval_every,
            target=args.target,
            seeds=seeds,
            threads=args.threads,
            progress=False,
        )
        for seed in seeds:
            shared = {
                "model": args.model,
                "epochs": args.epochs,
                "batch_size": args.batch_size,
                "warmup_epochs": args.warmup_epochs,
                "target_accuracy": args.target,
                "eval_every": args.eval_every,
                "threads": args.threads,
            }
            if args.stop_at_target:
                shared["stop_at_target"] = True
            if config.channels_last:
                # Runs before the demo trained in channels_last lack this key.
                shared["channels_last"] = True
            rec: dict[str, Any] = {
                "arm": arm.name,
                "seed": seed,
                "hyperparameters": arm.hyperparameters(),
                "config": shared,
            }
            if _key(rec) in done:
                continue
            before = machine_info()["load_average_1_5_15"]
            run = train_arm(data, config, arm, seed, stop_at_target=args.stop_at_target)
            rec["result"] = run.summary(args.target)
            rec["result"]["curve"] = [
                [p.step, round(p.train_seconds, 3), round(p.test_accuracy, 4)] for p in run.points
            ]
            rec["load_average_before"] = before
            rec["load_average_after"] = machine_info()["load_average_1_5_15"]
            rec["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            runs.append(rec)
            _save(args.out, runs)
            r = rec["result"]
            t = r["time_to_target_s"]
            print(
                f"{arm.name} {_label(rec)} seed {seed}: "
                f"time to {args.target:.0%} {'-' if t is None else f'{t:.1f} s'}, "
                f"final {r['final_test_accuracy']:.4f}, "
                f"{1000 * r['seconds_per_step']:.1f} ms/step, load {before}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
