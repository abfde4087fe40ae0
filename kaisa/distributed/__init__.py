"""Placement and traffic: the KAISA work plan and the communicator."""

from kaisa.distributed.comm import Communicator, default_world
from kaisa.distributed.plan import (
    LayerAssignment,
    LayerShape,
    WorkPlan,
    make_plan,
    resolve_grad_workers,
)

__all__ = [
    "Communicator",
    "LayerAssignment",
    "LayerShape",
    "WorkPlan",
    "default_world",
    "make_plan",
    "resolve_grad_workers",
]
