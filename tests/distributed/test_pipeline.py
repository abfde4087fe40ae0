"""Pipeline parallelism (``torch.distributed.pipelining``) with KAISA per stage.

Four gloo processes: two pipeline stages × two data-parallel replicas. Stage
``s`` lives on global ranks ``{2s, 2s + 1}`` (its data-parallel group); the
pipeline of replica ``r`` is ranks ``{r, 2 + r}``. Each stage builds its own
preconditioner over its data-parallel group (``process_group=``), for the
layers it holds; GPipe runs two micro-batches per step. After a few steps
every stage's weights must equal those of the whole model trained in one
process on the whole batch, to the tolerance of the whole-world equivalence
tests (float32, summation order only).

The recipe the test follows (and the README states): the pipeline's loss is
each micro-batch's mean loss divided by the number of micro-batches, with
``scale_grads=False``, so that the output gradients kaisa captures carry the
same scale as the weight gradients (GPipe's default divides the weight
gradients after the backward pass, which the captured ``δ`` never sees);
``accumulation_steps`` is the number of micro-batches. At its first step a
stage infers shapes by running its module on placeholder tensors (and, on
the last stage, a backward pass through them); kaisa ignores that pass.

In one process: passes whose forwards all run before their backwards (as a
pipeline schedule runs micro-batches) count as separate passes, and give the
factors of the same passes run one after the other.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_distributed
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import kaisa

STEPS = 3
MICRO = 2  # micro-batches per replica per step
REPLICAS = 2
ROWS = 4  # rows per micro-batch
TOLERANCE = 3e-6  # as tests/distributed/test_equivalence.py


def _stages() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(7)
    first = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 8), nn.Tanh())
    second = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    return first, second


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step the whole batch: replica r's rows are ``[r*MICRO*ROWS, (r+1)*MICRO*ROWS)``."""
    gen = torch.Generator().manual_seed(11)
    rows = REPLICAS * MICRO * ROWS
    return [
        (torch.randn(rows, 6, generator=gen), torch.randint(0, 3, (rows,), generator=gen))
        for _ in range(STEPS)
    ]


def _kaisa(
    module: nn.Module, group: dist.ProcessGroup | None, passes: int
) -> kaisa.KFACPreconditioner:
    return kaisa.KFACPreconditioner(
        module,
        lr=0.1,
        factor_update_steps=1,
        inv_update_steps=1,
        curvature="exact",
        factor_decay=0.5,
        accumulation_steps=passes,
        process_group=group,
    )


def _stage_worker(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    stage, replica = divmod(rank, REPLICAS)
    dp_groups = [dist.new_group([2 * s, 2 * s + 1]) for s in range(2)]
    pp_groups = [dist.new_group([r, REPLICAS + r]) for r in range(REPLICAS)]
    dp, pp = dp_groups[stage], pp_groups[replica]
    module = _stages()[stage]
    # Shapes inferred at the first step (a pass on placeholders kaisa ignores).
    pipe_stage = PipelineStage(module, stage, 2, torch.device("cpu"), group=pp)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target) / MICRO

    schedule = ScheduleGPipe(pipe_stage, MICRO, loss_fn=loss_fn, scale_grads=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    pre = _kaisa(module, dp, MICRO)
    share = MICRO * ROWS
    for x, y in _batches():
        xs, ys = (
            x[replica * share : (replica + 1) * share],
            y[replica * share : (replica + 1) * share],
        )
        optimizer.zero_grad()
        if stage == 0:
            schedule.step(xs)
        else:
            schedule.step(target=ys)
        for p in module.parameters():  # the data-parallel average within the stage
            assert p.grad is not None
            dist.all_reduce(p.grad, group=dp)
            p.grad.div_(REPLICAS)
        pre.step()
        optimizer.step()
    dist.barrier()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _one_process() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    first, second = _stages()
    model = nn.Sequential(first, second)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    passes = REPLICAS * MICRO
    pre = _kaisa(model, None, passes)
    for x, y in _batches():
        optimizer.zero_grad()
        for xs, ys in zip(x.split(ROWS), y.split(ROWS), strict=True):
            (F.cross_entropy(model(xs), ys) / passes).backward()
        pre.step()
        optimizer.step()
    return (
        {k: v.detach().clone() for k, v in first.state_dict().items()},
        {k: v.detach().clone() for k, v in second.state_dict().items()},
    )


@pytest.mark.timeout(240)
def test_two_stages_by_two_replicas_reproduce_the_whole_model_in_one_process() -> None:
    results = run_distributed(_stage_worker, 4, timeout=200)
    reference = _one_process()
    for rank, got in enumerate(results):
        want = reference[rank // REPLICAS]
        for key, value in want.items():
            err = (got[key] - value).abs().max().item()
            assert err <= TOLERANCE, (rank, key, err)
    # K-FAC moved the weights (the comparison has teeth).
    initial = _stages()
    moved = max(
        (reference[s][k] - v).abs().max().item()
        for s in range(2)
        for k, v in initial[s].state_dict().items()
    )
    assert moved > 1e-2


def _overlapped(overlap: bool) -> dict[str, torch.Tensor]:
    first, second = _stages()
    model = nn.Sequential(first, second)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = _kaisa(model, None, MICRO)
    for x, y in _batches():
        optimizer.zero_grad()
        pieces = list(
            zip(x[: MICRO * ROWS].split(ROWS), y[: MICRO * ROWS].split(ROWS), strict=True)
        )
        if overlap:  # every forward, then every backward (GPipe's order)
            losses = [F.cross_entropy(model(xs), ys) / MICRO for xs, ys in pieces]
            for loss in reversed(losses):
                loss.backward()
        else:
            for xs, ys in pieces:
                (F.cross_entropy(model(xs), ys) / MICRO).backward()
        pre.step()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_overlapping_passes_count_as_separate_passes() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "fewer passes than accumulation_steps"
        overlapped = _overlapped(True)
    sequential = _overlapped(False)
    for key, value in sequential.items():
        torch.testing.assert_close(overlapped[key], value, rtol=0, atol=TOLERANCE)
