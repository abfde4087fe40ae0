"""Maths: factor running averages, second-order state, preconditioning, KL clipping."""

from kaisa.curvature.block import ComputeMethod, KroneckerBlock
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

__all__ = [
    "ComputeMethod",
    "DecompositionError",
    "KroneckerBlock",
    "damped_inverse",
    "eigen_outer_inverse",
    "fold_running_average",
    "kl_clip_scale",
    "precondition_eigen",
    "precondition_inverse",
    "symmetric_eigen",
]
