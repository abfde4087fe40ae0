"""``factor_sample`` on 2 gloo processes: the factors average each rank's drawn rows.

Each rank draws the same share of its own rows (the draw is a function of
the step, the layer, the side and the call, not of the rank), and the
all-reduced factors are the sums over the rows drawn on every rank divided
by their count, with ``δ`` divided by the world size as for every row
(spec §3). Checked against that reference in float64 for both sides of both
layers, in every gradient-worker fraction 2 ranks allow, on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from harness import run_distributed
from torch import nn

import kaisa
from kaisa.capture import RowSampler
from kaisa.layers.base import draw_rows

TOKENS, D_IN, HIDDEN, OUT, SHARE = 12, 5, 4, 3, 0.25


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)).double()


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(
        2, TOKENS // 2, D_IN, generator=torch.Generator().manual_seed(rank), dtype=torch.float64
    )


def _worker(rank: int, world_size: int, fraction: float) -> dict[str, Any]:
    model = _model()
    pre = kaisa.KFACPreconditioner(
        model,
        lr=0.1,
        curvature="exact",
        factor_decay=0.0,
        factor_sample=SHARE,
        grad_worker_fraction=fraction,
        inv_dtype=torch.float64,
    )
    inputs: dict[int, torch.Tensor] = {}
    deltas: dict[int, torch.Tensor] = {}

    def hook(index: int) -> Any:
        def forward(_m: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            inputs[index] = args[0].detach().clone()
            out.register_hook(lambda g: deltas.__setitem__(index, g.detach().clone()))

        return forward

    handles = [model[i].register_forward_hook(hook(i)) for i in (0, 2)]
    x = _batch(rank)
    model(x).square().mean().backward()
    pre.step()
    for handle in handles:
        handle.remove()
    factors = {
        i: (layer.block.a.clone(), layer.block.g.clone()) for i, layer in enumerate(pre.layers)
    }
    dist.barrier()
    return {"factors": factors, "inputs": inputs, "deltas": deltas}


def _drawn(index: int, which: str) -> torch.Tensor:
    sampler = RowSampler(SHARE, [])
    sampler.begin(0)
    chosen = draw_rows(
        TOKENS,
        SHARE,
        torch.Generator().manual_seed(sampler.seed(index, which, 0)),
        torch.device("cpu"),
    )
    assert chosen is not None
    return chosen


def test_two_ranks_average_the_rows_each_drew() -> None:
    for fraction in (0.5, 1.0):
        results = run_distributed(_worker, 2, fraction, timeout=120)
        for index, module in enumerate((0, 2)):
            a_sum = g_sum = 0.0
            rows = 0
            for result in results:
                x = result["inputs"][module].reshape(-1, result["inputs"][module].shape[-1])
                x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=torch.float64)], 1)
                delta = result["deltas"][module].reshape(TOKENS, -1) / 2  # δ over the world size
                xa, dg = x[_drawn(index, "a")], delta[_drawn(index, "g")]
                a_sum = a_sum + xa.T @ xa
                g_sum = g_sum + dg.T @ dg
                rows += xa.shape[0]
            for result in results:
                a, g = result["factors"][index]
                torch.testing.assert_close(a, a_sum / rows, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(g, g_sum / rows, rtol=1e-12, atol=1e-12)
