"""Tensor parallelism (``torch.distributed.tensor.parallel``): exact factors of sharded Linears.

::

    parallelize_module(model, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    preconditioner = kaisa.KFACPreconditioner(model, process_group=dp_group)  # after it
    ...
    loss.backward()          # (and the gradients averaged over dp_group, as data parallelism does)
    preconditioner.step()
    optimizer.step()

After ``parallelize_module`` a parallelised ``nn.Linear``'s weight is a
``DTensor`` over the tensor-parallel mesh: column-wise
(``ColwiseParallel``, weight ``Shard(0)``), each rank holds some output rows,
sees the whole input (``A`` is the same on every tensor-parallel rank) and
the gradient of its own outputs only (a slice of ``δ``); row-wise
(``RowwiseParallel``, weight ``Shard(1)``), each rank holds some input
columns, sees its slice of the input and the whole output gradient.

kaisa uses the **exact factors** of the whole layer: the capture hook gathers
the side a rank lacks within the tensor-parallel group (the input,
``DTensor.full_tensor()``, in the forward hook; the output gradient, an
all-gather along the dimension the output is sharded on, in the backward
hook), so every tensor-parallel rank holds the factors a single process
would compute for the whole layer. The gradient is gathered whole
(``full_tensor()``, as for FSDP2), preconditioned, and this rank's shard of
the result is written back into the ``DTensor`` gradient.

Each tensor-parallel rank therefore keeps the whole layer's factors and
second-order state and preconditions the whole gradient (the same work on
every rank of a tensor-parallel group): exact, the same weights as the
unsharded model, at the memory and compute cost of the unsharded layer.
The block-diagonal approximation (each rank's factors of its own shard, no
gathering) is not offered: it changes the curvature with the
tensor-parallel degree, so the weights would depend on how the model is cut.

**Data parallelism** is across tensor-parallel groups: kaisa plans over the
data-parallel group, ``process_group=``, holding one rank of each
tensor-parallel group (``mesh["dp"].get_group()`` of a ``("dp", "tp")``
mesh). Tensor parallelism alone over the whole world needs none (each rank is
then its own data-parallel group). Its gradients are averaged over that
group by the user or the wrapper, as under data parallelism without kaisa.

Refused at construction, naming the layer: a registered layer with a
sharded DTensor parameter that is not an ``nn.Linear`` parallelised over a
1-D mesh (embeddings or convolutions sharded by a parallel style, 2-D
meshes), and tensor-parallel layers over different meshes. FSDP2 combined
with tensor parallelism is refused by :mod:`kaisa.engines.fsdp`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from kaisa.engines.fsdp import ShardedGradAccess, mesh_ranks


@dataclass(frozen=True)
class ParallelLinear:
    """One ``nn.Linear`` whose weight is a DTensor over the tensor-parallel mesh.

    ``style``: ``'colwise'`` (weight ``Shard(0)``), ``'rowwise'``
    (``Shard(1)``) or ``'replicate'``; ``mesh``: its 1-D tensor-parallel mesh.
    """

    name: str
    module: nn.Linear
    style: str
    mesh: DeviceMesh


#: The style of a parallelised Linear, by its weight's placement.
_STYLES = {"Shard(dim=0)": "colwise", "Shard(dim=1)": "rowwise", "Replicate()": "replicate"}


def _style(name: str, module: nn.Module) -> str | None:
    """The style of ``module``'s sharding, ``None`` when no parameter is sharded.

    Raises ``ValueError`` for a sharded parameter kaisa cannot gather for
    exact factors: anything but an ``nn.Linear`` sharded column- or row-wise
    over a 1-D mesh.
    """
    own = [(n, p) for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)]
    sharded = [(n, p) for n, p in own if any(not isinstance(x, Replicate) for x in p.placements)]
    if not sharded:
        return "replicate" if own and isinstance(module, nn.Linear) else None
    pname, param = sharded[0]
    where = f"{name or type(module).__name__}.{pname}"
    if not isinstance(module, nn.Linear):
        raise ValueError(
            f"kaisa: {where} ({type(module).__name__}) is sharded by tensor parallelism "
            f"(placements {tuple(param.placements)}): kaisa preconditions tensor-parallel "
            "nn.Linear layers (ColwiseParallel, RowwiseParallel); leave this layer out with "
            f"skip_layers={name!r} or do not parallelise it"
        )
    weight = module.weight
    assert isinstance(weight, DTensor)
    if weight.device_mesh.ndim != 1:
        raise ValueError(
            f"kaisa: {where} is sharded over a {weight.device_mesh.ndim}-D device mesh "
            f"(placements {tuple(weight.placements)}): kaisa supports tensor parallelism "
            "over a 1-D mesh (with data parallelism across meshes via process_group=)"
        )
    style = _STYLES.get(repr(weight.placements[0]))
    if style is None or (style == "replicate" and sharded):
        raise ValueError(
            f"kaisa: {where} has placements {tuple(param.placements)}: kaisa supports "
            "column-wise (weight Shard(0)) and row-wise (weight Shard(1)) parallel nn.Linear"
        )
    return style


def parallel_linears(
    model: nn.Module,
) -> tuple[dict[int, ParallelLinear], list[tuple[str, frozenset[int]]]]:
    """The modules of ``model`` with DTensor parameters: supported (by ``id``), and refused.

    Refused ones are the reason (:func:`_style`) and the ``id`` of their
    parameters; they are an error only
    once registered (:meth:`TensorParallelGradAccess.bind`), so a sharded
    layer left out with ``skip_layers`` does not stop the rest.
    """
    found: dict[int, ParallelLinear] = {}
    refused: list[tuple[str, frozenset[int]]] = []
    for name, module in model.named_modules():
        try:
            style = _style(name, module)
        except ValueError as error:
            own = frozenset(id(p) for p in module.parameters(recurse=False))
            refused.append((str(error), own))
            continue
        if style is not None:
            weight = module.weight
            assert isinstance(module, nn.Linear) and isinstance(weight, DTensor)
            found[id(module)] = ParallelLinear(name, module, style, weight.device_mesh)
    return found, refused


class TensorParallelGradAccess(ShardedGradAccess):
    """Exact factors and whole gradients of tensor-parallel ``nn.Linear`` layers.

    Gradients as :class:`~kaisa.engines.fsdp.ShardedGradAccess` (gathered with
    ``full_tensor()``, this rank's shard of the result written back); the
    capture hooks go through :meth:`full_capture`.
    """

    kind = "tensor-parallel"

    def __init__(
        self, layers: dict[int, ParallelLinear], refused: list[tuple[str, frozenset[int]]]
    ) -> None:
        super().__init__()
        self.layers = layers
        self.refused = refused
        self.tp_ranks: tuple[int, ...] = ()
        self._alone: Any = None

    def bind(self, params: Sequence[torch.Tensor]) -> None:
        """Check the registered layers: each a supported tensor-parallel Linear, one mesh."""
        super().bind(params)
        ids = {id(p) for p in params}
        for reason, own in self.refused:
            if own & ids:
                raise ValueError(reason)
        meshes: dict[tuple[int, ...], str] = {}
        for layer in self.layers.values():
            weight = layer.module.weight
            if id(weight) in ids and isinstance(weight, DTensor):
                meshes.setdefault(mesh_ranks(weight), layer.name)
        if len(meshes) > 1:
            raise ValueError(
                "kaisa: tensor-parallel layers over different device meshes ("
                + ", ".join(f"{name!r}: ranks {list(r)}" for r, name in meshes.items())
                + "): kaisa supports one tensor-parallel mesh"
            )
        self.tp_ranks = next(iter(meshes), ())

    def process_group(self, given: Any) -> Any:
        """The data-parallel group: one rank of each tensor-parallel group.

        Not given: tensor parallelism over the whole world leaves each rank
        its own data-parallel group (a group of one); over part of the world
        the group must be given. Given: it may hold no other rank of this
        rank's tensor-parallel group (they hold the same batch, not more).
        """
        if not isinstance(given, (dist.ProcessGroup, type(None))) or not self.tp_ranks:
            return given
        world, rank = dist.get_world_size(), dist.get_rank()
        tp = set(self.tp_ranks)
        if given is None or given is dist.GroupMember.WORLD:
            if len(tp) != world:
                raise ValueError(
                    f"kaisa: tensor parallelism over ranks {list(self.tp_ranks)} of a world of "
                    f"{world}: pass process_group= the data-parallel group (one rank of each "
                    "tensor-parallel group, e.g. mesh['dp'].get_group() of a ('dp', 'tp') mesh)"
                )
            if self._alone is None:
                self._alone = dist.new_group([rank], use_local_synchronization=True)
            return self._alone
        peers = sorted(tp & set(dist.get_process_group_ranks(given)))
        if peers != [rank]:
            raise ValueError(
                f"kaisa: process_group holds ranks {peers} of this rank's tensor-parallel group "
                f"{list(self.tp_ranks)}: it must be the data-parallel group, with one rank of "
                "each tensor-parallel group (e.g. mesh['dp'].get_group())"
            )
        return given

    def full_capture(
        self, module: nn.Module, x: torch.Tensor, output: torch.Tensor
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor] | None]:
        """The layer's whole input, and the all-gather that makes its output gradient whole.

        The input: a DTensor (what the parallel style's input hook makes of
        it) is gathered with ``full_tensor()``. The output: the shape the
        whole output would have (the input's rows, ``out_features``) tells
        along which dimension this rank's output (and so its gradient) is a
        shard: the features (column-wise) or the rows (a row-wise layer
        whose output stays sharded, as sequence parallelism asks).
        """
        layer = self.layers.get(id(module))
        if layer is None:
            return x, None
        linear = layer.module
        if isinstance(x, DTensor):
            x = x.full_tensor()
        if x.shape[-1] != linear.in_features:
            raise RuntimeError(
                f"kaisa: tensor-parallel layer {layer.name!r} was called on an input with "
                f"{x.shape[-1]} features, not its {linear.in_features}, and not as a DTensor: "
                "kaisa cannot gather it (use ColwiseParallel/RowwiseParallel's input layouts)"
            )
        if isinstance(output, DTensor):  # use_local_output=False
            return x, _full_dtensor
        whole = (*x.shape[:-1], linear.out_features)
        if tuple(output.shape) == whole:
            return x, None
        cut = [d for d, (a, b) in enumerate(zip(output.shape, whole, strict=False)) if a != b]
        if output.dim() != len(whole) or len(cut) != 1:
            raise RuntimeError(
                f"kaisa: tensor-parallel layer {layer.name!r} returned a shard of shape "
                f"{tuple(output.shape)} of a {whole} output: kaisa gathers outputs sharded "
                "along one dimension"
            )
        mesh = layer.mesh
        return x, lambda grad: _gather(grad, mesh, cut[0], whole)


def _full_dtensor(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _gather(grad: torch.Tensor, mesh: DeviceMesh, dim: int, whole: tuple[int, ...]) -> torch.Tensor:
    """All-gather this rank's shard ``grad`` along ``dim`` over ``mesh`` into ``whole``."""
    stride = [1] * len(whole)
    for d in range(len(whole) - 2, -1, -1):
        stride[d] = stride[d + 1] * whole[d + 1]
    sharded = DTensor.from_local(
        grad.contiguous(),
        mesh,
        [Shard(dim)],
        run_check=False,
        shape=torch.Size(whole),
        stride=tuple(stride),
    )
    return sharded.full_tensor()


def tensor_parallel_access(model: nn.Module) -> TensorParallelGradAccess:
    """The access of a model with DTensor parameters and no FSDP2 module (tensor parallelism)."""
    return TensorParallelGradAccess(*parallel_linears(model))
