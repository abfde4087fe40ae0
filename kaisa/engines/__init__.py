"""Engines: how each kind of parallelism holds the gradients kaisa preconditions.

One module per kind of parallelism; the front door
(:class:`~kaisa.KFACPreconditioner`) calls :func:`select_engine` once, at
construction, and reads and writes every gradient through the
:class:`~kaisa.engines.base.GradAccess` it returns:

* :mod:`kaisa.engines.base`: a plain module or one wrapped in DDP
  (``param.grad``, in place), and :class:`~kaisa.engines.base.StagedGradAccess`,
  what the engines below share: full gradients gathered once per step and
  written back;
* :mod:`kaisa.engines.deepspeed`: a DeepSpeed engine, ZeRO stages 0, 1 and 2
  (``pip install 'kaisa[deepspeed]'``);
* :mod:`kaisa.engines.fsdp`: FSDP2 (``fully_shard``, on a 1-D mesh or HSDP's
  2-D one), whose gradients are ``DTensor`` shards (torch only);
* :mod:`kaisa.engines.tensor_parallel`: ``nn.Linear`` layers parallelised
  column- or row-wise (``torch.distributed.tensor.parallel``): the shard a
  layer lacks is gathered for its factors and its gradient;
* :mod:`kaisa.engines.pipelining`: ``torch.distributed.pipelining`` stages,
  which need no access of their own; the module spots the stage's
  shape-inference pass, which is no micro-batch.

How one is chosen (:func:`select_engine`), in this order:

1. DeepSpeed, when ``deepspeed`` is already imported (only then can the model
   be a DeepSpeed engine) and the model is one; a module whose parameters a
   ZeRO optimizer manages, passed instead of its engine, is refused;
2. when a parameter is a ``DTensor``: FSDP2 (1-D mesh) or HSDP (2-D mesh,
   replicate × shard) when a module is sharded by ``fully_shard`` (FSDP2
   combined with tensor parallelism is refused), tensor parallelism
   (:mod:`kaisa.engines.tensor_parallel`) otherwise;
3. otherwise plain.

The engines sit below :mod:`kaisa.layers` and the front door and import
neither (nor the integrations, which wrap the front door); an engine's
framework is imported only when the model may use it.
"""

from __future__ import annotations

import sys

from torch import nn

from kaisa.engines.base import PLAIN, GradAccess, StagedGradAccess, is_dtensor

__all__ = ["PLAIN", "GradAccess", "StagedGradAccess", "is_dtensor", "select_engine"]


def select_engine(model: nn.Module) -> GradAccess:
    """The gradient access for what ``model`` is (see the module docstring).

    Raises ``ValueError`` for what kaisa cannot precondition correctly: a
    DeepSpeed ZeRO-3 engine, a module whose parameters a DeepSpeed ZeRO
    optimizer manages passed instead of its engine, FSDP2 combined with
    tensor parallelism, or a DTensor parameter sharded in a way kaisa cannot
    gather (:mod:`kaisa.engines.tensor_parallel` says which).
    """
    if "deepspeed" in sys.modules:
        # Only then can the model be a DeepSpeed engine (or hold ZeRO-managed parameters).
        from kaisa.engines.deepspeed import deepspeed_grad_access

        access = deepspeed_grad_access(model)
        if access is not None:
            return access
    if any(is_dtensor(p) for p in model.parameters()):
        from torch.distributed.fsdp import FSDPModule

        if any(isinstance(module, FSDPModule) for module in model.modules()):
            from kaisa.engines.fsdp import ShardedGradAccess, check_fully_sharded

            return ShardedGradAccess(check_fully_sharded(model))
        from kaisa.engines.tensor_parallel import tensor_parallel_access

        return tensor_parallel_access(model)
    return GradAccess()
