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

**Scaled lookups.** HuggingFace's ``*ScaledWordEmbedding`` classes (Gemma's
token embedding, scaled by ``√d``; BART's, mBART's, M2M100's, …) return
``s · W[i]`` for a constant ``embed_scale`` ``s``. The row ``i`` of the
table then gets the gradient ``s · δ``, so :class:`ScaledEmbeddingHandler`
takes ``G`` from ``s · δ`` (``s² δᵀδ``): the factors, and so the steps, of
the plain lookup followed by a multiplication by ``s`` outside it. Such a
class overrides ``forward``, which would leave it raw (and with it a head
tied to it); the registry knows these classes by name
(:func:`kaisa.layers.registry.handler_for`) and
:func:`scaled_embedding_handler` takes one only after checking, on a probe
lookup, that its ``forward`` is that product.

**Lookups of computed indices.** A learned position embedding (OPT's,
BART's, mBART's, BioGPT's, …) is an ``nn.Embedding`` subclass whose
``forward`` takes the token ids or the attention mask and looks up the
positions it derives from them, so the call's input is not what indexes the
table. :class:`ComputedIndexEmbeddingHandler` (what the registry gives an
``nn.Embedding`` subclass that overrides ``forward``) reads the indices from
the lookup itself, the output's autograd node (:func:`lookup_indices`): the
factors, and so the steps, of a plain ``nn.Embedding`` called on those
indices. A subclass whose output is anything but that lookup (or that lookup
broadcast over the batch) is left raw: at construction when a probe call
shows it (:func:`computed_index_refusal`: a normalised or scaled lookup,
the table indexed directly), else when it runs, capturing nothing, with the
reason in the warning about a layer that captured nothing.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kaisa.engines.base import is_dtensor
from kaisa.layers.base import (
    CaptureFn,
    Detachable,
    LayerHandler,
    accumulator_dtype,
    gram,
    last_dim_gram,
    last_dim_moments,
    probe_refusal,
    row_moments,
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


def lookup_indices(output: torch.Tensor, module: nn.Embedding) -> torch.Tensor | None:
    """The indices whose rows of ``module``'s table make ``output``, read off its autograd
    node; ``None`` when ``output`` is not such a lookup.

    ``output`` must be what ``F.embedding(indices, module.weight, module.padding_idx)``
    returned (an ``EmbeddingBackward0`` node whose weight is the table, dense, with the
    module's padding row and gradient scaling), or that broadcast by ``expand``
    (one lookup serving every sample: the indices are broadcast alike). Under
    FSDP2 the table the lookup read is the whole one swapped in for the call,
    no longer the module's (a shard) when its hooks run; it is taken by its shape.
    """
    node = output.grad_fn
    expanded = node is not None and type(node).__name__ == "ExpandBackward0"
    if expanded:
        assert node is not None
        node = node.next_functions[0][0]
    if node is None or type(node).__name__ != "EmbeddingBackward0":
        return None
    variable = getattr(node.next_functions[0][0], "variable", None)
    weight = module.weight
    if variable is not weight and not (
        # FSDP2 reshards a module after its forward, before this hook: the lookup
        # read the whole table it had swapped in, the module now holds its shard.
        is_dtensor(weight)
        and isinstance(variable, torch.Tensor)
        and tuple(variable.shape) == (module.num_embeddings, module.embedding_dim)
    ):
        return None
    saved: Any = node  # what the lookup saved for its backward: ``_saved_<argument>``
    padding = int(saved._saved_padding_idx)  # -1 (or its unsigned value): none
    padding_idx = padding if 0 <= padding < module.num_embeddings else None
    if (
        padding_idx != module.padding_idx
        or bool(saved._saved_sparse)
        or bool(saved._saved_scale_grad_by_freq) != module.scale_grad_by_freq
    ):
        return None
    indices: torch.Tensor = saved._saved_indices
    if not expanded:
        return indices
    try:
        return indices.expand(output.shape[:-1])
    except RuntimeError:  # broadcast along the last dimension too: not one row per index
        return None


class ComputedIndexEmbeddingHandler(EmbeddingHandler):
    """An ``nn.Embedding`` subclass whose ``forward`` computes the indices it looks up.

    HuggingFace's learned position embeddings (OPT's, BART's, mBART's, BioGPT's, …)
    take the token ids or the attention mask and look up positions they derive
    from it (offset by 2), so the call's input is not what the table is indexed
    by. kaisa reads the indices from the lookup itself: the output's autograd
    node (:func:`lookup_indices`), on the factor-update steps' forward calls, then
    proceeds as for ``nn.Embedding``. A call whose output is not a lookup of
    its table (scaled, summed, sliced after the lookup: most such classes are
    refused at construction, :func:`computed_index_refusal`) captures nothing:
    the gradient stays raw, and the warning about it says why.
    """

    kind = "kronecker (embedding, indices read from its lookup, diagonal A)"

    def attach(self, capture: CaptureFn) -> Detachable:
        own = self.module

        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            if module is not own or not isinstance(output, torch.Tensor):
                return
            if not output.requires_grad:
                return  # no gradient reaches this call: nothing to capture
            indices = lookup_indices(output, own)
            if indices is None:
                self.uncaptured_reason = (
                    f"{type(own).__name__}.forward() returned something other than a lookup "
                    "of its table (transformed after the lookup), so kaisa could not read "
                    "the indices it used"
                )
                return
            self.uncaptured_reason = None
            capture(indices, output, None)

        return own.register_forward_hook(hook)


def computed_index_refusal(module: nn.Module) -> str | None:
    """Why an ``nn.Embedding`` subclass that overrides ``forward`` is not taken for a
    lookup of computed indices (``None``: it is, or a probe cannot tell).

    ``forward`` is called directly (no hooks, gradients on, nothing sent back)
    on a probe batch, the indices ``0 … 3`` as one row of token ids (or of an
    attention mask): an output that is not a lookup of the table
    (:func:`lookup_indices`; normalised or scaled after the lookup, or the
    table indexed directly) refuses it. A ``forward`` that does not take such
    an input, or a table on the meta device, sharded or frozen, is decided
    by its lookups as it runs.
    """
    if not isinstance(module, nn.Embedding):
        return f"{type(module).__name__} is not an nn.Embedding"
    if module.sparse:
        return "sparse embedding (sparse=True): sparse gradients are not preconditioned"
    weight = module.weight
    if weight.is_meta or is_dtensor(weight) or not weight.requires_grad:
        return None
    probe = torch.arange(min(module.num_embeddings, 4), device=weight.device).reshape(1, -1)
    try:
        with torch.enable_grad():
            out = module.forward(probe)
    except Exception:  # another signature: decided by the lookups it makes as it runs
        return None
    if isinstance(out, torch.Tensor) and lookup_indices(out, module) is not None:
        return None
    return (
        f"{type(module).__name__}.forward() returned something other than a lookup of its "
        "table on a probe input (transformed after the lookup, or the table indexed directly), "
        "so kaisa cannot read the indices it uses"
    )


def computed_index_embedding_handler(module: nn.Module, **_: object) -> LayerHandler | None:
    """The handler of an ``nn.Embedding`` subclass that overrides ``forward`` (see
    :class:`ComputedIndexEmbeddingHandler`); ``None`` (left raw, with
    :func:`computed_index_refusal`'s reason) when a probe shows it is no such lookup."""
    if computed_index_refusal(module) is not None:
        return None
    assert isinstance(module, nn.Embedding)
    return ComputedIndexEmbeddingHandler(module)


def embedding_handler(module: nn.Module, **_: object) -> LayerHandler | None:
    """The handler of a dense ``nn.Embedding``; ``None`` (left raw) for ``sparse=True``."""
    assert isinstance(module, nn.Embedding)
    if module.sparse:
        return None
    return EmbeddingHandler(module)


class ScaledEmbeddingHandler(EmbeddingHandler):
    """An ``nn.Embedding`` whose output is ``scale`` times the looked-up row: ``y = s · W[i]``.

    The table's gradient is ``Σ (s δ) e_iᵀ``, so ``G`` is the gram (and the
    moments) of ``s · δ``; ``A`` is the plain lookup's (module docstring).
    ``scale=None``: read from the module's ``embed_scale`` at the first
    capture (a model surveyed on the meta device has no value to read yet).
    """

    kind = "kronecker (scaled embedding, diagonal A)"

    def __init__(self, module: nn.Embedding, scale: float | None = None) -> None:
        super().__init__(module)
        if scale is not None:
            _check_scale(scale)
        self._scale = scale

    @property
    def scale(self) -> float:
        """``s``, the constant the lookup multiplies by."""
        if self._scale is None:
            value = _embed_scale(self.module)
            if isinstance(value, str):
                raise ValueError(f"kaisa: {type(self.module).__name__}: {value}")
            self._scale = _check_scale(value)
        return self._scale

    def g_sum(
        self, grad_output: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        scale = self.scale
        return gram(rows, out, scale * scale), rows.shape[0]

    def g_moments(
        self, grad_output: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        return row_moments(rows, out, scale=self.scale), rows.shape[0]

    def __repr__(self) -> str:
        scale = "unread" if self._scale is None else f"{self._scale:g}"
        return (
            f"{type(self).__name__}({self.module!r}, a_size={self.a_size}, "
            f"g_size={self.g_size}, scale={scale})"
        )


def _check_scale(scale: float) -> float:
    if not (math.isfinite(scale) and scale != 0.0):
        raise ValueError(f"ScaledEmbeddingHandler needs a finite non-zero scale, got {scale}")
    return float(scale)


def _embed_scale(module: nn.Module) -> float | str:
    """``module.embed_scale`` as the lookup multiplies by it, or why it cannot be read.

    A tensor (Gemma's buffer) is read in the table's dtype, as its
    ``forward`` casts it; a number (BART's) as it is.
    """
    value = getattr(module, "embed_scale", None)
    weight = getattr(module, "weight", None)
    if isinstance(value, torch.Tensor) and isinstance(weight, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            return f"its embed_scale is a tensor of shape {tuple(value.shape)}, not one number"
        if value.is_meta:
            return "its embed_scale is on the meta device (no value to read yet)"
        return float(value.detach().to(weight.dtype).reshape(()))
    if isinstance(value, Real) and not isinstance(value, bool):
        return float(value)
    return f"it has no numeric embed_scale (found {type(value).__name__})"


def _lookup_mismatch(module: nn.Embedding, scale: float) -> str | None:
    """Why ``module.forward`` is not ``scale · W[i]`` on a probe lookup (``None``: it is).

    ``forward`` is called directly (no hooks), without gradients, on the
    first rows of the table. A table on the meta device or sharded (a
    ``DTensor``) cannot be compared here and is taken on its class's name.
    """
    weight = module.weight
    if weight.is_meta or is_dtensor(weight):
        return None
    idx = torch.arange(min(module.num_embeddings, 4), device=weight.device).reshape(1, -1)
    return probe_refusal(
        module,
        idx,
        lambda i: F.embedding(i, weight, module.padding_idx) * scale,
        f"the table's rows times embed_scale={scale:g}",
        "lookup",
    )


def scaled_embedding_refusal(module: nn.Module) -> str | None:
    """Why ``module`` is not taken as a scaled lookup ``embed_scale · W[i]`` (``None``: it is)."""
    if not isinstance(module, nn.Embedding):
        return f"{type(module).__name__} is not an nn.Embedding"
    if module.sparse:
        return "sparse embedding (sparse=True): sparse gradients are not preconditioned"
    if module.weight.is_meta:
        return None  # nothing to read or compare: taken on its class's name (see the handler)
    scale = _embed_scale(module)
    if isinstance(scale, str):
        return scale
    if not (math.isfinite(scale) and scale != 0.0):
        return f"its embed_scale ({scale:g}) is not a finite non-zero number"
    return _lookup_mismatch(module, scale)


def scaled_embedding_handler(module: nn.Module, **_: object) -> LayerHandler | None:
    """The handler of a HuggingFace ``*ScaledWordEmbedding``; ``None`` (left raw, with
    :func:`scaled_embedding_refusal`'s reason) when it is not the scaled lookup it should be."""
    if scaled_embedding_refusal(module) is not None:
        return None
    assert isinstance(module, nn.Embedding)
    scale = _embed_scale(module)
    return ScaledEmbeddingHandler(module, scale if isinstance(scale, float) else None)
