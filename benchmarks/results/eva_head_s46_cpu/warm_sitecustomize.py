"""Experiment (session 46): with KAISA_WARM set, the factor and inverse intervals in force are
capped by a warm-up, the largest power of two not above the step (1 at steps 0-1), so the
first factors and decompositions are refreshed at steps 1, 2, 4, 8, ... until the intervals
chosen (or given) take over. Not a kaisa option."""

import importlib.util
import os

_STUB = "/tmp/tvstub/sitecustomize.py"
if os.path.exists(_STUB):
    _spec = importlib.util.spec_from_file_location("_tvstub", _STUB)
    if _spec is not None and _spec.loader is not None:
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))

if os.environ.get("KAISA_WARM"):
    from kaisa import options as O

    def _warm(step: int) -> int:
        interval = 1
        while 2 * interval <= step:
            interval *= 2
        return interval

    _factor = O.KFACOptions.factor_interval
    _inverse = O.KFACOptions.inverse_interval

    def factor_interval(self, step, chosen=None, stretch=1):  # type: ignore[no-untyped-def]
        return min(_factor(self, step, chosen, stretch), _warm(step))

    def inverse_interval(self, step, chosen=None, stretch=1):  # type: ignore[no-untyped-def]
        return min(_inverse(self, step, chosen, stretch), _warm(step))

    O.KFACOptions.factor_interval = factor_interval
    O.KFACOptions.inverse_interval = inverse_interval
