"""Session 47's experiment, installed as ``sitecustomize.py`` (not a kaisa option).

With ``KAISA_RESTART`` set, each time ``stale_refresh`` finds the curvature stale,
every layer's factor average restarts: its update count goes to 0, so the next
factor update replaces the factor with the batch's and the ones after average the
batches since (``factor_init='first_batch'``'s rule). It first runs the torchvision
stand-in (``benchmarks/torchvision_standin/sitecustomize.py``, from the repository
root) when that file exists: Python imports only one ``sitecustomize``.
"""

import importlib.util
import os

_STUB = "benchmarks/torchvision_standin/sitecustomize.py"
if os.path.exists(_STUB):
    _spec = importlib.util.spec_from_file_location("_tvstub", _STUB)
    if _spec is not None and _spec.loader is not None:
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))

if os.environ.get("KAISA_RESTART"):
    from kaisa import preconditioner as _p

    _follow = _p.KFACPreconditioner._follow_staleness

    def _restarting(self, ratios, refreshed):  # type: ignore[no-untyped-def]
        before = self.telemetry.stale_refreshes
        _follow(self, ratios, refreshed)
        if self.telemetry.stale_refreshes > before:
            for layer in self._roster:
                layer.block.updates = 0

    _p.KFACPreconditioner._follow_staleness = _restarting  # type: ignore[method-assign]
