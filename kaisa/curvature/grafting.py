"""Grafting: a layer's preconditioned direction at the raw gradient's size.

K-FAC changes both the direction and the size of each layer's step; an
optimizer behind it was tuned for the size of raw gradients. Grafting (as
Shampoo grafts its direction onto another optimizer's step size) keeps the
direction and takes the size from the raw gradient, per layer:
``P ← P · ‖∇‖_F / ‖P‖_F``. A user can then put kaisa in front of an optimizer
at the optimizer's own tuned learning rate.
"""

from __future__ import annotations

import torch

__all__ = ["graft"]


def graft(preconditioned: torch.Tensor, grad: torch.Tensor) -> None:
    """Rescale ``preconditioned`` in place to ``grad``'s Frobenius norm (a zero one stays zero)."""
    dtype = torch.promote_types(preconditioned.dtype, torch.float32)
    size = preconditioned.to(dtype).norm()
    ratio = grad.to(dtype).norm() / size.clamp_min(torch.finfo(dtype).tiny)
    preconditioned.mul_(ratio.to(preconditioned.dtype))
