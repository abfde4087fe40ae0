"""Maths: factor running averages, second-order state, preconditioning, KL clipping.

Imported lazily, name by name, so that the torch-free parts (the
representation specs and costs in :mod:`kaisa.curvature.costs`) can be used
by ``kaisa plan`` without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kaisa import _lazy

if TYPE_CHECKING:
    from kaisa.choices import ComputeMethod
    from kaisa.curvature.block import KroneckerBlock
    from kaisa.curvature.costs import SideCost, SideSpec, side_cost
    from kaisa.curvature.linalg import (
        DecompositionError,
        damped_inverse,
        eigen_outer_inverse,
        fold_running_average,
        kl_clip_scale,
        precondition_eigen,
        precondition_inverse,
        symmetric_eigen,
    )
    from kaisa.curvature.representations import Side, make_side, split_damping

_LAZY = {
    "ComputeMethod": "kaisa.choices",
    "KroneckerBlock": "kaisa.curvature.block",
    "SideCost": "kaisa.curvature.costs",
    "SideSpec": "kaisa.curvature.costs",
    "side_cost": "kaisa.curvature.costs",
    "DecompositionError": "kaisa.curvature.linalg",
    "damped_inverse": "kaisa.curvature.linalg",
    "eigen_outer_inverse": "kaisa.curvature.linalg",
    "fold_running_average": "kaisa.curvature.linalg",
    "held_basis": "kaisa.curvature.linalg",
    "kl_clip_scale": "kaisa.curvature.linalg",
    "precondition_eigen": "kaisa.curvature.linalg",
    "precondition_inverse": "kaisa.curvature.linalg",
    "symmetric_eigen": "kaisa.curvature.linalg",
    "Side": "kaisa.curvature.representations",
    "make_side": "kaisa.curvature.representations",
    "split_damping": "kaisa.curvature.representations",
}

# Only __getattr__: dir() lists what has been imported so far, as before.
__getattr__ = _lazy.lazy_attributes(__name__, _LAZY)[0]

__all__ = [
    "ComputeMethod",
    "DecompositionError",
    "KroneckerBlock",
    "Side",
    "SideCost",
    "SideSpec",
    "damped_inverse",
    "eigen_outer_inverse",
    "fold_running_average",
    "held_basis",
    "kl_clip_scale",
    "make_side",
    "precondition_eigen",
    "precondition_inverse",
    "side_cost",
    "split_damping",
    "symmetric_eigen",
]
