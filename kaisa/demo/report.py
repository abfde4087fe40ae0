"""What the demo leaves behind: the table, ``results.json``, the CSV and the plot."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kaisa.demo.train import RunResult

__all__ = [
    "CSV_FIELDS",
    "format_table",
    "write_csv",
    "write_outputs",
    "write_plot",
    "write_results",
]

CSV_FIELDS = (
    "arm",
    "seed",
    "step",
    "epoch",
    "train_seconds",
    "test_accuracy",
    "test_loss",
    "train_loss",
)
"""Columns of ``evaluations.csv``: one row per evaluation on the test set."""

_LABELS = {"sgd": "SGD", "kaisa": "SGD + KAISA"}
_COLORS = {"sgd": "tab:blue", "kaisa": "tab:red"}


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value * scale, spec)


def format_table(results: dict[str, Any]) -> str:
    """The end-of-run table (medians over seeds) and a one-line verdict."""
    target = results["target_accuracy"]
    header = (
        "arm",
        "reached",
        f"time to {target:.1%}",
        "epochs to target",
        "final test acc",
        "ms/step",
        "K-FAC ms/step",
        "peak mem MB",
    )
    rows = [header]
    for name, arm in results["arms"].items():
        kfac = arm["kfac_seconds_per_step"] if "kfac" in arm["hyperparameters"] else None
        rows.append(
            (
                _LABELS.get(name, name),
                f"{arm['seeds_reaching_target']}/{arm['seeds']}",
                _fmt(arm["time_to_target_s"], ".1f") + (" s" if arm["time_to_target_s"] else ""),
                _fmt(arm["epochs_to_target"], ".2f"),
                _fmt(arm["final_test_accuracy"], ".2%"),
                _fmt(arm["seconds_per_step"], ".1f", 1000.0),
                _fmt(kfac, ".1f", 1000.0),
                _fmt(arm["peak_memory_mb"], ".0f"),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for j, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    seeds = results["shared"]["seeds"]
    lines.append(
        f"(median over {len(seeds)} seed{'s' if len(seeds) != 1 else ''}; "
        "training clock, evaluation excluded)"
    )
    lines.append(verdict(results))
    return "\n".join(lines)


def verdict(results: dict[str, Any]) -> str:
    """One sentence comparing the arms' median time to the target."""
    arms = results["arms"]
    target = results["target_accuracy"]
    if "sgd" not in arms or "kaisa" not in arms:
        return ""
    s, k = arms["sgd"]["time_to_target_s"], arms["kaisa"]["time_to_target_s"]
    if s is None and k is None:
        return f"Neither arm reached {target:.1%} test accuracy within the epoch budget."
    if k is None:
        return f"SGD + KAISA did not reach {target:.1%}; SGD did in {s:.1f} s."
    if s is None:
        return f"SGD did not reach {target:.1%}; SGD + KAISA did in {k:.1f} s."
    ratio = k / s
    if ratio <= 1.0:
        text = (
            f"SGD + KAISA reached {target:.1%} in {ratio:.2f}x SGD's time "
            f"({k:.1f} s vs {s:.1f} s, {1 - ratio:.1%} less)."
        )
    else:
        text = (
            f"SGD + KAISA took {ratio:.2f}x SGD's time to reach {target:.1%} "
            f"({k:.1f} s vs {s:.1f} s)."
        )
    paired = results.get("kaisa_time_ratio_per_seed") or {}
    if len(paired) > 1:
        each = ", ".join(
            f"{'never' if r is None else f'{r:.2f}x'} (seed {seed})" for seed, r in paired.items()
        )
        median = results.get("kaisa_time_ratio_per_seed_median")
        text += f" Seed by seed: {each}; median {'-' if median is None else f'{median:.2f}x'}."
    return text


def write_results(results: dict[str, Any], path: Path) -> None:
    """``results.json``."""
    path.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")


def write_csv(runs: Sequence[RunResult], path: Path) -> None:
    """One row per evaluation point of every run."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_FIELDS)
        for run in runs:
            for p in run.points:
                writer.writerow(
                    (
                        p.arm,
                        p.seed,
                        p.step,
                        f"{p.epoch:.4f}",
                        f"{p.train_seconds:.3f}",
                        f"{p.test_accuracy:.4f}",
                        f"{p.test_loss:.5f}",
                        f"{p.train_loss:.5f}",
                    )
                )


def write_plot(runs: Sequence[RunResult], results: dict[str, Any], path: Path) -> None:
    """Test accuracy against training time and against epochs, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = float(results["target_accuracy"])
    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    labelled: set[str] = set()
    accs: list[float] = []
    for run in runs:
        if not run.points:
            continue
        color = _COLORS.get(run.arm)
        label = None if run.arm in labelled else _LABELS.get(run.arm, run.arm)
        labelled.add(run.arm)
        t = [p.train_seconds for p in run.points]
        e = [p.epoch for p in run.points]
        a = [p.test_accuracy for p in run.points]
        accs += a
        ax_t.plot(t, a, color=color, alpha=0.8, lw=1.4, marker=".", ms=3, label=label)
        ax_e.plot(e, a, color=color, alpha=0.8, lw=1.4, marker=".", ms=3, label=label)
        hit = run.first_reaching(target)
        if hit is not None:
            ax_t.plot([hit.train_seconds], [hit.test_accuracy], "o", color=color, ms=6, mfc="none")
            ax_e.plot([hit.epoch], [hit.test_accuracy], "o", color=color, ms=6, mfc="none")
    for name, arm in results["arms"].items():
        t_med = arm["time_to_target_s"]
        if t_med is not None:
            ax_t.axvline(t_med, color=_COLORS.get(name), ls=":", lw=1)
    for ax in (ax_t, ax_e):
        ax.axhline(target, color="gray", ls="--", lw=1)
        ax.grid(alpha=0.3)
    if accs:
        top = max(max(accs), target)
        low = min(sorted(accs)[len(accs) // 10], target - 0.02)
        ax_t.set_ylim(max(0.0, low - 0.01), min(1.0, top + 0.01))
    ax_t.set_xlabel("training time, s (evaluation excluded)")
    ax_e.set_xlabel("epoch")
    ax_t.set_ylabel("test accuracy")
    ax_t.legend(loc="lower right")
    shared = results["shared"]
    ratio = results.get("kaisa_time_ratio")
    title = (
        f"{shared['model']} on Fashion-MNIST, batch {shared['batch_size']}, "
        f"{len(shared['seeds'])} seed(s), {shared['nproc']} process(es); "
        f"dashed: target {target:.1%}"
    )
    if ratio is not None:
        title += f"; KAISA/SGD time to target {ratio:.2f}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(runs: Sequence[RunResult], results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write ``results.json``, ``evaluations.csv`` and ``accuracy.png``; their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        out_dir / "results.json",
        out_dir / "evaluations.csv",
        out_dir / "accuracy.png",
    ]
    write_results(results, paths[0])
    write_csv(runs, paths[1])
    write_plot(runs, results, paths[2])
    return paths
