"""One factor-update step's batch factors folded into the layers' running averages.

The batch factors arrive all-reduced, per layer and per piece (side and
capture: a gram or the rows' moments), with the rows each was summed over.
A layer is folded only when it captured rows on some rank and its ``A`` is
not all zeros, and not when its batch is held back as a possible outlier
(:meth:`~kaisa.curvature.block.KroneckerBlock.fold_unless_outlier`: the next
update tells an outlier batch from a lasting change of scale); the whole
step is skipped when any batch factor or any gradient is not finite (an AMP
overflow must not reach the running averages). One host sync serves all
these checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kaisa.curvature.block import KroneckerBlock
from kaisa.curvature.costs import Capture
from kaisa.curvature.linalg import finite_with_values

__all__ = ["SKIPPED_IN_A_ROW", "FoldOutcome", "fold_batch"]

#: After this many factor updates skipped in a row (not finite), the front door
#: warns, naming the likely cause: one overflow is an accident, three in a row
#: mean that no curvature is being gathered at all.
SKIPPED_IN_A_ROW = 3

#: Per layer, per ``(side, capture)`` piece: the batch factor and its row count.
Batch = Mapping[str, Mapping[tuple[str, Capture], tuple[torch.Tensor, float]]]


@dataclass(frozen=True)
class FoldOutcome:
    """What :func:`fold_batch` did: ``skipped`` (not finite), else per layer name.

    ``held``: batches held back (beyond the outlier ratio; the next update
    tells); ``outliers``: layers whose held batch proved an outlier batch (this
    update was back within the rescale ratio of the average; that batch was
    never folded); ``rescaled``: layers whose scale changed (the batch after a
    held one still beyond the rescale ratio; the running average restarted
    from it).
    """

    skipped: bool
    outliers: tuple[str, ...] = ()
    held: tuple[str, ...] = ()
    rescaled: tuple[str, ...] = ()


def fold_batch(
    blocks: Mapping[str, KroneckerBlock],
    batch: Batch,
    grads: Sequence[torch.Tensor],
    decay: float,
) -> FoldOutcome:
    """Fold each block's batch factors (the pieces its representations hold) with ``decay``.

    ``blocks`` in registration order; ``grads``: the gradients checked for
    finiteness with the factors.
    """
    reduced: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    captured: dict[str, bool] = {}
    traces: list[torch.Tensor] = []
    for name, block in blocks.items():
        pieces = batch.get(name)
        if pieces is None:
            continue
        (a, a_rows), (g, g_rows) = (
            pieces[(which, spec.capture)]
            for which, spec in zip(("a", "g"), block.specs, strict=True)
        )
        reduced[name] = (a, g)
        captured[name] = a_rows > 0 and g_rows > 0
        # The batch's and the running averages' traces: A's batch trace is 0
        # when the layer saw only zeros, or nothing (not folded); a spike
        # against the running average is an outlier batch.
        traces += block.traces(a, g)
    names = list(reduced)
    finite, trace_values = finite_with_values(
        [t for name in names for t in reduced[name]] + list(grads), traces
    )
    if not finite:
        return FoldOutcome(skipped=True, outliers=())
    status: dict[str, list[str]] = {"spike": [], "held": [], "rescaled": []}
    for i, name in enumerate(names):
        layer_traces = trace_values[4 * i : 4 * i + 4]
        # Rows on some rank and a non-zero A (a layer captured nowhere, or fed
        # only zeros, is skipped).
        if not (captured[name] and layer_traces[0] != 0.0):
            continue
        done = blocks[name].fold_unless_outlier(*reduced[name], decay, layer_traces)
        status.get(done, []).append(name)
    return FoldOutcome(
        skipped=False,
        outliers=tuple(status["spike"]),
        held=tuple(status["held"]),
        rescaled=tuple(status["rescaled"]),
    )
