"""Learning-rate (and K-FAC damping / KL-clip) sweep for the demo's two arms.

Each configuration is one full demo run of one arm (same model, data order,
batch, epoch budget, warm-up + cosine schedule and weight decay as the demo),
and its time to the target, final accuracy and time per step are appended to
a JSON file, so a sweep can be run in pieces and resumed (configurations
already in the file are skipped). ``--report`` prints the table and the best
configuration per arm: the smallest median time to the target, ties broken
by final accuracy; a configuration that never reached the target ranks by
its final accuracy after all that did.

Examples (the sweep kept in ``benchmarks/results/``)::

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

from kaisa.demo.compare import machine_info
from kaisa.demo.config import ArmConfig, DemoConfig, KfacConfig
from kaisa.demo.data import DEFAULT_DATA_DIR, load_fashion_mnist
from kaisa.demo.train import train_arm

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "lr_sweep.json"


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
            f" damping={k['damping']:g} kl_clip={k['kl_clip']}"
            f" f/i={k['factor_update_steps']}/{k['inv_update_steps']}"
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arm", choices=("sgd", "kaisa"))
    p.add_argument("--lrs", type=_floats, default=[0.025, 0.05, 0.1, 0.2, 0.4])
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
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--warmup-epochs", type=float, default=0.25)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--target", type=float, default=0.91)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seeds", default="0")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument(
        "--stop-at-target",
        action="store_true",
        help="end each run when it reaches the target (ranks by time/steps to target only)",
    )
    p.add_argument("--report", action="store_true", help="print the table and the best settings")
    args = p.parse_args(argv)
    if args.report or args.arm is None:
        return report(args.out, None)

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
            target_accuracy=args.target,
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
