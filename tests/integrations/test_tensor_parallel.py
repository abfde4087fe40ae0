"""Tensor parallelism (``ColwiseParallel`` / ``RowwiseParallel``): kaisa equals the whole model.

The model: ``Linear(6, 10)`` column-wise, ``tanh``, ``Linear(10, 8)`` row-wise,
``tanh``, ``Linear(8, 3)`` not parallelised (plain parameters on every rank),
all with biases. Two runs on gloo processes:

* **TP alone**, 2 processes over a 1-D mesh: both ranks see the same batch;
  each rank is its own data-parallel group (no ``process_group=``);
* **TP x DP**, 4 processes on a ``("dp", "tp")`` mesh of ``(2, 2)``:
  ``parallelize_module`` over ``mesh["tp"]``, each data-parallel replica its
  own rows, gradients averaged over ``mesh["dp"]`` by hand, kaisa built with
  ``process_group=mesh["dp"].get_group()``.

One process trains the unsharded model on the whole batch (the rows of every
replica). With exact factors (kaisa gathers the input of a row-wise layer
and the output gradient of a column-wise one) after ``STEPS`` steps (exact
curvature, absolute damping, KL clipping that binds), for COMM-OPT and
MEM-OPT, to the tolerance of the DDP equivalence tests:

* the weights (gathered with ``full_tensor()``) equal the single process's,
  on every rank; without kaisa they are far away;
* the factors equal the single process's, on every rank;
* each preconditioned gradient came back as the DTensor shard it was
  (same placements, this rank's local shape).

A third model (TP alone) keeps a row-wise layer's output sharded along the
sequence (``output_layouts=Shard(1)``, as sequence parallelism does) and
gathers it in the next column-wise layer (``input_layouts=Shard(1)``,
``output_layouts=Replicate()``): its factors and weights equal the whole
model's too (the row-wise output gradient is gathered along the rows).

Refused at construction, naming the setup: a sharded ``nn.Embedding``
(``RowwiseParallel`` on an embedding) registered by kaisa, and, with TP x DP,
no ``process_group=`` (the world is not the data-parallel group) or one that
holds both ranks of a tensor-parallel group.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from harness import run_distributed

TOL = 3e-6  # float32, summation order only (as tests/distributed/test_equivalence.py)
TIMEOUT = 240.0
STEPS = 3
ROWS = 6  # rows per data-parallel replica
LR = 0.1
KAISA: dict[str, Any] = {
    "lr": LR,
    "curvature": "exact",
    "factor_update_steps": 1,
    "inv_update_steps": 1,
    "damping": 1e-3,
    "damping_mode": "absolute",
    "kl_clip": 1e-3,
}
FRACTIONS = ["comm-opt", "mem-opt"]


def _model() -> torch.nn.Module:
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * replica + step)
    return torch.randn(ROWS, 6, generator=g), torch.randint(0, 3, (ROWS,), generator=g)


def _whole_batch(replicas: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [_batch(r, step) for r in range(replicas)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _train(
    model: torch.nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    fraction: str | None,
    dp_group: Any = None,
    dp_size: int = 1,
) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.nn.functional as F

    import kaisa

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    pre = (
        None
        if fraction is None
        else kaisa.KFACPreconditioner(
            model, grad_worker_fraction=fraction, process_group=dp_group, **KAISA
        )
    )
    shapes = []
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if dp_size > 1:  # data parallelism by hand, over the data-parallel group
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(_local(p.grad), group=dp_group)
                _local(p.grad).div_(dp_size)
        before = [
            (type(p.grad).__name__, getattr(p.grad, "placements", None)) for p in model.parameters()
        ]
        if pre is not None:
            pre.step()
        after = [
            (
                type(p.grad).__name__,
                getattr(p.grad, "placements", None),
                tuple(_local(p.grad).shape),
            )
            for p in model.parameters()
        ]
        shapes.append((before, after, [tuple(_local(p).shape) for p in model.parameters()]))
        optimizer.step()
    factors: list[torch.Tensor] = []
    if pre is not None:
        for layer in pre.layers:
            state = layer.block.state_dict()
            factors += [state["a"], state["g"]]
    return {
        "weights": [_full(p) for p in model.parameters()],
        "factors": factors,
        "shapes": shapes,
        "workers": None if pre is None else pre.plan.grad_workers,
    }


def _parallel(mesh: Any) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = _model()
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def _refused(build: Any) -> str:
    try:
        build()
    except ValueError as error:
        return str(error)
    return "accepted"


def _embedding(mesh: Any) -> torch.nn.Module:
    from torch import nn
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 2))
    parallelize_module(model, mesh, {"0": RowwiseParallel()})
    return model


def _sequence_model() -> torch.nn.Module:
    from torch import nn

    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 4))


def _sequence_parallel(mesh: Any) -> torch.nn.Module:
    """Row-wise output sharded along the sequence (dim 1), the next colwise gathering it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = _sequence_model()
    plan = {
        "0": ColwiseParallel(),
        "2": RowwiseParallel(output_layouts=Shard(1)),
        "4": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, plan)
    return model


def _sequence_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(3, 4, 6, generator=g), torch.randint(0, 4, (3, 4), generator=g)


def _train_sequence(model: torch.nn.Module) -> dict[str, Any]:
    import torch.nn.functional as F

    import kaisa

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    pre = kaisa.KFACPreconditioner(model, **KAISA)
    for step in range(STEPS):
        x, y = _sequence_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        pre.step()
        optimizer.step()
    factors = [
        t for la in pre.layers for t in (la.block.state_dict()["a"], la.block.state_dict()["g"])
    ]
    return {"weights": [_full(p) for p in model.parameters()], "factors": factors}


def _tp_alone(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import kaisa

    mesh = init_device_mesh("cpu", (world_size,))
    batches = [_batch(0, step) for step in range(STEPS)]  # the same rows on both ranks
    results = {str(f): _train(_parallel(mesh), batches, f) for f in [*FRACTIONS, None]}
    results["embedding"] = _refused(lambda: kaisa.KFACPreconditioner(_embedding(mesh), lr=0.1))
    # Left out, the sharded embedding stops nothing.
    pre = kaisa.KFACPreconditioner(_embedding(mesh), skip_layers="0", lr=0.1)
    results["embedding-skipped"] = len(pre.layers)
    results["sequence"] = _train_sequence(_sequence_parallel(mesh))
    return results


def _tp_dp(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import kaisa

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_group = mesh["dp"].get_group()
    replica = mesh["dp"].get_local_rank()
    batches = [_batch(replica, step) for step in range(STEPS)]
    results = {
        str(f): _train(_parallel(mesh["tp"]), batches, f, dp_group, 2) for f in [*FRACTIONS, None]
    }
    results["no-group"] = _refused(lambda: kaisa.KFACPreconditioner(_parallel(mesh["tp"]), lr=0.1))
    tp_group = mesh["tp"].get_group()
    results["tp-group"] = _refused(
        lambda: kaisa.KFACPreconditioner(_parallel(mesh["tp"]), process_group=tp_group, lr=0.1)
    )
    dist.barrier()
    return results


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def alone() -> list[dict[str, Any]]:
    return run_distributed(_tp_alone, 2, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def with_dp() -> list[dict[str, Any]]:
    return run_distributed(_tp_dp, 4, timeout=TIMEOUT)


def _single(replicas: int) -> dict[str, dict[str, Any]]:
    batches = [_whole_batch(replicas, step) for step in range(STEPS)]
    return {str(f): _train(_model(), batches, f) for f in [*FRACTIONS, None]}


def _check(runs: list[dict[str, Any]], single: dict[str, dict[str, Any]], fraction: str) -> None:
    from torch.distributed.tensor import Replicate, Shard

    want = single[fraction]
    for run in runs:
        got = run[fraction]
        assert _distance(got["weights"], want["weights"]) <= TOL
        assert _distance(got["factors"], want["factors"]) <= TOL
        assert len(got["factors"]) == 6  # three layers, A and G each
        assert _distance(run["None"]["weights"], want["weights"]) > 1e-3
        for before, after, local_shapes in got["shapes"]:
            # Each gradient comes back as the shard it was: DTensor, placements, local shape.
            assert [(kind, placements) for kind, placements, _ in after] == before
            assert [shape for *_, shape in after] == local_shapes
        placements = [p for _, p, _ in got["shapes"][0][1]]
        assert placements[:4] == [(Shard(0),), (Shard(0),), (Shard(1),), (Replicate(),)]
        assert placements[4:] == [None, None]  # the plain Linear
    assert _distance(single["None"]["weights"], runs[0]["None"]["weights"]) <= TOL


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_tensor_parallel_alone_equals_whole_model(
    alone: list[dict[str, Any]], fraction: str
) -> None:
    _check(alone, _single(1), fraction)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_tensor_and_data_parallel_equal_whole_model(
    with_dp: list[dict[str, Any]], fraction: str
) -> None:
    _check(with_dp, _single(2), fraction)
    for run in with_dp:
        assert run[fraction]["workers"] == (2 if fraction == "comm-opt" else 1)


def test_output_sharded_along_the_sequence_is_gathered(alone: list[dict[str, Any]]) -> None:
    """A row-wise layer whose output stays sharded along dim 1 (as sequence parallelism)."""
    want = _train_sequence(_sequence_model())
    for run in alone:
        got = run["sequence"]
        assert len(got["factors"]) == 6
        assert _distance(got["factors"], want["factors"]) <= TOL
        assert _distance(got["weights"], want["weights"]) <= TOL


def test_sharded_embedding_is_refused_unless_skipped(alone: list[dict[str, Any]]) -> None:
    for run in alone:
        assert "is sharded by tensor parallelism" in run["embedding"]
        assert "skip_layers='0'" in run["embedding"]
        assert run["embedding-skipped"] == 1


def test_data_parallel_group_is_required_and_checked(with_dp: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(with_dp):
        assert "pass process_group= the data-parallel group" in run["no-group"]
        tp_pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert f"holds ranks {tp_pair} of this rank's tensor-parallel group" in run["tp-group"]
