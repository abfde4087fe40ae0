"""Load a benchmark or example script (not a package module) by its path, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str, *, register: bool = False) -> ModuleType:
    """The script at ``ROOT / relative``, executed as the module ``name``.

    Its own folder is on ``sys.path`` while it runs (a benchmark imports its
    ``common`` helpers). ``register``: the module stays in ``sys.modules``
    under ``name`` (dataclasses and pickling look their module up there).
    """
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
        if not register:
            del sys.modules[name]
    return module
