"""Placement and traffic: the KAISA work plan and the communicator."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kaisa.distributed.plan import (
    LayerAssignment,
    LayerShape,
    WorkPlan,
    make_plan,
    resolve_grad_workers,
)

if TYPE_CHECKING:
    from kaisa.distributed.comm import Communicator, default_world

__all__ = [
    "Communicator",
    "LayerAssignment",
    "LayerShape",
    "WorkPlan",
    "default_world",
    "make_plan",
    "resolve_grad_workers",
]


def __getattr__(name: str) -> Any:
    # The communicator needs torch; the plan does not (see `kaisa plan`).
    if name in ("Communicator", "default_world"):
        value = getattr(importlib.import_module("kaisa.distributed.comm"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
