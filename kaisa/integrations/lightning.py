"""PyTorch Lightning: K-FAC preconditioning as a callback.

::

    from kaisa.integrations.lightning import KFACCallback

    trainer = lightning.pytorch.Trainer(callbacks=[KFACCallback()], ...)
    trainer.fit(module)

:class:`KFACCallback` builds a :class:`~kaisa.KFACPreconditioner` for the
``LightningModule`` when fitting starts (the module is on its device, the
process group exists, the optimizer is configured) and calls its ``step()``
in ``on_before_optimizer_step``: once per optimizer step, after the last
backward pass of a gradient-accumulation window, after Lightning's
precision plugin has unscaled the gradients (``'16-mixed'``), before
gradient clipping and before the optimizer updates the weights. What it sets
for the preconditioner:

* ``accumulation_steps``: the trainer's ``accumulate_grad_batches`` (an
  explicit other value is refused);
* ``lr`` (read by KL clipping): the optimizer's current
  ``param_groups[0]['lr']``, so it follows any learning-rate scheduler;
* ``grad_scaler``: the precision plugin's ``GradScaler``, if it has one.

The preconditioner's state is saved in the trainer's checkpoints under
:data:`CHECKPOINT_KEY` and restored when a fit resumes from one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
except ImportError as error:
    raise ImportError(
        "kaisa.integrations.lightning needs PyTorch Lightning (the 'lightning' package): "
        "pip install 'kaisa[lightning]'"
    ) from error

import torch

from kaisa.preconditioner import KFACPreconditioner
from kaisa.warn import warn

__all__ = ["CHECKPOINT_KEY", "KFACCallback"]

#: The key of the preconditioner's ``state_dict()`` in a trainer checkpoint.
CHECKPOINT_KEY = "kaisa"


class KFACCallback(pl.Callback):
    """Precondition a ``LightningModule``'s gradients with K-FAC at every optimizer step.

    Args:
        preconditioner: an existing :class:`~kaisa.KFACPreconditioner` built on
            the ``LightningModule`` itself (not on a DDP wrapper); its
            ``accumulation_steps`` must equal the trainer's
            ``accumulate_grad_batches``, and under ``'16-mixed'`` it must hold the
            precision plugin's scaler as ``grad_scaler``. Leave it out to have
            the callback build one.
        **kwargs: options for the preconditioner the callback builds (any
            :class:`~kaisa.KFACPreconditioner` keyword). ``accumulation_steps``
            and ``grad_scaler`` are taken from the trainer (an explicit value
            must agree with it); ``lr`` defaults to the optimizer's current
            learning rate.

    Supported: automatic optimization, or manual optimization with one
    optimizer; single-device and DDP strategies (``'ddp'``, ``'ddp_spawn'``,
    ``'ddp_fork'``). Sharded strategies (FSDP, DeepSpeed, model parallel) are
    refused: untested through Lightning (kaisa supports DeepSpeed engines and
    FSDP2 models in a plain loop).
    """

    def __init__(self, preconditioner: KFACPreconditioner | None = None, **kwargs: Any) -> None:
        super().__init__()
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
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending_state: Mapping[str, Any] | None = None

    @property
    def preconditioner(self) -> KFACPreconditioner:
        """The preconditioner (built when fitting starts unless one was given)."""
        if self._preconditioner is None:
            raise RuntimeError(
                "KFACCallback builds its preconditioner when fitting starts; call trainer.fit first"
            )
        return self._preconditioner

    # -- checks ----------------------------------------------------------------------
    def _accumulation_steps(self, trainer: pl.Trainer) -> int:
        """The trainer's ``accumulate_grad_batches``, checked against an explicit value."""
        steps = int(trainer.accumulate_grad_batches)
        if self._preconditioner is not None:
            mine = self._preconditioner.options.accumulation_steps
            where = f"the preconditioner's accumulation_steps={mine!r}"
        else:
            mine = self._options.get("accumulation_steps", steps)
            where = f"KFACCallback(accumulation_steps={mine!r})"
        if mine != steps:
            raise ValueError(
                f"{where} conflicts with Trainer(accumulate_grad_batches={steps}): kaisa must "
                "see every forward/backward pass of an optimizer step; leave "
                "accumulation_steps out and the callback follows the trainer"
            )
        return steps

    @staticmethod
    def _check_strategy(trainer: pl.Trainer) -> None:
        strategy = trainer.strategy
        supported = isinstance(strategy, (SingleDeviceStrategy, DDPStrategy))
        if not supported or isinstance(strategy, DeepSpeedStrategy):
            raise ValueError(
                "KFACCallback supports single-device and DDP strategies; got "
                f"{type(strategy).__name__}: the callback is untested with sharded strategies; "
                "kaisa itself supports DeepSpeed engines and FSDP2 models in a plain loop "
                "(docs/deepspeed-fsdp.md)"
            )

    def _scaler(self, trainer: pl.Trainer) -> Any:
        """The precision plugin's loss scaler, or ``None``."""
        return getattr(trainer.precision_plugin, "scaler", None)

    def _lr(self, step: int) -> float:
        """The optimizer's current learning rate, for KL clipping."""
        if self._optimizer is None:
            raise RuntimeError("KFACCallback: no optimizer yet (fitting has not started)")
        return float(self._optimizer.param_groups[0]["lr"])

    # -- hooks -----------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a conflicting configuration before the strategy sets anything up."""
        if stage == "fit":
            self._check_strategy(trainer)
            self._accumulation_steps(trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Build the preconditioner (or check the given one) and restore a pending checkpoint."""
        self._check_strategy(trainer)
        steps = self._accumulation_steps(trainer)
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise ValueError(
                f"KFACCallback supports one optimizer; the module configures {len(optimizers)} "
                "(kaisa preconditions every registered layer once per step)"
            )
        self._optimizer = optimizers[0]
        scaler = self._scaler(trainer)
        if self._preconditioner is None:
            options = dict(self._options)
            options["accumulation_steps"] = steps
            options.setdefault("lr", self._lr)
            if scaler is not None:
                given = options.get("grad_scaler")
                if given is not None and given is not scaler:
                    raise ValueError(
                        "KFACCallback(grad_scaler=...) is not the trainer's loss scaler "
                        f"({type(trainer.precision_plugin).__name__}.scaler); leave grad_scaler "
                        "out and the callback passes the trainer's"
                    )
                options["grad_scaler"] = scaler
            self._preconditioner = KFACPreconditioner(pl_module, **options)
        else:
            pre = self._preconditioner
            if pre.model is not pl_module:
                raise ValueError(
                    "the preconditioner was built on another module than the one being fitted "
                    f"({type(pre.model).__name__}, not {type(pl_module).__name__}); build it on "
                    "the LightningModule itself"
                )
            if scaler is not None and pre.options.grad_scaler is not scaler:
                raise ValueError(
                    "the trainer scales the loss (precision plugin "
                    f"{type(trainer.precision_plugin).__name__}), but the preconditioner does "
                    "not hold its scaler as grad_scaler: build it with "
                    "grad_scaler=<the plugin's scaler>, or let KFACCallback build it"
                )
        if self._pending_state is not None:
            self._preconditioner.load_state_dict(self._pending_state)
            self._pending_state = None

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Precondition the accumulated, unscaled gradients before the optimizer steps."""
        pre = self.preconditioner
        steps = int(trainer.accumulate_grad_batches)
        if steps != pre.options.accumulation_steps:
            raise ValueError(
                f"Trainer.accumulate_grad_batches changed to {steps} during fit (a "
                "GradientAccumulationScheduler?), but the preconditioner's accumulation_steps "
                f"is fixed at {pre.options.accumulation_steps}"
            )
        pre.step()

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Store the preconditioner's state in the checkpoint under :data:`CHECKPOINT_KEY`."""
        if self._preconditioner is not None:
            checkpoint[CHECKPOINT_KEY] = self._preconditioner.state_dict()
        elif self._pending_state is not None:
            checkpoint[CHECKPOINT_KEY] = self._pending_state

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Restore the preconditioner's state (when it is built, if it is not yet)."""
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is None:
            warn(
                f"kaisa: the checkpoint holds no preconditioner state (no {CHECKPOINT_KEY!r} "
                "key); K-FAC starts afresh from this point"
            )
            return
        if self._preconditioner is not None:
            self._preconditioner.load_state_dict(state)
        else:
            self._pending_state = state
