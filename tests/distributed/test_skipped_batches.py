"""An iteration is a transaction, on several ranks (issue 30, item 1).

On a factor-update step the factor all-reduce leaves from the output-gradient
hooks, so an iteration abandoned after its backward pass has collectives in
flight. When every rank skips the same batch (the usual case: the same
``if`` on the loss, or a data loader shared by all), the ranks must stay in
step and train exactly as if the batch had never been seen. When only some
ranks skip it, every rank must fail with ``RankDisagreementError`` rather
than hang or die in a mismatched collective.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from harness import average_gradients, run_distributed
from torch import nn

import kaisa
from kaisa.distributed.agreement import RankDisagreementError

STEPS = 4


class Branchy(nn.Module):
    """A side branch only rank 1 takes: with a bucket per layer, rank 0's hooks launch
    fewer all-reduces than rank 1's (the side layer's bucket blocks those behind it)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 6)
        self.side = nn.Linear(8, 6)
        self.c = nn.Linear(6, 3)
        self.use_side = rank == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        out = torch.tanh(self.b(h))
        if self.use_side:
            out = out + torch.tanh(self.side(h))
        return self.c(out)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))


def _average_gradients(model: nn.Module, world_size: int) -> None:
    for p in model.parameters():
        if p.grad is None:  # (the side branch on rank 0)
            p.grad = torch.zeros_like(p)
    average_gradients(model, world_size)


def _batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)


def _train(
    rank: int, world_size: int, in_hook: bool, accumulation: int, skip: str | None
) -> dict[str, list[torch.Tensor]]:
    """STEPS steps; with ``skip``, a batch before step 1 is skipped in that way, on every rank."""
    model = Branchy(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = kaisa.KFACPreconditioner(
        model,
        lr=0.1,
        curvature="exact",
        factor_update_steps=1,
        inv_update_steps=1,
        accumulation_steps=accumulation,
        update_factors_in_hook=in_hook,
        # Tiny buckets: several all-reduces, launched layer by layer from the hooks.
        allreduce_bucket_cap_mb=1e-4,
    )

    def passes(step: int) -> None:
        for micro in range(accumulation):
            x, y = _batch(rank, step, micro)
            (F.cross_entropy(model(x), y) / accumulation).backward()

    for step in range(STEPS):
        if step == 1 and skip is not None:
            passes(99)  # a batch skipped after its backward pass
            optimizer.zero_grad()
            if skip == "discard_captures":
                pre.discard_captures()
        optimizer.zero_grad()
        passes(step)
        _average_gradients(model, world_size)
        pre.step()
        optimizer.step()
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "factors": [t.clone() for la in pre.layers for t in (la.block.a, la.block.g)],
    }


def _skips_alike(rank: int, world_size: int) -> list[str]:
    problems = []
    for in_hook in (True, False):
        for accumulation in (1, 2):
            clean = _train(rank, world_size, in_hook, accumulation, None)
            for skip in ("next forward", "discard_captures"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    skipped = _train(rank, world_size, in_hook, accumulation, skip)
                for key in ("weights", "factors"):
                    if not all(
                        torch.equal(a, b) for a, b in zip(clean[key], skipped[key], strict=True)
                    ):
                        problems.append(f"{key} differ: in_hook={in_hook}, {accumulation}, {skip}")
    return problems


def test_a_batch_every_rank_skips_leaves_no_trace() -> None:
    """Skipped on both ranks, after (part of) the factor all-reduce left from the hooks:
    weights and factors bit for bit as without the batch."""
    assert run_distributed(_skips_alike, 2, timeout=120) == [[], []]


def _skips_on_rank_zero(rank: int, world_size: int, in_hook: bool) -> str:
    model = _model()
    pre = kaisa.KFACPreconditioner(
        model, lr=0.1, curvature="exact", factor_update_steps=1, update_factors_in_hook=in_hook
    )
    x, y = _batch(rank, 0, 0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.cross_entropy(model(x), y).backward()
            if rank == 0:  # rank 0 skips the batch; rank 1 steps
                model.zero_grad()
                F.cross_entropy(model(x), y).backward()
            pre.step()
    except RankDisagreementError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("in_hook", [True, False])
def test_a_batch_skipped_on_one_rank_only_is_a_named_error_on_every_rank(in_hook: bool) -> None:
    first, second = run_distributed(_skips_on_rank_zero, 2, in_hook, timeout=120)
    assert first.startswith("kaisa: rank 0 discarded this iteration's captures"), first
    assert second.startswith("kaisa: rank 1 called step() while other ranks discarded it"), second
    assert "every rank must skip the same batches" in first + second
