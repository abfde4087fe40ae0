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

**HSDP** (``fully_shard(module, mesh=mesh)`` on a 2-D mesh, replicate ×
shard: placements ``(Replicate(), Shard(d))``) is the same to kaisa: the
gradient is averaged over both mesh dimensions, ``full_tensor()`` gathers
the shard dimension, and the write-back cuts this rank's shard. Every rank
of the mesh is a data-parallel rank: factors are all-reduced and work is
placed over all of them, as for DDP over the same ranks. The mesh must be
the data-parallel group kaisa plans over (the world, or ``process_group=``);
:meth:`ShardedGradAccess.process_group` checks it.

The capture hooks need nothing special: they see each layer's input and
output gradient, whatever FSDP2 does to the parameters around the forward.
Build the preconditioner after ``fully_shard`` (built before, it would
treat the model as plain and refuses the first DTensor gradient it meets).

FSDP1 (``FullyShardedDataParallel``) needs an accelerator and does not run on
CPU; it is not tested here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from kaisa.engines.base import StagedGradAccess


def mesh_ranks(tensor: DTensor) -> tuple[int, ...]:
    """The global ranks of ``tensor``'s device mesh, sorted."""
    return tuple(sorted(int(r) for r in tensor.device_mesh.mesh.flatten().tolist()))


def is_hsdp(placements: Any) -> bool:
    """Whether ``placements`` are HSDP's: ``(Replicate(), Shard(d))`` on a 2-D mesh."""
    return (
        len(placements) == 2
        and isinstance(placements[0], Replicate)
        and type(placements[1]) is Shard  # (FSDP2 with TP uses a strided shard subclass)
    )


def check_fully_sharded(model: torch.nn.Module) -> tuple[int, ...]:
    """Refuse DTensor parameters that are not FSDP2's (or HSDP's) shards.

    Accepted: every DTensor parameter over a 1-D mesh (FSDP2), or over a 2-D
    mesh with HSDP's placements ``(Replicate(), Shard(d))``, all over the same
    ranks. Refused, naming the setup: FSDP2 combined with tensor parallelism
    (a 2-D mesh whose second dimension shards a tensor-parallel layer, or a
    3-D mesh), and parameters over different sets of ranks. Returns the
    ranks of the mesh: the data-parallel ranks.
    """
    ranks: tuple[int, ...] | None = None
    first = ""
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue
        ndim = param.device_mesh.ndim
        if ndim > 2 or (ndim == 2 and not is_hsdp(param.placements)):
            raise ValueError(
                f"kaisa: parameter {name!r} is a DTensor over a {ndim}-D device mesh with "
                f"placements {tuple(param.placements)}: FSDP2 combined with tensor "
                "parallelism is not supported; FSDP2 over a 1-D mesh, HSDP (a 2-D mesh, "
                "replicate x shard), and tensor parallelism alone (with process_group= "
                "its data-parallel group) are"
            )
        here = mesh_ranks(param)
        if ranks is None:
            ranks, first = here, name
        elif here != ranks:
            raise ValueError(
                f"kaisa: FSDP2 parameters {first!r} and {name!r} are sharded over different "
                f"ranks ({list(ranks)} and {list(here)}): kaisa needs one data-parallel mesh"
            )
    assert ranks is not None
    return ranks


class ShardedGradAccess(StagedGradAccess):
    """Full gradients of FSDP2's DTensor parameters (plain ones pass through).

    ``ranks``: the global ranks of the model's FSDP2 (or HSDP) device mesh,
    its data-parallel ranks (:func:`check_fully_sharded`).
    """

    kind = "FSDP2"

    def __init__(self, ranks: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.ranks = ranks

    def process_group(self, given: Any) -> Any:
        """The data-parallel group: the one given, or the world; it must be the mesh's ranks.

        Factors are averaged over the group kaisa plans over and gradients
        over the mesh: they must be the same ranks, or the preconditioned
        gradient would mix two different averages.
        """
        if not self.ranks or not isinstance(given, (dist.ProcessGroup, type(None))):
            return given  # (a bad process_group is refused by data_parallel_group)
        if given is None or given is dist.GroupMember.WORLD:
            members: tuple[int, ...] = tuple(range(dist.get_world_size()))
            where = "the world (no process_group= given)"
        else:
            members = tuple(sorted(dist.get_process_group_ranks(given)))
            where = "process_group"
        if members != self.ranks:
            raise ValueError(
                f"kaisa: the {self.kind} device mesh spans ranks {list(self.ranks)} but {where} "
                f"has ranks {_short(members)}: pass process_group= a group of exactly the "
                "mesh's ranks (they average the gradients, so they must average the factors)"
            )
        return given

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


def _short(ranks: tuple[int, ...]) -> str:
    """Ranks for a message: all of a few, the first and last of many."""
    return str(list(ranks)) if len(ranks) <= 8 else f"[{ranks[0]}, ..., {ranks[-1]}]"
