"""Every choice of :class:`~kaisa.KFACPreconditioner`, validated in one place.

Names and meanings follow the published KAISA implementation (spec §1) so
that its users find what they know. Each bad value raises ``TypeError`` (wrong
kind) or ``ValueError`` (wrong value) naming the argument, the value given and
what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kaisa.distributed.plan import FractionSpec, resolve_grad_workers
from kaisa.schedules import Hyperparameter, Rule

GradScale = Callable[[], float]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _choice(name: str, value: object, allowed: Sequence[str]) -> str:
    if not isinstance(value, str) or value.lower() not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value.lower()


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return value


def _dtype(name: str, value: object, allow_none: bool = True) -> torch.dtype | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, torch.dtype) or value not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating torch.dtype ({', '.join(map(str, _FLOAT_DTYPES))})"
            f"{' or None' if allow_none else ''}; got {value!r}"
        )
    return value


@dataclass(frozen=True)
class KFACOptions:
    """The validated constructor arguments of :class:`~kaisa.KFACPreconditioner`."""

    factor_update_steps: Any = 1
    inv_update_steps: Any = 1
    damping: Any = 0.001
    factor_decay: Any = 0.95
    kl_clip: Any = 0.001
    lr: Any = 0.1
    accumulation_steps: int = 1
    allreduce_bucket_cap_mb: float = 25.0
    assignment_strategy: Literal["compute", "memory"] = "compute"
    colocate_factors: bool = True
    compute_method: Literal["eigen", "inverse"] = "eigen"
    compute_eigenvalue_outer_product: bool = True
    grad_worker_fraction: FractionSpec = "comm-opt"
    symmetry_aware: bool = False
    grad_scaler: object = None
    factor_dtype: torch.dtype | None = None
    inv_dtype: torch.dtype | None = torch.float32
    skip_layers: Sequence[str] = ()
    update_factors_in_hook: bool = True
    conv_factor_estimator: Literal["expand", "reduce"] = "expand"
    factor_product_dtype: torch.dtype | None = None
    damping_mode: Literal["absolute", "relative"] = "absolute"
    factor_init: Literal["identity", "first_batch"] = "identity"
    # Derived, validated views.
    hyper: dict[str, Hyperparameter] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        hyper: dict[str, Hyperparameter] = {
            "factor_update_steps": Hyperparameter(
                Rule("factor_update_steps", integer=True, low=1), self.factor_update_steps
            ),
            "inv_update_steps": Hyperparameter(
                Rule("inv_update_steps", integer=True, low=1), self.inv_update_steps
            ),
            "damping": Hyperparameter(Rule("damping", low=0.0, low_open=True), self.damping),
            "factor_decay": Hyperparameter(
                Rule("factor_decay", low=0.0, high=1.0, high_open=True), self.factor_decay
            ),
            "lr": Hyperparameter(Rule("lr", low=0.0), self.lr),
        }
        if self.kl_clip is not None:
            hyper["kl_clip"] = Hyperparameter(Rule("kl_clip", low=0.0, low_open=True), self.kl_clip)
        set_(self, "hyper", hyper)
        steps = self.accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise TypeError(f"accumulation_steps must be an integer >= 1; got {steps!r}")
        if steps < 1:
            raise ValueError(f"accumulation_steps must be an integer >= 1; got {steps!r}")
        cap = self.allreduce_bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)):
            raise TypeError(f"allreduce_bucket_cap_mb must be a number > 0; got {cap!r}")
        if not cap > 0 or cap == float("inf"):
            raise ValueError(f"allreduce_bucket_cap_mb must be a finite number > 0; got {cap!r}")
        set_(
            self,
            "assignment_strategy",
            _choice("assignment_strategy", self.assignment_strategy, ("compute", "memory")),
        )
        set_(
            self,
            "compute_method",
            _choice("compute_method", self.compute_method, ("eigen", "inverse")),
        )
        set_(
            self,
            "conv_factor_estimator",
            _choice("conv_factor_estimator", self.conv_factor_estimator, ("expand", "reduce")),
        )
        set_(
            self,
            "damping_mode",
            _choice("damping_mode", self.damping_mode, ("absolute", "relative")),
        )
        set_(
            self,
            "factor_init",
            _choice("factor_init", self.factor_init, ("identity", "first_batch")),
        )
        for name in (
            "colocate_factors",
            "compute_eigenvalue_outer_product",
            "symmetry_aware",
            "update_factors_in_hook",
        ):
            _flag(name, getattr(self, name))
        # The fraction is checked against every world size later; here its form.
        resolve_grad_workers(self.grad_worker_fraction, 1)
        scaler = self.grad_scaler
        if scaler is not None and not (callable(scaler) or hasattr(scaler, "get_scale")):
            raise TypeError(
                "grad_scaler must be a torch.amp.GradScaler, a callable returning the current "
                f"loss scale, or None; got {scaler!r}"
            )
        _dtype("factor_dtype", self.factor_dtype)
        _dtype("inv_dtype", self.inv_dtype)
        _dtype("factor_product_dtype", self.factor_product_dtype)
        skip = self.skip_layers
        if skip is None:
            skip = ()
        if isinstance(skip, str):
            skip = (skip,)
        if not isinstance(skip, (list, tuple)) or not all(isinstance(p, str) for p in skip):
            raise TypeError(
                f"skip_layers must be a regular expression or a list of them; got {skip!r}"
            )
        for pattern in skip:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"skip_layers holds an invalid regular expression {pattern!r}: {error}"
                ) from error
        set_(self, "skip_layers", tuple(skip))

    def grad_scale_reader(self) -> GradScale | None:
        """A function returning the current loss scale, or ``None`` without a scaler."""
        scaler = self.grad_scaler
        if scaler is None:
            return None
        get_scale = getattr(scaler, "get_scale", None)
        if callable(get_scale):
            return lambda: float(get_scale())
        assert callable(scaler)
        return lambda: float(scaler())
