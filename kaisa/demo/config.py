"""What the benchmark suite runs with: workloads, arms, their optimizers and learning rates.

Everything here is plain data that round-trips through JSON, so the same
configuration can be handed to the worker processes of a ``--nproc`` run and
recorded in ``results.json``.

* :data:`WORKLOADS` is the one table of workloads: the network, the target test
  accuracy and the epoch budget of each. Its entries are provisional until
  ``make demo`` is calibrated (see :class:`Workload`).
* :data:`ARM_NAMES` are the optimizer arms. Every arm follows the same
  schedule shape (linear warm-up, then cosine to 0) on its own peak learning
  rate, looked up per (workload, arm) by :func:`resolve_lr`: a command-line
  override, else the sweep's result file :data:`DEFAULT_LR_FILE` (written by
  ``benchmarks/lr_sweep.py --suite``), else :data:`FALLBACK_LRS`.
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
    "MUON_ADAMW_LR_RATIO",
    "WORKLOADS",
    "ArmConfig",
    "DemoConfig",
    "KfacConfig",
    "LrTableError",
    "SuiteConfig",
    "Workload",
    "base_arm",
    "make_arm",
    "read_lr_table",
    "resolve_lr",
]


# --- workloads -----------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """One workload of the suite: a network from :mod:`kaisa.models`, a target, a budget.

    ``provisional`` marks a target or budget that has not been calibrated by a
    full ``make demo`` yet; results record the flag so that nobody reads a
    placeholder as a finding. gap_cnn's, small_cnn's and vit's have been.
    """

    name: str
    model: str
    target_accuracy: float
    epochs: int
    provisional: bool = True
    note: str = ""


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
    "resnet32": Workload(
        "resnet32",
        "resnet32",
        0.91,
        3,
        note="PLACEHOLDER, not in the default suite; kept so that --model resnet32 still works",
    ),
}
"""The workload table: edit the target and epoch budget here (``--target`` and
``--epochs`` override them for every selected workload)."""

DEFAULT_WORKLOADS: tuple[str, ...] = ("gap_cnn", "small_cnn", "vit")
"""The workloads ``kaisa demo`` runs without ``--workload``.

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
) -> ArmConfig:
    """The arm called ``name`` with peak learning rate ``lr`` and the suite's settings.

    ``momentum`` and ``weight_decay`` are the SGD arms' (coupled decay, as the
    original demo); ``adamw_weight_decay`` is the decoupled decay of AdamW,
    kaisa-adamw, SOAP and Muon's AdamW group. Muon's own group uses momentum
    0.95 (``torch.optim.Muon``'s and its authors' default) and a decoupled decay
    of ``adamw_weight_decay * MUON_ADAMW_LR_RATIO``, so that both of its groups
    shrink their weights by the same ``lr * wd`` per step. The kaisa arms get
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
            weight_decay=adamw_weight_decay * MUON_ADAMW_LR_RATIO,
            optimizer="muon",
            adamw_lr_ratio=MUON_ADAMW_LR_RATIO,
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
replace them; results record ``lr_source`` for every arm.
"""


class LrTableError(ValueError):
    """The learning-rate file is unreadable or not what the sweep writes."""


def _sweep_note(entry: dict[str, Any]) -> str:
    """How the sweep found an entry's LR, in a few words ('' if the entry does not say)."""
    settings = entry.get("settings")
    if not isinstance(settings, dict):
        return ""
    parts = []
    if isinstance(settings.get("epochs"), int):
        parts.append(f"{settings['epochs']} epoch(s)")
    if isinstance(settings.get("target_accuracy"), (int, float)):
        parts.append(f"target {settings['target_accuracy']:.1%}")
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
    (the sweep file, :func:`read_lr_table`), :data:`FALLBACK_LRS`.
    """
    if arm in overrides:
        return overrides[arm], "command line"
    if arm in table.get(workload, {}):
        lr, note = table[workload][arm]
        return lr, f"{table_name} ({note})" if note else table_name
    return FALLBACK_LRS[arm], "fallback table (not swept)"


# --- whole runs ----------------------------------------------------------------


@dataclass(frozen=True)
class DemoConfig:
    """One workload's comparison: the settings all arms share and the arms themselves."""

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
    target_accuracy: float = 0.91
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
    #: (``benchmarks/memory_format.py``).
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
    extra: dict[str, Any] = field(default_factory=dict)

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
