"""kaisa: K-FAC gradient preconditioning with KAISA's adaptable placement of work.

Two lines in an existing training loop::

    preconditioner = kaisa.KFACPreconditioner(model)
    ...
    loss.backward()
    preconditioner.step()
    optimizer.step()
"""

from kaisa.curvature import DecompositionError
from kaisa.distributed import LayerShape, WorkPlan, make_plan
from kaisa.layers import LayerHandler, register_handler
from kaisa.preconditioner import KFACPreconditioner
from kaisa.telemetry import Telemetry

__version__ = "0.1.0"

__all__ = [
    "DecompositionError",
    "KFACPreconditioner",
    "LayerHandler",
    "LayerShape",
    "Telemetry",
    "WorkPlan",
    "__version__",
    "make_plan",
    "register_handler",
]
