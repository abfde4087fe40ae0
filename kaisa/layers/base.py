"""What every layer handler knows: captures to factor sums, and the gradient matrix.

A handler turns the input ``x`` a module saw in the forward pass and the
gradient ``δ = ∂L/∂y`` of its output into *sums* of Kronecker-factor rows
(``āᵀā`` and ``δᵀδ`` with the per-family scaling of spec §3) together with the
number of rows. Sums and row counts add up across calls (weight sharing) and
micro-batches (gradient accumulation); dividing one by the other gives the
batch factors ``A_batch`` and ``G_batch``.

Handlers know nothing of processes, ranks or schedules.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Literal, Protocol

import torch
from torch import nn

from kaisa.engines.base import PLAIN, GradAccess

#: Picks one layer's part of an output gradient (``None``: all of it).
GradSelect = Callable[[torch.Tensor], torch.Tensor] | None

#: ``capture(x, output, select)``: one call of a layer saw the input ``x`` and
#: produced ``output`` (whose gradient, through ``select``, is the layer's ``δ``).
CaptureFn = Callable[[torch.Tensor, torch.Tensor, GradSelect], None]

#: How a weight parameter holds the ``(g_size, a_size)`` gradient matrix (see
#: :attr:`LayerHandler.weight_layout`).
WeightLayout = Literal["out_in", "in_out"]


class Detachable(Protocol):
    """What :meth:`LayerHandler.attach` returns: ``remove()`` stops the captures."""

    def remove(self) -> None: ...


class LayerHandler(ABC):
    """Capture and gradient access for one registered module.

    The contract: for every call, the gradient autograd computes for the
    weight, as the ``(g_size, a_size)`` matrix :meth:`grad_matrix` reads, is
    ``Σ_rows δ āᵀ`` of the rows whose products :meth:`a_sum` and
    :meth:`g_sum` add up (up to one constant factor per layer kind, the
    scaling of spec §3). :attr:`weight_layout` says how the weight holds that
    matrix; :func:`kaisa.register_handler` checks a new handler against
    autograd once, on a probe (:mod:`kaisa.layers.probe`), and refuses one
    that breaks the contract.

    Attributes:
        module: the module whose gradient is preconditioned.
        a_size: side of the ``A`` factor (input features, +1 with a bias).
        g_size: side of the ``G`` factor (output features).
    """

    module: nn.Module
    a_size: int
    g_size: int
    #: Appended to the module's name (``name.suffix``) when one module holds
    #: several blocks (the four projections of ``nn.MultiheadAttention``).
    suffix: str = ""
    #: The representations this layer kind needs for ``(A, G)`` unless the user
    #: fixes them (``None``: left to the automatic choice). ``nn.Embedding``'s
    #: ``A`` is diagonal.
    default_sides: tuple[str | None, str | None] = (None, None)
    #: What kind of block this is, for :meth:`kaisa.KFACPreconditioner.coverage`.
    kind: str = "kronecker"
    #: How the weight parameter holds the gradient matrix's weight columns:
    #: ``'out_in'``, one row per output (``nn.Linear``'s ``(out, in)``, a
    #: convolution's ``(out, in, kh, kw)``): the matrix is the weight's rows
    #: (those of :meth:`weight_slot`) reshaped to ``(g_size, -1)``;
    #: ``'in_out'``, a 2-D weight stored ``(in, out)`` (``y = x W``:
    #: HuggingFace's ``Conv1D``, ``nn.Embedding``'s ``(num_embeddings,
    #: embedding_dim)``): the matrix is the weight *transposed*. Reshaping an
    #: ``(in, out)`` weight to ``(out, in)`` scrambles it instead of
    #: transposing it; the registration probe refuses such a handler.
    weight_layout: WeightLayout = "out_in"
    #: How gradients are read and written (:mod:`kaisa.engines`): ``.grad``
    #: in place unless the preconditioner installs the access its model needs
    #: (DeepSpeed ZeRO, FSDP2). A handler that overrides :meth:`grad_matrix` or
    #: :meth:`set_grad_matrix` reads and writes through it too.
    grads: GradAccess = PLAIN
    #: Why the module's last forward call captured nothing, where the handler can
    #: tell (a lookup whose indices it could not read); ``None`` otherwise. The
    #: warning about a layer that captured nothing yet has a gradient says it.
    uncaptured_reason: str | None = None

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def claimed_modules(self) -> list[nn.Module]:
        """The modules whose parameters this handler covers (their children are not registered)."""
        return [self.module]

    def attach(self, capture: CaptureFn) -> Detachable:
        """Call ``capture(x, output, None)`` on every forward call of the module.

        ``x`` is the call's first positional argument. Handlers whose layer
        is not a module call of its own (attention projections) override this.
        """

        own = self.module

        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            # A deep copy of the model carries this hook along: its modules are
            # not this handler's and must not capture into it.
            if module is not own:
                return
            if args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
                capture(args[0], output, None)

        return own.register_forward_hook(hook)

    def weight_slot(self) -> tuple[torch.Tensor, slice]:
        """The parameter holding the weight, and its rows that are this block's."""
        weight = self.module.weight
        assert isinstance(weight, torch.Tensor)
        return weight, slice(None)

    def bias_slot(self) -> tuple[torch.Tensor, slice] | None:
        """The parameter holding the bias and this block's entries of it, or ``None``."""
        bias = getattr(self.module, "bias", None)
        return None if bias is None else (bias, slice(None))

    @property
    def has_bias(self) -> bool:
        return self.bias_slot() is not None

    @property
    def weight(self) -> torch.Tensor:
        """The parameter holding the weight (all of it: see :meth:`weight_slot`)."""
        return self.weight_slot()[0]

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients this handler reads and writes."""
        params = [self.weight_slot()[0]]
        bias = self.bias_slot()
        if bias is not None:
            params.append(bias[0])
        return params

    @abstractmethod
    def a_sum(self, x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """``āᵀā`` for one call's input ``x`` (added into ``out`` when given) and its row count."""

    @abstractmethod
    def g_sum(
        self, grad_output: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """``δᵀδ`` for one call's output gradient (added into ``out``) and its row count."""

    @abstractmethod
    def a_moments(
        self, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """``[Σ ā; Σ ā²]`` (``(2, a_size)``) for one call's input and its row count.

        The first and second moments of the same rows whose products
        :meth:`a_sum` adds up (the ones column included), for the ``'kvec'``
        and ``'diagonal'`` representations: ``O(rows · a_size)`` instead of
        ``O(rows · a_size²)``.
        """

    @abstractmethod
    def g_moments(
        self, grad_output: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """``[Σ δ; Σ δ²]`` (``(2, g_size)``) for one call's output gradient and its row count."""

    def sample_rows(
        self, which: str, t: torch.Tensor, keep: float, generator: torch.Generator
    ) -> torch.Tensor | None:
        """One call's capture cut to a random ``keep`` share of its rows (``factor_sample``).

        ``t`` is the call's input (``which='a'``) or output gradient
        (``'g'``) as :meth:`a_sum` / :meth:`g_sum` take it; the result must be
        something they take too, whose row count is that of the rows kept.
        ``generator`` (CPU, seeded for this draw) is the only source of
        randomness (:func:`draw_rows`). ``None``: this handler cannot draw
        rows, and the grams take all of them (the default; the preconditioner
        names such layers when ``factor_sample`` is below 1).
        """
        return None

    def capture_work(self, which: str, capture: str, rows: float) -> float:
        """Multiply-adds of one step's captures of side ``which`` over ``rows`` rows.

        ``capture`` is ``'gram'`` (``rows·n²`` for plain row products) or
        ``'moments'`` (``2·rows·n``). The automatic curvature choice
        (:mod:`kaisa.curvature.budget`) weighs representations with it; a
        handler whose products are cheaper than that says so here.
        """
        n = self.a_size if which == "a" else self.g_size
        return rows * n * n if capture == "gram" else 2.0 * rows * n

    def training_work(self, rows: float) -> float:
        """Multiply-adds of the layer's forward and backward passes over ``rows`` rows.

        ``rows`` as the moments captures count them (every row of spec §3):
        one product of ``rows × a`` by ``a × g`` forward, two backward.
        """
        return 3.0 * rows * self.a_size * self.g_size

    def grad_matrix(self) -> torch.Tensor | None:
        """The gradient as one ``(g_size, a_size)`` matrix, or ``None`` if there is none.

        A layer whose weight has no gradient (it did not take part in the
        loss) returns ``None``; one whose bias alone is missing gets zeros
        for the bias column. Gradients are read through :attr:`grads`.
        """
        weight, rows = self.weight_slot()
        # A weight frozen after registration keeps whatever .grad it has: kaisa
        # never writes it (nor its layer's bias, then left raw).
        if not weight.requires_grad:
            return None
        full = self.grads.read(weight)
        if full is None:
            return None
        if self.weight_layout == "in_out":
            _whole_weight(self, weight, rows)
            grad = full.t()
        else:
            grad = full[rows].reshape(self.g_size, -1)
        slot = self.bias_slot()
        if slot is None:
            # (A transposed weight is handed on as a contiguous copy.)
            return grad.contiguous() if self.weight_layout == "in_out" else grad
        bias, b_rows = slot
        bias_full = self.grads.read(bias)
        bias_grad = bias_full[b_rows] if bias_full is not None else grad.new_zeros(self.g_size)
        return torch.cat([grad, bias_grad.reshape(-1, 1)], dim=1)

    def set_grad_matrix(self, matrix: torch.Tensor) -> None:
        """Write a ``(g_size, a_size)`` matrix back as the parameters' gradients.

        Through :attr:`grads`: a staged access keeps the write until its
        ``flush()`` (the preconditioner's, at the end of the step).
        """
        weight, rows = self.weight_slot()
        w_cols = matrix.shape[1] - (1 if self.has_bias else 0)
        if self.weight_layout == "in_out":
            _whole_weight(self, weight, rows)
            self.grads.write(weight, rows, matrix[:, :w_cols].t())
        else:
            self.grads.write(weight, rows, matrix[:, :w_cols])
        slot = self.bias_slot()
        if slot is None or not slot[0].requires_grad:  # frozen after registration: not written
            return
        bias, b_rows = slot
        self.grads.write(bias, b_rows, matrix[:, w_cols])

    def probe_input(self, generator: torch.Generator) -> tuple[torch.Tensor, ...] | None:
        """Arguments for one forward call of :attr:`module` that make exactly one row.

        The registration check (:mod:`kaisa.layers.probe`) runs the module on
        them, in float64 where it can. The default suits a Linear-like layer:
        one row of ``a_size`` input features (less the bias's ones column),
        ``(1, d_in)``. A handler whose module takes other inputs (images,
        indices, several arguments) overrides this; ``None`` means it cannot
        make one.
        """
        weight = self.weight
        d_in = self.a_size - (1 if self.has_bias else 0)
        return (torch.randn(1, d_in, generator=generator, dtype=torch.float64).to(weight),)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.module!r}, a_size={self.a_size}, g_size={self.g_size})"


def _whole_weight(handler: LayerHandler, weight: torch.Tensor, rows: slice) -> None:
    """An ``'in_out'`` weight is one 2-D matrix, taken whole."""
    if weight.dim() != 2 or rows != slice(None):
        raise ValueError(
            f"{type(handler).__name__}: weight_layout 'in_out' takes a whole 2-D weight "
            f"(weight_slot() gave a {weight.dim()}-D weight with rows {rows})"
        )


def draw_rows(
    count: int, keep: float, generator: torch.Generator, device: torch.device
) -> torch.Tensor | None:
    """Indices of ``max(1, round(keep · count))`` of ``count`` rows drawn without
    replacement, in increasing order, on ``device``; ``None`` when that is every row."""
    kept = max(1, round(keep * count))
    if kept >= count:
        return None
    chosen = torch.randperm(count, generator=generator)[:kept].sort().values
    return chosen.to(device, non_blocking=True)


def sample_leading_rows(t: torch.Tensor, keep: float, generator: torch.Generator) -> torch.Tensor:
    """``t``'s rows over every leading dimension (``(rows, t.shape[-1])``), cut to
    a ``keep`` share by :func:`draw_rows` (a Linear's tokens)."""
    rows = t.reshape(-1, t.shape[-1])
    chosen = draw_rows(rows.shape[0], keep, generator, rows.device)
    return rows if chosen is None else rows.index_select(0, chosen)


def probe_refusal(
    module: nn.Module,
    probe: torch.Tensor,
    expected: Callable[[torch.Tensor], torch.Tensor],
    what: str,
    noun: str = "input",
) -> str | None:
    """Why a module known by its class's name does not compute what that class should
    (``None``: it does), from one call of its ``forward`` on ``probe``.

    ``forward`` is called directly (no hooks), without gradients, and compared
    with ``expected(probe)``, within ``1e-10`` of the largest expected entry in
    float64, ``1e-5`` in float32, ``1e-2`` in half precision. The reason names
    ``what`` it should be and the probe (``noun``: 'input', 'lookup').
    """
    try:
        with torch.no_grad():
            got = module.forward(probe)
            want = expected(probe)
    except Exception as err:  # any failure means: not what this class should be
        return f"its forward failed on a probe {noun} ({type(err).__name__}: {err})"
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return f"its forward returned {shape} on a probe {noun}, not {tuple(want.shape)}"
    rtol = {torch.float64: 1e-10, torch.float32: 1e-5}.get(want.dtype, 1e-2)
    diff = float((got.double() - want.double()).abs().max())
    if diff > rtol * max(float(want.double().abs().max()), 1e-30):
        return f"its forward is not {what} on a probe {noun} (off by {diff:.3g})"
    return None


def accumulator_dtype(rows: torch.Tensor) -> torch.dtype:
    """The dtype factor sums of ``rows`` accumulate in: at least float32."""
    return torch.promote_types(rows.dtype, torch.float32)


def gram(rows: torch.Tensor, out: torch.Tensor | None, scale: float = 1.0) -> torch.Tensor:
    """``scale · rowsᵀ rows``, accumulated into ``out`` when it is given.

    Products run in ``rows``' dtype (bfloat16 rows use the fast half-precision
    matrix units); the result is accumulated in at least float32.
    """
    if out is None:
        product = torch.mm(rows.t(), rows).to(accumulator_dtype(rows))
        return product if scale == 1.0 else product.mul_(scale)
    if out.dtype == rows.dtype:
        return out.addmm_(rows.t(), rows, alpha=scale)
    return out.add_(torch.mm(rows.t(), rows), alpha=scale)


def gram_with_ones(
    rows: torch.Tensor, out: torch.Tensor | None, scale: float = 1.0
) -> torch.Tensor:
    """``scale · [rows | 1]ᵀ [rows | 1]`` without materialising the concatenation.

    The top-left block is ``rowsᵀrows``, the last row and column hold the
    column sums, and the corner is the row count. Accumulated in at least float32.
    """
    d = rows.shape[1]
    if out is None:
        out = rows.new_zeros(d + 1, d + 1, dtype=accumulator_dtype(rows))
    gram(rows, out[:d, :d], scale)
    add_ones_border(out, rows.sum(dim=0, dtype=out.dtype), rows.shape[0], scale)
    return out


def row_moments(
    rows: torch.Tensor,
    out: torch.Tensor | None,
    scale: float = 1.0,
    ones: float | None = None,
) -> torch.Tensor:
    """``[Σ r; Σ r²]`` of ``scale · rows`` (``(2, d)``, or ``(2, d + 1)`` with a ones column).

    ``ones`` is the value of the ones column's entry in every row (``None``:
    no ones column), as scaled rows see it. Accumulated in at least float32
    into ``out`` when given.
    """
    rows = rows.to(accumulator_dtype(rows))
    d = rows.shape[1]
    extra = 0 if ones is None else 1
    if out is None:
        out = rows.new_zeros(2, d + extra)
    out[0, :d].add_(rows.sum(dim=0), alpha=scale)
    out[1, :d].add_(rows.square().sum(dim=0), alpha=scale * scale)
    if ones is not None:
        count = rows.shape[0]
        out[0, d].add_(count * ones)
        out[1, d].add_(count * ones * ones)
    return out


def add_ones_border(out: torch.Tensor, col_sum: torch.Tensor, count: int, scale: float) -> None:
    """Add the ones column's part of ``scale · [R | 1]ᵀ [R | 1]`` to ``out`` in place.

    ``col_sum`` is ``Rᵀ1`` (the last row and column) and ``count`` the number
    of rows (the corner); the top-left block ``RᵀR`` is the caller's.
    """
    d = col_sum.shape[0]
    out[:d, d].add_(col_sum, alpha=scale)
    out[d, :d].add_(col_sum, alpha=scale)
    out[d, d].add_(count * scale)


def last_dim_gram(t: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """``RᵀR`` of ``t``'s rows over every leading dimension (into ``out``), and the row count."""
    rows = t.reshape(-1, t.shape[-1])
    return gram(rows, out), rows.shape[0]


def last_dim_moments(t: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """``[Σ r; Σ r²]`` of ``t``'s rows over every leading dimension, and the row count."""
    rows = t.reshape(-1, t.shape[-1])
    return row_moments(rows, out), rows.shape[0]
