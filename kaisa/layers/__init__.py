"""Capture: per-module-family Kronecker-factor rows and gradient matrices."""

from kaisa.layers.attention import AttentionProjectionHandler
from kaisa.layers.base import LayerHandler
from kaisa.layers.conv import Conv1dHandler, Conv2dHandler
from kaisa.layers.embedding import EmbeddingHandler
from kaisa.layers.linear import LinearHandler, TransposedLinearHandler
from kaisa.layers.probe import HandlerContractError
from kaisa.layers.registry import (
    Coverage,
    Treatment,
    find_layers,
    handler_for,
    register_handler,
    survey,
)

__all__ = [
    "AttentionProjectionHandler",
    "Conv1dHandler",
    "Conv2dHandler",
    "Coverage",
    "EmbeddingHandler",
    "HandlerContractError",
    "LayerHandler",
    "LinearHandler",
    "TransposedLinearHandler",
    "Treatment",
    "find_layers",
    "handler_for",
    "register_handler",
    "survey",
]
