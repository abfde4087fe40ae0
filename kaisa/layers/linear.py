"""``nn.Linear`` and HuggingFace's ``Conv1D``: factors over every leading dimension (spec §3).

``transformers.pytorch_utils.Conv1D`` (GPT-2, GPT, CTRL, …) is a Linear layer
whose weight is stored ``(in, out)``: ``y = x W + b``. Its captures and
factors are ``nn.Linear``'s; its gradient matrix is ``W.grad`` *transposed*
(``weight_layout = 'in_out'``, :class:`TransposedLinearHandler`). The
registry knows the class by name and never imports transformers
(:mod:`kaisa.layers.registry`).

**A Linear its parent applies itself.** timm's EVA and BEiT attention
(``EvaAttention``, BEiT's ``Attention``) hold their fused projection as an
``nn.Linear`` ``qkv`` without a bias but never call it: their ``forward``
calls ``F.linear(x, self.qkv.weight, cat(q_bias, k_bias, v_bias))``, so a
hook on ``qkv`` sees nothing. :class:`HostedLinearHandler` watches the
parent (the host) instead: while the host's ``forward`` runs, a
``TorchFunctionMode`` sees each ``F.linear`` call and captures the input
and output of every call whose weight is the layer's, which is exactly what
a hook on the layer would capture had it been called (the weight's gradient
``δᵀx`` does not depend on the bias added). The biases stay with the
optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from kaisa.layers.base import (
    CaptureFn,
    Detachable,
    LayerHandler,
    gram,
    gram_with_ones,
    last_dim_gram,
    last_dim_moments,
    row_moments,
    sample_leading_rows,
)


class LinearHandler(LayerHandler):
    """``x`` of shape ``(..., d_in)`` and ``δ`` of shape ``(..., d_out)``.

    All leading dimensions are flattened into ``R`` rows, so a sequence model's
    tokens count as rows: ``A_batch = āᵀā / R`` with ``ā = [x | 1]``,
    ``G_batch = δᵀδ / R``.
    """

    module: nn.Linear
    kind = "kronecker (linear)"

    def __init__(self, module: nn.Linear) -> None:
        super().__init__(module)
        self.a_size = module.in_features + (1 if module.bias is not None else 0)
        self.g_size = module.out_features

    def a_sum(self, x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        rows = x.reshape(-1, x.shape[-1])
        total = gram_with_ones(rows, out) if self.has_bias else gram(rows, out)
        return total, rows.shape[0]

    def g_sum(
        self, grad_output: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        return last_dim_gram(grad_output, out)

    def a_moments(
        self, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        rows = x.reshape(-1, x.shape[-1])
        return row_moments(rows, out, ones=1.0 if self.has_bias else None), rows.shape[0]

    def sample_rows(
        self, which: str, t: torch.Tensor, keep: float, generator: torch.Generator
    ) -> torch.Tensor:
        """Tokens: a ``keep`` share of the rows over every leading dimension."""
        return sample_leading_rows(t, keep, generator)

    def g_moments(
        self, grad_output: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        return last_dim_moments(grad_output, out)


class TransposedLinearHandler(LinearHandler):
    """A Linear layer whose ``weight`` is stored ``(in, out)``: ``y = x W + b``.

    HuggingFace's ``Conv1D`` (``weight`` ``(nx, nf)``, ``bias`` ``(nf,)``):
    the rows and factors of :class:`LinearHandler` for ``d_in = nx``,
    ``d_out = nf``; the gradient matrix ``[W.gradᵀ | b.grad]``
    (``weight_layout = 'in_out'``). Kaisa takes exactly the steps it takes
    on the ``nn.Linear`` holding ``Wᵀ`` (``tests/layers/test_hf_conv1d.py``).
    """

    module: nn.Module  # type: ignore[assignment]
    kind = "kronecker (linear, (in, out) weight)"
    weight_layout = "in_out"

    def __init__(self, module: nn.Module) -> None:
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(
                f"{type(self).__name__} needs a module with a 2-D (in, out) weight, got {module!r}"
            )
        LayerHandler.__init__(self, module)
        bias = getattr(module, "bias", None)
        if bias is not None and tuple(bias.shape) != (weight.shape[1],):
            raise ValueError(
                f"{type(self).__name__}: a bias of shape {tuple(bias.shape)} does not match an "
                f"(in, out) weight of shape {tuple(weight.shape)}"
            )
        self.a_size = weight.shape[0] + (1 if bias is not None else 0)
        self.g_size = weight.shape[1]


def transposed_linear_handler(module: nn.Module, **_: object) -> TransposedLinearHandler:
    """Handler factory for HuggingFace's ``Conv1D`` (and any ``(in, out)`` Linear layer)."""
    return TransposedLinearHandler(module)


class _LinearCalls(TorchFunctionMode):
    """Captures the ``F.linear`` calls whose weight is ``layer``'s weight."""

    def __init__(self, layer: nn.Linear, capture: CaptureFn) -> None:
        super().__init__()
        self.layer = layer
        self.capture = capture

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.linear:
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            # The weight as the layer holds it now (FSDP2 swaps in the whole one for a call).
            mine = weight is self.layer.weight
            if mine and isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor):
                self.capture(x, out, None)
        return out


class _HostHooks:
    """The host's two hooks, removed together (:class:`~kaisa.layers.base.Detachable`)."""

    def __init__(self, *handles: Any) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class HostedLinearHandler(LinearHandler):
    """An ``nn.Linear`` (``layer``) whose parent ``host`` applies its weight with
    ``F.linear`` in its own ``forward`` (module docstring); ``suffix``: the layer's
    attribute name, so the block is named as the layer would be.

    Captured while the host runs in training with gradients on, from every
    ``F.linear`` call on the layer's weight (the layer's own ``forward``
    included, which calls ``F.linear``): one capture per use, however the
    host applies it. The mode is popped when the host's ``forward`` ends,
    raising or not. It is entered on every training forward of the host,
    factor-update step or not (the captures themselves run only when
    due): one Python call per torch function the host's ``forward`` makes,
    an attention's few dozen.
    """

    kind = "kronecker (linear, applied by its parent)"

    def __init__(self, layer: nn.Linear, host: nn.Module, suffix: str) -> None:
        super().__init__(layer)
        self.host = host
        self.suffix = suffix

    def attach(self, capture: CaptureFn) -> Detachable:
        host = self.host
        mode = _LinearCalls(self.module, capture)
        entered: list[bool] = []  # one flag per host call under way (a stack)

        def enter(module: nn.Module, args: tuple[object, ...]) -> None:
            if module is not host:
                return
            on = host.training and torch.is_grad_enabled()
            if on:
                mode.__enter__()  # type: ignore[no-untyped-call]
            entered.append(on)

        def leave(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            if module is not host or not entered:
                return
            if entered.pop():
                mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]

        return _HostHooks(
            host.register_forward_pre_hook(enter),
            host.register_forward_hook(leave, always_call=True),
        )


def hosted_qkv_handler(module: nn.Module, **_: object) -> LayerHandler | None:
    """Handler factory for an attention that applies its ``qkv`` ``nn.Linear`` with
    ``F.linear`` itself (timm's ``EvaAttention``, BEiT's ``Attention``); ``None`` when
    it has no such layer (its fused projection split, or not an ``nn.Linear``)."""
    qkv = getattr(module, "qkv", None)
    if not isinstance(qkv, nn.Linear) or type(qkv).forward is not nn.Linear.forward:
        return None
    return HostedLinearHandler(qkv, module, "qkv")
