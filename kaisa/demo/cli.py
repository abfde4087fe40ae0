"""``kaisa demo``: a time-to-accuracy benchmark suite of optimizers with and without KAISA.

Every selected workload (a network from :mod:`kaisa.models` with its data, a
target and a budget, :data:`~kaisa.demo.config.WORKLOADS`: the image
classifiers on Fashion-MNIST with a target test accuracy, the byte-level GPT
on the ``fortunes`` text corpus with a target validation loss) is trained by
every selected arm (SGD, AdamW, Muon + AdamW, SOAP, and SGD or AdamW behind
``kaisa.KFACPreconditioner`` with the library's defaults) over several seeds,
the arms of a seed in lockstep; the result is the median training time to the
target per (workload, arm), written per workload to ``OUT/<workload>/`` and
summarised in ``OUT/summary.{json,md}``.

Bad input (a missing or corrupt dataset file, an impossible target, a bad
option value, an unknown arm or workload, the soap arm without heavyball)
ends the command with one line ``kaisa demo: error: ...`` on standard error
and exit code 2, without a traceback.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from kaisa.choices import (
    CONV_ESTIMATORS,
    DAMPING_MODES,
    EIGEN_CORRECTIONS,
    FACTOR_INITS,
    NAMED_FRACTIONS,
    PROFILES,
)
from kaisa.demo.config import (
    ADAMW_WEIGHT_DECAY,
    ARM_NAMES,
    DEFAULT_LR_FILE,
    DEFAULT_WORKLOADS,
    KAISA_ARMS,
    METRICS,
    MUON_ADAMW_LR_RATIO,
    WORKLOADS,
    DemoConfig,
    KfacConfig,
    LrTableError,
    SuiteConfig,
    Workload,
    base_arm,
    make_arm,
    read_lr_table,
    resolve_lr,
)
from kaisa.demo.data import DEFAULT_DATA_DIR, DatasetError
from kaisa.demo.datasets import (
    Dataset,
    DatasetKey,
    dataset_hint,
    dataset_label,
    default_directory,
    load_dataset,
)
from kaisa.demo.optimizers import MissingDependencyError, require_heavyball
from kaisa.demo.text import DEFAULT_TEXT_DIR, TextCorpus
from kaisa.distributed.plan import resolve_grad_workers

__all__ = ["DEFAULTS", "QUICK", "DemoError", "build_config", "main", "parse_args"]

PROG = "kaisa demo"

DEFAULTS: dict[str, Any] = {
    "workloads": DEFAULT_WORKLOADS,
    "arms": ARM_NAMES,
    "momentum": 0.9,
    "weight_decay": 5e-4,
    "adamw_weight_decay": ADAMW_WEIGHT_DECAY,
    "warmup_epochs": 0.25,
    "seeds": (0, 1, 2),
    "threads": 2,
    "nproc": 1,
    "device": "cpu",
    "stop_at_target": True,
    "progress_seconds": 30.0,
}
"""The full run's settings (``make demo``); each workload's target, budget,
batch size, evaluation interval and warm-up (``warmup_epochs`` unless the
workload gives warm-up steps) come from :data:`~kaisa.demo.config.WORKLOADS`,
each arm's peak learning rate from the sweep file
(:func:`~kaisa.demo.config.resolve_lr`).

Runs stop at the target by default: the suite measures the time to the target,
which stopping does not change, and stopping roughly halves the cost of the
arms that get there (``--no-stop-at-target`` runs every budget out, for the
final accuracy). Calibrating ``make demo`` to about 30 minutes on 2 cores is
a matter of the workloads' epoch budgets, ``seeds`` and ``arms`` here.
"""

QUICK: dict[str, Any] = {
    "workloads": ("gap_cnn",),
    "arms": ("sgd", "adamw", "muon", "kaisa-sgd"),
    "epochs": 1,
    "seeds": (0,),
    "target": 0.85,
}
"""What ``--quick`` changes (``make demo-quick``, meant to take about two minutes
on 2 cores); explicit options still win. One epoch of gap_cnn, four arms, one
seed, target 85% (SGD reached 82.5% after the first of several epochs in
earlier runs, so 85% is within a one-epoch schedule's reach; provisional until
timed on a quiet machine). The preset's target and epochs are for the image
workloads: with ``--quick --workload gpt`` the language model keeps its own
target and step budget."""


_QUICK_OPTIONS = {"workloads": "workload"}

_T = TypeVar("_T")


class DemoError(Exception):
    """Bad input: reported as one line and exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise DemoError(message)


def _checked(
    convert: Callable[[str], _T], accept: Callable[[_T], bool], expected: str
) -> Callable[[str], _T]:
    """An argparse type: ``convert(text)`` where ``accept`` takes it, else "expected ..."."""

    def check(text: str) -> _T:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return check


def _device_text(text: str) -> str:
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(text) from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(text)
    return str(device)


_device = _checked(_device_text, lambda v: True, "cpu, cuda or cuda:K")
#: An argparse type for the options that take a positive integer (benchmarks use it too).
positive_int = _checked(int, lambda v: v >= 1, "a positive integer")
_nonnegative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
_positive_float = _checked(float, lambda v: math.isfinite(v) and v > 0, "a positive number")
_nonnegative_float = _checked(float, lambda v: math.isfinite(v) and v >= 0, "a number >= 0")
_fraction = _checked(float, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
_share = _checked(float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")
_unit_or_named = _checked(
    float, lambda v: 0.0 <= v <= 1.0, f"a number in [0, 1] or one of {', '.join(NAMED_FRACTIONS)}"
)


_TargetSpec = float | dict[str, float]
"""``--target``: one value for every selected workload, or one per named workload."""


def _target_value(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number such as 0.91 (an accuracy) or 1.5 (a loss), got {text!r}"
        ) from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"impossible target {text}: it must be finite")
    return value


def _target(text: str) -> _TargetSpec:
    """A number, or WORKLOAD=VALUE pairs; checked against each workload's metric later."""
    if "=" not in text:
        return _target_value(text)
    out: dict[str, float] = {}
    for item in _names(text, "WORKLOAD=VALUE pairs"):
        name, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(
                f"expected WORKLOAD=VALUE pairs such as gap_cnn=0.9,gpt=2.0, got {item!r}"
            )
        out[_workload(name.strip())] = _target_value(value.strip())
    return out


def _seeds(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        seeds = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 0,1,2, got {text!r}"
        ) from None
    if not seeds or any(s < 0 for s in seeds):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers >= 0 such as 0,1,2, got {text!r}"
        )
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"repeated seed in {text!r}")
    return seeds


def _gwf(text: str) -> float | str:
    if text.lower() in NAMED_FRACTIONS:
        return text.lower()
    return _unit_or_named(text)


def _curvature(text: str) -> str:
    """'auto', or one representation for every side ('exact', 'lowrank:K', 'kvec', 'diagonal')."""
    if text.strip().lower() == "auto":
        return "auto"
    from kaisa.curvature.costs import SideSpec

    try:
        return str(SideSpec.parse(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be 'auto', 'exact', 'lowrank:K' (K >= 1), 'kvec' or 'diagonal'; got {text!r}"
        ) from None


def _kl_clip(text: str) -> float | str:
    if text.lower() in ("none", "off", "0"):
        return "off"
    return _positive_float(text)


def _names(text: str, what: str | None = None) -> list[str]:
    """The comma-separated names in ``text``; with ``what``, at least one of them."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    if what is not None and not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {text!r}")
    return names


def _arm(name: str) -> str:
    try:
        return base_arm(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _arms(text: str) -> tuple[str, ...]:
    canonical = [_arm(name) for name in _names(text, "arms")]
    return tuple(n for n in ARM_NAMES if n in canonical)


def _workload(name: str) -> str:
    if name not in WORKLOADS:
        raise argparse.ArgumentTypeError(
            f"unknown workload {name!r}; allowed: {', '.join(WORKLOADS)}"
        )
    return name


def _workloads(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(_workload(name) for name in _names(text, "workloads")))


def _lr_overrides(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in _names(text):
        arm, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(
                f"expected ARM=LR pairs such as sgd=0.1,adamw=0.002, got {item!r}"
            )
        out[_arm(arm.strip())] = _positive_float(value.strip())
    if not out:
        raise argparse.ArgumentTypeError(f"expected ARM=LR pairs, got {text!r}")
    return out


def _on_off(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected 'on' or 'off'; got {text!r}")
    return value == "on"


def _show(value: Any) -> str:
    """A default as the help shows it: lists comma-separated, flags as on/off."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(_show(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _library_default(name: str) -> str:
    """``kaisa.KFACPreconditioner``'s default for ``name``, as the help shows it."""
    shown = "the library's"
    try:
        from kaisa import KFACPreconditioner
        from kaisa.profiles import PROFILED_OPTIONS

        default = inspect.signature(KFACPreconditioner).parameters[name].default
    except (ImportError, KeyError, TypeError, ValueError):  # pragma: no cover - defensive
        return shown
    if default is inspect.Parameter.empty:  # pragma: no cover - defensive
        return shown
    if default is None:
        return f"{shown}, chosen automatically"
    if default == "auto" and name in PROFILED_OPTIONS:
        return f"{shown}, the model's profile's"
    return f"{shown}, {_show(default)}"


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


_Options = dict[str, tuple[str, dict[str, Any]]]
"""Options by flag: the help (without its default) and ``add_argument``'s other arguments."""

_KFAC_OPTIONS: _Options = {
    "--factor-update-steps": ("update the factors every N steps", {"type": positive_int}),
    "--inv-update-steps": ("recompute the eigenbases every N steps", {"type": positive_int}),
    "--damping": ("Tikhonov damping", {"type": _positive_float}),
    "--kl-clip": ("KL clip; 'none' turns it off", {"type": _kl_clip}),
    "--factor-decay": ("running-average decay of the factors", {"type": _fraction}),
    "--conv-factor-estimator": (
        "conv factors from every patch ('expand') or per-sample patch means ('reduce')",
        {"choices": CONV_ESTIMATORS},
    ),
    "--damping-mode": (
        "damping added as is or relative to each factor's mean eigenvalue",
        {"choices": DAMPING_MODES},
    ),
    "--factor-init": (
        "factors start as the identity or as the first batch's factors",
        {"choices": FACTOR_INITS},
    ),
    "--calibrate-budget": (
        "'off': the curvature choice from the cost model alone (the same on every "
        "machine); 'on': re-chosen after 10 steps from the measured iteration",
        {"type": _on_off, "metavar": "{on,off}"},
    ),
    "--grad-worker-fraction": (
        "KAISA gradient-worker fraction with --nproc (1: COMM-OPT, 1/N: MEM-OPT)",
        {"type": _gwf},
    ),
    "--curvature": (
        "every layer's sides held as 'auto' (chosen to fit the time budget), 'exact', "
        "'lowrank:K', 'kvec' or 'diagonal'",
        {"type": _curvature},
    ),
    "--eigenvalue-correction": (
        "divide the rotated gradient by its measured second moments ('ekfac': EKFAC's "
        "solve at the factors' scale; 'adam': their square root) or not ('off')",
        {"choices": EIGEN_CORRECTIONS},
    ),
    "--eigenbasis-tolerance": (
        "keep an eigenbasis at an inverse update while it still diagonalises its factor "
        "to within this off-diagonal share; decompose only stale ones",
        {"type": _fraction},
    ),
    "--adaptive-intervals": (
        "'on': stretch the factor and inverse intervals up to 8x while few eigenbases go "
        "stale (needs --eigenbasis-tolerance); 'off': the intervals as given",
        {"type": _on_off, "metavar": "{on,off}"},
    ),
    "--stale-refresh": (
        "'on': refresh factors and inverses every step (then doubling back to the intervals "
        "given or chosen) when the preconditioned gradients' sizes show the curvature went "
        "stale (the default); 'off': the intervals as given or chosen",
        {"type": _on_off, "metavar": "{on,off}"},
    ),
    "--fresh-start-steps": (
        "refresh factors and inverses at least every 2 steps for the first N steps, then at "
        "the intervals given or chosen (0: off, the default); buys steps, not time, on a CPU",
        {"type": _nonnegative_int, "metavar": "N"},
    ),
    "--factor-sample": (
        "the share of each layer call's rows (tokens; a convolution's examples) the factor "
        "products multiply out, drawn anew at every factor update (1: every row)",
        {"type": _share},
    ),
    "--profile": (
        "which defaults the kaisa options not given here take: 'language-model' (EKFAC, "
        "intervals 5/5 that stretch, --time-budget 1.25), 'general', or 'auto' (the "
        "model's: 'language-model' when it has an nn.Embedding)",
        {"choices": PROFILES},
    ),
    "--time-budget": (
        "the automatic choice's allowance: K-FAC's work per step at most this many times "
        "the layers' own forward and backward work",
        {"type": _positive_float},
    ),
}
"""The overrides of ``kaisa.KFACPreconditioner``'s defaults, one per field of
:class:`~kaisa.demo.config.KfacConfig` (the option's destination is the
field's and the library's name); unset, each is the library's default, which
the help shows."""


def _workload_summary(w: Workload) -> str:
    """``gap_cnn (91% in 3 epochs)``, ``gpt (validation loss 2.10 nats/byte in 1500 steps)``."""
    metric = METRICS[w.metric]
    target = f"{w.target:.0%}" if metric.name == "accuracy" else metric.target_text(w.target)
    budget = f"{w.steps} steps" if w.steps is not None else f"{w.epochs} epochs"
    return f"{w.name} ({target} in {budget}" + (", provisional" if w.provisional else "") + ")"


def _option_groups() -> list[tuple[str, str | None, _Options]]:
    """The options of :func:`_parser`, group by group, in the order the help shows them.

    Each option's help ends in "(default: ...)": ``default_text`` where given
    (a default that is not a value: the workload's, the library's, ...), else
    the ``default`` argument as :func:`_show` shows it.
    """
    d = DEFAULTS
    workloads = ", ".join(_workload_summary(w) for w in WORKLOADS.values())
    quick = ", ".join(f"--{_QUICK_OPTIONS.get(k, k)} {_show(v)}" for k, v in QUICK.items())
    lr_file = DEFAULT_LR_FILE.relative_to(DEFAULT_LR_FILE.parents[2])
    as_for_lr = "as for --lr"
    off = {"action": "store_true", "default": False}
    data: _Options = {
        "--data-dir": (
            "directory with the four Fashion-MNIST IDX .gz files (the image workloads)",
            {
                "default": default_directory("fashion_mnist"),
                "default_text": f"$KAISA_DATA_DIR if set, else {DEFAULT_DATA_DIR}",
            },
        ),
        "--text-dir": (
            "directory of the fortunes text files (the gpt workload; Debian package fortunes)",
            {
                "default": default_directory("fortunes"),
                "default_text": f"$KAISA_TEXT_DIR if set, else {DEFAULT_TEXT_DIR}",
            },
        ),
        "--workload": (
            "comma-separated workloads, each with its own metric, target and budget: " + workloads,
            {"type": _workloads, "default_text": _show(d["workloads"])},
        ),
        "--model": (
            "deprecated: the same as --workload with a single name",
            {"type": _workload, "default_text": "none; use --workload"},
        ),
    }
    arms: _Options = {
        "--arms": (
            f"comma-separated arms: {', '.join(ARM_NAMES)} ('kaisa' = kaisa-sgd)",
            {"type": _arms, "default_text": "all"},
        ),
        "--lr": (
            "peak learning rates for every workload, e.g. sgd=0.1,muon=0.02 (Muon: the "
            f"matrix LR; its AdamW group runs at the workload's ratio, {MUON_ADAMW_LR_RATIO:g}x "
            "but gpt 0.15x)",
            {
                "type": _lr_overrides,
                "metavar": "ARM=LR[,...]",
                "default_text": "the --lr-file's LR for the workload and arm, else the "
                "fallback table (the workload's row, if it has one)",
            },
        ),
        "--sgd-lr": (
            "the same as --lr sgd=LR",
            {"type": _positive_float, "default_text": as_for_lr},
        ),
        "--kaisa-lr": (
            "the same as --lr kaisa-sgd=LR",
            {"type": _positive_float, "default_text": as_for_lr},
        ),
        "--lr-file": (
            "best peak LR per (workload, arm), as written by benchmarks/lr_sweep.py --suite",
            {"type": Path, "default_text": f"{lr_file} in a source checkout, if there"},
        ),
    }
    training: _Options = {
        "--epochs": (
            "epoch budget for every workload",
            {"type": positive_int, "default_text": "the workload's"},
        ),
        "--steps": (
            "step budget for every workload, in place of its epoch budget (gpt's budget is in "
            "steps; --epochs E gives it E passes' worth of its training bytes instead)",
            {"type": positive_int, "default_text": "the workload's: epochs, gpt 1500 steps"},
        ),
        "--batch-size": (
            "global batch: images, or gpt's windows of 64 bytes",
            {"type": positive_int, "default_text": "the workload's: 128, gpt 16"},
        ),
        "--warmup-epochs": (
            "linear warm-up length in epochs, then cosine decay to 0",
            {
                "type": _nonnegative_float,
                "default_text": f"{d['warmup_epochs']:g}, but gpt warms up over its 100 steps",
            },
        ),
        "--warmup-steps": (
            "linear warm-up length in steps for every workload (in place of --warmup-epochs)",
            {"type": positive_int, "default_text": "as for --warmup-epochs"},
        ),
        "--momentum": (
            "SGD momentum (sgd, kaisa-sgd)",
            {"type": _fraction, "default": d["momentum"]},
        ),
        "--weight-decay": (
            "SGD's coupled weight decay (sgd, kaisa-sgd)",
            {"type": _nonnegative_float, "default": d["weight_decay"]},
        ),
        "--adamw-weight-decay": (
            "decoupled weight decay of adamw, kaisa-adamw, soap and Muon's AdamW group "
            "(Muon's own group: 0.1x, the same lr*wd per step)",
            {"type": _nonnegative_float, "default": d["adamw_weight_decay"]},
        ),
    }
    kfac: _Options = {
        flag: (text, {"default_text": _library_default(_dest(flag)), **kwargs})
        for flag, (text, kwargs) in _KFAC_OPTIONS.items()
    }
    measurement: _Options = {
        "--target": (
            "target for every workload in its metric (test accuracy, a fraction, for the "
            "image workloads; validation loss in nats/byte, reached at or below, for gpt), or "
            "WORKLOAD=VALUE pairs such as gap_cnn=0.9,gpt=2.0",
            {"type": _target, "default_text": "the workload's"},
        ),
        "--seeds": (
            "comma-separated seeds; results are medians over them",
            {"type": _seeds, "default_text": _show(d["seeds"])},
        ),
        "--eval-every": (
            "evaluate every N steps",
            {"type": positive_int, "default_text": "the workload's: 100, gpt 50"},
        ),
        "--eval-every-near": (
            "evaluate every N steps while just short of the target (within 1 point of "
            "accuracy; gpt: within 0.05 nats/byte)",
            {"type": positive_int, "default_text": "--eval-every / 4"},
        ),
        "--stop-at-target": (
            "end each run at the first evaluation that reaches the target (the time to the "
            "target is unchanged; 'final' accuracy is then the accuracy there)",
            {"action": argparse.BooleanOptionalAction, "default": d["stop_at_target"]},
        ),
        "--threads": (
            "torch threads in all, divided among the --nproc processes (at least 1 each)",
            {"type": positive_int, "default": d["threads"]},
        ),
        "--device": (
            "where every arm trains: cpu, or a CUDA device (cuda, cuda:K) for a one-process "
            "run; the data stay in host memory and each batch is copied to the device inside "
            "the timed step",
            {"type": _device, "default": d["device"]},
        ),
        "--nproc": (
            "processes (torchrun + gloo, DDP for every arm, KAISA distributed); the batch is "
            "split among them",
            {"type": positive_int, "default": d["nproc"]},
        ),
        "--quick": ("a version of about two minutes: " + quick, off),
        "--out": ("output directory", {"default_text": "runs/demo-<timestamp>"}),
        "--sequential": (
            "train the arms one after the other instead of in lockstep (one step of each "
            "in turn, so that the machine's load falls on all alike); gives each arm its own "
            "peak memory",
            off,
        ),
        "--progress-every": (
            "when the output is not a terminal, print a progress line per arm (workload, "
            "arm, seed, step, elapsed time, last test accuracy or validation loss) every "
            "SECONDS; 0: after every step",
            {"type": _nonnegative_float, "default": d["progress_seconds"], "metavar": "SECONDS"},
        ),
        "--no-progress": ("no progress bars on a terminal, no progress lines otherwise", off),
    }
    return [
        ("data and workloads", None, data),
        ("arms and learning rates", None, arms),
        ("training (all arms)", None, training),
        (
            "K-FAC / KAISA overrides",
            "The kaisa arms use kaisa.KFACPreconditioner's defaults; each option here "
            "overrides one of them for every workload.",
            kfac,
        ),
        ("measurement", None, measurement),
    ]


def _parser() -> _Parser:
    p = _Parser(
        prog=PROG,
        description=(
            "Benchmark suite: train each workload (a network with its data, a target and a "
            "budget: image classifiers on Fashion-MNIST to a test accuracy, a byte-level GPT on "
            "the fortunes text corpus down to a validation loss) with each optimizer arm and "
            "compare the wall-clock training time to the target. Arms: sgd (momentum 0.9, weight "
            "decay 5e-4), adamw (decoupled decay 0.05), muon (Muon on hidden weights incl. conv "
            "filters, AdamW on the first layer, head, biases and norms), soap (heavyball.SOAP; "
            "needs the 'bench' extra), kaisa-sgd and kaisa-adamw (kaisa.KFACPreconditioner with "
            "the library's defaults in front of SGD / AdamW; 'kaisa' = kaisa-sgd). All arms of a "
            "workload share the model, initial weights, data order, batch size, budget and "
            "learning-rate schedule shape (linear warm-up, then cosine) on their own peak LR; the"
            " arms of a seed train in lockstep and the clock excludes evaluation. Outputs: "
            "OUT/<workload>/{results.json,evaluations.csv,accuracy.png (gpt: val_loss.png)} and "
            "OUT/summary.{json,md}. On a terminal every arm shows a progress bar; when the output"
            " is not a terminal (a log file, CI) every arm prints a plain progress line every "
            "--progress-every seconds instead."
        ),
    )
    for title, description, options in _option_groups():
        group = p.add_argument_group(title, description)
        for flag, (text, spec) in options.items():
            kwargs = dict(spec)
            default_text = kwargs.pop("default_text", None)
            shown = default_text if default_text is not None else _show(kwargs["default"])
            help_text = f"{text} (default: {shown})"
            group.add_argument(flag, help=help_text.replace("%", "%%"), **kwargs)
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse the options; raises :class:`DemoError` on a bad one."""
    return _parser().parse_args(list(argv))


def _kfac_overrides(args: argparse.Namespace) -> KfacConfig:
    return KfacConfig(**{_dest(flag): getattr(args, _dest(flag)) for flag in _KFAC_OPTIONS})


def _lr_table(args: argparse.Namespace) -> tuple[dict[str, dict[str, tuple[float, str]]], str]:
    """The sweep's learning rates and how results name their source."""
    path: Path | None = args.lr_file
    if path is None:
        if not DEFAULT_LR_FILE.is_file():
            return {}, ""
        path = DEFAULT_LR_FILE
    elif not path.is_file():
        raise DemoError(f"argument --lr-file: {path}: file not found")
    try:
        table = read_lr_table(path)
    except LrTableError as exc:
        raise DemoError(str(exc)) from None
    shown = os.path.relpath(path)
    return table, f"sweep file {path if shown.startswith('..') else shown}"


def _given(value: _T | None, preset: _T) -> _T:
    """An option's value where given, else the preset's (:data:`DEFAULTS`, :data:`QUICK`)."""
    return value if value is not None else preset


def _targets(
    args: argparse.Namespace, workloads: Sequence[str], preset: dict[str, Any]
) -> dict[str, float]:
    """Each selected workload's target: ``--target`` (checked against its metric), else the
    preset's (an accuracy, for accuracy workloads only), else the workload's."""
    spec: _TargetSpec | None = args.target
    if isinstance(spec, dict):
        unknown = [name for name in spec if name not in workloads]
        if unknown:
            raise DemoError(
                f"argument --target: {', '.join(unknown)} not among the selected workloads "
                f"({', '.join(workloads)})"
            )
    out: dict[str, float] = {}
    for name in workloads:
        w = WORKLOADS[name]
        metric = METRICS[w.metric]
        if isinstance(spec, dict):
            value = spec.get(name)
        elif spec is not None:
            value = spec
        else:
            value = preset.get("target") if w.metric == "accuracy" else None
        if value is None:
            out[name] = w.target
            continue
        problem = metric.check_target(value)
        if problem:
            raise DemoError(f"argument --target: {problem} (workload {name})")
        out[name] = value
    if isinstance(spec, float) and len({WORKLOADS[n].metric for n in workloads}) > 1:
        kinds = ", ".join(f"{n}: {METRICS[WORKLOADS[n].metric].label}" for n in workloads)
        raise DemoError(
            f"argument --target: one value for workloads measured differently ({kinds}); "
            "give WORKLOAD=VALUE pairs such as gap_cnn=0.9,gpt=2.0"
        )
    return out


def _data_dir(args: argparse.Namespace, dataset: str) -> str:
    directory: str = args.text_dir if dataset == "fortunes" else args.data_dir
    return directory


def build_config(args: argparse.Namespace) -> SuiteConfig:
    """Check the options against each other and build the suite's configuration."""
    preset = dict(DEFAULTS)
    if args.quick:
        preset.update(QUICK)
    if args.model is not None and args.workload is not None:
        raise DemoError("argument --model: deprecated alias of --workload; give only --workload")
    if args.model is not None:
        workloads: tuple[str, ...] = (args.model,)
    else:
        workloads = _given(args.workload, preset["workloads"])
    arms: tuple[str, ...] = _given(args.arms, preset["arms"])
    seeds = _given(args.seeds, preset["seeds"])
    targets = _targets(args, workloads, preset)
    for name in workloads:
        batch = _given(args.batch_size, WORKLOADS[name].batch_size)
        if batch % args.nproc:
            raise DemoError(
                f"argument --batch-size: {batch} (workload {name}) is not divisible by "
                f"--nproc {args.nproc}"
            )
    if args.nproc > 1 and args.grad_worker_fraction is not None:
        try:  # the library's rule, checked before any process starts
            resolve_grad_workers(args.grad_worker_fraction, args.nproc)
        except ValueError as error:
            raise DemoError(f"argument --grad-worker-fraction: {error}") from None
    if (
        args.factor_update_steps is not None
        and args.inv_update_steps is not None
        and args.factor_update_steps > args.inv_update_steps
    ):
        raise DemoError(
            f"argument --inv-update-steps: {args.inv_update_steps} is shorter than "
            f"--factor-update-steps {args.factor_update_steps}"
        )
    _check_device(args.device, args.nproc)
    if "soap" in arms:
        try:
            require_heavyball()
        except MissingDependencyError as exc:
            raise DemoError(f"argument --arms: {exc}") from None
    overrides: dict[str, float] = dict(args.lr or {})
    if args.sgd_lr is not None:
        overrides["sgd"] = args.sgd_lr
    if args.kaisa_lr is not None:
        overrides["kaisa-sgd"] = args.kaisa_lr
    table, table_name = _lr_table(args)
    kfac = _kfac_overrides(args)
    out = args.out or os.path.join("runs", "demo-" + time.strftime("%Y%m%d-%H%M%S"))
    configs = []
    for name in workloads:
        w = WORKLOADS[name]
        ratio = w.muon_adamw_lr_ratio
        arm_configs = []
        for arm in arms:
            lr, source = resolve_lr(name, arm, overrides, table, table_name)
            arm_configs.append(
                make_arm(
                    arm,
                    lr,
                    kfac=kfac if arm in KAISA_ARMS else None,
                    momentum=args.momentum,
                    weight_decay=args.weight_decay,
                    adamw_weight_decay=args.adamw_weight_decay,
                    lr_source=source,
                    adamw_lr_ratio=MUON_ADAMW_LR_RATIO if ratio is None else ratio,
                )
            )
        # The budget: --steps, else --epochs, else the workload's steps if it has a step
        # budget, else the preset's or the workload's epochs.
        max_steps = args.steps
        if max_steps is None and args.epochs is None:
            max_steps = w.steps
        # The warm-up: --warmup-steps, else --warmup-epochs, else the workload's.
        warmup_steps = args.warmup_steps
        if warmup_steps is None and args.warmup_epochs is None:
            warmup_steps = w.warmup_steps
        configs.append(
            DemoConfig(
                data_dir=_data_dir(args, w.dataset),
                out_dir=os.path.join(out, name),
                arms=tuple(arm_configs),
                model=w.model,
                epochs=_given(args.epochs, preset.get("epochs", w.epochs)),
                batch_size=_given(args.batch_size, w.batch_size),
                warmup_epochs=_given(args.warmup_epochs, preset["warmup_epochs"]),
                eval_every=_given(args.eval_every, w.eval_every),
                eval_every_near=args.eval_every_near,
                near_margin=w.near_margin,
                target=targets[name],
                seeds=tuple(seeds),
                threads=max(1, args.threads // args.nproc),
                nproc=args.nproc,
                progress=not args.no_progress,
                progress_seconds=args.progress_every,
                quick=args.quick,
                lockstep=not args.sequential,
                workload=name,
                stop_at_target=args.stop_at_target,
                metric=w.metric,
                dataset=w.dataset,
                max_steps=max_steps,
                warmup_steps=warmup_steps,
                context=w.context,
                device=args.device,
            )
        )
    return SuiteConfig(out_dir=out, workloads=tuple(configs), nproc=args.nproc, quick=args.quick)


def _check_device(device: str, nproc: int) -> None:
    """Refuse a device this machine does not have, and CUDA with several processes."""
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise DemoError(
            f"argument --device: {device} is not available here (torch {torch.__version__} "
            "sees no CUDA device); allowed: cpu"
        )
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        raise DemoError(
            f"argument --device: {device} does not exist (this machine has "
            f"{torch.cuda.device_count()} CUDA device(s): cuda:0.."
            f"cuda:{torch.cuda.device_count() - 1})"
        )
    if nproc > 1:
        raise DemoError(
            f"argument --device: {device} runs in one process; --nproc {nproc} "
            "(torchrun + gloo) trains on the CPU"
        )


def _prepare_out_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise DemoError(f"cannot write to output directory {path}: {exc.strerror or exc}") from None
    return out


def _data_text(key: DatasetKey, data: Dataset) -> str:
    """One line about a loaded data set, for the run's header."""
    if isinstance(data, TextCorpus):
        return f"  data: {dataset_label(key[0])}: {data.describe()}"
    _, height, width = data.image_shape
    return (
        f"  data: {dataset_label(key[0])}: {data.train_x.shape[0]} training images "
        f"{height}x{width}, from {data.directory}"
    )


def _describe(suite: SuiteConfig, data: dict[DatasetKey, Dataset]) -> str:
    first = suite.workloads[0]
    kfac = next((a.kfac for a in first.arms if a.kfac is not None), None)
    lines = [
        f"kaisa demo: {len(suite.workloads)} workload(s) x {len(first.arms)} arm(s), "
        f"seeds {','.join(map(str, first.seeds))}, "
        f"{first.nproc} process(es) x {first.threads} thread(s)"
        + (f" on {first.device}" if first.device != "cpu" else "")
        + (", runs stop at the target" if first.stop_at_target else "")
    ]
    lines += [_data_text(key, d) for key, d in data.items()]
    if kfac is not None:
        record = kfac.as_record()
        lines.append(
            "  K-FAC: kaisa.KFACPreconditioner defaults"
            + (" with " + ", ".join(f"{k}={v}" for k, v in record.items()) if record else "")
        )
    for config in suite.workloads:
        w = WORKLOADS.get(config.name)
        budget = (
            f"{config.max_steps} steps" if config.max_steps is not None else
            f"{config.epochs} epoch(s)"
        )  # fmt: skip
        batch = f"batch {config.batch_size}"
        if config.dataset == "fortunes":
            batch += f" x {config.context} bytes"
        lines.append(
            f"  {config.name}: target {config.metric_spec.target_text(config.target)}, "
            f"{budget}, {batch}"
            + (" [provisional]" if w is not None and w.provisional else "")
            + "; peak LRs "
            + ", ".join(f"{a.name} {a.lr:g}" for a in config.arms)
        )
        sources = sorted({a.lr_source for a in config.arms})
        lines.append(f"    LRs from: {'; '.join(sources)}")
    lines.append(f"  output: {suite.out_dir}")
    return "\n".join(lines)


def _run_local(suite: SuiteConfig, data: dict[DatasetKey, Dataset]) -> int:
    import torch

    from kaisa.demo.suite import run_suite

    torch.set_num_threads(suite.workloads[0].threads)
    run_suite(suite, data)
    return 0


def _check_workload(config: DemoConfig, data: Dataset) -> None:
    """Build the model and every arm's optimizer (and preconditioner) once, before training."""
    import torch

    from kaisa.demo.optimizers import build_optimizer
    from kaisa.demo.train import build_demo_model

    if isinstance(data, TextCorpus):
        n_train = int(data.train.numel())
        if config.batch_size * config.context > n_train:
            raise DemoError(
                f"argument --batch-size: {config.batch_size} windows of {config.context} bytes "
                f"are larger than the training stream ({n_train} bytes)"
            )
        if int(data.val.numel()) <= config.context:
            raise DemoError(
                f"workload {config.name}: the validation stream ({data.val.numel()} bytes) is "
                f"shorter than a window of {config.context + 1} bytes"
            )
        model = build_demo_model(config.model, context=config.context)
        example = torch.zeros(2, config.context, dtype=torch.long)
        what = f"{config.context}-byte windows"
    else:
        shape = data.image_shape
        n_images = int(data.train_x.shape[0])
        if config.batch_size > n_images:
            raise DemoError(
                f"argument --batch-size: {config.batch_size} is larger than the training set "
                f"({n_images} images)"
            )
        try:
            model = build_demo_model(config.model, shape)
        except ValueError as exc:
            raise DemoError(f"workload {config.name} ({config.model}): {exc}") from None
        example = torch.zeros(2, *shape)
        what = f"{shape[1]}x{shape[2]} images"
    try:
        with torch.no_grad():
            model.eval()(example)
    except (ValueError, RuntimeError, IndexError) as exc:
        raise DemoError(
            f"workload {config.name} ({config.model}) does not fit {what}: {exc}"
        ) from None
    for arm in config.arms:
        try:
            build_optimizer(model, arm)
        except MissingDependencyError as exc:
            raise DemoError(f"argument --arms: {exc}") from None
        if arm.kfac is not None:
            from kaisa import KFACPreconditioner

            try:
                with warnings.catch_warnings():
                    # Its advice, if any, is given again when the arm is built for training.
                    warnings.simplefilter("ignore")
                    pre = KFACPreconditioner(model, lr=arm.lr, **arm.kfac.overrides())
            except (ValueError, TypeError) as exc:
                raise DemoError(
                    f"K-FAC option rejected by kaisa.KFACPreconditioner: {exc}"
                ) from None
            pre.remove_hooks()


def _run_distributed(suite: SuiteConfig) -> int:
    from kaisa.demo.dist import launch

    code, message = launch(suite)
    if code:
        print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def _load_and_check(suite: SuiteConfig) -> dict[DatasetKey, Dataset]:
    """Load each workload's data (each data set once) and check the workload against it.

    Workload by workload, so that a problem with the first workload is
    reported before the next one's data is read.
    """
    data: dict[DatasetKey, Dataset] = {}
    for config in suite.workloads:
        key = (config.dataset, config.data_dir)
        if key not in data:
            try:
                data[key] = load_dataset(*key)
            except DatasetError as exc:
                hint = dataset_hint(config.dataset)
                raise DatasetError(f"{exc} ({hint})" if hint else str(exc)) from None
        _check_workload(config, data[key])
    return data


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kaisa demo``; returns the exit code."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(args_in)
        suite = build_config(args)
        data = _load_and_check(suite)
        _prepare_out_dir(suite.out_dir)
        for config in suite.workloads:
            _prepare_out_dir(config.out_dir)
        if args.model is not None:
            print(
                f"{PROG}: note: --model is deprecated; use --workload {args.model}",
                file=sys.stderr,
            )
        print(_describe(suite, data), flush=True)
        if suite.nproc > 1:
            del data  # each worker loads its own copy
            return _run_distributed(suite)
        return _run_local(suite, data)
    except DemoError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except DatasetError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
