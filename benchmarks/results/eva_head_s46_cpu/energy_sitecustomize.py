"""Session 46's experiment, installed as ``sitecustomize.py`` (not a kaisa option).

With ``KAISA_ENERGY`` set, exact sides take relative damping's scale ``s`` from the
energy-weighted mean eigenvalue ``tr(F²)/tr(F) = Σλ²/Σλ`` instead of the mean one
``tr(F)/n``. It lies between the mean and the largest eigenvalue: the mean for a flat
spectrum, the largest for a rank-one factor, so it damps a factor whose trace sits in a
few directions harder than today's rule (session 45's ``max_scaled_sitecustomize.py``
always used the largest). ``KAISA_ENERGY_SIDE=a`` (or ``g``) limits it to one side of
every layer, ``KAISA_ENERGY_LAYER=REGEX`` to the layers whose name it matches in full.
EKFAC's solve (``eigenvalue_correction='ekfac'``) does not read this scale.

It first runs ``/tmp/tvstub/sitecustomize.py`` when that file exists (the stand-in for
torchvision that timm needs on this machine; only one ``sitecustomize`` is imported).
"""

import importlib.util
import os
import re
import sys

_STUB = "/tmp/tvstub/sitecustomize.py"
if os.path.exists(_STUB):
    _spec = importlib.util.spec_from_file_location("_tvstub", _STUB)
    if _spec is not None and _spec.loader is not None:
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))

if os.environ.get("KAISA_ENERGY"):
    from kaisa.curvature import representations as R

    _side = os.environ.get("KAISA_ENERGY_SIDE")
    _layer = os.environ.get("KAISA_ENERGY_LAYER")
    _mean = R.ExactSide._scale_source

    def _energy(self):  # type: ignore[no-untyped-def]
        layer, which = self.name.rsplit(".", 1)
        if (_side and which != _side) or (_layer and not re.fullmatch(_layer, layer)):
            return _mean(self)
        if self.method == "eigen":
            v = self.work_state()[1].clamp_min(0)
            return ((v * v).sum() / v.sum().clamp_min(1e-30)).reshape(1)
        f = self.factor.to(self.work_dtype)
        return ((f * f).sum() / f.diagonal().sum().clamp_min(1e-30)).reshape(1)

    R.ExactSide._scale_source = _energy
    print("energy-weighted scale on", file=sys.stderr)
