"""DeepSpeed: a preconditioner built on the engine, with the same lines as under DDP.

::

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    preconditioner = kaisa.KFACPreconditioner(engine, lr=...)
    for x, y in loader:
        loss = criterion(engine(x), y)
        engine.backward(loss)
        preconditioner.step()
        engine.step()

:class:`~kaisa.KFACPreconditioner` recognises the engine and reads and writes
gradients through :class:`DeepSpeedGradAccess` (:mod:`kaisa.engines.base`):

* ZeRO stages 1 and 2 keep gradients in partitioned buffers (every ``.grad``
  is ``None``): kaisa gathers each registered parameter's full gradient with
  ``deepspeed.utils.safe_get_full_grad`` (an all-reduce over the data-parallel
  group, the same parameters in the same order on every rank) once per step
  and writes the preconditioned one back into the local partition with
  ``safe_set_full_grad``; stage 0 reads and writes ``.grad``.
* ``gradient_accumulation_steps``: ``step()`` does nothing on the micro-steps
  where the engine will not step either, and ``accumulation_steps`` follows the
  engine's (an explicit other value is refused).
* fp16 loss scaling: the gradients kaisa sees are still multiplied by the
  engine's loss scale (DeepSpeed unscales them in ``engine.step()``), so the
  captured output gradients are unscaled with it and KL clipping is computed
  as on unscaled gradients; no ``grad_scaler=`` is needed (one is refused).
* ZeRO stage 3 partitions the parameters themselves and is refused at
  construction: use ZeRO-1/2, or FSDP2 (``fully_shard``).

``deepspeed`` is imported only when a model might be an engine (it is
already imported then); see ``docs/deepspeed-fsdp.md``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

try:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad
except ImportError as error:  # pragma: no cover - exercised with deepspeed missing
    raise ImportError(
        "kaisa.engines.deepspeed needs DeepSpeed: pip install 'kaisa[deepspeed]'"
    ) from error

from kaisa.engines.base import StagedGradAccess


def _zero_optimizer_type() -> type | None:
    try:
        from deepspeed.runtime.base_optimizer import ZeROOptimizer
    except ImportError:  # pragma: no cover - older DeepSpeed
        return None
    return ZeROOptimizer  # type: ignore[no-any-return]


class DeepSpeedGradAccess(StagedGradAccess):
    """Full gradients of a DeepSpeed engine's parameters (ZeRO stages 0, 1, 2).

    Raises ``ValueError`` for an engine kaisa cannot serve: ZeRO stage 3,
    ``managed_gradient_accumulation=false`` (gradients are reduced only inside
    ``engine.step()``, after kaisa would have used them), a pipeline engine.
    """

    kind = "DeepSpeed"

    def __init__(self, engine: Any) -> None:
        super().__init__()
        if isinstance(engine, deepspeed.PipelineEngine):
            raise ValueError(
                "kaisa: a DeepSpeed PipelineEngine runs backward and the optimizer step "
                "inside train_batch(), leaving no point for preconditioner.step() between "
                "them; pipeline engines are not supported"
            )
        stage = int(engine.zero_optimization_stage())
        if stage >= 3:
            raise ValueError(
                f"kaisa: DeepSpeed ZeRO stage {stage} is not supported: it partitions the "
                "parameters themselves, so a layer's weight exists whole only inside its "
                "own forward and backward, and kaisa reads and rewrites whole gradient "
                "matrices after the backward pass; use ZeRO stage 1 or 2 (optimizer "
                "state and gradients partitioned, which kaisa supports with the same "
                "lines), or FSDP2 (torch.distributed.fsdp.fully_shard), which kaisa "
                "supports for sharded parameters"
            )
        managed = getattr(engine, "managed_gradient_accumulation", None)
        if callable(managed) and not managed():
            raise ValueError(
                "kaisa: the DeepSpeed engine has managed_gradient_accumulation=false: it "
                "reduces gradients inside engine.step(), after preconditioner.step() must "
                "have used them; keep the default (managed) accumulation"
            )
        self.engine = engine
        self.stage = stage

    def gather(self, param: torch.Tensor) -> torch.Tensor | None:
        full = safe_get_full_grad(param)
        return full if full is None or isinstance(full, torch.Tensor) else None

    def scatter(self, param: torch.Tensor, full: torch.Tensor) -> None:
        if full is param.grad:  # stage 0: written in place
            return
        hp_grad = getattr(param, "_hp_grad", None)
        if isinstance(hp_grad, torch.Tensor):
            # DeepSpeed's BF16 optimizer (bf16 weights, fp32 gradient accumulation)
            # holds each parameter's whole reduced gradient in fp32 on every rank
            # (_hp_grad, which safe_get_full_grad reads; the optimizer steps on its
            # partition of the same buffer). safe_set_full_grad writes the bf16
            # .grad instead, which the step never reads again, and the parameter's
            # set_full_hp_grad fails on it (it takes the buffer for a fragment).
            hp_grad.copy_(full.reshape(hp_grad.shape))
        elif param.grad is None and not hasattr(param, "_hp_mapping"):
            param.grad = full.to(param.dtype)  # stage 0, a gradient created by kaisa
        else:
            safe_set_full_grad(param, full)

    def at_boundary(self) -> bool:
        return bool(self.engine.is_gradient_accumulation_boundary())

    def accumulation_steps(self, given: Any) -> Any:
        engine_steps = int(self.engine.gradient_accumulation_steps())
        if given is None:
            return engine_steps
        if isinstance(given, int) and not isinstance(given, bool) and given != engine_steps:
            raise ValueError(
                f"kaisa: accumulation_steps={given} conflicts with the DeepSpeed engine's "
                f"gradient_accumulation_steps={engine_steps}; leave accumulation_steps unset "
                "(it follows the engine) or make them equal"
            )
        return given

    def process_group(self, given: Any) -> Any:
        """The engine's data-parallel group unless one is given (model or pipeline parallel)."""
        if given is not None:
            return given
        group = getattr(self.engine, "data_parallel_group", None)
        if group is None or dist.get_world_size(group) == dist.get_world_size():
            return None  # the whole world: kaisa's default
        return group

    def grad_scaler(self, given: Any) -> Any:
        if given is not None:
            raise ValueError(
                f"kaisa: grad_scaler={given!r} given with a DeepSpeed engine, whose loss scale "
                "kaisa reads from the engine itself; leave grad_scaler unset"
            )
        return self.loss_scale

    def loss_scale(self) -> float:
        """The factor ``engine.backward`` multiplied the loss by (1 for fp32 and bf16).

        DeepSpeed unscales the gradients only in ``engine.step()``. A ZeRO
        optimizer scales the loss with ``scale_if_loss`` (its dynamic or
        static fp16 loss scaler, or torch autocast's scaler); at stage 0,
        the engine's own torch autocast ``GradScaler`` does, if any.
        """
        engine = self.engine
        optimizer = engine.optimizer
        zero_type = _zero_optimizer_type()
        scale_if_loss = getattr(optimizer, "scale_if_loss", None)
        if zero_type is not None and isinstance(optimizer, zero_type) and callable(scale_if_loss):
            # The same call engine.backward makes, on a probe loss of 1.
            with torch.enable_grad():
                probe = torch.ones((), device=engine.device, requires_grad=True) * 1.0
                return float(scale_if_loss(probe).detach())
        if zero_type is None and self.stage in (1, 2):  # pragma: no cover - older DeepSpeed
            return float(getattr(optimizer, "loss_scale", None) or 1.0)
        scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
        if scaler is not None:
            return float(scaler.get_scale())
        return 1.0


def deepspeed_grad_access(model: nn.Module) -> DeepSpeedGradAccess | None:
    """The access for a DeepSpeed engine; ``None`` for a model DeepSpeed does not manage.

    Refuses (``ValueError``) a module whose parameters a ZeRO optimizer
    manages passed instead of its engine: their ``.grad`` stays ``None``.
    """
    if isinstance(model, deepspeed.DeepSpeedEngine):
        return DeepSpeedGradAccess(model)
    for name, param in model.named_parameters():
        if hasattr(param, "_hp_mapping") or hasattr(param, "ds_id"):
            raise ValueError(
                f"kaisa: the parameters of {type(model).__name__} (e.g. {name!r}) belong to a "
                "DeepSpeed ZeRO optimizer, which keeps their gradients in its own partitioned "
                "buffers (their .grad stays None): pass the engine deepspeed.initialize "
                "returned, KFACPreconditioner(engine, ...), not engine.module"
            )
    return None
