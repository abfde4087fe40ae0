"""``nn.MultiheadAttention`` as four Linear blocks: Q, K, V and the output projection.

``nn.MultiheadAttention`` computes with its weights directly (``F.linear`` on
``in_proj_weight`` and ``out_proj.weight``), so no module hook sees its
projections. While a training forward runs, a :class:`~torch.overrides.TorchFunctionMode`
active only inside the attention module runs torch's own attention function
with its ``linear`` calls watched, and hands each projection's input and
output to the projection's block:

* Q, K, V: rows ``[x | 1]`` of the query, key and value inputs; ``δ`` the
  gradient of the projection's output (the matching third of the packed
  output's columns when torch projects Q, K and V in one product);
* the output projection: the attention context and the gradient of the
  module's output.

Each block is then exactly the block of an ``nn.Linear`` doing that
projection: kaisa on a model with ``nn.MultiheadAttention`` takes the steps it
takes on the same attention written with four ``nn.Linear`` modules. The
forward itself is torch's own (every mask, ``need_weights``,
``batch_first``, ``kdim``/``vdim``, ``add_bias_kv`` and ``add_zero_attn``),
and the inference fast paths, which never run in training, are left alone:
evaluation captures nothing. ``bias_k`` and ``bias_v`` (``add_bias_kv``) are
not projections and keep their raw gradients.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from kaisa.layers.base import CaptureFn, Detachable, GradSelect
from kaisa.layers.linear import LinearHandler
from kaisa.validation import one_of

#: The projections of one attention module, in ``in_proj_weight``'s row order.
ROLES = ("q", "k", "v", "out_proj")


def _rebound(func: Callable[..., Any], namespace: dict[str, Any]) -> Callable[..., Any]:
    """``func`` (a plain Python function) with its global names looked up in ``namespace``."""
    code = func.__code__
    copy = types.FunctionType(code, namespace, func.__name__, func.__defaults__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy


def _watched_attention(linear: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    """torch's ``F.multi_head_attention_forward`` with its projections going through ``linear``.

    The function and the two in-projection helpers it calls are torch's own
    code, rebound to a namespace where the name ``linear`` is the watcher:
    every mask, dropout and weight option behaves as in torch.
    """
    namespace = dict(vars(F))
    namespace["linear"] = linear
    for name in ("_in_projection_packed", "_in_projection"):
        namespace[name] = _rebound(getattr(F, name), namespace)
    return _rebound(F.multi_head_attention_forward, namespace)


class _ProjectionWatch(TorchFunctionMode):
    """Inside one attention forward: runs torch's attention with watched projections.

    ``nn.MultiheadAttention.forward`` hands its work to
    ``F.multi_head_attention_forward``, which offers it to the active
    function mode first; this mode runs the watched copy instead.
    """

    def __init__(self, site: _AttentionSite) -> None:
        super().__init__()
        self.site = site

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if func is F.multi_head_attention_forward:
            func = self.site.watched_forward
        return func(*args, **(kwargs or {}))


class _AttentionSite:
    """One ``nn.MultiheadAttention``: routes its projections to the attached blocks."""

    def __init__(self, module: nn.MultiheadAttention) -> None:
        self.module = module
        self.captures: dict[str, CaptureFn] = {}
        self._hooks: list[RemovableHandle] = []
        self._watch: _ProjectionWatch | None = None
        self.watched_forward = _watched_attention(self._linear)

    def _linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        output = F.linear(x, weight, bias)
        self.projected(x, weight, output)
        return output

    def attach(self, role: str, capture: CaptureFn) -> Detachable:
        self.captures[role] = capture
        if not self._hooks:
            self._hooks = [
                self.module.register_forward_pre_hook(self._enter),
                # always_call: the watch is left even when the forward raises.
                self.module.register_forward_hook(self._leave, always_call=True),
            ]
        return _Detach(self, role)

    def detach(self, role: str) -> None:
        self.captures.pop(role, None)
        if not self.captures:
            for handle in self._hooks:
                handle.remove()
            self._hooks = []

    def _enter(self, module: nn.Module, args: object) -> None:
        if (
            module is self.module
            and module.training
            and torch.is_grad_enabled()
            and self._watch is None
        ):
            self._watch = _ProjectionWatch(self)
            self._watch.__enter__()  # type: ignore[no-untyped-call]

    def _leave(self, module: nn.Module, args: object, output: object) -> None:
        if self._watch is not None:
            watch, self._watch = self._watch, None
            watch.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def _rows(self, weight: torch.Tensor) -> list[tuple[str, slice | None]]:
        """The projections a weight (or a row block of ``in_proj_weight``) computes.

        Each with the columns of the product's output that belong to it
        (``None``: all of them).
        """
        m = self.module
        if weight is m.out_proj.weight:
            return [("out_proj", None)]
        for role in ("q", "k", "v"):
            if weight is getattr(m, f"{role}_proj_weight", None):
                return [(role, None)]
        packed = m.in_proj_weight
        if packed is None or weight.untyped_storage().data_ptr() != (
            packed.untyped_storage().data_ptr()
        ):
            return []
        e = m.embed_dim
        first = (weight.storage_offset() - packed.storage_offset()) // packed.shape[1]
        if first % e or weight.shape[0] % e:
            return []
        start = first // e
        return [
            ((ROLES[start + i]), slice(i * e, (i + 1) * e) if weight.shape[0] > e else None)
            for i in range(weight.shape[0] // e)
        ]

    def projected(self, x: torch.Tensor, weight: torch.Tensor, output: torch.Tensor) -> None:
        for role, columns in self._rows(weight):
            capture = self.captures.get(role)
            if capture is not None:
                capture(x, output, _columns(columns))


def _columns(columns: slice | None) -> GradSelect:
    if columns is None:
        return None
    return lambda grad: grad[..., columns]


class _Detach:
    def __init__(self, site: _AttentionSite, role: str) -> None:
        self.site, self.role = site, role

    def remove(self) -> None:
        self.site.detach(self.role)


class AttentionProjectionHandler(LinearHandler):
    """One projection (``'q'``, ``'k'``, ``'v'`` or ``'out_proj'``) of an attention module.

    Captures and factors as :class:`LinearHandler` for a Linear of
    ``in_features`` (``embed_dim``, ``kdim`` or ``vdim``) to ``embed_dim``;
    its gradient matrix is its row block of the projection weight with its
    slice of the packed bias.
    """

    module: nn.MultiheadAttention  # type: ignore[assignment]
    kind = "kronecker (attention projection)"

    def __init__(self, module: nn.MultiheadAttention, role: str, site: _AttentionSite) -> None:
        role = one_of("role", role, ROLES)
        self.module = module
        self.role = role
        self.suffix = role
        self._site = site
        e = module.embed_dim
        in_features = {"q": e, "k": module.kdim, "v": module.vdim, "out_proj": e}[role]
        self.a_size = in_features + (1 if self.has_bias else 0)
        self.g_size = e

    def claimed_modules(self) -> list[nn.Module]:
        return [self.module, self.module.out_proj]

    def attach(self, capture: CaptureFn) -> Detachable:
        return self._site.attach(self.role, capture)

    def weight_slot(self) -> tuple[torch.Tensor, slice]:
        m = self.module
        e = m.embed_dim
        if self.role == "out_proj":
            return m.out_proj.weight, slice(0, e)
        if m.in_proj_weight is not None:
            i = ROLES.index(self.role)
            return m.in_proj_weight, slice(i * e, (i + 1) * e)
        weight = getattr(m, f"{self.role}_proj_weight")
        assert isinstance(weight, torch.Tensor)
        return weight, slice(0, e)

    def bias_slot(self) -> tuple[torch.Tensor, slice] | None:
        m = self.module
        e = m.embed_dim
        if self.role == "out_proj":
            bias = m.out_proj.bias
            return None if bias is None else (bias, slice(0, e))
        if m.in_proj_bias is None:
            return None
        i = ROLES.index(self.role)
        return m.in_proj_bias, slice(i * e, (i + 1) * e)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.role}, a_size={self.a_size}, g_size={self.g_size})"


def attention_handlers(module: nn.MultiheadAttention) -> list[AttentionProjectionHandler]:
    """The four projection blocks of one attention module, sharing one capture site."""
    site = _AttentionSite(module)
    return [AttentionProjectionHandler(module, role, site) for role in ROLES]
