"""What the suite leaves behind: tables, ``results.json``, the CSV, the plot and the summary.

Per workload (``OUT/<workload>/``): ``results.json``, ``evaluations.csv`` and
a plot of the workload's metric against training time and against epochs,
one colour per arm, its median seed drawn bold and the other seeds faint
(``accuracy.png`` for the image workloads' test accuracy, ``val_loss.png``
for the language model's validation loss), and a table printed at the end of
the workload, whose columns name the metric. Over all workloads (``OUT/``):
``summary.json`` and ``summary.md``, one row per (workload, arm).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kaisa.demo.config import KAISA_ARMS, METRICS, Metric
from kaisa.demo.train import RunResult

__all__ = [
    "CSV_FIELDS",
    "LABELS",
    "format_summary",
    "format_table",
    "median_seed_runs",
    "plot_name",
    "summary_markdown",
    "verdict",
    "write_csv",
    "write_outputs",
    "write_plot",
    "write_results",
    "write_summary",
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
"""Columns of ``evaluations.csv``: one row per evaluation on the held-out data.

For the language model ``test_accuracy`` and ``test_loss`` are the fixed
validation windows' next-byte accuracy and cross-entropy (nats per byte).
"""

LABELS = {
    "sgd": "SGD",
    "adamw": "AdamW",
    "muon": "Muon + AdamW",
    "soap": "SOAP",
    "kaisa-sgd": "SGD + KAISA",
    "kaisa-adamw": "AdamW + KAISA",
}
"""How tables and plots name the arms."""

_COLORS = {
    "sgd": "tab:blue",
    "adamw": "tab:green",
    "muon": "tab:purple",
    "soap": "tab:orange",
    "kaisa-sgd": "tab:red",
    "kaisa-adamw": "tab:brown",
}


def _label(name: str) -> str:
    return LABELS.get(name, name)


def _metric(results: dict[str, Any]) -> Metric:
    """The metric a ``results.json`` is measured by (accuracy when it names none)."""
    return METRICS.get(str(results.get("metric", "accuracy")), METRICS["accuracy"])


def _target(results: dict[str, Any]) -> float:
    """The target of a ``results.json`` (``target_accuracy`` in documents without ``target``)."""
    return float(results["target"] if "target" in results else results["target_accuracy"])


def _budget(shared: dict[str, Any]) -> str:
    if shared.get("max_steps") is not None:
        return f"{shared['max_steps']} steps"
    return f"{shared['epochs']} epoch(s)"


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value * scale, spec)


def _ratio_text(ratio: float | None, other: str | None, reached: bool) -> str:
    if not reached:
        return "never"
    if other is None:
        return "(none)"
    if ratio is None:
        return "-"
    return f"{ratio:.2f}x {other}"


def _grid(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def format_table(results: dict[str, Any]) -> str:
    """One workload's end-of-run table (medians over seeds) and its verdict lines.

    The columns name the workload's metric: ``time to 91.0%`` and ``final test
    acc`` for an image workload, ``time to loss 1.50`` and ``final val loss``
    for the language model.
    """
    target = _target(results)
    metric = _metric(results)
    final_key = f"final_{metric.key}"
    header = (
        "arm",
        "peak lr",
        "reached",
        f"time to {metric.target_short(target)}",
        "steps",
        "steps vs fewest",
        metric.column,
        "ms/step",
        "K-FAC ms/step",
        "K-FAC share",
        "vs best other",
        "peak mem MB",
    )
    rows = [header]
    for name, arm in results["arms"].items():
        kfac = "kfac_share" in arm
        comp = results["comparisons"][name]["vs_best"]
        steps = results["comparisons"][name]["vs_fewest_steps"]
        rows.append(
            (
                _label(name),
                f"{arm['hyperparameters']['lr']:g}",
                f"{arm['seeds_reaching_target']}/{arm['seeds']}",
                _fmt(arm["time_to_target_s"], ".1f") + (" s" if arm["time_to_target_s"] else ""),
                _fmt(arm["steps_to_target"], ".0f"),
                _ratio_text(steps["steps_ratio"], steps["arm"], arm["steps_to_target"] is not None),
                "-" if arm.get(final_key) is None else metric.format(arm[final_key]),
                _fmt(arm["seconds_per_step"], ".1f", 1000.0),
                _fmt(arm["kfac_seconds_per_step"] if kfac else None, ".1f", 1000.0),
                _fmt(arm.get("kfac_share"), ".0%"),
                _ratio_text(comp["time_ratio"], comp["arm"], arm["time_to_target_s"] is not None),
                _fmt(arm["peak_memory_mb"], ".0f"),
            )
        )
    lines = [f"{results['workload']}: target {metric.target_text(target)}, "
             f"{_budget(results['shared'])}"
             + (" (provisional target/budget)" if results.get("provisional") else "")]  # fmt: skip
    lines += _grid(rows)
    seeds = results["shared"]["seeds"]
    note = (
        f"(median over {len(seeds)} seed{'s' if len(seeds) != 1 else ''}; "
        "training clock, evaluation excluded"
    )
    if results["shared"].get("stop_at_target"):
        what = "accuracy" if metric.name == "accuracy" else "loss"
        note += f"; runs stop at the target, so 'final' is the {what} there"
    lines.append(note + ")")
    text = verdict(results)
    if text:
        lines.append(text)
    return "\n".join(lines)


def _sentence(results: dict[str, Any], name: str, key: str) -> str:
    arms = results["arms"]
    goal = _metric(results).target_text(_target(results))
    comp = results["comparisons"][name][key]
    other = comp["arm"]
    me = _label(name)
    mine = arms[name]["time_to_target_s"]
    if other is None:
        if mine is None:
            return f"{me} did not reach {goal}, nor did any arm it is compared with."
        return f"{me} reached {goal} in {mine:.1f} s; no arm it is compared with did."
    theirs = arms[other]["time_to_target_s"]
    if mine is None and theirs is None:
        return f"Neither {me} nor {_label(other)} reached {goal}."
    if mine is None:
        return f"{me} did not reach {goal}; {_label(other)} did in {theirs:.1f} s."
    if theirs is None:
        return f"{me} reached {goal} in {mine:.1f} s; {_label(other)} did not."
    ratio = comp["time_ratio"]
    if ratio <= 1.0:
        text = (
            f"{me} reached {goal} in {ratio:.2f}x {_label(other)}'s time "
            f"({mine:.1f} s vs {theirs:.1f} s, {1 - ratio:.1%} less)."
        )
    else:
        text = (
            f"{me} took {ratio:.2f}x {_label(other)}'s time to reach {goal} "
            f"({mine:.1f} s vs {theirs:.1f} s)."
        )
    paired = comp["per_seed"]
    if len(paired) > 1:
        each = ", ".join(
            f"{'never' if r is None else f'{r:.2f}x'} (seed {seed})" for seed, r in paired.items()
        )
        median = comp["per_seed_median"]
        text += f" Seed by seed: {each}; median {'-' if median is None else f'{median:.2f}x'}."
    return text


def verdict(results: dict[str, Any]) -> str:
    """Sentences comparing each kaisa arm with the best arm without K-FAC and with its base.

    Empty when no kaisa arm ran, or when nothing else ran to compare with.
    """
    lines: list[str] = []
    for name in results["arms"]:
        if name not in KAISA_ARMS:
            continue
        comp = results["comparisons"][name]
        if comp["vs_best"]["arm"] is None and not any(a not in KAISA_ARMS for a in results["arms"]):
            continue
        best = _sentence(results, name, "vs_best")
        lines.append(best)
        base = comp.get("vs_base")
        if base is not None and comp["vs_best"]["arm"] not in (None, base["arm"]):
            lines.append(_sentence(results, name, "vs_base"))
    return "\n".join(lines)


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


def median_seed_runs(runs: Sequence[RunResult], target: float) -> dict[str, RunResult]:
    """Per arm, the run of its median seed: by time to the target, then the best metric value.

    Runs that never reached the target sort after those that did; with an
    even number of seeds the lower median is taken.
    """
    by_arm: dict[str, list[RunResult]] = {}
    for run in runs:
        by_arm.setdefault(run.arm, []).append(run)
    out: dict[str, RunResult] = {}
    for arm, mine in by_arm.items():

        def key(r: RunResult) -> tuple[float, float]:
            hit = r.first_reaching(target)
            best = r.best_value
            if r.metric_spec.higher_is_better:
                rank = -(best or 0.0)
            else:
                rank = math.inf if best is None else best
            return (hit.train_seconds if hit else math.inf, rank)

        ranked = sorted(mine, key=key)
        out[arm] = ranked[(len(ranked) - 1) // 2]
    return out


def plot_name(results: dict[str, Any]) -> str:
    """The plot's file name: ``accuracy.png``, or ``val_loss.png`` for the language model."""
    metric = _metric(results)
    return "accuracy.png" if metric.name == "accuracy" else f"{metric.name}.png"


def write_plot(runs: Sequence[RunResult], results: dict[str, Any], path: Path) -> None:
    """The metric against training time and against epochs: median seed bold, others faint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = _target(results)
    metric = _metric(results)
    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    medians = median_seed_runs(runs, target)
    values: list[float] = []
    order = {name: i for i, name in enumerate(results.get("arm_order", []))}
    # Faint seeds first, under the bold median seeds; arms in table order.
    ranked = sorted(
        runs, key=lambda r: (medians.get(r.arm) is r, order.get(r.arm, len(order)), r.arm)
    )
    for run in ranked:
        if not run.points:
            continue
        color = _COLORS.get(run.arm)
        bold = medians.get(run.arm) is run
        style: dict[str, Any] = (
            {"alpha": 0.95, "lw": 1.8, "marker": ".", "ms": 3, "label": _label(run.arm)}
            if bold
            else {"alpha": 0.25, "lw": 1.0}
        )
        t = [p.train_seconds for p in run.points]
        e = [p.epoch for p in run.points]
        a = [p.value(metric.name) for p in run.points]
        values += a
        ax_t.plot(t, a, color=color, **style)
        ax_e.plot(e, a, color=color, **style)
        hit = run.first_reaching(target)
        if hit is not None and bold:
            y = hit.value(metric.name)
            ax_t.plot([hit.train_seconds], [y], "o", color=color, ms=6, mfc="none")
            ax_e.plot([hit.epoch], [y], "o", color=color, ms=6, mfc="none")
    for ax in (ax_t, ax_e):
        ax.axhline(target, color="gray", ls="--", lw=1)
        ax.grid(alpha=0.3)
    finite = [v for v in values if math.isfinite(v)]
    if finite and metric.higher_is_better:
        top = max(max(finite), target)
        low = min(sorted(finite)[len(finite) // 10], target - 0.02)
        ax_t.set_ylim(max(0.0, low - 0.01), min(1.0, top + 0.01))
    elif finite:
        low = min(min(finite), target)
        high = max(sorted(finite)[-1 - len(finite) // 10], target + 0.1)
        ax_t.set_ylim(max(0.0, low - 0.05), high + 0.05)
    ax_t.set_xlabel("training time, s (evaluation excluded)")
    ax_e.set_xlabel("epoch")
    ax_t.set_ylabel(f"{metric.label}, {metric.unit}" if metric.unit else metric.label)
    if medians:
        ax_t.legend(loc="lower right" if metric.higher_is_better else "upper right", fontsize=8)
    shared = results["shared"]
    if "corpus" in shared or shared.get("dataset") == "fortunes":
        data = f"the fortunes corpus, batch {shared['batch_size']} x {shared.get('context')} bytes"
    else:
        data = f"Fashion-MNIST, batch {shared['batch_size']}"
    title = (
        f"{results['workload']} on {data}, "
        f"{len(shared['seeds'])} seed(s) (median seed bold), {shared['nproc']} process(es); "
        f"dashed: target {metric.target_short(target)}"
    )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(runs: Sequence[RunResult], results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write ``results.json``, ``evaluations.csv`` and the plot (:func:`plot_name`); their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        out_dir / "results.json",
        out_dir / "evaluations.csv",
        out_dir / plot_name(results),
    ]
    write_results(results, paths[0])
    write_csv(runs, paths[1])
    write_plot(runs, results, paths[2])
    return paths


# --- the summary over workloads --------------------------------------------------

_SUMMARY_HEADER = (
    "workload",
    "arm",
    "reached",
    "steps to target",
    "steps vs fewest other",
    "ms/step",
    "time to target",
    "vs best other",
    "K-FAC share",
)


def _summary_cells(row: dict[str, Any]) -> tuple[str, ...]:
    t = row["time_to_target_s"]
    reached = row["steps_to_target"] is not None
    return (
        row["workload"],
        _label(row["arm"]),
        f"{row['seeds_reaching_target']}/{row['seeds']}",
        _fmt(row["steps_to_target"], ".0f"),
        _ratio_text(row["steps_ratio"], row["steps_vs"], reached),
        _fmt(row["ms_per_step"], ".1f"),
        "-" if t is None else f"{t:.1f} s",
        _ratio_text(row["ratio"], row["vs"], t is not None),
        _fmt(row.get("kfac_share"), ".0%"),
    )


def _phase_text(row: dict[str, Any]) -> str:
    phases = row.get("kfac_phase_seconds") or {}
    return ", ".join(f"{k} {v:.2f} s" for k, v in phases.items() if v > 0)


def _choice_text(row: dict[str, Any]) -> str:
    """kaisa's automatic choice (the first seed's), e.g. 'factors/inverses every 80/100; ...'.

    With ``adaptive_intervals`` it says how far the intervals were stretched,
    with ``stale_refresh`` how often the curvature was found stale, with or
    without an automatic choice.
    """
    choice = row.get("curvature_choice") or {}
    stretch = row.get("interval_stretch") or {}
    stretched = (
        f" (adaptive_intervals: x{stretch['factor']} at the end, "
        f"{stretch.get('changes', 0)} change(s))"
        if "factor" in stretch
        else ""
    )
    if "stale_refreshes" in stretch:
        stretched += f" (stale_refresh: stale {stretch['stale_refreshes']} time(s))"
    profile = f"profile {row['profile']}: " if row.get("profile") else ""
    if not choice:
        given = f"no automatic choice, intervals as given{stretched}" if stretched else ""
        return f"{profile}{given}" if given else ""
    held = [
        f"{name} {a}/{g}"
        for name, (a, g) in choice.get("specs", {}).items()
        if (a, g) != ("exact", "exact")
    ]
    share = float(choice.get("kfac_work", 0.0)) / max(float(choice.get("training_work", 1)), 1e-30)
    return (
        f"{profile}factors/inverses every {choice.get('factor_update_steps')}/"
        f"{choice.get('inv_update_steps')} steps{stretched}, modelled share {share:.3f}"
        + (
            f", budget scaled by the clock {float(choice.get('time_scale', 1.0)):.3g}x"
            if choice.get("calibrated")
            else ""
        )
        + "; "
        + ("A/G held as: " + ", ".join(held) if held else "every layer exact")
    )


def _summary_notes(summary: dict[str, Any]) -> list[str]:
    seeds = summary["seeds"]
    notes = [
        f"Medians over {len(seeds)} seed(s) ({', '.join(map(str, seeds))}); training clock, "
        "evaluation excluded. 'vs best other': median time to target over that of the best "
        "other arm (for kaisa arms: the best arm without K-FAC); 'steps vs fewest other': "
        "median steps to the target over the fewest among the same arms (on a GPU, steps are "
        "what a cheap-step optimizer competes on); 'never': this arm did not reach the "
        "target; '(none)': it did, no arm it is compared with did.",
    ]
    targets = ", ".join(
        f"{name} {_workload_target(w)} in {_budget(w)}"
        + (" [provisional]" if w["provisional"] else "")
        for name, w in summary["workloads"].items()
    )
    notes.append(f"Targets: {targets}.")
    return notes


def _workload_target(entry: dict[str, Any]) -> str:
    """A workload's target in the summary's notes: ``91.0%`` or ``validation loss <= 1.50 ...``."""
    if "target_accuracy" in entry:
        return f"{entry['target_accuracy']:.1%}"
    metric = METRICS.get(str(entry.get("metric")), METRICS["accuracy"])
    sign = "" if metric.higher_is_better else "<= "
    return f"{metric.label} {sign}{entry['target']:.2f} {metric.unit}".rstrip()


def format_summary(summary: dict[str, Any]) -> str:
    """The summary table over workloads, as printed at the end of the suite."""
    rows = [_SUMMARY_HEADER, *(_summary_cells(r) for r in summary["rows"])]
    lines = ["Summary over workloads", *_grid(rows)]
    for row in summary["rows"]:
        phases = _phase_text(row)
        if phases:
            lines.append(f"K-FAC phases, {row['workload']} {_label(row['arm'])}: {phases}")
        choice = _choice_text(row)
        if choice:
            lines.append(f"K-FAC choice, {row['workload']} {_label(row['arm'])}: {choice}")
    lines += _summary_notes(summary)
    return "\n".join(lines)


def summary_markdown(summary: dict[str, Any]) -> str:
    """``summary.md``: the summary table in Markdown, with K-FAC's phases and the notes."""
    lines = ["# kaisa demo: summary over workloads", ""]
    lines.append("| " + " | ".join(_SUMMARY_HEADER) + " |")
    lines.append("|" + "|".join(" --- " for _ in _SUMMARY_HEADER) + "|")
    for row in summary["rows"]:
        lines.append("| " + " | ".join(_summary_cells(row)) + " |")
    phases = [(row, _phase_text(row)) for row in summary["rows"]]
    if any(text for _, text in phases):
        lines += ["", "K-FAC's seconds per phase (median over seeds):", ""]
        lines += [
            f"- {row['workload']}, {_label(row['arm'])}: {text}" for row, text in phases if text
        ]
    choices = [(row, _choice_text(row)) for row in summary["rows"]]
    if any(text for _, text in choices):
        # (Rows come from runs, so a summary with choices has at least one seed.)
        lines += ["", f"kaisa's automatic curvature choice (seed {summary['seeds'][0]}):", ""]
        lines += [
            f"- {row['workload']}, {_label(row['arm'])}: {text}" for row, text in choices if text
        ]
    lines += ["", *_summary_notes(summary)]
    at_start = (summary["machine"].get("at_start") or {}).get("load_average_1_5_15")
    at_end = (summary["machine"].get("at_end") or {}).get("load_average_1_5_15")
    lines.append(f"Load average (1/5/15 min) at start {at_start}, at end {at_end}.")
    device = summary.get("device") or "cpu"
    machine = summary["machine"].get("at_start") or {}
    if device != "cpu":
        gpu = machine.get("gpu")
        lines.append(f"Trained on {device}" + (f" ({gpu})." if gpu else "."))
    elif "cpu_capability" in machine:
        bf16 = "native" if machine.get("cpu_native_bfloat16") else "emulated"
        lines.append(
            f"CPU: {machine.get('cpu')}, {machine.get('cpu_count')} CPUs, "
            f"{machine['cpu_capability']}, bfloat16 {bf16}."
        )
    return "\n".join(lines) + "\n"


def write_summary(summary: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write ``summary.json`` and ``summary.md`` into ``out_dir``; their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "summary.json", out_dir / "summary.md"]
    paths[0].write_text(json.dumps(summary, indent=2) + "\n")
    paths[1].write_text(summary_markdown(summary))
    return paths
