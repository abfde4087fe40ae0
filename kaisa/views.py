"""Read-only views of what the preconditioner holds, for users, tools and tests.

:attr:`kaisa.KFACPreconditioner.layers` returns one :class:`RegisteredLayer`
per registered layer (a snapshot taken when it is read); its ``block`` is a
:class:`BlockView`, which reads the layer's curvature block live without
letting anything change it. The tensors it returns are the block's own
(no copy is made): treat them as read-only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kaisa.curvature.block import KroneckerBlock
from kaisa.curvature.costs import Capture
from kaisa.layers import LayerHandler

__all__ = ["BlockView", "RegisteredLayer"]


class BlockView:
    """One layer's curvature block, read-only: factors, counters, representations, state."""

    __slots__ = ("_block",)

    def __init__(self, block: KroneckerBlock) -> None:
        self._block = block

    @property
    def a(self) -> torch.Tensor:
        """The running average of ``A`` (its two moment rows for a moments side)."""
        return self._block.a

    @property
    def g(self) -> torch.Tensor:
        """The running average of ``G`` (its two moment rows for a moments side)."""
        return self._block.g

    @property
    def specs(self) -> tuple[str, str]:
        """``(A's, G's)`` representations, as strings (``'exact'``, ``'lowrank:K'``, …)."""
        a, g = self._block.specs
        return str(a), str(g)

    @property
    def updates(self) -> int:
        """Factor updates folded in so far."""
        return self._block.updates

    @property
    def outliers(self) -> int:
        """Consecutive outlier batches refused (reset by the next folded update)."""
        return self._block.outliers

    @property
    def has_second_order(self) -> bool:
        """Whether this rank holds second-order state for the layer."""
        return self._block.has_second_order

    @property
    def second_order(self) -> dict[str, tuple[torch.Tensor, ...]]:
        """Each allocated side's second-order tensors (``(Q, λ)``, ``((F+γI)⁻¹,)``, …)."""
        return {which: tuple(tensors) for which, tensors in self._block.second_order.items()}

    def state_dict(self) -> dict[str, object]:
        """The block's part of a checkpoint (copies)."""
        return self._block.state_dict()

    def __repr__(self) -> str:
        a, g = self.specs
        return f"BlockView({self._block.name!r}, A={a}, G={g}, updates={self.updates})"


@dataclass(frozen=True)
class RegisteredLayer:
    """One registered layer, as :attr:`KFACPreconditioner.layers` shows it (read-only).

    ``curvature`` is the representation of ``A`` and of ``G`` (provisional
    until the automatic choice is made); ``grad_worker``: this rank
    preconditions the layer's gradient (KAISA's plan); ``dormant``: it
    captured nothing on the last factor-update step and keeps its raw
    gradient until it captures again (its factors and second-order state are
    kept). ``capture_keys``: what it captures on a factor-update step
    (per side ``'gram'`` or ``'moments'``); ``micro_batches`` and
    ``pending_passes``: the current iteration's complete passes and calls
    still waiting for their output gradient; ``captured_rows``: the rows
    captured so far in it, per ``(side, capture)``; ``corrected``: whether
    ``eigenvalue_correction`` reaches it.
    """

    name: str
    module: nn.Module
    kind: str
    a_size: int
    g_size: int
    curvature: tuple[str, str]
    grad_worker: bool
    dormant: bool
    handler: LayerHandler
    block: BlockView
    capture_keys: tuple[tuple[str, Capture], ...]
    micro_batches: int
    pending_passes: int
    captured_rows: dict[tuple[str, Capture], int]
    #: The eigenvalue correction preconditions the layer (``eigenvalue_correction``
    #: on, and both sides exact or diagonal or the layer a tied weight's use; see
    #: :meth:`~kaisa.roster.Layer.correction_gap`).
    corrected: bool = False
