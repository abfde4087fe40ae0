"""Teach kaisa a layer of your own: a handler, registered once.

``Dense`` below is not an ``nn.Linear``: its parameters are called ``kernel``
and ``offset``, and its kernel is stored ``(in, out)`` (``y = x kernel +
offset``, as in HuggingFace's ``Conv1D``, JAX and Keras), the transpose of
``nn.Linear``'s ``(out, in)``. kaisa would leave it raw
(``preconditioner.coverage()`` says so). A handler tells kaisa the factor
sides, how one call's input and output gradient become factor sums, where
the weight and bias live and how the weight holds the ``(out, in)``
gradient matrix (``weight_layout = 'in_out'``: transposed; reshaping an
``(in, out)`` kernel to ``(out, in)`` would scramble it). ``kaisa.register_handler``
checks the handler against autograd once, on the ``example`` module, and
refuses it with a message if its gradient matrix is not the layer's
(try ``weight_layout = 'out_in'``); then every ``Dense`` (and every subclass
that keeps its ``forward``) is a K-FAC layer. The script registers it,
trains a small ``Dense`` network on random data and prints the coverage.
(``tests/layers/test_extension.py`` checks that kaisa then takes exactly the
steps it takes with ``nn.Linear``.)

    python examples/custom_layer.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.layers.base import gram_with_ones, last_dim_gram, last_dim_moments, row_moments


class Dense(nn.Module):
    """``y = x kernel + offset``, ``kernel`` stored ``(in, out)``: a Linear layer, transposed."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(d_in, d_out) / d_in**0.5)
        self.offset = nn.Parameter(torch.zeros(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.kernel + self.offset


class DenseHandler(kaisa.LayerHandler):
    """``A`` from the inputs with a ones column (the offset), ``G`` from the output gradients."""

    kind = "kronecker (dense)"
    # The gradient matrix is (out, in + 1): the kernel's gradient transposed, then the offset's.
    weight_layout = "in_out"

    def __init__(self, module: Dense) -> None:
        super().__init__(module)
        d_in, self.g_size = module.kernel.shape
        self.a_size = d_in + 1

    # Where the gradient lives: the rows of the weight, and the bias.
    def weight_slot(self) -> tuple[torch.Tensor, slice]:
        return self.module.kernel, slice(None)

    def bias_slot(self) -> tuple[torch.Tensor, slice] | None:
        return self.module.offset, slice(None)

    # Factor sums for one call (every leading dimension is a row) and the rows.
    def a_sum(self, x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        rows = x.reshape(-1, x.shape[-1])
        return gram_with_ones(rows, out), rows.shape[0]

    def g_sum(
        self, grad: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        return last_dim_gram(grad, out)

    # Row moments, for the cheap representations ('kvec', 'diagonal').
    def a_moments(
        self, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        rows = x.reshape(-1, x.shape[-1])
        return row_moments(rows, out, ones=1.0), rows.shape[0]

    def g_moments(
        self, grad: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        return last_dim_moments(grad, out)


def dense_handler(module: nn.Module, **options: object) -> DenseHandler:
    """The factory kaisa calls for every ``Dense`` it finds (``options``: kaisa's own)."""
    assert isinstance(module, Dense)
    return DenseHandler(module)


def train(steps: int = 30) -> tuple[float, str]:
    torch.manual_seed(0)
    model = nn.Sequential(Dense(8, 32), nn.Tanh(), Dense(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    preconditioner = kaisa.KFACPreconditioner(model, lr=0.1)
    x, y = torch.randn(256, 8), torch.randint(0, 4, (256,))
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        preconditioner.step()
        optimizer.step()
    return loss.item(), str(preconditioner.coverage())


def main() -> None:
    # Checked here, on the example, against the gradient autograd computes.
    kaisa.register_handler(Dense, dense_handler, example=Dense(3, 2))
    loss, coverage = train()
    print(coverage)
    print(f"final training loss {loss:.4f}")


if __name__ == "__main__":
    main()
