"""``factor_sample``: the factor products over a drawn share of the rows (issue 31).

The factors are checked against dense float64 grams of exactly the rows the
documented draw picks (:class:`kaisa.capture.RowSampler`); runs are checked
to be reproducible and resumable bit for bit.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_factors import capture, output_grads
from torch import nn

import kaisa
from kaisa.capture import RowSampler
from kaisa.layers.base import draw_rows


def _drawn(count: int, keep: float, which: str, index: int = 0, step: int = 0) -> torch.Tensor:
    """The indices the preconditioner draws for one call (the first of its layer)."""
    sampler = RowSampler(keep, [])
    sampler.begin(step)
    generator = torch.Generator().manual_seed(sampler.seed(index, which, 0))
    chosen = draw_rows(count, keep, generator, torch.device("cpu"))
    assert chosen is not None
    return chosen


def test_draw_rows_keeps_a_share_without_replacement() -> None:
    generator = torch.Generator().manual_seed(3)
    chosen = draw_rows(40, 0.25, generator, torch.device("cpu"))
    assert chosen is not None and chosen.shape == (10,)
    assert chosen.unique().numel() == 10 and bool((chosen[1:] > chosen[:-1]).all())
    assert int(chosen.min()) >= 0 and int(chosen.max()) < 40
    assert draw_rows(40, 1.0, generator, torch.device("cpu")) is None  # every row: nothing drawn
    assert draw_rows(3, 0.01, generator, torch.device("cpu")).numel() == 1  # type: ignore[union-attr]
    # A function of the seed alone.
    again = draw_rows(40, 0.25, torch.Generator().manual_seed(3), torch.device("cpu"))
    assert torch.equal(chosen, again)  # type: ignore[arg-type]


@pytest.mark.parametrize("bias", [True, False])
def test_linear_factors_over_the_drawn_tokens(bias: bool) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(5, 3, bias=bias).double()
    x = torch.randn(4, 6, 5, dtype=torch.float64)  # 24 tokens
    (delta,) = output_grads(layer, layer, x)
    rows_x = x.reshape(-1, 5)
    if bias:
        rows_x = torch.cat([rows_x, torch.ones(24, 1, dtype=torch.float64)], 1)
    rows_d = delta.reshape(-1, 3)
    a_rows = rows_x[_drawn(24, 0.25, "a")]
    g_rows = rows_d[_drawn(24, 0.25, "g")]
    block = capture(layer, x, factor_sample=0.25).layers[0].block
    torch.testing.assert_close(block.a, a_rows.T @ a_rows / 6, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block.g, g_rows.T @ g_rows / 6, rtol=1e-12, atol=1e-12)
    # The two sides draw apart, and not all rows.
    assert not torch.equal(_drawn(24, 0.25, "a"), _drawn(24, 0.25, "g"))


def test_convolution_factors_over_the_drawn_examples() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1).double()
    x = torch.randn(8, 2, 5, 5, dtype=torch.float64)
    (delta,) = output_grads(conv, conv, x)
    sampled = capture(conv, x, factor_sample=0.5).layers[0]
    a_idx, g_idx = _drawn(8, 0.5, "a"), _drawn(8, 0.5, "g")
    # The factors of whole examples, as the (separately tested) full products give them.
    handler = sampled.handler
    a_sum, a_rows = handler.a_sum(x[a_idx])
    g_sum, g_rows = handler.g_sum(delta[g_idx])
    assert a_rows == g_rows == 4 * 25
    torch.testing.assert_close(sampled.block.a, a_sum / a_rows, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sampled.block.g, g_sum / g_rows, rtol=1e-12, atol=1e-12)


def test_embedding_factors_over_the_drawn_tokens() -> None:
    torch.manual_seed(0)
    table = nn.Embedding(7, 4).double()
    tokens = torch.randint(0, 7, (3, 8))
    (delta,) = output_grads(table, table, tokens)
    # A held diagonal: its moments are cheap and take every token; G's gram the drawn ones.
    block = (
        capture(table, tokens, factor_sample=0.5, curvature=("diagonal", "exact")).layers[0].block
    )
    counts = torch.bincount(tokens.reshape(-1), minlength=7).double() / 24
    assert block.a.shape == (2, 7)
    torch.testing.assert_close(block.a[1], counts, rtol=1e-12, atol=1e-12)
    g_rows = delta.reshape(-1, 4)[_drawn(24, 0.5, "g")]
    torch.testing.assert_close(block.g, g_rows.T @ g_rows / 12, rtol=1e-12, atol=1e-12)


def test_a_share_of_one_is_every_row() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(5, 3).double()
    x = torch.randn(4, 6, 5, dtype=torch.float64)
    full = capture(copy.deepcopy(layer), x).layers[0].block
    one = capture(copy.deepcopy(layer), x, factor_sample=1.0).layers[0].block
    assert torch.equal(full.a, one.a) and torch.equal(full.g, one.g)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


OPTIONS = {
    "factor_sample": 0.5,
    "factor_update_steps": 1,
    "inv_update_steps": 2,
    "curvature": "exact",
    "lr": 0.1,
}


def _train(model: nn.Module, pre: kaisa.KFACPreconditioner, steps: range) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in steps:
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(4, 8, 6, generator=g)
        y = torch.randint(0, 3, (4, 8), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x).reshape(-1, 3), y.reshape(-1)).backward()
        pre.step()
        optimizer.step()


def test_sampled_runs_repeat_and_resume_bit_identically() -> None:
    model = _net()
    pre = kaisa.KFACPreconditioner(model, **OPTIONS)
    _train(model, pre, range(5))
    state = copy.deepcopy(pre.state_dict())
    weights = copy.deepcopy(model.state_dict())
    _train(model, pre, range(5, 10))
    expected = [p.detach().clone() for p in model.parameters()]
    # The same run again, from the start: the same weights (the draws are seeded).
    again = _net()
    _train(again, kaisa.KFACPreconditioner(again, **OPTIONS), range(10))
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), expected, strict=True))
    # Resumed from step 5: it draws what the uninterrupted run drew.
    fresh = _net()
    fresh.load_state_dict(weights)
    resumed = kaisa.KFACPreconditioner(fresh, **OPTIONS)
    resumed.load_state_dict(state)
    _train(fresh, resumed, range(5, 10))
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), expected, strict=True))
    # And the draws matter: every row gives other weights.
    full = _net()
    _train(full, kaisa.KFACPreconditioner(full, **{**OPTIONS, "factor_sample": 1.0}), range(10))
    assert not all(torch.equal(a, b) for a, b in zip(full.parameters(), expected, strict=True))


def test_the_draws_leave_the_global_random_state_alone() -> None:
    after = {}
    for share in (0.5, 1.0):
        model = _net()
        pre = kaisa.KFACPreconditioner(model, **{**OPTIONS, "factor_sample": share})
        torch.manual_seed(11)
        _train(model, pre, range(3))
        after[share] = torch.rand(4)
    assert torch.equal(after[0.5], after[1.0])


def test_the_sampled_rows_set_the_products_cost_in_the_automatic_choice() -> None:
    """The budget sees the rows multiplied out: fewer gram rows, the same training rows."""
    sides = {}
    for share in (1.0, 0.25):
        model = _net()
        # A budget that affords everything: the same sides and intervals either way.
        pre = kaisa.KFACPreconditioner(model, factor_sample=share, time_budget=1e6, lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _train(model, pre, range(2))
        choice = pre.curvature_choice
        assert choice is not None
        sides[share] = choice
    full, drawn = sides[1.0], sides[0.25]
    assert (drawn.specs, drawn.factor_update_steps) == (full.specs, full.factor_update_steps)
    assert drawn.training_work == full.training_work
    assert drawn.kfac_work < full.kfac_work


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0.0, ValueError, "factor_sample"),
        (1.5, ValueError, "factor_sample"),
        (float("nan"), ValueError, "factor_sample"),
        ("half", TypeError, "factor_sample"),
        (True, TypeError, "factor_sample"),
    ],
)
def test_a_bad_share_is_refused_by_name(value: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        kaisa.KFACPreconditioner(_net(), factor_sample=value, lr=0.1)  # type: ignore[arg-type]
