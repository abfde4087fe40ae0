"""HuggingFace transformers: K-FAC preconditioning in ``Trainer`` as a callback.

::

    from kaisa.integrations.transformers import KFACCallback

    trainer = transformers.Trainer(model, args, callbacks=[KFACCallback()], ...)
    trainer.train()

:class:`KFACCallback` builds a :class:`~kaisa.KFACPreconditioner` for the
trainer's model when training begins and calls its ``step()`` in
``on_pre_optimizer_step``: once per optimizer step, after the last backward
pass of a gradient-accumulation window (the DDP all-reduce done, an fp16
loss scale removed) and before the optimizer updates the weights.

**Gradient clipping comes after preconditioning.** ``Trainer`` clips the raw
gradients to ``max_grad_norm`` (1.0 by default) before any callback can act,
which would bound the gradient K-FAC then rescales by orders of magnitude
(the bound would mean nothing) and log the norm of a gradient the optimizer
never sees. So the callback takes clipping over: for the duration of
``train()`` it sets ``args.max_grad_norm`` to 0 (Trainer then only measures
the raw norm, still logged as ``grad_norm``), and after ``step()`` clips the
preconditioned gradients to the original ``max_grad_norm``, as the Lightning
callback's order (precondition, then clip) does. ``kaisa/grad_norm`` in the
logs is the preconditioned norm before clipping. The value is restored when
training ends.

What it sets for the preconditioner:

* ``accumulation_steps``: ``args.gradient_accumulation_steps`` (an explicit
  other value is refused). An epoch whose batches do not divide by it ends
  with a shorter window, which kaisa reports (the factors of that window are
  still folded);
* ``optimizer`` (KL clipping's learning rate): the trainer's optimizer, its
  ``param_groups[0]['lr']`` read at every step (it follows the scheduler);
  an explicit ``lr=`` wins;
* ``grad_scaler``: the loss scaler of an fp16 run (``optimizer.scaler``, set
  by accelerate), so that captured output gradients are unscaled. bf16 needs
  none: autocast changes the forward's precision, not the gradients' scale.

**Checkpoints**: at every save the preconditioner's ``state_dict()`` is
written to :data:`STATE_FILE` in ``<output_dir>/checkpoint-<step>`` (by the
main process). When training resumes (the trainer's restored
``global_step`` > 0) it is loaded from ``args.resume_from_checkpoint`` if
that is a folder, else from ``<output_dir>/checkpoint-<global_step>``;
without one it warns and K-FAC starts afresh.

**Logs**: each time the trainer logs, the callback adds ``kaisa/…`` entries
(KL clipping's last scale and clipped steps, the preconditioned gradient
norm, skipped and outlier factor updates, kaisa's seconds) to the logged
dict and to ``state.log_history``. Reporting integrations (TensorBoard,
W&B) run before user callbacks and see them from the next log on only if
this callback is moved first (``trainer.callback_handler.callbacks``).

Supported: single process and DDP (``torchrun``, or multi-CPU); DeepSpeed and
FSDP through Trainer are refused (untested; kaisa supports DeepSpeed engines
and FSDP2 models in a plain loop).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as error:
    raise ImportError(
        "kaisa.integrations.transformers needs HuggingFace transformers: "
        "pip install 'kaisa[transformers]'"
    ) from error

if not hasattr(TrainerCallback, "on_pre_optimizer_step"):
    raise ImportError(
        "kaisa.integrations.transformers needs a transformers whose Trainer calls "
        "on_pre_optimizer_step (between the backward passes and the optimizer step): "
        "pip install -U 'kaisa[transformers]'"
    )

import torch
from torch import nn

from kaisa.preconditioner import KFACPreconditioner
from kaisa.warn import warn

__all__ = ["STATE_FILE", "KFACCallback"]

#: The preconditioner's ``state_dict()`` in a Trainer checkpoint folder.
STATE_FILE = "kaisa_preconditioner.pt"

log = logging.getLogger("kaisa")


class KFACCallback(TrainerCallback):
    """Precondition a ``Trainer``'s gradients with K-FAC at every optimizer step.

    Args:
        preconditioner: an existing :class:`~kaisa.KFACPreconditioner` built on
            the trainer's model (not on a wrapper); its ``accumulation_steps``
            must equal ``args.gradient_accumulation_steps``. Leave it out to
            have the callback build one.
        **kwargs: options for the preconditioner the callback builds (any
            :class:`~kaisa.KFACPreconditioner` keyword). ``accumulation_steps``
            and ``grad_scaler`` come from the trainer (an explicit value must
            agree); without ``lr`` KL clipping reads the trainer's optimizer.
    """

    def __init__(self, preconditioner: KFACPreconditioner | None = None, **kwargs: Any) -> None:
        if preconditioner is not None and kwargs:
            raise ValueError(
                "KFACCallback takes either a preconditioner or options to build one, not "
                f"both; got a preconditioner and {sorted(kwargs)}"
            )
        if preconditioner is not None and not isinstance(preconditioner, KFACPreconditioner):
            raise TypeError(
                "preconditioner must be a kaisa.KFACPreconditioner; "
                f"got {type(preconditioner).__name__}"
            )
        self._options = dict(kwargs)
        self._preconditioner = preconditioner
        #: ``args.max_grad_norm`` as given: applied after preconditioning.
        self._max_grad_norm = 0.0
        self._args: TrainingArguments | None = None
        self._grad_norm: float | None = None

    @property
    def preconditioner(self) -> KFACPreconditioner:
        """The preconditioner (built when training begins unless one was given)."""
        if self._preconditioner is None:
            raise RuntimeError(
                "KFACCallback builds its preconditioner when training begins; call "
                "trainer.train() first"
            )
        return self._preconditioner

    @property
    def max_grad_norm(self) -> float:
        """The bound the preconditioned gradients are clipped to (0: none)."""
        return self._max_grad_norm

    # -- checks ----------------------------------------------------------------------
    @staticmethod
    def _check_args(args: TrainingArguments) -> None:
        sharded = [
            name
            for name, on in (
                ("deepspeed", bool(getattr(args, "deepspeed", None))),
                ("fsdp", bool(getattr(args, "fsdp", None))),
            )
            if on
        ]
        if sharded:
            raise ValueError(
                f"KFACCallback does not support Trainer with {' and '.join(sharded)} "
                "(untested); single-process and DDP runs are supported, and kaisa supports "
                "DeepSpeed engines and FSDP2 models in a plain loop (docs/deepspeed-fsdp.md)"
            )

    def _accumulation_steps(self, args: TrainingArguments) -> int:
        steps = int(args.gradient_accumulation_steps)
        if self._preconditioner is not None:
            mine = self._preconditioner.options.accumulation_steps
            where = f"the preconditioner's accumulation_steps={mine!r}"
        else:
            mine = self._options.get("accumulation_steps", steps)
            where = f"KFACCallback(accumulation_steps={mine!r})"
        if mine != steps:
            raise ValueError(
                f"{where} conflicts with TrainingArguments(gradient_accumulation_steps={steps}): "
                "kaisa must see every forward/backward pass of an optimizer step; leave "
                "accumulation_steps out and the callback follows the trainer"
            )
        return steps

    # -- events ----------------------------------------------------------------------
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        """Build the preconditioner, take clipping over, and restore a resumed run's state."""
        self._check_args(args)
        steps = self._accumulation_steps(args)
        if model is None or optimizer is None:
            raise RuntimeError("KFACCallback: the trainer passed no model or optimizer")
        scaler = getattr(optimizer, "scaler", None)  # accelerate's, under fp16
        if self._preconditioner is None:
            options = dict(self._options)
            options["accumulation_steps"] = steps
            if "lr" not in options:
                options.setdefault("optimizer", optimizer)
            if scaler is not None:
                given = options.get("grad_scaler")
                if given is not None and given is not scaler:
                    raise ValueError(
                        "KFACCallback(grad_scaler=...) is not the trainer's loss scaler; leave "
                        "grad_scaler out and the callback passes the trainer's"
                    )
                options["grad_scaler"] = scaler
            self._preconditioner = KFACPreconditioner(model, **options)
        else:
            pre = self._preconditioner
            if pre.model is not model:
                raise ValueError(
                    "the preconditioner was built on another module than the trainer's model "
                    f"({type(pre.model).__name__}, not {type(model).__name__}); build it on "
                    "trainer.model"
                )
            if scaler is not None and pre.options.grad_scaler is not scaler:
                raise ValueError(
                    "the trainer scales the loss (fp16), but the preconditioner does not hold "
                    "its scaler as grad_scaler: build it with grad_scaler=optimizer.scaler, or "
                    "let KFACCallback build it"
                )
        self._args = args
        self._max_grad_norm = float(args.max_grad_norm or 0.0)
        if self._max_grad_norm > 0:
            args.max_grad_norm = 0.0
            log.info(
                "kaisa: KFACCallback clips the preconditioned gradients to max_grad_norm=%g "
                "(Trainer's own clipping of the raw gradients is off during train())",
                self._max_grad_norm,
            )
        if state.global_step > 0:
            self._resume(args, state)

    def _resume(self, args: TrainingArguments, state: TrainerState) -> None:
        folders = []
        given = getattr(args, "resume_from_checkpoint", None)
        if isinstance(given, str) and os.path.isdir(given):
            folders.append(given)
        folders.append(os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}"))
        for folder in folders:
            path = os.path.join(folder, STATE_FILE)
            if os.path.isfile(path):
                self.preconditioner.load_state_dict(torch.load(path, weights_only=False))
                return
        warn(
            f"kaisa: training resumes at step {state.global_step}, but no {STATE_FILE} was "
            f"found in {' or '.join(folders)}; K-FAC starts afresh from this point"
        )

    def on_pre_optimizer_step(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """Precondition the accumulated gradients, then clip them to ``max_grad_norm``."""
        pre = self.preconditioner
        pre.step()
        params = [p for p in pre.model.parameters() if p.grad is not None]
        bound = self._max_grad_norm if self._max_grad_norm > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, bound)
        self._grad_norm = float(norm)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Add kaisa's telemetry to the logged values and to ``state.log_history``."""
        if self._preconditioner is None or logs is None:
            return
        telemetry = self._preconditioner.telemetry
        extra: dict[str, float] = {
            "kaisa/kl_scale": float(telemetry.last_kl_scale),
            "kaisa/kl_clipped_steps": float(telemetry.kl_clipped_steps),
            "kaisa/skipped_factor_updates": float(telemetry.skipped_factor_updates),
            "kaisa/outlier_factor_updates": float(telemetry.outlier_factor_updates),
            "kaisa/seconds": float(sum(telemetry.phase_seconds.values())),
        }
        if self._grad_norm is not None:
            extra["kaisa/grad_norm"] = self._grad_norm
        history = state.log_history
        if history and all(history[-1].get(k) == v for k, v in logs.items()):
            history[-1].update(extra)
        logs.update(extra)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Write the preconditioner's state into the checkpoint folder just saved."""
        if self._preconditioner is None or not state.is_world_process_zero:
            return
        folder = os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(self._preconditioner.state_dict(), os.path.join(folder, STATE_FILE))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Give the arguments their ``max_grad_norm`` back."""
        if self._args is not None and self._max_grad_norm > 0:
            self._args.max_grad_norm = self._max_grad_norm
