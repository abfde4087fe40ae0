"""Reference networks for tests, examples and benchmarks.

``build_model(name, **kwargs)`` builds one by name; the keyword arguments go
to the constructor (e.g. ``build_model("gap_cnn", width=16)``). ``ViT``
(``"vit"``) is the one built from stock ``torch.nn`` Transformer modules
(``nn.TransformerEncoder``, hence ``nn.MultiheadAttention``) rather than
designed for K-FAC; ``GPT`` (``"gpt"``) is a byte-level decoder written the
way GPT-style language models usually are.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from kaisa.models.cnn import GapCNN, SmallCNN
from kaisa.models.gpt import GPT
from kaisa.models.resnet import BasicBlock, CifarResNet, cifar_resnet, resnet20, resnet32
from kaisa.models.transformer import TransformerClassifier
from kaisa.models.vit import ViT

__all__ = [
    "GPT",
    "MODEL_NAMES",
    "BasicBlock",
    "CifarResNet",
    "GapCNN",
    "SmallCNN",
    "TransformerClassifier",
    "ViT",
    "build_model",
    "cifar_resnet",
    "resnet20",
    "resnet32",
]

_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "resnet20": resnet20,
    "resnet32": resnet32,
    "small_cnn": SmallCNN,
    "gap_cnn": GapCNN,
    "transformer": TransformerClassifier,
    "vit": ViT,
    "gpt": GPT,
}

MODEL_NAMES: tuple[str, ...] = tuple(_BUILDERS)
"""The names ``build_model`` accepts."""


def build_model(name: str, **kwargs: object) -> nn.Module:
    """Build the network called ``name`` (one of ``MODEL_NAMES``) with ``kwargs``.

    Raises ``ValueError`` for an unknown name, listing the allowed ones.
    """
    try:
        builder = _BUILDERS[name]
    except KeyError:
        allowed = ", ".join(repr(n) for n in MODEL_NAMES)
        raise ValueError(f"name must be one of {allowed}, got {name!r}") from None
    return builder(**kwargs)
