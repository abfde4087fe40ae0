"""``nn.Linear``: factors over every leading dimension (spec §3, Linear)."""

from __future__ import annotations

import torch
from torch import nn

from kaisa.layers.base import (
    LayerHandler,
    gram,
    gram_with_ones,
    last_dim_gram,
    last_dim_moments,
    row_moments,
)


class LinearHandler(LayerHandler):
    """``x`` of shape ``(..., d_in)`` and ``δ`` of shape ``(..., d_out)``.

    All leading dimensions are flattened into ``R`` rows, so a sequence model's
    tokens count as rows: ``A_batch = āᵀā / R`` with ``ā = [x | 1]``,
    ``G_batch = δᵀδ / R``.
    """

    module: nn.Linear
    kind = "kronecker (linear)"

    def __init__(self, module: nn.Linear) -> None:
        super().__init__(module)
        self.a_size = module.in_features + (1 if module.bias is not None else 0)
        self.g_size = module.out_features

    def a_sum(self, x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        rows = x.reshape(-1, x.shape[-1])
        total = gram_with_ones(rows, out) if self.has_bias else gram(rows, out)
        return total, rows.shape[0]

    def g_sum(
        self, grad_output: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        return last_dim_gram(grad_output, out)

    def a_moments(
        self, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        rows = x.reshape(-1, x.shape[-1])
        return row_moments(rows, out, ones=1.0 if self.has_bias else None), rows.shape[0]

    def g_moments(
        self, grad_output: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        return last_dim_moments(grad_output, out)
