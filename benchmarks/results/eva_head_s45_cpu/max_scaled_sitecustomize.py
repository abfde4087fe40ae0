"""Session 45's experiment, installed as ``sitecustomize.py``: with ``KAISA_MAXSCALE`` set,
exact sides take relative damping's scale from their largest eigenvalue, not their mean one
(what ``eva_head_diagnosis.py --max-scaled-damping`` does in process)."""

import os

if os.environ.get("KAISA_MAXSCALE"):
    from kaisa.curvature import representations as R

    def _src(self):  # type: ignore[no-untyped-def]
        if self.method == "eigen":
            return self.work_state()[1].max().reshape(1)
        return self.factor.diagonal().max().reshape(1).to(self.work_dtype)

    R.ExactSide._scale_source = _src
