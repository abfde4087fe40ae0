"""Which module types kaisa can precondition, and how to find them in a model."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence

from torch import nn

from kaisa.layers.base import LayerHandler
from kaisa.layers.conv import Conv2dHandler, ConvEstimator
from kaisa.layers.linear import LinearHandler

#: ``factory(module, **options)`` returns a handler, or ``None`` to skip the module.
#: Options are the handler options of :func:`find_layers` (e.g. ``conv_estimator``);
#: a factory ignores the ones that do not concern it.
HandlerFactory = Callable[..., LayerHandler | None]

_REGISTRY: dict[type[nn.Module], HandlerFactory] = {}


def register_handler(module_type: type[nn.Module], factory: HandlerFactory) -> None:
    """Teach kaisa a module type: ``factory(module)`` returns a handler or ``None`` to skip it.

    Subclasses of a registered type use the nearest registered ancestor's factory.
    """
    _REGISTRY[module_type] = factory


def handler_for(module: nn.Module, **options: object) -> LayerHandler | None:
    """The handler for ``module``, or ``None`` if kaisa does not precondition it."""
    for cls in type(module).__mro__:
        factory = _REGISTRY.get(cls)
        if factory is not None:
            return factory(module, **options)
    return None


def _linear(module: nn.Module, **_: object) -> LayerHandler:
    assert isinstance(module, nn.Linear)
    return LinearHandler(module)


def _conv2d(
    module: nn.Module, conv_estimator: ConvEstimator = "expand", **_: object
) -> LayerHandler | None:
    assert isinstance(module, nn.Conv2d)
    if module.groups != 1:
        return None
    return Conv2dHandler(module, estimator=conv_estimator)


register_handler(nn.Linear, _linear)
register_handler(nn.Conv2d, _conv2d)


def find_layers(
    model: nn.Module, skip_layers: Sequence[str] = (), **options: object
) -> list[tuple[str, LayerHandler]]:
    """Every module of ``model`` that kaisa preconditions, with its qualified name.

    The root module, if it is itself a layer, is named by its class name.
    A module is left out when its name or class name matches one of the
    ``skip_layers`` regular expressions (``re.search``), when none of its
    parameters requires a gradient, or when no handler supports it (a
    grouped convolution is left out with a warning naming it). A module that
    appears twice in the tree is registered once. ``options`` go to the
    handler factories (``conv_estimator='expand'|'reduce'`` for convolutions).
    """
    patterns = [re.compile(p) for p in skip_layers]
    found: list[tuple[str, LayerHandler]] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        class_name = type(module).__name__
        if any(p.search(name) or p.search(class_name) for p in patterns):
            continue
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        handler = handler_for(module, **options)
        if handler is None:
            if isinstance(module, nn.Conv2d) and module.groups != 1:
                warnings.warn(
                    f"kaisa: skipping {name!r} ({class_name}, groups={module.groups}): "
                    "grouped convolutions are not preconditioned; their gradients are left as is",
                    stacklevel=3,
                )
            continue
        if not all(p.requires_grad for p in handler.parameters()):
            # A frozen weight (or bias) cannot be preconditioned as one matrix.
            continue
        found.append((name or class_name, handler))
    return found
