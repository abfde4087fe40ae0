"""Module attributes imported on first use (PEP 562), for the packages' ``__init__``.

``kaisa``, ``kaisa.curvature`` and ``kaisa.distributed`` export names whose
modules need torch; importing them lazily lets the pure-Python planning code
(``kaisa plan``, :mod:`kaisa.distributed.plan`, :mod:`kaisa.curvature.costs`)
run without importing torch. This module imports nothing but the standard
library.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(
    module_name: str, table: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for the module ``module_name``.

    ``table`` maps each lazy name to the module that defines it. The first
    access imports that module and stores the value in ``module_name``'s
    globals, so later accesses do not come back here.
    """

    def __getattr__(name: str) -> Any:
        if name in table:
            value = getattr(importlib.import_module(table[name]), name)
            setattr(sys.modules[module_name], name, value)
            return value
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted([*vars(sys.modules[module_name]), *table])

    return __getattr__, __dir__
