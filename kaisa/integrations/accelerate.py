"""Hugging Face accelerate: a preconditioner that steps with the optimizer.

::

    from kaisa.integrations.accelerate import prepare_preconditioner

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    preconditioner = prepare_preconditioner(accelerator, model, optimizer)
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(criterion(model(x), y))
            preconditioner.step()  # only when accelerator.sync_gradients
            optimizer.step()
            optimizer.zero_grad()

:func:`prepare_preconditioner` builds a :class:`~kaisa.KFACPreconditioner`
with ``accumulation_steps`` from ``accelerator.gradient_accumulation_steps``,
``grad_scaler`` from ``accelerator.scaler`` and ``lr`` following the
optimizer, and wraps it in an :class:`AcceleratedPreconditioner`, whose
``step()`` does nothing on the passes where accelerate only accumulates
gradients (``accelerator.sync_gradients`` false) and unscales the
gradients first under fp16 mixed precision.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
except ImportError as error:
    raise ImportError(
        "kaisa.integrations.accelerate needs Hugging Face accelerate: "
        "pip install 'kaisa[accelerate]'"
    ) from error

import torch
from torch import nn

from kaisa.preconditioner import KFACPreconditioner

__all__ = ["AcceleratedPreconditioner", "prepare_preconditioner"]

#: Distributed types whose gradients are sharded or owned by another engine.
_UNSUPPORTED = frozenset(
    getattr(DistributedType, name)
    for name in ("DEEPSPEED", "FSDP", "MEGATRON_LM")
    if hasattr(DistributedType, name)
)


class AcceleratedPreconditioner:
    """A :class:`~kaisa.KFACPreconditioner` that steps when accelerate syncs gradients.

    ``step()`` belongs between ``accelerator.backward(loss)`` and
    ``optimizer.step()``, inside ``accelerator.accumulate(model)`` when
    accumulating. ``state_dict()`` / ``load_state_dict()`` are the
    preconditioner's, so ``accelerator.register_for_checkpointing(it)`` saves
    and restores it with ``save_state`` / ``load_state``.
    """

    def __init__(self, accelerator: Accelerator, preconditioner: KFACPreconditioner) -> None:
        self.accelerator = accelerator
        self.preconditioner = preconditioner

    def step(self) -> bool:
        """Precondition the gradients if this pass ends an accumulation window.

        Returns whether it did. Under fp16 mixed precision the gradients are
        unscaled first (``accelerator.unscale_gradients()``), unless something
        (``accelerator.clip_grad_norm_``) already did this iteration.
        """
        accelerator = self.accelerator
        if not accelerator.sync_gradients:
            return False
        pre = self.preconditioner
        steps = int(accelerator.gradient_accumulation_steps)
        if steps != pre.options.accumulation_steps:
            raise ValueError(
                f"accelerator.gradient_accumulation_steps changed to {steps}, but the "
                f"preconditioner's accumulation_steps is fixed at {pre.options.accumulation_steps}"
            )
        if accelerator.scaler is not None and pre.loss_scale.still_scaled():
            accelerator.unscale_gradients()
        pre.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        """The preconditioner's :meth:`~kaisa.KFACPreconditioner.state_dict`."""
        return self.preconditioner.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` into the preconditioner."""
        self.preconditioner.load_state_dict(state_dict)


def prepare_preconditioner(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    **kwargs: Any,
) -> AcceleratedPreconditioner:
    """Build a preconditioner for an accelerate training loop.

    Args:
        accelerator: the ``Accelerator`` (its process group, if any, is the
            preconditioner's).
        model: the model, after ``accelerator.prepare`` (wrapped or not).
        optimizer: the (prepared) optimizer; with it, and without ``lr`` in
            ``kwargs``, KL clipping reads its current ``param_groups[0]['lr']``.
        **kwargs: any other :class:`~kaisa.KFACPreconditioner` option.
            ``accumulation_steps`` and ``grad_scaler`` come from the
            accelerator (``gradient_accumulation_steps``, ``scaler``); an
            explicit value must agree with it.

    Raises:
        ValueError: under DeepSpeed, FSDP or Megatron-LM (sharded gradients),
            for a model not on the accelerator's device, or for an
            ``accumulation_steps`` / ``grad_scaler`` that disagrees with the
            accelerator.
    """
    kind = accelerator.distributed_type
    if kind in _UNSUPPORTED:
        raise ValueError(
            f"kaisa's accelerate helper does not support accelerate's {kind} (untested); plain, "
            "DDP and multi-CPU runs are supported, and kaisa supports DeepSpeed engines and "
            "FSDP2 models in a plain loop (docs/deepspeed-fsdp.md)"
        )
    device = torch.device(accelerator.device)
    weight = next(iter(model.parameters()), None)
    if weight is not None and weight.device.type != device.type:
        raise ValueError(
            f"the model is on {weight.device} but the accelerator on {device}: build the "
            "preconditioner after accelerator.prepare(model)"
        )
    options = dict(kwargs)
    steps = int(accelerator.gradient_accumulation_steps)
    given = options.setdefault("accumulation_steps", steps)
    if given != steps:
        raise ValueError(
            f"prepare_preconditioner(accumulation_steps={given!r}) conflicts with "
            f"accelerator.gradient_accumulation_steps={steps}: leave accumulation_steps out "
            "and the preconditioner follows the accelerator"
        )
    scaler = accelerator.scaler
    if scaler is not None:
        given_scaler = options.setdefault("grad_scaler", scaler)
        if given_scaler is not scaler:
            raise ValueError(
                "prepare_preconditioner(grad_scaler=...) is not accelerator.scaler; leave "
                "grad_scaler out and the preconditioner uses the accelerator's"
            )
    if optimizer is not None and "lr" not in options:
        options["lr"] = lambda step: float(optimizer.param_groups[0]["lr"])
    return AcceleratedPreconditioner(accelerator, KFACPreconditioner(model, **options))
