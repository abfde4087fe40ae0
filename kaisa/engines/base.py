"""The gradient seam: how kaisa reads and writes a parameter's full gradient.

Handlers (:meth:`~kaisa.layers.LayerHandler.grad_matrix` and
:meth:`~kaisa.layers.LayerHandler.set_grad_matrix`) and the preconditioner's
finiteness check never touch ``.grad`` themselves: they go through the
:class:`GradAccess` the preconditioner chose at construction from what the
model is (:func:`kaisa.engines.select_engine`):

* a plain module, or one wrapped in DDP: :class:`GradAccess`, ``param.grad``
  read and written in place;
* a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``; its
  parameters and gradients are ``DTensor`` shards):
  :class:`kaisa.engines.fsdp.ShardedGradAccess`;
* a DeepSpeed engine (ZeRO stages 0, 1 and 2; with stages 1 and 2 every
  ``.grad`` is ``None`` and the gradients live in DeepSpeed's partitioned
  buffers): :class:`kaisa.engines.deepspeed.DeepSpeedGradAccess`.

The last two are :class:`StagedGradAccess`: the full gradient is not a tensor
kaisa can write in place. The first read of a step gathers the full gradient
of every registered parameter, in registration order (a gather is a
collective: every rank gathers the same parameters in the same order), once;
writes go into those full tensors and :meth:`~GradAccess.flush` hands the
written ones back; :meth:`~GradAccess.release` drops them when ``step()`` ends.

An access also says what the model's wrapper decides about a step: whether
this backward pass ends an accumulation cycle (:meth:`~GradAccess.at_boundary`),
how many passes a cycle has (:meth:`~GradAccess.accumulation_steps`) and
which loss scale the gradients still carry (:meth:`~GradAccess.loss_scale`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (FSDP2's shards)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is not None and isinstance(tensor, dtensor)


class GradAccess:
    """``param.grad``, read and written in place (a plain model, DDP).

    ``read`` returns the gradient tensor itself (``None`` when there is none);
    ``write`` copies into rows of it, creating a zero gradient first if there
    is none. Nothing is staged: :meth:`flush` and :meth:`release` do nothing.
    """

    #: What the access serves, for messages.
    kind: str = "plain"

    def bind(self, params: Sequence[torch.Tensor]) -> None:
        """The registered parameters, each once, in an order equal on every rank."""

    def read(self, param: torch.Tensor) -> torch.Tensor | None:
        """The full gradient of ``param`` (its shape), or ``None``; do not modify it."""
        grad = param.grad
        if grad is not None and is_dtensor(grad):
            raise RuntimeError(
                "kaisa: a registered parameter's gradient is a DTensor (FSDP2's fully_shard, "
                "or tensor parallelism's parallelize_module, was applied after the "
                "KFACPreconditioner was built, which then could not see it): build the "
                "preconditioner after fully_shard (or parallelize_module)"
            )
        return grad

    def write(self, param: torch.Tensor, rows: slice, value: torch.Tensor) -> None:
        """Set rows ``rows`` (along dim 0) of ``param``'s full gradient to ``value``."""
        grad = param.grad
        if grad is None:
            grad = param.grad = torch.zeros_like(param)
        target = grad[rows]
        target.copy_(value.reshape(target.shape))

    def flush(self) -> None:
        """Hand every gradient written since the last flush back to its owner."""

    def release(self) -> None:
        """End of ``step()``: drop what this step staged."""

    def at_boundary(self) -> bool:
        """Whether the backward pass just run completes an accumulation cycle."""
        return True

    def accumulation_steps(self, given: Any) -> Any:
        """The ``accumulation_steps`` to use, given the user's (``None``: not given)."""
        return 1 if given is None else given

    def grad_scaler(self, given: Any) -> Any:
        """The ``grad_scaler`` to use, given the user's."""
        return given

    def process_group(self, given: Any) -> Any:
        """The data-parallel group to plan over, given the user's (``None``: the world)."""
        return given

    def loss_scale(self) -> float:
        """The factor the gradients :meth:`read` returns are still multiplied by."""
        return 1.0

    def full_capture(
        self, module: torch.nn.Module, x: torch.Tensor, output: torch.Tensor
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor] | None]:
        """A call's whole input, and what makes its output gradient whole (``None``: it is).

        What a capture hook of ``module`` hands on for the factors: with
        tensor parallelism a layer sees a shard of its input or of its
        output gradient (:mod:`kaisa.engines.tensor_parallel`); elsewhere
        ``x`` as it is, and no gathering.
        """
        return x, None


#: The access of handlers used outside a preconditioner.
PLAIN = GradAccess()


class LossScale:
    """Every reading of a loss scaler in one place: ``grad_scaler`` as the engine gave it.

    Two scales matter to kaisa. The captured output gradients ``δ`` carry the
    loss scale of the backward pass; :meth:`reader` reads it (a
    ``torch.amp.GradScaler``'s ``get_scale()``, a callable's value, a DeepSpeed
    engine's scale), and the captures are unscaled with it before any
    product. The parameter gradients may still carry a scale when kaisa
    reads them, which is the engine's to say (:meth:`GradAccess.loss_scale`).
    :meth:`still_scaled` tells when a ``GradScaler`` has unscaled no
    optimizer's gradients yet in this iteration.
    """

    def __init__(self, scaler: object) -> None:
        self.scaler = scaler

    def reader(self) -> Callable[[], float] | None:
        """A function returning the current loss scale, or ``None`` without a scaler."""
        scaler = self.scaler
        if scaler is None:
            return None
        get_scale = getattr(scaler, "get_scale", None)
        if callable(get_scale):
            return lambda: float(get_scale())
        assert callable(scaler)
        return lambda: float(scaler())

    def still_scaled(self) -> bool:
        """A ``torch.amp.GradScaler`` that is on and has unscaled no optimizer this iteration.

        ``GradScaler.unscale_(optimizer)`` marks that optimizer unscaled until
        ``update()``; a ``step()`` of kaisa before it sees gradients still
        multiplied by the loss scale. ``False`` when it cannot be told (a
        callable scale, another scaler type).
        """
        states = getattr(self.scaler, "_per_optimizer_states", None)
        is_enabled = getattr(self.scaler, "is_enabled", None)
        if not isinstance(states, Mapping) or not callable(is_enabled) or not is_enabled():
            return False
        return not any(
            getattr(state.get("stage"), "name", "") == "UNSCALED" for state in states.values()
        )


class StagedGradAccess(GradAccess):
    """Full gradients gathered once per step, written back by :meth:`flush`.

    Subclasses say how one parameter's full gradient is gathered
    (:meth:`gather`, possibly a collective) and how a full gradient is
    written back to its owner (:meth:`scatter`).
    """

    def __init__(self) -> None:
        self._params: list[torch.Tensor] = []
        self._full: dict[int, torch.Tensor | None] | None = None
        self._written: dict[int, torch.Tensor] = {}

    def gather(self, param: torch.Tensor) -> torch.Tensor | None:
        """The full gradient of ``param``: a tensor of its shape this access may modify."""
        raise NotImplementedError

    def scatter(self, param: torch.Tensor, full: torch.Tensor) -> None:
        """Write ``full`` (``param``'s shape) back as ``param``'s gradient."""
        raise NotImplementedError

    def bind(self, params: Sequence[torch.Tensor]) -> None:
        self._params = list({id(p): p for p in params}.values())
        self.release()

    def read(self, param: torch.Tensor) -> torch.Tensor | None:
        if self._full is None:
            # Every bound parameter, in bound order: the same collectives on every rank.
            self._full = {id(p): self.gather(p) for p in self._params}
        key = id(param)
        if key not in self._full:
            raise KeyError(
                f"kaisa: a parameter of shape {tuple(param.shape)} is not one the "
                f"{self.kind} gradient access was bound to"
            )
        return self._full[key]

    def write(self, param: torch.Tensor, rows: slice, value: torch.Tensor) -> None:
        full = self.read(param)
        if full is None:
            assert self._full is not None
            full = self._full[id(param)] = torch.zeros(
                param.shape, dtype=value.dtype, device=value.device
            )
        target = full[rows]
        target.copy_(value.reshape(target.shape))
        self._written[id(param)] = param

    def flush(self) -> None:
        if self._full is None:
            return
        for key, param in self._written.items():
            full = self._full[key]
            assert full is not None
            self.scatter(param, full)
        self._written.clear()

    def release(self) -> None:
        self._full = None
        self._written.clear()
