"""A small Vision Transformer built only from standard ``torch.nn`` modules.

Unlike :class:`kaisa.models.TransformerClassifier`, which spells out every
projection as its own ``nn.Linear`` so that K-FAC can see it, ``ViT`` is a
network *not* designed for K-FAC: its encoder is ``nn.TransformerEncoder``, so
attention runs inside ``nn.MultiheadAttention`` (a fused ``in_proj_weight``
parameter for query, key and value, and an ``out_proj`` whose module is never
called), and in eval mode without gradients PyTorch may take its fused
"fast path" that bypasses the sub-modules altogether (kaisa covers the
attention through :mod:`kaisa.layers.attention`). It is the benchmark suite's
example of an off-the-shelf architecture.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["ViT"]


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class ViT(nn.Module):
    """Patch embedding, class token, pre-norm ``nn.TransformerEncoder``, linear head.

    With ``p = patch``, ``d = d_model`` and ``P = (image_size / p) ** 2`` patches::

        Conv2d(in_channels, d, kernel_size=p, stride=p)   # (N, C, H, W) -> (N, d, H/p, W/p)
        flatten, transpose                                # -> (N, P, d)
        prepend the class token (1, 1, d)                 # -> (N, 1 + P, d)
        add the position embedding (1, 1 + P, d)
        TransformerEncoder of num_layers pre-norm TransformerEncoderLayer(
            d, num_heads, dim_feedforward=mlp_ratio * d, activation="gelu",
            batch_first=True, norm_first=True)            # -> (N, 1 + P, d)
        LayerNorm(d) on the class token                   # -> (N, d)
        Linear(d, num_classes)                            # -> (N, num_classes)

    The defaults (Fashion-MNIST: one 28x28 channel, ``7x7`` patches, so 16
    patches and 17 tokens; ``d_model=64``, 4 heads, 2 layers, MLP width 128)
    give 72,074 parameters, small enough for a two-core CPU benchmark.

    Input ``(N, in_channels, image_size, image_size)`` (normalised images, as
    the demo's data loader produces), output logits ``(N, num_classes)``.
    Raises ``ValueError`` for a non-positive integer argument, a ``d_model``
    not divisible by ``num_heads``, a ``patch`` that does not divide
    ``image_size``, or a ``dropout`` outside ``[0, 1)``.
    """

    def __init__(
        self,
        image_size: int = 28,
        patch: int = 7,
        in_channels: int = 1,
        num_classes: int = 10,
        d_model: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        mlp_ratio: int = 2,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("image_size", image_size),
            ("patch", patch),
            ("in_channels", in_channels),
            ("num_classes", num_classes),
            ("d_model", d_model),
            ("num_heads", num_heads),
            ("num_layers", num_layers),
            ("mlp_ratio", mlp_ratio),
        ):
            _check_positive(name, value)
        if d_model % num_heads:
            raise ValueError(
                f"d_model must be divisible by num_heads, got d_model={d_model}, "
                f"num_heads={num_heads}"
            )
        if image_size % patch:
            raise ValueError(
                f"patch must divide image_size, got patch={patch}, image_size={image_size}"
            )
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
            raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.image_size = image_size
        self.patch = patch
        self.in_channels = in_channels
        self.num_patches = (image_size // patch) ** 2
        self.patch_embed = nn.Conv2d(in_channels, d_model, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + self.num_patches, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model,
            num_heads,
            dim_feedforward=mlp_ratio * d_model,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        # Nested tensors only help with padding masks, which images do not have
        # (and pre-norm layers cannot use them anyway).
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        """Images ``(N, C, H, W)`` to logits ``(N, num_classes)``."""
        expected = (self.in_channels, self.image_size, self.image_size)
        if x.dim() != 4 or tuple(x.shape[1:]) != expected:
            raise ValueError(
                f"x must have shape (N, {', '.join(map(str, expected))}), got {tuple(x.shape)}"
            )
        tokens: Tensor = self.patch_embed(x).flatten(2).transpose(1, 2)  # (N, P, d)
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # (N, 1, d)
        tokens = torch.cat([cls, tokens], dim=1) + self.pos_embed  # (N, 1 + P, d)
        encoded: Tensor = self.encoder(tokens)
        logits: Tensor = self.head(self.norm(encoded[:, 0]))
        return logits

    def extra_repr(self) -> str:
        return f"image_size={self.image_size}, patch={self.patch}, num_patches={self.num_patches}"
