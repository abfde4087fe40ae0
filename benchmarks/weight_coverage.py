"""The share of a model's weight matrices kaisa preconditions, and what it leaves raw.

Shared by ``hf_coverage_survey.py`` and ``timm_coverage.py``: the model is
surveyed as ``KFACPreconditioner`` would register it
(:func:`kaisa.layers.survey`), without running it (the meta device will do).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

from torch import nn

from kaisa.layers import survey


class Raw(NamedTuple):
    """A trainable parameter of two or more dimensions left raw."""

    parameter: str
    elements: int
    reason: str
    #: A construction warning names its module or the parameter, or lists its
    #: kind past the first eight modules ("and N more: <reason>").
    warned: bool


def coverage(model: nn.Module) -> tuple[float, int, list[Raw]]:
    """``(share preconditioned, elements, raw)`` over trainable parameters of ≥ 2 dims."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = survey(model)
    messages = [str(w.message) for w in caught] + list(found.warnings)
    params = dict(model.named_parameters())
    total = done = 0
    raw = []
    for t in found.treatments:
        p = params[t.parameter]
        if p.ndim < 2 or not p.requires_grad:
            continue
        total += p.numel()
        if t.kind != "raw":
            done += p.numel()
            continue
        module = t.parameter.rsplit(".", 1)[0]
        kind = t.reason.split(" (")[0]
        warned = any(
            f"'{module}'" in m or f"'{t.parameter}'" in m or (" more: " in m and kind in m)
            for m in messages
        )
        raw.append(Raw(t.parameter, p.numel(), t.reason, warned))
    return (done / total if total else float("nan")), total, raw
