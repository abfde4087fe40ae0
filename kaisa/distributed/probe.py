"""The fraction in force at construction: given, or ``'auto'`` measured and chosen.

:func:`settle_fraction` is what the preconditioner calls before it makes its
plan. For a given ``grad_worker_fraction`` it resolves the number of gradient
workers and has the ranks check that they agree (spec §10). For ``'auto'``:

1. the ranks first check that they agree on everything but the fraction (so
   that a rank given another fraction fails here, by name, instead of
   mismatching the probe's collectives);
2. the speeds come from :data:`~kaisa.distributed.fraction.LINK_ENV` when it
   is set, else from a short probe on the process group
   (:func:`probe_link`: all-reduces of 4 bytes, 64 KiB and 1 MiB, best of
   three each, and a 256 × 256 matrix product), each rank's measurements
   reduced to the slowest rank's (an all-reduce of their maxima);
3. the budget is ``memory_budget`` or, on a CUDA device, the device's free
   memory; the smallest over the ranks holds (none on the CPU: the choice is
   by time alone);
4. :func:`~kaisa.distributed.fraction.choose_stable` chooses from those
   equal numbers, so every rank chooses alike; the ranks then check the
   final plan's agreement as for a given fraction, and the choice is logged
   (``logging.getLogger("kaisa")``, INFO).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from kaisa.distributed.agreement import agreement_digest, check_agreement
from kaisa.distributed.fraction import (
    DEFAULT_LINK,
    LINK_ENV,
    FractionChoice,
    FractionModel,
    Link,
    choose_stable,
)
from kaisa.distributed.plan import LayerShape, make_plan, resolve_grad_workers

__all__ = ["PROBE_ELEMENTS", "default_budget", "probe_link", "settle_fraction"]

log = logging.getLogger("kaisa")

#: The all-reduces the probe times, in float32 elements (4 B, 64 KiB, 1 MiB).
PROBE_ELEMENTS = (1, 2**14, 2**18)
#: Timed repetitions of each probe (the best counts).
PROBE_REPEATS = 3
#: Side of the matrix product that measures the compute rate.
MATMUL_SIDE = 256


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(run: Any, device: torch.device) -> float:
    run()  # warm-up
    best = math.inf
    for _ in range(PROBE_REPEATS):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def probe_link(group: dist.ProcessGroup | None, device: torch.device) -> Link:
    """This rank's speeds: per-message latency and bandwidth on ``group``, matmul rate.

    Collective (every rank of ``group`` calls it). All-reduces are timed and
    read as a ring's ``2(n−1)`` messages (the model's all-reduce, so that it
    gives back what was measured): the smallest one's time gives the latency,
    the extra seconds per extra byte from the middle one to the largest the
    bandwidth.
    """
    times = []
    for numel in PROBE_ELEMENTS:
        buffer = torch.zeros(numel, device=device)
        times.append(_best(lambda b=buffer: dist.all_reduce(b, group=group), device))
    extra = (PROBE_ELEMENTS[-1] - PROBE_ELEMENTS[1]) * 4
    slope = times[-1] - times[1]
    per_byte = slope / extra if slope > 0 else times[-1] / (PROBE_ELEMENTS[-1] * 4)
    # A ring all-reduce over n ranks: 2(n-1) messages of bytes/n each.
    n = max(2, dist.get_world_size(group))
    matrix = torch.ones(MATMUL_SIDE, MATMUL_SIDE, device=device) / MATMUL_SIDE
    rate = MATMUL_SIDE**3 / _best(lambda: matrix @ matrix, device)
    return Link(
        latency_s=times[0] / (2 * (n - 1)),
        bandwidth=2 * (n - 1) / (n * per_byte),
        compute_rate=rate,
    )


def _reduce(values: list[float], op: Any, group: Any, device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op, group=group)
    return [float(v) for v in tensor.tolist()]


def default_budget(device: torch.device) -> int | None:
    """The device's free memory in bytes on a CUDA device; ``None`` (no limit) elsewhere."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return None


def settle_fraction(
    options: Any,
    shapes: Sequence[LayerShape],
    world_size: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    *,
    factor_dtype: torch.dtype,
    inv_dtype: torch.dtype,
    product_dtype: torch.dtype,
) -> FractionChoice:
    """The fraction in force (see the module docstring); collective with several ranks.

    Raises :class:`~kaisa.distributed.agreement.RankDisagreementError` when
    the ranks differ, :class:`~kaisa.distributed.fraction.MemoryBudgetError`
    when no fraction fits the budget, and ``ValueError`` for a bad
    :data:`~kaisa.distributed.fraction.LINK_ENV`.
    """
    layers = [(s.name, s.a_size, s.g_size) for s in shapes]

    def agree(grad_workers: int) -> None:
        plan = make_plan(
            shapes,
            world_size,
            grad_workers / world_size,
            options.assignment_strategy,
            options.colocate_factors,
        )
        digest = agreement_digest(
            options,
            plan,
            layers,
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            product_dtype=product_dtype,
        )
        if options.grad_worker_fraction == "auto":  # probed on every rank, or given on every one
            digest[LINK_ENV] = "given" if os.environ.get(LINK_ENV, "").strip() else "probed"
        check_agreement(digest, group)

    if options.grad_worker_fraction != "auto":
        m = resolve_grad_workers(options.grad_worker_fraction, world_size)
        agree(m)
        return FractionChoice(world_size=world_size, grad_workers=m)
    distributed = world_size > 1
    if distributed:
        agree(world_size)  # everything but the fraction, before the probe's collectives
    text = os.environ.get(LINK_ENV, "").strip()
    measured = Link.parse(text) if text else (probe_link(group, device) if distributed else None)
    budget = options.memory_budget
    if budget is None:
        budget = default_budget(device)
    if distributed:
        assert measured is not None
        worst = _reduce(
            [measured.latency_s, 1 / measured.bandwidth, 1 / measured.compute_rate],
            dist.ReduceOp.MAX,
            group,
            device,
        )
        measured = Link(worst[0], 1 / worst[1], 1 / worst[2])
        least = _reduce(
            [math.inf if budget is None else float(budget)], dist.ReduceOp.MIN, group, device
        )
        budget = None if math.isinf(least[0]) else least[0]
    hyper = options.resolve(0)
    model = FractionModel(
        compute_method=options.compute_method,
        eigen_outer_product=options.compute_eigenvalue_outer_product,
        symmetry_aware=options.symmetry_aware,
        assignment_strategy=options.assignment_strategy,
        colocate_factors=options.colocate_factors,
        factor_update_steps=hyper.factor_update_steps,
        inv_update_steps=hyper.inv_update_steps,
        bucket_cap_mb=options.allreduce_bucket_cap_mb,
        factor_bytes=factor_dtype.itemsize,
        state_bytes=inv_dtype.itemsize,
        grad_bytes=factor_dtype.itemsize,
        cost_model=options.cost_model,
    )
    choice = choose_stable(shapes, world_size, measured or DEFAULT_LINK, budget, model)
    if distributed:
        agree(choice.grad_workers)
    log.info("kaisa: %s", choice.describe())
    return choice
