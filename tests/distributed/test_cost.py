"""The cost model of spec §5: memory per rank and elements passed to collectives."""

from __future__ import annotations

import random

import pytest

from kaisa.distributed.cost import (
    MaxMean,
    RankMemory,
    RankTraffic,
    rank_memory,
    rank_traffic,
    summarize,
)
from kaisa.distributed.plan import LayerShape, WorkPlan, make_plan

# A tiny model, costs worked out by hand.
#   layer  a  g   a²+g²  ag  a(a+1)/2+g(g+1)/2  a²+g²+a+g  (+ag)  n³ cost
#   L0     3  2    13     6         9              18       24     35
#   L1     2  4    20     8        13              26       34     72
#   L2     5  1    26     5        16              32       37    126
# With N = 4 and f = 1/2 (m = 2, columns {0, 2} and {1, 3}), largest first:
# L2 -> column 0 (rank 0), L1 -> column 1 (rank 1), L0 -> column 1 (rank 3).
TINY = [LayerShape("L0", 3, 2), LayerShape("L1", 2, 4), LayerShape("L2", 5, 1)]


@pytest.fixture
def tiny() -> WorkPlan:
    plan = make_plan(TINY, 4, 0.5)
    assert [(la.column, la.a_rank) for la in plan.layers] == [(1, 3), (1, 1), (0, 0)]
    return plan


def test_tiny_memory(tiny: WorkPlan) -> None:
    # Column 0 owns L2; column 1 owns L0 and L1.
    for rank, eigen_outer, eigen, inverse in [(0, 37, 32, 26), (1, 58, 44, 33)]:
        for r in (rank, rank + 2):
            assert rank_memory(tiny, r) == RankMemory(factors=59, second_order=eigen_outer)
            assert rank_memory(tiny, r, "eigen", eigen_outer_product=False) == RankMemory(59, eigen)
            assert rank_memory(tiny, r, "inverse") == RankMemory(59, inverse)
            assert (
                rank_memory(tiny, r, "inverse", eigen_outer_product=False).second_order == inverse
            )
    assert rank_memory(tiny, 1).total == 59 + 58


def test_tiny_traffic(tiny: WorkPlan) -> None:
    for rank, eigen, inverse in [(0, 32, 26), (2, 32, 26), (1, 44, 33), (3, 44, 33)]:
        assert rank_traffic(tiny, rank) == RankTraffic(59, eigen, 19)
        assert rank_traffic(tiny, rank, "inverse") == RankTraffic(59, inverse, 19)
        assert rank_traffic(tiny, rank, symmetry_aware=True) == RankTraffic(38, eigen, 19)
    assert rank_traffic(tiny, 0).per_step(10, 100) == pytest.approx(5.9 + 0.32 + 19)
    assert rank_traffic(tiny, 1).per_step(10, 100) == pytest.approx(5.9 + 0.44 + 19)
    assert rank_traffic(tiny, 1).per_step() == 59 + 44 + 19


def test_tiny_summary(tiny: WorkPlan) -> None:
    s = summarize(tiny, factor_update_steps=10, inv_update_steps=100)
    assert s.factors == MaxMean(59, 59)
    assert s.second_order == MaxMean(58, 47.5)
    assert s.memory_total == MaxMean(117, 106.5)
    assert s.factor_allreduce == MaxMean(59, 59)
    assert s.inverse_broadcast == MaxMean(44, 38)
    assert s.grad_broadcast == MaxMean(19, 19)
    assert s.per_step.max == pytest.approx(25.34)
    assert s.per_step.mean == pytest.approx(25.28)
    # Rank loads 126, 72, 0, 35.
    assert s.imbalance == pytest.approx(126 / (233 / 4))
    assert (s.grad_workers, s.fraction, s.strategy_name) == (2, 0.5, "hybrid-opt")


def test_tiny_mem_opt_and_comm_opt() -> None:
    mem = make_plan(TINY, 4, "mem-opt")
    for r in range(4):
        t = rank_traffic(mem, r)
        assert (t.factor_allreduce, t.inverse_broadcast, t.grad_broadcast) == (59, 0, 19)
    # Each rank keeps second-order state for its own layers only: L2, L1, L0, nothing.
    assert sorted(rank_memory(mem, r).second_order for r in range(4)) == [0, 24, 34, 37]
    comm = make_plan(TINY, 4, "comm-opt")
    for r in range(4):
        assert rank_traffic(comm, r) == RankTraffic(59, 76, 0)
        assert rank_memory(comm, r) == RankMemory(59, 24 + 34 + 37)


def test_single_process_sends_nothing() -> None:
    plan = make_plan(TINY, 1, 1.0)
    assert rank_traffic(plan, 0) == RankTraffic(0, 0, 0)
    assert rank_memory(plan, 0) == RankMemory(59, 24 + 34 + 37)
    s = summarize(plan)
    assert s.per_step == MaxMean(0, 0)
    assert s.imbalance == 1.0


def simulated_traffic(
    plan: WorkPlan, compute_method: str, symmetry_aware: bool
) -> list[tuple[int, int, int]]:
    """Walk through every collective call of spec §5 and charge its participants.

    Each call is (kind, participating ranks, elements of the tensor); a rank is
    charged the whole tensor for every call it takes part in.
    """
    n, m = plan.world_size, plan.grad_workers
    calls: list[tuple[int, tuple[int, ...], int]] = []
    everyone = tuple(range(n))
    for la in plan.layers:
        a, g = la.a_size, la.g_size
        if n > 1:
            for side in (a, g):
                size = side * (side + 1) // 2 if symmetry_aware else side * side
                calls.append((0, everyone, size))
        if m > 1:
            for side in (a, g):
                # Eigenvectors and eigenvalues, or the inverse.
                tensors = [side * side, side] if compute_method == "eigen" else [side * side]
                for size in tensors:
                    calls.append((1, la.grad_workers, size))
        if m < n:
            for row in range(m):
                calls.append((2, plan.row_ranks(row), a * g))
    totals = [[0, 0, 0] for _ in range(n)]
    for kind, ranks, size in calls:
        for r in ranks:
            totals[r][kind] += size
    return [(t[0], t[1], t[2]) for t in totals]


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
@pytest.mark.parametrize("symmetry_aware", [False, True])
def test_traffic_matches_simulated_collectives(
    seed: int, compute_method: str, symmetry_aware: bool
) -> None:
    rng = random.Random(seed)
    n = rng.choice([1, 2, 4, 6, 8, 12])
    m = rng.choice([d for d in range(1, n + 1) if n % d == 0])
    layers = [
        LayerShape(f"l{i}", rng.randint(1, 50), rng.randint(1, 50))
        for i in range(rng.randint(1, 20))
    ]
    plan = make_plan(layers, n, m / n, colocate_factors=bool(seed % 2))
    expected = simulated_traffic(plan, compute_method, symmetry_aware)
    for r in range(n):
        t = rank_traffic(plan, r, compute_method, symmetry_aware)  # type: ignore[arg-type]
        assert (t.factor_allreduce, t.inverse_broadcast, t.grad_broadcast) == expected[r]


@pytest.mark.parametrize("seed", range(6))
def test_summary_equals_brute_force_over_ranks(seed: int) -> None:
    rng = random.Random(50 + seed)
    n = rng.choice([2, 4, 8, 16, 24])
    m = rng.choice([d for d in range(1, n + 1) if n % d == 0])
    layers = [
        LayerShape(f"l{i}", rng.randint(1, 80), rng.randint(1, 80))
        for i in range(rng.randint(1, 30))
    ]
    plan = make_plan(layers, n, m / n)
    for method, outer, sym in [
        ("eigen", True, False),
        ("eigen", False, True),
        ("inverse", True, True),
    ]:
        s = summarize(plan, method, outer, sym, factor_update_steps=3, inv_update_steps=7)  # type: ignore[arg-type]
        mem = [rank_memory(plan, r, method, outer) for r in range(n)]  # type: ignore[arg-type]
        traffic = [rank_traffic(plan, r, method, sym) for r in range(n)]  # type: ignore[arg-type]

        def check(stat: MaxMean, values: list[float]) -> None:
            assert stat.max == max(values)
            assert stat.mean == pytest.approx(sum(values) / len(values))

        check(s.factors, [x.factors for x in mem])
        check(s.second_order, [x.second_order for x in mem])
        check(s.memory_total, [x.total for x in mem])
        check(s.factor_allreduce, [t.factor_allreduce for t in traffic])
        check(s.inverse_broadcast, [t.inverse_broadcast for t in traffic])
        check(s.grad_broadcast, [t.grad_broadcast for t in traffic])
        check(s.per_step, [t.per_step(3, 7) for t in traffic])
        assert s.imbalance == plan.imbalance()


def test_fraction_trades_memory_for_communication() -> None:
    layers = [LayerShape(f"l{i}", 100 + 10 * i, 50 + 7 * i) for i in range(16)]
    summaries = [summarize(make_plan(layers, 16, m / 16)) for m in (1, 2, 4, 8, 16)]
    second = [s.second_order.mean for s in summaries]
    grad = [s.grad_broadcast.max for s in summaries]
    assert second == sorted(second) and second[0] < second[-1]
    assert grad[:-1] == [grad[0]] * 4 and grad[-1] == 0


def test_to_dict() -> None:
    d = summarize(make_plan(TINY, 4, 0.5), factor_update_steps=10).to_dict(bytes_per_element=4)
    assert d["grad_workers"] == 2 and d["strategy"] == "hybrid-opt"
    assert d["memory_elements"] == {
        "factors": {"max": 59, "mean": 59},
        "second_order": {"max": 58, "mean": 47.5},
        "total": {"max": 117, "mean": 106.5},
    }
    mb = d["memory_mb"]
    assert isinstance(mb, dict)
    assert mb["factors"] == {"max": pytest.approx(59 * 4e-6), "mean": pytest.approx(59 * 4e-6)}
    sent = d["elements_sent"]
    assert isinstance(sent, dict)
    assert sent["grad_broadcast_per_step"] == {"max": 19, "mean": 19}


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda p: rank_memory(p, 0, "svd"), "compute_method"),
        (lambda p: rank_traffic(p, 0, "cholesky"), "compute_method"),
        (lambda p: summarize(p, "svd"), "compute_method"),
        (lambda p: rank_memory(p, 4), "rank"),
        (lambda p: rank_traffic(p, -1), "rank"),
        (lambda p: summarize(p, factor_update_steps=0), "factor_update_steps"),
        (lambda p: summarize(p, inv_update_steps=-2), "inv_update_steps"),
        (lambda p: rank_traffic(p, 0).per_step(1, 0), "inv_update_steps"),
    ],
)
def test_bad_arguments(call: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        call(make_plan(TINY, 4, 0.5))  # type: ignore[operator]
