"""Warnings that point at the user's line, found by walking the stack (no counted stack levels).

kaisa warns from deep inside ``step()``, its hooks and its rooms; a warning's
file and line should be the user's call (``preconditioner.step()``,
``loss.backward()``, ``model(x)``, the constructor), whatever the depth. The
first frame that is neither kaisa's library code nor torch's (its ``no_grad``
wrapper, autograd, ``Module.__call__``) is taken as the user's. The demo and
the models shipped in ``kaisa/demo`` and ``kaisa/models`` are users of the
library here.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["user_stacklevel", "warn"]

_KAISA = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: Parts of the package that use the library as a user would.
_USERS = tuple(_KAISA + name + os.sep for name in ("demo", "models"))


def _torch_dir() -> str | None:
    torch = sys.modules.get("torch")
    path = getattr(torch, "__file__", None)
    return None if path is None else os.path.dirname(os.path.abspath(path)) + os.sep


def _internal(filename: str, torch_dir: str | None) -> bool:
    path = os.path.abspath(filename)
    if path.startswith(_KAISA) and not path.startswith(_USERS):
        return True
    return torch_dir is not None and path.startswith(torch_dir)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes the caller's ``warnings.warn`` name the user's line."""
    torch_dir = _torch_dir()
    frame = sys._getframe(2)  # level 2 of the caller's warnings.warn: the caller's caller
    level = 2
    while frame.f_back is not None and _internal(frame.f_code.co_filename, torch_dir):
        frame = frame.f_back
        level += 1
    return level


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
