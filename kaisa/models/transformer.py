"""A small pre-norm Transformer encoder that classifies token sequences.

Every projection is an explicit ``nn.Linear`` (query, key, value, output and
the two MLP layers), so a K-FAC preconditioner can register each of them; the
attention itself is ``softmax(q kᵀ / sqrt(d_head)) v`` with no parameters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["EncoderBlock", "SelfAttention", "TransformerClassifier"]


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate q/k/v/out ``nn.Linear`` projections.

    Input ``(N, L, d_model)`` and an optional ``padding_mask`` ``(N, L)`` (True
    marks padding, which no position attends to); output ``(N, L, d_model)``.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(
                f"d_model must be divisible by num_heads, got d_model={d_model}, "
                f"num_heads={num_heads}"
            )
        self.num_heads = num_heads
        self.d_head = d_model // num_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def _heads(self, x: Tensor) -> Tensor:
        """``(N, L, d_model)`` to ``(N, heads, L, d_head)``."""
        n, length, _ = x.shape
        return x.view(n, length, self.num_heads, self.d_head).transpose(1, 2)

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """``(N, L, d_model)`` to ``(N, L, d_model)``."""
        n, length, d_model = x.shape
        q, k, v = self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)  # (N, heads, L, L)
        if padding_mask is not None:
            scores = scores.masked_fill(padding_mask[:, None, None, :], float("-inf"))
        weights = self.dropout(F.softmax(scores, dim=-1))
        context = (weights @ v).transpose(1, 2).reshape(n, length, d_model)
        result: Tensor = self.out(context)
        return result


class EncoderBlock(nn.Module):
    """Pre-norm block: ``x + attn(LN(x))`` then ``x + MLP(LN(x))``.

    The MLP is ``Linear(d_model, mlp_ratio * d_model)``, GELU,
    ``Linear(mlp_ratio * d_model, d_model)``. Shapes as ``SelfAttention``.
    """

    def __init__(
        self, d_model: int, num_heads: int, mlp_ratio: int = 4, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, num_heads, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, mlp_ratio * d_model)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(mlp_ratio * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """``(N, L, d_model)`` to ``(N, L, d_model)``."""
        x = x + self.dropout(self.attn(self.norm1(x), padding_mask))
        x = x + self.dropout(self.fc2(self.act(self.fc1(self.norm2(x)))))
        return x


class TransformerClassifier(nn.Module):
    """Token embedding + learned positions, pre-norm encoder blocks, mean pooling, linear head.

    Input token ids ``(N, L)`` (int64, ``0 <= id < vocab_size``, ``L <= max_len``)
    and an optional ``padding_mask`` ``(N, L)`` (True marks padding, excluded
    from attention and from the mean); output logits ``(N, num_classes)``.
    """

    def __init__(
        self,
        vocab_size: int = 1000,
        num_classes: int = 2,
        d_model: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        max_len: int = 128,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("num_classes", num_classes),
            ("d_model", d_model),
            ("num_heads", num_heads),
            ("num_layers", num_layers),
            ("max_len", max_len),
            ("mlp_ratio", mlp_ratio),
        ):
            _check_positive(name, value)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.max_len = max_len
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(
            EncoderBlock(d_model, num_heads, mlp_ratio, dropout) for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """Token ids ``(N, L)`` to logits ``(N, num_classes)``."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape (N, L), got {tuple(tokens.shape)}")
        length = tokens.shape[1]
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds max_len={self.max_len}")
        positions = torch.arange(length, device=tokens.device)
        x: Tensor = self.embed(tokens) + self.pos(positions)[None]
        for block in self.blocks:
            x = block(x, padding_mask)
        x = self.norm(x)
        if padding_mask is None:
            pooled = x.mean(dim=1)
        else:
            keep = (~padding_mask).unsqueeze(-1).to(x.dtype)  # (N, L, 1)
            pooled = (x * keep).sum(dim=1) / keep.sum(dim=1).clamp_min(1.0)
        logits: Tensor = self.head(pooled)
        return logits
