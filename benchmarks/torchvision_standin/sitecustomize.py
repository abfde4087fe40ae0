"""A stand-in for ``torchvision`` so that ``timm`` imports beside the pinned CPU torch.

Not part of kaisa and not a torchvision: torchvision has no CPU build that imports beside
``torch==2.13.0`` on this project's machines, and timm imports a few of its modules at
load time (``torchvision.ops.misc``, ``torchvision.transforms``) that none of the models
the benchmarks build calls in its forward or backward pass. Put this folder first on
``PYTHONPATH`` (Python imports the first ``sitecustomize`` it finds) with timm's folder
after it::

    pip install --no-deps --target /tmp/timmsite timm==1.0.31
    PYTHONPATH=benchmarks/torchvision_standin:/tmp/timmsite:. python benchmarks/...

Every ``torchvision`` module is made on first import; every name read from one is a
placeholder class whose attributes are placeholders too, so ``InterpolationMode.BILINEAR``
or ``class X(FrozenBatchNorm2d)`` load. Calling into one fails loudly.

The session-46 patches under ``results/eva_head_s46_cpu/`` look for this file at
``/tmp/tvstub/sitecustomize.py``: copy it there when running them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__name__}.{name}")


def _placeholder(name: str) -> type:
    def _refuse(self: object, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"torchvision stand-in: {name} is a placeholder and cannot run")

    return _PlaceholderMeta(name, (), {"__init__": _refuse, "__call__": _refuse})


class _StandinModule(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        module = _StandinModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0+standin"
        return module

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        return None


sys.meta_path.append(_Finder())
