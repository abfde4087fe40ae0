"""kaisa: K-FAC gradient preconditioning with KAISA's adaptable placement of work.

Two lines in an existing training loop::

    preconditioner = kaisa.KFACPreconditioner(model, optimizer=optimizer)
    ...
    loss.backward()
    preconditioner.step()
    optimizer.step()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kaisa import _lazy

if TYPE_CHECKING:
    from kaisa.curvature import DecompositionError
    from kaisa.distributed import LayerShape, WorkPlan, make_plan
    from kaisa.layers import LayerHandler, register_handler
    from kaisa.preconditioner import KFACPreconditioner
    from kaisa.telemetry import Telemetry
    from kaisa.views import BlockView, RegisteredLayer

__version__ = "0.1.0"

# Imported on first use so that `kaisa plan` (and anything else that needs only
# the pure-Python planning code) does not pay for importing torch.
_LAZY = {
    "DecompositionError": "kaisa.curvature",
    "KFACPreconditioner": "kaisa.preconditioner",
    "LayerHandler": "kaisa.layers",
    "LayerShape": "kaisa.distributed.plan",
    "RegisteredLayer": "kaisa.views",
    "BlockView": "kaisa.views",
    "Telemetry": "kaisa.telemetry",
    "WorkPlan": "kaisa.distributed.plan",
    "make_plan": "kaisa.distributed.plan",
    "register_handler": "kaisa.layers",
}

__getattr__, __dir__ = _lazy.lazy_attributes(__name__, _LAZY)

__all__ = [
    "BlockView",
    "DecompositionError",
    "KFACPreconditioner",
    "LayerHandler",
    "LayerShape",
    "RegisteredLayer",
    "Telemetry",
    "WorkPlan",
    "__version__",
    "make_plan",
    "register_handler",
]
