"""``nn.Embedding``: a Linear on one-hot rows, with a diagonal ``A``.

A lookup ``y = W[i]`` is the Linear ``y = Wᵀ e_i`` on the one-hot row ``e_i``
(no bias), so the factors are the Linear ones (spec §3) over every looked-up
index: ``A_batch = Σ e_i e_iᵀ / R`` is diagonal, holding how often each row
was used, and ``G_batch = δᵀδ / R``. ``A`` is therefore represented as
``'diagonal'`` unless the user fixes another representation, and its
captures cost ``O(R)`` (a count per row). The table is stored ``(in, out)``
(``weight_layout = 'in_out'``): the gradient matrix is ``W.grad`` transposed
(``(embedding_dim, num_embeddings)``), so column ``j`` is row ``j`` of the
table.

``padding_idx``: torch gives that row a zero gradient, and a diagonal ``A``
keeps it zero, so the padding row is never moved. ``sparse=True`` embeddings
are not preconditioned (see :func:`embedding_handler`).
"""

from __future__ import annotations

import torch
from torch import nn

from kaisa.layers.base import (
    LayerHandler,
    accumulator_dtype,
    last_dim_gram,
    last_dim_moments,
    sample_leading_rows,
)


class EmbeddingHandler(LayerHandler):
    """``nn.Embedding`` (dense gradients): ``a = num_embeddings``, ``g = embedding_dim``."""

    module: nn.Embedding
    default_sides = ("diagonal", None)
    kind = "kronecker (embedding, diagonal A)"
    weight_layout = "in_out"

    def __init__(self, module: nn.Embedding) -> None:
        if module.sparse:
            raise ValueError("EmbeddingHandler needs dense gradients (sparse=False)")
        super().__init__(module)
        self.a_size = module.num_embeddings
        self.g_size = module.embedding_dim

    @property
    def _dtype(self) -> torch.dtype:
        """Counts accumulate as the table's gradients would: at least float32."""
        return accumulator_dtype(self.weight)

    def _counts(self, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        flat = indices.reshape(-1)
        return torch.bincount(flat, minlength=self.a_size).to(dtype)

    def sample_rows(
        self, which: str, t: torch.Tensor, keep: float, generator: torch.Generator
    ) -> torch.Tensor:
        """Tokens: a ``keep`` share of the indices (``'a'``) or of the gradient's rows."""
        if which == "a":
            return sample_leading_rows(t.reshape(-1, 1), keep, generator).reshape(-1)
        return sample_leading_rows(t, keep, generator)

    def a_sum(self, x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        counts = self._counts(x, out.dtype if out is not None else self._dtype)
        if out is None:
            out = torch.diag(counts)
        else:
            out.diagonal().add_(counts)
        return out, x.numel()

    def g_sum(
        self, grad_output: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        return last_dim_gram(grad_output, out)

    def a_moments(
        self, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        # One-hot rows: the sum and the sum of squares are both the counts.
        counts = self._counts(x, out.dtype if out is not None else self._dtype)
        if out is None:
            out = counts.new_zeros(2, self.a_size)
        out[0].add_(counts)
        out[1].add_(counts)
        return out, x.numel()

    def g_moments(
        self, grad_output: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        return last_dim_moments(grad_output, out)

    def capture_work(self, which: str, capture: str, rows: float) -> float:
        if which == "a":
            return rows  # a count per looked-up index, whatever the representation
        return super().capture_work(which, capture, rows)

    def training_work(self, rows: float) -> float:
        # A gather forward and a scatter-add backward of embedding_dim per row.
        return 2.0 * rows * self.g_size

    def probe_input(self, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        """One index (one one-hot row), never ``padding_idx``'s (whose gradient is zero)."""
        rows = [i for i in range(self.a_size) if i != self.module.padding_idx]
        pick = rows[int(torch.randint(len(rows), (1,), generator=generator))]
        return (torch.tensor([pick], device=self.weight.device),)


def embedding_handler(module: nn.Module, **_: object) -> LayerHandler | None:
    """The handler of a dense ``nn.Embedding``; ``None`` (left raw) for ``sparse=True``."""
    assert isinstance(module, nn.Embedding)
    if module.sparse:
        return None
    return EmbeddingHandler(module)
