"""``nn.Linear`` and HuggingFace's ``Conv1D``: factors over every leading dimension (spec §3).

``transformers.pytorch_utils.Conv1D`` (GPT-2, GPT, CTRL, …) is a Linear layer
whose weight is stored ``(in, out)``: ``y = x W + b``. Its captures and
factors are ``nn.Linear``'s; its gradient matrix is ``W.grad`` *transposed*
(``weight_layout = 'in_out'``, :class:`TransposedLinearHandler`). The
registry knows the class by name and never imports transformers
(:mod:`kaisa.layers.registry`).
"""

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
    sample_leading_rows,
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

    def sample_rows(
        self, which: str, t: torch.Tensor, keep: float, generator: torch.Generator
    ) -> torch.Tensor:
        """Tokens: a ``keep`` share of the rows over every leading dimension."""
        return sample_leading_rows(t, keep, generator)

    def g_moments(
        self, grad_output: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        return last_dim_moments(grad_output, out)


class TransposedLinearHandler(LinearHandler):
    """A Linear layer whose ``weight`` is stored ``(in, out)``: ``y = x W + b``.

    HuggingFace's ``Conv1D`` (``weight`` ``(nx, nf)``, ``bias`` ``(nf,)``):
    the rows and factors of :class:`LinearHandler` for ``d_in = nx``,
    ``d_out = nf``; the gradient matrix ``[W.gradᵀ | b.grad]``
    (``weight_layout = 'in_out'``). Kaisa takes exactly the steps it takes
    on the ``nn.Linear`` holding ``Wᵀ`` (``tests/layers/test_hf_conv1d.py``).
    """

    module: nn.Module  # type: ignore[assignment]
    kind = "kronecker (linear, (in, out) weight)"
    weight_layout = "in_out"

    def __init__(self, module: nn.Module) -> None:
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(
                f"{type(self).__name__} needs a module with a 2-D (in, out) weight, got {module!r}"
            )
        LayerHandler.__init__(self, module)
        bias = getattr(module, "bias", None)
        if bias is not None and tuple(bias.shape) != (weight.shape[1],):
            raise ValueError(
                f"{type(self).__name__}: a bias of shape {tuple(bias.shape)} does not match an "
                f"(in, out) weight of shape {tuple(weight.shape)}"
            )
        self.a_size = weight.shape[0] + (1 if bias is not None else 0)
        self.g_size = weight.shape[1]


def transposed_linear_handler(module: nn.Module, **_: object) -> TransposedLinearHandler:
    """Handler factory for HuggingFace's ``Conv1D`` (and any ``(in, out)`` Linear layer)."""
    return TransposedLinearHandler(module)
