"""What the benchmark suite runs with: workloads, arms, their optimizers and learning rates.

Everything here is plain data that round-trips through JSON, so the same
configuration can be handed to the worker processes of a ``--nproc`` run and
recorded in ``results.json``.

* :data:`WORKLOADS` is the one table of workloads: the network, its data, the
  metric and target it is measured by (test accuracy, higher is better, for
  the image workloads; validation loss in nats per byte, lower is better, for
  the language model), and its budget. Its entries are provisional until
  ``make demo`` is calibrated (see :class:`Workload`). :data:`METRICS`
  describes the metrics.
* :data:`ARM_NAMES` are the optimizer arms. Every arm follows the same
  schedule shape (linear warm-up, then cosine to 0) on its own peak learning
  rate, looked up per (workload, arm) by :func:`resolve_lr`: a command-line
  override, else the sweep's result file :data:`DEFAULT_LR_FILE` (written by
  ``benchmarks/lr_sweep.py --suite``), else the workload's row of
  :data:`WORKLOAD_FALLBACK_LRS`, else :data:`FALLBACK_LRS`.
* The kaisa arms put ``kaisa.KFACPreconditioner`` with the library's defaults
  in front of their optimizer; :class:`KfacConfig` only holds explicit
  overrides, so the same K-FAC configuration runs on every workload.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = [
    "ADAMW_WEIGHT_DECAY",
    "ARM_ALIASES",
    "ARM_NAMES",
    "DEFAULT_LR_FILE",
    "DEFAULT_WORKLOADS",
    "FALLBACK_LRS",
    "KAISA_ARMS",
    "METRICS",
    "MUON_ADAMW_LR_RATIO",
    "WORKLOADS",
    "WORKLOAD_FALLBACK_LRS",
    "ArmConfig",
    "DemoConfig",
    "KfacConfig",
    "LrTableError",
    "Metric",
    "SuiteConfig",
    "Workload",
    "base_arm",
    "make_arm",
    "read_lr_table",
    "resolve_lr",
]


# --- workloads -----------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    """What a workload is measured by, and which way is better.

    ``key`` names the metric in the records: ``results.json`` holds
    ``final_<key>`` and ``best_<key>`` per run and arm. ``reached`` is the
    rule of "reached the target": at least the target when higher is better,
    at most the target when lower is better.
    """

    name: str
    key: str
    label: str
    unit: str
    higher_is_better: bool
    column: str
    """The per-workload table's header of the value at the end of a run."""

    def reached(self, value: float, target: float) -> bool:
        """Whether ``value`` meets ``target`` (``>=`` or ``<=`` by the direction)."""
        return value >= target if self.higher_is_better else value <= target

    def near(self, value: float, target: float, margin: float) -> bool:
        """Whether ``value`` has not reached ``target`` but is within ``margin`` of it."""
        if self.higher_is_better:
            return target - margin <= value < target
        return target < value <= target + margin

    def best(self, values: list[float]) -> float:
        """The best of ``values``."""
        return max(values) if self.higher_is_better else min(values)

    def format(self, value: float) -> str:
        """A value as the tables show it: ``91.23%`` or ``1.4872``."""
        return f"{value:.2%}" if self.name == "accuracy" else f"{value:.4f}"

    def target_text(self, target: float) -> str:
        """A target in a sentence: ``91.0%`` or ``validation loss 1.50 nats/byte``."""
        if self.name == "accuracy":
            return f"{target:.1%}"
        return f"{self.label} {target:.2f} {self.unit}".rstrip()

    def target_short(self, target: float) -> str:
        """A target in a table header: ``91.0%`` or ``loss 1.50``."""
        return f"{target:.1%}" if self.name == "accuracy" else f"loss {target:.2f}"

    def check_target(self, target: float) -> str:
        """An error message for an impossible ``target``, ``''`` when it is possible."""
        if self.name == "accuracy":
            if 0.0 < target <= 1.0:
                return ""
            hint = f" (did you mean {target / 100:g}?)" if 1.0 < target <= 100.0 else ""
            return f"impossible target accuracy {target:g}: it must be a fraction in (0, 1]{hint}"
        if target > 0.0 and math.isfinite(target):
            return ""
        return f"impossible target {self.label} {target:g}: it must be a positive number"


METRICS: dict[str, Metric] = {
    "accuracy": Metric(
        "accuracy", "test_accuracy", "test accuracy", "", True, column="final test acc"
    ),
    "val_loss": Metric(
        "val_loss",
        "val_loss",
        "validation loss",
        "nats/byte",
        False,
        column="final val loss",
    ),
}
"""The metrics workloads are measured by: ``accuracy`` (test accuracy of an image
classifier, a fraction, higher is better) and ``val_loss`` (mean next-byte
cross-entropy over fixed validation windows, nats per byte, lower is better)."""


@dataclass(frozen=True)
class Workload:
    """One workload of the suite: a network from :mod:`kaisa.models`, its data, a target, a budget.

    ``metric`` (a key of :data:`METRICS`) says what ``target`` is: a test
    accuracy to reach or exceed (``"accuracy"``, the image workloads on
    Fashion-MNIST) or a validation loss in nats per byte to reach or go
    below (``"val_loss"``, the language model on the ``fortunes`` text
    corpus); ``higher_is_better`` follows from it. The budget is ``epochs``
    passes over the training data, or ``steps`` optimizer steps when given
    (the learning-rate schedule spans the budget either way), with a warm-up
    of ``warmup_steps`` steps when given (else the suite's
    ``--warmup-epochs``). ``batch_size`` is the global batch (images, or
    windows of ``context`` bytes), ``eval_every`` the evaluation interval in
    steps, ``near_margin`` how close below (above, for a loss) the target
    evaluations become four times as frequent. ``muon_adamw_lr_ratio`` is the
    Muon arm's AdamW-group LR over its Muon LR (``None``: the suite's
    :data:`MUON_ADAMW_LR_RATIO`).

    ``provisional`` marks a target or budget that has not been calibrated by a
    full ``make demo`` yet; results record the flag so that nobody reads a
    placeholder as a finding. gap_cnn's, small_cnn's, vit's and gpt's have been.
    """

    name: str
    model: str
    target: float
    epochs: int
    provisional: bool = True
    note: str = ""
    metric: str = "accuracy"
    dataset: str = "fashion_mnist"
    batch_size: int = 128
    steps: int | None = None
    warmup_steps: int | None = None
    eval_every: int = 100
    near_margin: float = 0.01
    context: int = 64
    muon_adamw_lr_ratio: float | None = None

    @property
    def higher_is_better(self) -> bool:
        """Whether a higher value of the metric is better (accuracy) or a lower one (loss)."""
        return METRICS[self.metric].higher_is_better

    @property
    def budget(self) -> str:
        """``3 epoch(s)`` or ``1500 steps``."""
        return f"{self.steps} steps" if self.steps is not None else f"{self.epochs} epoch(s)"


WORKLOADS: dict[str, Workload] = {
    "gap_cnn": Workload(
        "gap_cnn",
        "gap_cnn",
        0.91,
        3,
        provisional=False,
        note="the original demo's workload: 91% in 3 epochs was reached by SGD and SGD + KAISA "
        "on every seed of earlier runs",
    ),
    "small_cnn": Workload(
        "small_cnn",
        "small_cnn",
        0.91,
        3,
        provisional=False,
        note="the wide-FC CNN of issue 15 (Linear 3136->128): every arm of the 2026-11-24 "
        "sweep reached 91% in 3 epochs at its best learning rate (SGD in 950 steps)",
    ),
    "resnet20": Workload(
        "resnet20",
        "resnet20",
        0.91,
        3,
        note="PLACEHOLDER target and budget, to be decided by a calibration run; "
        "28x28 input as is (global average pooling: 28 -> 14 -> 7)",
    ),
    "vit": Workload(
        "vit",
        "vit",
        0.86,
        3,
        provisional=False,
        note="a ViT from nn.TransformerEncoder (7x7 patches, d 64, 2 layers, 4 heads), the "
        "transformer workload of issue 16: target fixed after a 3-epoch probe at the fallback "
        "LRs (every arm but SGD reached 86%); in the suite runs of 2026-11-24 every arm but "
        "SGD reached it on all 3 seeds at its swept LR",
    ),
    "gpt": Workload(
        "gpt",
        "gpt",
        2.10,
        1,
        provisional=False,
        note="a byte-level GPT (kaisa.models.GPT: d 128, 3 layers, 4 heads, context 64, "
        "0.67 M parameters) on Debian's fortunes corpus, batch 16 x 64 bytes, 1500 steps "
        "(issue 31). Target 2.10 nats/byte, not the issue's 1.50: one AdamW run at lr 3e-3 "
        "(seed 0, the full 1500 steps, evaluated every 50) ended at 1.998 nats/byte, so 1.50 "
        "is out of reach in this budget; it passed 2.10 between steps 900 (2.117) and 950 "
        "(2.088), about 62% of the budget, as the image workloads' targets fall at about "
        "two thirds to four fifths of theirs. Fixed before any comparison and calibrated by the "
        "full make demo of 2026-11-28 (AdamW reached it at 946 of 1500 steps, median of 3 "
        "seeds; benchmarks/results/suite-s17); LRs swept for AdamW, SOAP and kaisa-adamw "
        "(seed 0, 2026-11-25) and Muon, SGD and kaisa-sgd (2026-11-28; neither SGD arm "
        "reaches the target)",
        metric="val_loss",
        dataset="fortunes",
        batch_size=16,
        steps=1500,
        warmup_steps=100,
        eval_every=50,
        near_margin=0.05,
        context=64,
        muon_adamw_lr_ratio=0.15,
    ),
    "resnet32": Workload(
        "resnet32",
        "resnet32",
        0.91,
        3,
        note="PLACEHOLDER, not in the default suite; kept so that --model resnet32 still works",
    ),
}
"""The workload table: edit the target and budget here (``--target``, ``--epochs``
and ``--steps`` override them for every selected workload)."""

DEFAULT_WORKLOADS: tuple[str, ...] = ("gap_cnn", "small_cnn", "vit", "gpt")
"""The workloads ``kaisa demo`` runs without ``--workload``.

``gpt`` (issue 31) is the language model: a byte-level GPT decoder
(:class:`kaisa.models.GPT`, 0.67 M parameters) on the ``fortunes`` text
corpus (:mod:`kaisa.demo.text`), measured by its validation loss.

ResNet-20 is not among them yet: an SGD step of it took 198–346 ms in
``benchmarks/step_overhead.py`` (3×32×32 images, batch 128, 2 threads), 5–9×
GapCNN's 40 ms in the suite, so its 18 runs (six arms, three seeds) would
take an estimated one to two hours, beyond ``make demo``'s half hour. Run it
with ``--workload resnet20``; its target, epochs and learning rates are not
calibrated yet."""


# --- arms ----------------------------------------------------------------------

ARM_NAMES: tuple[str, ...] = ("sgd", "adamw", "muon", "soap", "kaisa-sgd", "kaisa-adamw")
"""Every arm, in the order tables list them."""

ARM_ALIASES: dict[str, str] = {"kaisa": "kaisa-sgd"}
"""Older arm names still accepted."""

KAISA_ARMS: dict[str, str] = {"kaisa-sgd": "sgd", "kaisa-adamw": "adamw"}
"""The K-FAC arms and the arm of their base optimizer."""

MUON_ADAMW_LR_RATIO = 0.1
"""Muon arm: the AdamW group's peak learning rate over the Muon group's.

Muon's learning rate (0.02 in its authors' code) is about ten times a typical
AdamW learning rate for the same network (2e-3), so the Muon sweep grid
0.005-0.08 puts the AdamW group at 5e-4-8e-3, the AdamW arm's own grid.
"""

ADAMW_WEIGHT_DECAY = 0.05
"""Decoupled weight decay of AdamW, kaisa-adamw, SOAP and Muon's AdamW group.

0.05 is the value of the common AdamW image-classification recipes (DeiT,
ConvNeXt). Decoupled decay shrinks the weights by ``lr * wd`` per step, about
1e-4 at a peak LR of 2e-3: over this suite's few epochs a mild regulariser,
weaker than SGD's coupled 5e-4 (about ``lr * wd / (1 - momentum)`` = 5e-4 per
step at lr 0.1). It is not swept.
"""


@dataclass(frozen=True)
class KfacConfig:
    """Explicit overrides of ``kaisa.KFACPreconditioner``'s defaults for the kaisa arms.

    Every field defaults to ``None``: the library's default, whichever it is
    when the demo runs (:meth:`overrides` passes only the fields that are set).
    ``kl_clip="off"`` turns KL clipping off (the library's ``kl_clip=None``).
    """

    factor_update_steps: int | None = None
    inv_update_steps: int | None = None
    damping: float | None = None
    kl_clip: float | str | None = None
    factor_decay: float | None = None
    grad_worker_fraction: float | str | None = None
    conv_factor_estimator: str | None = None
    damping_mode: str | None = None
    factor_init: str | None = None
    calibrate_budget: bool | None = None
    curvature: str | None = None
    eigenvalue_correction: str | None = None
    eigenbasis_tolerance: float | None = None
    adaptive_intervals: bool | None = None
    stale_refresh: bool | None = None
    fresh_start_steps: int | None = None
    time_budget: float | None = None
    factor_sample: float | None = None
    profile: str | None = None

    def overrides(self) -> dict[str, Any]:
        """Keyword arguments for ``KFACPreconditioner``: the fields that are set."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            out[f.name] = None if (f.name == "kl_clip" and value == "off") else value
        return out

    def as_record(self) -> dict[str, Any]:
        """The fields that are set, as JSON (``kl_clip`` stays ``"off"``)."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }


@dataclass(frozen=True)
class ArmConfig:
    """One arm: an optimizer, its peak learning rate, optionally K-FAC in front.

    ``optimizer`` is ``"sgd"`` (momentum, coupled weight decay), ``"adamw"``
    (``torch.optim.AdamW``, decoupled decay), ``"muon"`` (``torch.optim.Muon``
    on hidden weight matrices, the demo's own Muon step on hidden conv filters,
    AdamW on the rest; see :mod:`kaisa.demo.optimizers`) or ``"soap"``
    (``heavyball.SOAP`` with its defaults but for ``lr`` and ``weight_decay``).

    ``momentum`` is SGD's or Muon's momentum (unused by AdamW and SOAP, which
    keep their libraries' betas). For Muon, ``lr`` and ``weight_decay`` are the
    Muon group's and ``adamw_lr_ratio`` / ``adamw_weight_decay`` the AdamW
    group's. ``lr_source`` records where ``lr`` came from.
    """

    name: str
    lr: float
    momentum: float = 0.9
    weight_decay: float = 5e-4
    kfac: KfacConfig | None = None
    optimizer: str = "sgd"
    adamw_lr_ratio: float = MUON_ADAMW_LR_RATIO
    adamw_weight_decay: float = ADAMW_WEIGHT_DECAY
    lr_source: str = ""

    def hyperparameters(self) -> dict[str, Any]:
        """The arm's settings as a flat JSON-ready dictionary."""
        out: dict[str, Any]
        if self.optimizer == "sgd":
            out = {
                "optimizer": "SGD",
                "lr": self.lr,
                "momentum": self.momentum,
                "weight_decay": self.weight_decay,
            }
        elif self.optimizer == "adamw":
            out = {"optimizer": "AdamW", "lr": self.lr, "weight_decay": self.weight_decay}
        elif self.optimizer == "muon":
            out = {
                "optimizer": "Muon+AdamW",
                "lr": self.lr,
                "momentum": self.momentum,
                "weight_decay": self.weight_decay,
                "adamw_lr": self.lr * self.adamw_lr_ratio,
                "adamw_lr_ratio": self.adamw_lr_ratio,
                "adamw_weight_decay": self.adamw_weight_decay,
                "conv_filters": "Muon (the demo's own step on the (out, in*kh*kw) flattening)",
            }
        else:
            out = {"optimizer": "heavyball.SOAP", "lr": self.lr, "weight_decay": self.weight_decay}
        if self.kfac is not None:
            out["kfac"] = self.kfac.as_record()
        if self.lr_source:
            out["lr_source"] = self.lr_source
        return out


def base_arm(name: str) -> str:
    """The canonical arm name for ``name`` (aliases resolved); ``ValueError`` if unknown."""
    name = ARM_ALIASES.get(name, name)
    if name not in ARM_NAMES:
        raise ValueError(
            f"unknown arm {name!r}; allowed: {', '.join(ARM_NAMES)} "
            f"({', '.join(f'{a} = {b}' for a, b in ARM_ALIASES.items())})"
        )
    return name


def make_arm(
    name: str,
    lr: float,
    *,
    kfac: KfacConfig | None = None,
    momentum: float = 0.9,
    weight_decay: float = 5e-4,
    adamw_weight_decay: float = ADAMW_WEIGHT_DECAY,
    lr_source: str = "",
    adamw_lr_ratio: float = MUON_ADAMW_LR_RATIO,
) -> ArmConfig:
    """The arm called ``name`` with peak learning rate ``lr`` and the suite's settings.

    ``momentum`` and ``weight_decay`` are the SGD arms' (coupled decay, as the
    original demo); ``adamw_weight_decay`` is the decoupled decay of AdamW,
    kaisa-adamw, SOAP and Muon's AdamW group. Muon's AdamW group runs at
    ``adamw_lr_ratio`` times the Muon LR (the workload's, default
    :data:`MUON_ADAMW_LR_RATIO`); Muon's own group uses momentum 0.95
    (``torch.optim.Muon``'s and its authors' default) and a decoupled decay of
    ``adamw_weight_decay * adamw_lr_ratio``, so that both of its groups shrink
    their weights by the same ``lr * wd`` per step. The kaisa arms get
    ``kfac`` (default: no overrides, the library's defaults).
    """
    name = base_arm(name)
    if name in ("sgd", "kaisa-sgd"):
        return ArmConfig(
            name,
            lr,
            momentum,
            weight_decay,
            kfac=(kfac or KfacConfig()) if name == "kaisa-sgd" else None,
            optimizer="sgd",
            lr_source=lr_source,
        )
    if name in ("adamw", "kaisa-adamw"):
        return ArmConfig(
            name,
            lr,
            weight_decay=adamw_weight_decay,
            kfac=(kfac or KfacConfig()) if name == "kaisa-adamw" else None,
            optimizer="adamw",
            lr_source=lr_source,
        )
    if name == "muon":
        return ArmConfig(
            name,
            lr,
            momentum=0.95,
            weight_decay=adamw_weight_decay * adamw_lr_ratio,
            optimizer="muon",
            adamw_lr_ratio=adamw_lr_ratio,
            adamw_weight_decay=adamw_weight_decay,
            lr_source=lr_source,
        )
    return ArmConfig(
        name, lr, weight_decay=adamw_weight_decay, optimizer="soap", lr_source=lr_source
    )


# --- learning rates ------------------------------------------------------------

DEFAULT_LR_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "suite_lrs.json"
"""The sweep's best peak learning rate per (workload, arm), read by default.

Written by ``python benchmarks/lr_sweep.py --suite`` (see that script); it
exists in a source checkout only, so an installed copy of kaisa falls back to
:data:`FALLBACK_LRS`.
"""

FALLBACK_LRS: dict[str, float] = {
    "sgd": 0.1,
    "kaisa-sgd": 0.05,
    "adamw": 2e-3,
    "kaisa-adamw": 2e-3,
    "soap": 2e-3,
    "muon": 0.02,
}
"""Peak learning rates for a (workload, arm) the sweep file has no entry for.

Not swept for this suite: conventional starting points, the middle of each
family's sweep grid (SGD 0.1, AdamW and SOAP 2e-3, Muon 0.02, the value of
Muon's authors) except kaisa-sgd at 0.05, the original demo's swept value for
SGD + KAISA on gap_cnn (with different K-FAC settings). Run the sweep to
replace them; results record ``lr_source`` for every arm. A workload with its
own row in :data:`WORKLOAD_FALLBACK_LRS` uses that row instead.
"""

WORKLOAD_FALLBACK_LRS: dict[str, dict[str, float]] = {
    "gpt": {
        "sgd": 0.3,
        "kaisa-sgd": 0.3,
        "adamw": 3e-3,
        "kaisa-adamw": 3e-3,
        "soap": 3e-3,
        "muon": 0.02,
    },
}
"""Per-workload fallback learning rates, **NOT SWEPT**: starting points until
``benchmarks/lr_sweep.py --suite --workloads gpt`` replaces them.

gpt (the byte-level language model): AdamW, kaisa-adamw and SOAP 3e-3, a
common peak for a small character-level Transformer; Muon 0.02 (its authors'
value) with its AdamW group (embeddings, head, norms, biases) at 3e-3, the
workload's ``muon_adamw_lr_ratio`` of 0.15; SGD and kaisa-sgd 0.3.
"""


class LrTableError(ValueError):
    """The learning-rate file is unreadable or not what the sweep writes."""


def _sweep_note(entry: dict[str, Any]) -> str:
    """How the sweep found an entry's LR, in a few words ('' if the entry does not say)."""
    settings = entry.get("settings")
    if not isinstance(settings, dict):
        return ""
    parts = []
    if isinstance(settings.get("max_steps"), int):
        parts.append(f"{settings['max_steps']} steps")
    elif isinstance(settings.get("epochs"), int):
        parts.append(f"{settings['epochs']} epoch(s)")
    if isinstance(settings.get("target_accuracy"), (int, float)):
        parts.append(f"target {settings['target_accuracy']:.1%}")
    elif isinstance(settings.get("target"), (int, float)):
        metric = METRICS.get(str(settings.get("metric", "accuracy")), METRICS["accuracy"])
        parts.append(f"target {metric.target_text(settings['target'])}")
    if entry.get("at_grid_edge"):
        parts.append("at the grid's edge")
    return ", ".join(parts)


def read_lr_table(path: str | Path) -> dict[str, dict[str, tuple[float, str]]]:
    """``{workload: {arm: (lr, note)}}`` from a file written by ``lr_sweep.py --suite``.

    The file's ``"lrs"`` maps workload to arm to an entry with a positive
    ``"lr"``; the other keys record how the sweep found it, which ``note``
    sums up (epochs and target of the sweep, whether the LR is at the edge of
    the grid). Raises :class:`LrTableError` naming the file when it cannot be
    read or parsed.
    """
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise LrTableError(f"learning-rate file {p}: {exc}") from None
    table = doc.get("lrs") if isinstance(doc, dict) else None
    if not isinstance(table, dict):
        raise LrTableError(f"learning-rate file {p}: no 'lrs' object")
    out: dict[str, dict[str, tuple[float, str]]] = {}
    for workload, arms in table.items():
        if not isinstance(arms, dict):
            raise LrTableError(f"learning-rate file {p}: 'lrs.{workload}' is not an object")
        for arm, entry in arms.items():
            lr = entry.get("lr") if isinstance(entry, dict) else None
            if (
                isinstance(lr, bool)
                or not isinstance(lr, (int, float))
                or not (math.isfinite(lr) and lr > 0)
            ):
                raise LrTableError(
                    f"learning-rate file {p}: 'lrs.{workload}.{arm}.lr' must be a positive "
                    f"number, got {lr!r}"
                )
            name = ARM_ALIASES.get(str(arm), str(arm))
            out.setdefault(str(workload), {})[name] = (float(lr), _sweep_note(entry))
    return out


def resolve_lr(
    workload: str,
    arm: str,
    overrides: dict[str, float],
    table: dict[str, dict[str, tuple[float, str]]],
    table_name: str = "sweep file",
) -> tuple[float, str]:
    """Peak learning rate of ``arm`` on ``workload`` and where it came from.

    In order: ``overrides[arm]`` (the command line), ``table[workload][arm]``
    (the sweep file, :func:`read_lr_table`), the workload's row of
    :data:`WORKLOAD_FALLBACK_LRS`, :data:`FALLBACK_LRS`.
    """
    if arm in overrides:
        return overrides[arm], "command line"
    if arm in table.get(workload, {}):
        lr, note = table[workload][arm]
        return lr, f"{table_name} ({note})" if note else table_name
    if arm in WORKLOAD_FALLBACK_LRS.get(workload, {}):
        return WORKLOAD_FALLBACK_LRS[workload][arm], f"fallback table for {workload} (not swept)"
    return FALLBACK_LRS[arm], "fallback table (not swept)"


# --- whole runs ----------------------------------------------------------------


@dataclass(frozen=True)
class DemoConfig:
    """One workload's comparison: the settings all arms share and the arms themselves.

    ``data_dir`` is the directory of the workload's ``dataset``
    (``"fashion_mnist"``: the four IDX files; ``"fortunes"``: the text files,
    see :mod:`kaisa.demo.text`). ``metric`` (a key of :data:`METRICS`) says
    what ``target`` is and which way is better. The budget is ``epochs``
    passes over the training data, or ``max_steps`` steps when set; the
    warm-up lasts ``warmup_steps`` steps when set, else ``warmup_epochs``
    epochs. ``context`` is the window length in bytes of a text workload.
    """

    data_dir: str
    out_dir: str
    arms: tuple[ArmConfig, ...]
    model: str = "gap_cnn"
    epochs: int = 3
    batch_size: int = 128
    warmup_epochs: float = 0.25
    eval_every: int = 100
    eval_every_near: int | None = None
    near_margin: float = 0.01
    target: float = 0.91
    seeds: tuple[int, ...] = (0, 1, 2)
    threads: int = 2
    nproc: int = 1
    progress: bool = True
    #: With ``progress`` and an output that is not a terminal (a log file,
    #: CI), each arm prints a plain progress line at most this often (wall
    #: seconds; 0: after every step) in place of the terminal's tqdm bars.
    progress_seconds: float = 30.0
    quick: bool = False
    #: Train and evaluate in ``torch.channels_last`` (all arms): the same
    #: maths, GapCNN steps about 1.3x faster on the CPUs measured here
    #: (``benchmarks/memory_format.py``). Image workloads only.
    channels_last: bool = True
    #: Train the arms of a seed in lockstep, one step of each in turn, so that
    #: the machine's load falls on all alike (peak memory is then shared);
    #: ``False``: one arm after the other.
    lockstep: bool = True
    #: The workload's name in :data:`WORKLOADS` (``""``: just ``model``).
    workload: str = ""
    #: End each run at the first evaluation that reaches the target (the time
    #: and steps to the target are those of a full run; the final accuracy is
    #: then the accuracy at the target).
    stop_at_target: bool = False
    #: What ``target`` measures: a key of :data:`METRICS`.
    metric: str = "accuracy"
    #: The data set: ``"fashion_mnist"`` or ``"fortunes"``.
    dataset: str = "fashion_mnist"
    #: A step budget that replaces ``epochs`` (``None``: ``epochs`` passes).
    max_steps: int | None = None
    #: The warm-up in steps (``None``: ``warmup_epochs`` epochs).
    warmup_steps: int | None = None
    #: A text workload's window length in bytes (the model's context).
    context: int = 64
    #: End every run after this many steps, whatever the budget (the schedule
    #: is still the full budget's, so steps to a target reached before the
    #: limit are those of a full run): for probes. ``None``: no limit.
    step_limit: int | None = None
    #: Where every arm trains: ``"cpu"`` or a CUDA device (``"cuda"``,
    #: ``"cuda:1"``). The data stay in host memory; each batch is copied to
    #: the device inside the timed step, as a data loader's would be.
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def metric_spec(self) -> Metric:
        """The :class:`Metric` of ``metric``."""
        return METRICS[self.metric]

    @property
    def name(self) -> str:
        """The workload's name (``model`` when none was given)."""
        return self.workload or self.model

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dictionary that :meth:`from_json` turns back into this object."""
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> DemoConfig:
        """Rebuild a configuration written by :meth:`to_json`."""
        arms = []
        for arm in data["arms"]:
            kfac = arm.get("kfac")
            arms.append(
                ArmConfig(**{**arm, "kfac": KfacConfig(**kfac) if kfac is not None else None})
            )
        rest = {k: v for k, v in data.items() if k != "arms"}
        rest["seeds"] = tuple(rest["seeds"])
        return DemoConfig(arms=tuple(arms), **rest)


@dataclass(frozen=True)
class SuiteConfig:
    """The whole benchmark: one :class:`DemoConfig` per workload, run in order.

    Each workload writes to its own ``DemoConfig.out_dir`` (``out_dir/<workload>``);
    the summary over workloads goes to ``out_dir``.
    """

    out_dir: str
    workloads: tuple[DemoConfig, ...]
    nproc: int = 1
    quick: bool = False

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dictionary that :meth:`from_json` turns back into this object."""
        return {
            "out_dir": self.out_dir,
            "workloads": [w.to_json() for w in self.workloads],
            "nproc": self.nproc,
            "quick": self.quick,
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> SuiteConfig:
        """Rebuild a configuration written by :meth:`to_json`."""
        return SuiteConfig(
            out_dir=data["out_dir"],
            workloads=tuple(DemoConfig.from_json(w) for w in data["workloads"]),
            nproc=data["nproc"],
            quick=data["quick"],
        )
