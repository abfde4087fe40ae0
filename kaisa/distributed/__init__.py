"""Placement and traffic: the KAISA work plan and the communicator."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kaisa import _lazy
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


# The communicator needs torch; the plan does not (see `kaisa plan`).
_LAZY = {
    "Communicator": "kaisa.distributed.comm",
    "default_world": "kaisa.distributed.comm",
}

# Only __getattr__: dir() lists what has been imported so far, as before.
__getattr__ = _lazy.lazy_attributes(__name__, _LAZY)[0]
