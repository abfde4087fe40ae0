"""What one comparison runs with: the shared settings and each arm's optimizer.

Everything here is plain data that round-trips through JSON, so the same
configuration can be handed to the worker processes of a ``--nproc`` run and
recorded in ``results.json``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ArmConfig", "DemoConfig", "KfacConfig"]


@dataclass(frozen=True)
class KfacConfig:
    """The K-FAC / KAISA preconditioner's settings for the ``kaisa`` arm."""

    factor_update_steps: int = 10
    inv_update_steps: int = 100
    damping: float = 0.03
    kl_clip: float | None = 0.001
    factor_decay: float = 0.95
    grad_worker_fraction: float = 1.0
    conv_factor_estimator: str = "reduce"
    damping_mode: str = "absolute"
    factor_init: str = "identity"


@dataclass(frozen=True)
class ArmConfig:
    """One arm: SGD with momentum, optionally preceded by the K-FAC preconditioner."""

    name: str
    lr: float
    momentum: float = 0.9
    weight_decay: float = 5e-4
    kfac: KfacConfig | None = None

    def hyperparameters(self) -> dict[str, Any]:
        """The arm's settings as a flat JSON-ready dictionary."""
        out: dict[str, Any] = {
            "optimizer": "SGD",
            "lr": self.lr,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
        }
        if self.kfac is not None:
            out["kfac"] = asdict(self.kfac)
        return out


@dataclass(frozen=True)
class DemoConfig:
    """The whole comparison: the settings both arms share and the arms themselves."""

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
    quick: bool = False
    #: Train and evaluate in ``torch.channels_last`` (both arms): the same
    #: maths, GapCNN steps about 1.3x faster on the CPUs measured here
    #: (``benchmarks/memory_format.py``).
    channels_last: bool = True
    #: Train the arms of a seed in lockstep, one step of each in turn, so that
    #: the machine's load falls on both alike (peak memory is then shared);
    #: ``False``: one arm after the other.
    lockstep: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

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
                ArmConfig(
                    name=arm["name"],
                    lr=arm["lr"],
                    momentum=arm["momentum"],
                    weight_decay=arm["weight_decay"],
                    kfac=KfacConfig(**kfac) if kfac is not None else None,
                )
            )
        rest = {k: v for k, v in data.items() if k != "arms"}
        rest["seeds"] = tuple(rest["seeds"])
        return DemoConfig(arms=tuple(arms), **rest)
