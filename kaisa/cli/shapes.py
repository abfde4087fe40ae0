"""The factor sides of the layers a model would register, for ``kaisa plan``.

The plan (:mod:`kaisa.distributed`) knows shapes only; this reads them off an
``nn.Module`` through the layer registry, so the command line plans exactly
the layers ``KFACPreconditioner`` registers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kaisa.distributed.plan import LayerShape

if TYPE_CHECKING:
    from torch import nn

__all__ = ["module_layer_shapes"]


def module_layer_shapes(model: nn.Module, skip_layers: Sequence[str] = ()) -> list[LayerShape]:
    """The factor sides of every layer the preconditioner would register in ``model``.

    Asks the layer registry (:func:`kaisa.layers.find_layers`), so the plan
    printed for a model counts exactly the layers ``KFACPreconditioner``
    registers, with the same names and the same ``skip_layers`` rule; a
    layer kind's own representation (an embedding's diagonal ``A``) is kept,
    the other sides are exact.
    """
    from kaisa.layers import find_layers

    return [
        LayerShape(
            name,
            handler.a_size,
            handler.g_size,
            *(side or "exact" for side in handler.default_sides),
        )
        for name, handler in find_layers(model, skip_layers)
    ]
