"""Capture: per-module-family Kronecker-factor rows and gradient matrices."""

from kaisa.layers.base import LayerHandler
from kaisa.layers.conv import Conv2dHandler
from kaisa.layers.linear import LinearHandler
from kaisa.layers.registry import find_layers, handler_for, register_handler

__all__ = [
    "Conv2dHandler",
    "LayerHandler",
    "LinearHandler",
    "find_layers",
    "handler_for",
    "register_handler",
]
