"""``grad_worker_fraction='auto'`` in one process: the model by hand, the choice, the refusals.

The cost model of :mod:`kaisa.distributed.fraction` is checked against
numbers worked out by hand for two small layers on two ranks; the choice
against those numbers (the fastest fraction that fits, the budget refusal
naming the smallest memory, the tie-break at a rounding boundary); the
preconditioner's memory against the model's; and the option's checks.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

import kaisa
from kaisa.distributed.fraction import (
    LINK_ENV,
    FractionChoice,
    FractionModel,
    Link,
    MemoryBudgetError,
    choose,
    choose_stable,
    parse_bytes,
)
from kaisa.distributed.plan import LayerShape

#: Two layers: L1 with a = 3, g = 4; L2 with a = 5, g = 2.
SHAPES = [LayerShape("L1", 3, 4), LayerShape("L2", 5, 2)]
#: One collective 1 ms, 10⁶ bytes/s, 10⁶ multiply-adds/s.
LINK = Link(latency_s=1e-3, bandwidth=1e6, compute_rate=1e6)


def _costs(inv_update_steps: int = 1) -> dict[int, object]:
    model = FractionModel(factor_update_steps=1, inv_update_steps=inv_update_steps)
    return {p.grad_workers: model.cost(p, LINK) for p in model.plans(SHAPES, 2)}


def test_the_model_matches_numbers_worked_out_by_hand() -> None:
    # Placement (largest n³ first): L2 (125 + 8) on rank 0, L1 (27 + 64) on rank 1;
    # with m = 1 each rank is a column, with m = 2 one column holds both.
    costs = _costs()
    mem_opt, comm_opt = costs[1], costs[2]
    # Factors on every rank: 9 + 16 + 25 + 4 = 54 floats. Second-order state
    # (eigen, with the outer product) a² + a + g² + g + a·g: L1 44, L2 46.
    assert mem_opt.factor_bytes == comm_opt.factor_bytes == 54 * 4  # type: ignore[attr-defined]
    assert mem_opt.second_order_bytes == 46 * 4  # type: ignore[attr-defined]
    assert comm_opt.second_order_bytes == 90 * 4  # type: ignore[attr-defined]
    # All-reduce, a ring on two ranks: 2·(one bucket's 1 ms + 216 B / 2 / 1 MB/s). Decompositions:
    # the busiest rank, 8·(5³ + 2³) = 1064 multiply-adds. Preconditioning: per
    # layer 2·(2a²g + 2g²a): L1 336, L2 280. Gradient broadcast (m = 1): two
    # layers, 12 + 10 floats. Inverse broadcast (m = 2): 8 calls (two per side),
    # 32 + 36 floats. Broadcasts over two ranks: one round of the tree.
    expected_mem_opt = {
        "factor_allreduce": 2 * (1e-3 + 108e-6),
        "decomposition": 1064e-6,
        "inverse_broadcast": 0.0,
        "precondition": 336e-6,
        "grad_broadcast": 2e-3 + 88e-6,
    }
    expected_comm_opt = {
        "factor_allreduce": 2 * (1e-3 + 108e-6),
        "decomposition": 1064e-6,
        "inverse_broadcast": 8e-3 + 272e-6,
        "precondition": 616e-6,
        "grad_broadcast": 0.0,
    }
    for cost, expected in ((mem_opt, expected_mem_opt), (comm_opt, expected_comm_opt)):
        for part, value in expected.items():
            assert cost.seconds[part] == pytest.approx(value, rel=1e-12), part  # type: ignore[attr-defined]
    assert mem_opt.time_s == pytest.approx(5.704e-3, rel=1e-12)  # type: ignore[attr-defined]
    assert comm_opt.time_s == pytest.approx(12.168e-3, rel=1e-12)  # type: ignore[attr-defined]


def test_the_choice_is_the_fastest_fraction_that_fits() -> None:
    every_step = list(_costs(1).values())
    assert choose(every_step, None).grad_workers == 1  # type: ignore[arg-type]
    # Inverses every 100 steps: the inverse broadcast is amortised and COMM-OPT's
    # 2.2e-3 + 8.3e-5 + ... beats MEM-OPT's gradient broadcast every step.
    rare = list(_costs(100).values())
    times = {c.grad_workers: c.time_s for c in rare}  # type: ignore[attr-defined]
    assert times[2] < times[1]
    assert choose(rare, None).grad_workers == 2  # type: ignore[arg-type]
    assert choose(rare, 576).grad_workers == 2  # type: ignore[arg-type]  # exactly fits
    assert choose(rare, 575).grad_workers == 1  # type: ignore[arg-type]  # only MEM-OPT fits


def test_a_budget_no_fraction_meets_names_the_smallest_memory() -> None:
    with pytest.raises(MemoryBudgetError) as caught:
        choose(list(_costs().values()), 399)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "memory_budget=399 bytes" in message
    assert "the smallest is 400 bytes" in message and "memory_budget >= 400" in message
    assert "1 gradient worker(s) per layer (mem-opt)" in message


def test_measurements_are_rounded_and_a_boundary_takes_the_smaller_memory() -> None:
    model = FractionModel(factor_update_steps=1, inv_update_steps=100)

    def pick(latency: float) -> int:
        rounded = Link(latency, 2.0**20, 2.0**20)
        return choose([model.cost(p, rounded) for p in model.plans(SHAPES, 2)], None).grad_workers

    # The latency class at which the choice flips (higher latency: fewer broadcasts).
    flip = next(e for e in range(-30, 0) if pick(2.0**e) != pick(2.0 ** (e + 1)))
    low, high = pick(2.0**flip), pick(2.0 ** (flip + 1))
    assert {low, high} == {1, 2}
    # Well inside a class: that class's choice, whatever the exact value.
    for offset, expected in ((0.2, low), (-0.3, low), (0.8, high), (1.3, high)):
        link = Link(2.0 ** (flip + offset), 2.0**20 * 1.1, 2.0**20 * 0.95)
        choice = choose_stable(SHAPES, 2, link, None, model)
        assert (choice.grad_workers, choice.boundary) == (expected, False), offset
        assert choice.link == Link(2.0 ** round(flip + offset), 2.0**20, 2.0**20)
    # Near the boundary between the two: the one with less memory (m = 1), flagged.
    for offset in (0.4, 0.5, 0.6):
        choice = choose_stable(
            SHAPES, 2, Link(2.0 ** (flip + offset), 2.0**20, 2.0**20), None, model
        )
        assert (choice.grad_workers, choice.boundary) == (1, True), offset


def test_links_and_byte_counts_parse_and_refuse_by_name() -> None:
    assert Link.parse("latency=2e-5, bandwidth=1e10,compute=1e13") == Link(2e-5, 1e10, 1e13)
    for bad, text in (
        ("latency=1", "lacks bandwidth, compute"),
        ("latency=1,latency=2,bandwidth=1,compute=1", "each once"),
        ("latency=x,bandwidth=1,compute=1", "latency must be a number"),
        ("latency=0,bandwidth=1,compute=1", "Link.latency_s must be a finite number > 0"),
    ):
        with pytest.raises(ValueError, match=text):
            Link.parse(bad)
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512 MB") == 512 * 10**6
    assert parse_bytes(3e9) == 3_000_000_000
    assert parse_bytes("1.5kib") == 1536
    for bad in ("2 parsecs", "-1", "0", "inf", "GiB"):
        with pytest.raises(ValueError, match="memory_budget"):
            parse_bytes(bad)
    with pytest.raises(TypeError, match="memory_budget"):
        parse_bytes(True)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def test_options_accept_auto_and_refuse_a_budget_without_it() -> None:
    with pytest.raises(
        ValueError, match="memory_budget is the budget of grad_worker_fraction='auto'"
    ):
        kaisa.KFACPreconditioner(_model(), grad_worker_fraction=0.5, memory_budget="1GiB", lr=0.1)
    with pytest.raises(ValueError, match="memory_budget must be a number of bytes"):
        kaisa.KFACPreconditioner(
            _model(), grad_worker_fraction="auto", memory_budget="lots", lr=0.1
        )
    with pytest.raises(ValueError, match=r"got 'half' \(or 'auto'"):
        kaisa.KFACPreconditioner(_model(), grad_worker_fraction="half", lr=0.1)
    pre = kaisa.KFACPreconditioner(
        _model(), grad_worker_fraction="AUTO", memory_budget="1MiB", lr=0.1
    )
    assert pre.options.grad_worker_fraction == "auto"
    assert pre.options.memory_budget == 2**20
    assert pre.grad_worker_choice.auto and pre.grad_worker_choice.grad_workers == 1


def test_one_process_auto_holds_the_modelled_memory_and_refuses_a_small_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _model()
    with caplog.at_level(logging.INFO, logger="kaisa"):
        pre = kaisa.KFACPreconditioner(
            model,
            grad_worker_fraction="auto",
            curvature="exact",
            factor_update_steps=1,
            inv_update_steps=1,
            lr=0.1,
        )
    assert sum("grad_worker_fraction='auto': 1 of 1" in r.getMessage() for r in caplog.records) == 1
    model(torch.randn(16, 6)).pow(2).sum().backward()
    pre.step()
    usage = pre.memory_usage()
    cost = pre.grad_worker_choice.cost_of(1)
    assert cost is not None
    assert (usage["factors"], usage["second_order"]) == (cost.factor_bytes, cost.second_order_bytes)
    pre.remove_hooks()
    with pytest.raises(MemoryBudgetError, match=f"memory_budget >= {cost.memory_bytes}"):
        kaisa.KFACPreconditioner(
            _model(),
            grad_worker_fraction="auto",
            curvature="exact",
            memory_budget=cost.memory_bytes - 1,
            lr=0.1,
        )


def test_the_choice_goes_into_the_state_dict_and_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LINK_ENV, "latency=1e-5,bandwidth=1e9,compute=1e10")
    model = _model()
    pre = kaisa.KFACPreconditioner(
        model, grad_worker_fraction="auto", factor_update_steps=1, lr=0.1
    )
    model(torch.randn(16, 6)).pow(2).sum().backward()
    pre.step()
    state = pre.state_dict()
    saved = state["grad_worker_choice"]
    assert saved["grad_workers"] == 1 and saved["world_size"] == 1
    assert saved["link"] == Link(1e-5, 1e9, 1e10).rounded().to_dict()
    assert FractionChoice.from_state(saved, "x") == (1, 1)
    pre.remove_hooks()
    again = kaisa.KFACPreconditioner(
        model, grad_worker_fraction="auto", factor_update_steps=1, lr=0.1
    )
    again.load_state_dict(state)
    assert again.state_dict()["grad_worker_choice"] == saved
    # A malformed record is refused by name, and the preconditioner is unchanged.
    bad = dict(state, grad_worker_choice={**saved, "grad_workers": 0})
    with pytest.raises(ValueError, match=r"grad_worker_choice'.*grad_workers must be an integer"):
        again.load_state_dict(bad)
    assert again.state_dict()["grad_worker_choice"] == saved
    # A given fraction records no choice.
    again.remove_hooks()
    given = kaisa.KFACPreconditioner(model, grad_worker_fraction="comm-opt", lr=0.1)
    assert given.state_dict()["grad_worker_choice"] is None
    assert not math.isnan(given.grad_worker_choice.fraction)
