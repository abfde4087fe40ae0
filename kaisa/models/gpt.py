"""A small byte-level GPT: a decoder-only Transformer written as such models usually are.

``GPT`` predicts the next byte of a text from the bytes before it. It is
built the way GPT-2-style decoders are commonly written, not for K-FAC:
token and learned position embeddings (``nn.Embedding``), pre-LayerNorm
blocks whose causal self-attention runs through
``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``
on a fused ``nn.Linear(d, 3d)`` query/key/value projection (or three
separate ones, ``fused_qkv=False``), a GELU MLP, a final LayerNorm and a
linear head over the vocabulary, optionally tied to the token embedding
(``tied_head=True``). It is the language-model workload of the benchmark
suite (``kaisa demo --workload gpt``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "CausalSelfAttention", "DecoderBlock", "DecoderMLP"]


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_flag(name: str, value: bool) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``(N, T, d)`` to ``(N, T, d)``.

    Queries, keys and values come from one ``nn.Linear(d, 3d)`` (``qkv``) or,
    with ``fused_qkv=False``, from three ``nn.Linear(d, d)`` (``q``, ``k``,
    ``v``); position ``t`` attends to positions ``0..t`` only
    (``scaled_dot_product_attention(..., is_causal=True)``); the heads are
    concatenated and projected by ``proj``, an ``nn.Linear(d, d)``.
    """

    def __init__(self, d_model: int, n_head: int, fused_qkv: bool = True) -> None:
        super().__init__()
        _check_positive("d_model", d_model)
        _check_positive("n_head", n_head)
        _check_flag("fused_qkv", fused_qkv)
        if d_model % n_head:
            raise ValueError(
                f"d_model must be divisible by n_head, got d_model={d_model}, n_head={n_head}"
            )
        self.d_model = d_model
        self.n_head = n_head
        self.fused_qkv = fused_qkv
        if fused_qkv:
            self.qkv = nn.Linear(d_model, 3 * d_model)
        else:
            self.q = nn.Linear(d_model, d_model)
            self.k = nn.Linear(d_model, d_model)
            self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)

    def _split_heads(self, x: Tensor) -> Tensor:
        """``(N, T, d)`` to ``(N, heads, T, d / heads)``."""
        n, length, _ = x.shape
        return x.view(n, length, self.n_head, self.d_model // self.n_head).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        """``(N, T, d)`` to ``(N, T, d)``; no position sees a later one."""
        n, length, d = x.shape
        if self.fused_qkv:
            q, k, v = self.qkv(x).split(d, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        heads = F.scaled_dot_product_attention(
            self._split_heads(q), self._split_heads(k), self._split_heads(v), is_causal=True
        )  # (N, heads, T, d / heads)
        merged = heads.transpose(1, 2).reshape(n, length, d)
        out: Tensor = self.proj(merged)
        return out


class DecoderMLP(nn.Module):
    """``Linear(d, 4d)``, GELU, ``Linear(4d, d)``."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.proj(self.act(self.fc(x)))
        return out


class DecoderBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, d_model: int, n_head: int, fused_qkv: bool = True) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, fused_qkv)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = DecoderMLP(d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """Byte-level decoder: token ids ``(N, T)`` to next-token logits ``(N, T, vocab_size)``.

    ::

        tok_embed = Embedding(vocab_size, d_model)      # the bytes
        pos_embed = Embedding(context, d_model)         # positions 0..T-1, learned
        x = tok_embed(idx) + pos_embed(arange(T))
        n_layer x DecoderBlock(d_model, n_head)         # pre-LN, causal attention, GELU MLP
        ln_f = LayerNorm(d_model)
        head = Linear(d_model, vocab_size, bias=False)  # tied_head: head.weight is tok_embed.weight

    The defaults (``vocab_size=256``, ``d_model=128``, ``n_layer=3``,
    ``n_head=4``, ``context=64``) give 668,800 parameters with an untied head
    and 636,032 with a tied one. There is no dropout. Weights are initialised
    as GPT-2's: every ``nn.Linear`` and ``nn.Embedding`` weight normal with
    standard deviation 0.02, biases zero, LayerNorms the identity, and the
    two projections that write into the residual stream in each block
    (``attn.proj``, ``mlp.proj``) at 0.02 / sqrt(2 * n_layer), so that the
    stream's variance does not grow with depth. The draw follows the
    caller's ``torch`` seed.

    Raises ``ValueError`` for a size that is not a positive integer, a
    ``d_model`` not divisible by ``n_head``, a flag that is not a bool, and
    (in ``forward``) an input that is not ``(N, T)`` integer ids with
    ``1 <= T <= context``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        d_model: int = 128,
        n_layer: int = 3,
        n_head: int = 4,
        context: int = 64,
        fused_qkv: bool = True,
        tied_head: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("d_model", d_model),
            ("n_layer", n_layer),
            ("n_head", n_head),
            ("context", context),
        ):
            _check_positive(name, value)
        _check_flag("fused_qkv", fused_qkv)
        _check_flag("tied_head", tied_head)
        if d_model % n_head:
            raise ValueError(
                f"d_model must be divisible by n_head, got d_model={d_model}, n_head={n_head}"
            )
        self.vocab_size = vocab_size
        self.context = context
        self.tied_head = tied_head
        self.tok_embed = nn.Embedding(vocab_size, d_model)
        self.pos_embed = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(
            DecoderBlock(d_model, n_head, fused_qkv) for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self._init_weights(n_layer)
        if tied_head:
            self.head.weight = self.tok_embed.weight

    def _init_weights(self, n_layer: int) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * n_layer)
        for block in self.blocks:
            assert isinstance(block, DecoderBlock)
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids ``(N, T)`` to logits ``(N, T, vocab_size)`` for the token after each."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (N, T) token ids, got shape {tuple(idx.shape)}")
        if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            raise ValueError(f"idx must hold integer token ids, got dtype {idx.dtype}")
        length = idx.shape[1]
        if not 1 <= length <= self.context:
            raise ValueError(f"sequence length {length} must be in 1..context={self.context}")
        positions = torch.arange(length, device=idx.device)
        x: Tensor = self.tok_embed(idx) + self.pos_embed(positions)
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.ln_f(x))
        return logits

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, context={self.context}, tied_head={self.tied_head}"
