"""FSDP2 (``torch.distributed.fsdp.fully_shard``): gradients that are DTensor shards.

::

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    preconditioner = kaisa.KFACPreconditioner(model, lr=...)   # after fully_shard
    ...
    loss.backward()
    preconditioner.step()
    optimizer.step()

After ``fully_shard`` every parameter is a ``DTensor`` holding this rank's
shard (dim 0 by default), and after the backward pass its ``.grad`` is the
matching shard of the gradient averaged over the ranks (reduce-scattered).
:class:`ShardedGradAccess` gathers each registered parameter's full gradient
(``DTensor.full_tensor()``, an all-gather: every rank gathers the same
parameters in the same order, once per step), kaisa preconditions the full
matrices exactly as under DDP, and the access writes this rank's shard of the
result back into the ``DTensor`` gradient (``distribute_tensor`` with
``src_data_rank=None`` cuts the shard locally, by the gradient's own mesh and
placements: any shard dimension, uneven shards).

The capture hooks need nothing special: they see each layer's input and
output gradient, whatever FSDP2 does to the parameters around the forward.
Build the preconditioner after ``fully_shard`` (built before, it would
treat the model as plain and refuses the first DTensor gradient it meets).

FSDP1 (``FullyShardedDataParallel``) needs an accelerator and does not run on
CPU; it is not tested here.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from kaisa.engines.base import StagedGradAccess


def check_fully_sharded(model: torch.nn.Module) -> None:
    """Refuse DTensor parameters that are not FSDP2's one-dimensional shards.

    Tensor parallelism (``torch.distributed.tensor.parallel``) also makes
    parameters DTensors, but its layers see only their shard of the inputs
    or output gradients: gathering their gradients would pair full
    gradients with local factors. It is refused, as are 2-D meshes (FSDP2
    combined with tensor parallelism, or HSDP), which are untested.
    """
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(module, FSDPModule) for module in model.modules()):
        raise ValueError(
            "kaisa: the model has DTensor parameters but no module sharded by FSDP2's "
            "fully_shard: tensor parallelism (torch.distributed.tensor.parallel) is not "
            "supported (the README's 'Pipeline and model parallelism' says what it would "
            "take); FSDP2 and pipeline stages with process_group= are"
        )
    for name, param in model.named_parameters():
        if isinstance(param, DTensor) and param.device_mesh.ndim != 1:
            raise ValueError(
                f"kaisa: parameter {name!r} is sharded over a {param.device_mesh.ndim}-D "
                "device mesh (FSDP2 with tensor parallelism, or HSDP): kaisa supports "
                "FSDP2 over a 1-D mesh"
            )


class ShardedGradAccess(StagedGradAccess):
    """Full gradients of FSDP2's DTensor parameters (plain ones pass through)."""

    kind = "FSDP2"

    def gather(self, param: torch.Tensor) -> torch.Tensor | None:
        grad = param.grad
        if isinstance(grad, DTensor):
            return grad.full_tensor()
        return grad  # a parameter FSDP2 does not shard: read and written in place

    def scatter(self, param: torch.Tensor, full: torch.Tensor) -> None:
        grad = param.grad
        if full is grad:
            return
        if isinstance(grad, DTensor):
            shard = distribute_tensor(full, grad.device_mesh, grad.placements, src_data_rank=None)
            grad.to_local().copy_(shard.to_local())
        elif isinstance(param, DTensor):  # a gradient kaisa created (a bias without one)
            param.grad = distribute_tensor(
                full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None
            )
        elif grad is None:
            param.grad = full.to(param.dtype)
        else:
            grad.copy_(full)
