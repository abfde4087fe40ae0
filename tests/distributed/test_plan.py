"""The KAISA work plan (spec §5): placement, grid, greedy balance, argument checks."""

from __future__ import annotations

import math
import random

import pytest

from kaisa.distributed.layer_shapes import bert_large_shapes, resnet50_shapes
from kaisa.distributed.plan import (
    LayerShape,
    WorkPlan,
    make_plan,
    resolve_grad_workers,
)

CONFIGS = [
    (1, 1.0),
    (2, 0.5),
    (4, 0.0),
    (4, 0.5),
    (4, 1.0),
    (6, 1 / 3),
    (8, 0.25),
    (12, 0.5),
    (16, "hybrid-opt"),
    (64, "mem-opt"),
    (64, "comm-opt"),
]


def random_layers(rng: random.Random, count: int, max_side: int = 300) -> list[LayerShape]:
    return [
        LayerShape(f"l{i}", rng.randint(1, max_side), rng.randint(1, max_side))
        for i in range(count)
    ]


def reference_plan(
    layers: list[LayerShape], n: int, m: int, power: int, colocate: bool
) -> dict[str, tuple[int, int, int]]:
    """The greedy rule written out independently: name -> (column, a_rank, g_rank).

    Largest first (registration order among equals); each layer to the column
    with the smallest load (lowest index on ties); inside it, each factor to
    the member with the smallest load (lowest rank on ties), the larger factor
    first when the two may go to different ranks.
    """
    cols = n // m
    col_load = [0] * cols
    rank_load = [0] * n
    total = [layer.a_size**power + layer.g_size**power for layer in layers]
    order = sorted(range(len(layers)), key=lambda i: (-total[i], i))
    out = {}
    for i in order:
        layer = layers[i]
        best = 0
        for c in range(1, cols):
            if col_load[c] < col_load[best]:
                best = c
        col_load[best] += total[i]
        members = [best + row * cols for row in range(m)]

        def pick(members: list[int] = members) -> int:
            chosen = members[0]
            for r in members[1:]:
                if rank_load[r] < rank_load[chosen]:
                    chosen = r
            return chosen

        ca, cg = layer.a_size**power, layer.g_size**power
        if colocate:
            a = g = pick()
            rank_load[a] += ca + cg
        elif ca >= cg:
            a = pick()
            rank_load[a] += ca
            g = pick()
            rank_load[g] += cg
        else:
            g = pick()
            rank_load[g] += cg
            a = pick()
            rank_load[a] += ca
        out[layer.name] = (best, a, g)
    return out


# --- structure ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "fraction"), CONFIGS)
@pytest.mark.parametrize("colocate", [True, False])
def test_every_layer_placed_exactly_once_inside_its_column(
    n: int, fraction: float | str, colocate: bool
) -> None:
    layers = random_layers(random.Random(n), 23)
    plan = make_plan(layers, n, fraction, colocate_factors=colocate)
    assert [la.name for la in plan.layers] == [layer.name for layer in layers]
    for layer, la in zip(layers, plan.layers, strict=True):
        assert (la.a_size, la.g_size) == (layer.a_size, layer.g_size)
        assert 0 <= la.column < plan.num_columns
        assert la.grad_workers == plan.column_ranks(la.column)
        assert la.a_rank in la.grad_workers
        assert la.g_rank in la.grad_workers
        if colocate:
            assert la.a_rank == la.g_rank
        assert plan.layer(la.name) is la
        for r in range(n):
            assert plan.is_grad_worker(la.name, r) == (r in la.grad_workers)
            source = plan.gradient_source(la.name, r)
            assert source in la.grad_workers
            assert source in plan.row_ranks(plan.row_of(r))


@pytest.mark.parametrize(("n", "fraction"), CONFIGS)
def test_columns_and_rows_partition_the_ranks(n: int, fraction: float | str) -> None:
    plan = make_plan([LayerShape("x", 3, 2)], n, fraction)
    m, cols = plan.grad_workers, plan.num_columns
    assert m * cols == n
    columns = [plan.column_ranks(c) for c in range(cols)]
    rows = [plan.row_ranks(r) for r in range(m)]
    assert sorted(r for col in columns for r in col) == list(range(n))
    assert sorted(r for row in rows for r in row) == list(range(n))
    assert all(len(col) == m for col in columns)
    assert all(len(row) == cols for row in rows)
    for row in rows:
        for col in columns:
            assert len(set(row) & set(col)) == 1
    for r in range(n):
        # Spec §5: rank r sits at row r // (N/m), column r % (N/m).
        assert plan.row_of(r) == r // (n // m)
        assert plan.column_of(r) == r % (n // m)
        assert r in plan.column_ranks(plan.column_of(r))
        assert r in plan.row_ranks(plan.row_of(r))


def test_grid_for_eight_ranks_and_four_workers() -> None:
    plan = make_plan([LayerShape("x", 3, 2)], 8, 0.5)
    assert plan.grad_workers == 4 and plan.num_columns == 2
    assert [plan.column_ranks(c) for c in range(2)] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert [plan.row_ranks(r) for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]


@pytest.mark.parametrize(
    ("n", "m", "name"),
    [(1, 1, "comm-opt"), (8, 1, "mem-opt"), (8, 4, "hybrid-opt"), (8, 8, "comm-opt")],
)
def test_strategy_name(n: int, m: int, name: str) -> None:
    assert make_plan([LayerShape("x", 2, 2)], n, m / n).strategy_name == name


def test_plan_is_deterministic() -> None:
    layers = random_layers(random.Random(0), 40)
    assert make_plan(layers, 16, 0.25, colocate_factors=False) == make_plan(
        list(layers), 16, 0.25, colocate_factors=False
    )


def test_empty_model() -> None:
    plan = make_plan([], 4, 0.5)
    assert plan.layers == ()
    assert plan.imbalance() == 1.0


# --- greedy balance ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("strategy", ["compute", "memory"])
@pytest.mark.parametrize("colocate", [True, False])
def test_matches_independent_greedy(seed: int, strategy: str, colocate: bool) -> None:
    rng = random.Random(seed)
    n = rng.choice([1, 2, 4, 6, 8, 12, 16, 32])
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    m = rng.choice(divisors)
    layers = random_layers(rng, rng.randint(1, 60))
    # Equal costs exercise the tie-breaking too.
    layers += [LayerShape(f"dup{i}", 17, 9) for i in range(rng.randint(0, 5))]
    plan = make_plan(layers, n, m / n, strategy, colocate)  # type: ignore[arg-type]
    expected = reference_plan(layers, n, m, 3 if strategy == "compute" else 2, colocate)
    assert {la.name: (la.column, la.a_rank, la.g_rank) for la in plan.layers} == expected


@pytest.mark.parametrize(("n", "m"), [(4, 1), (8, 2), (8, 8), (12, 3), (16, 4)])
@pytest.mark.parametrize("count", [1, 7, 16, 33])
def test_equal_layers_spread_evenly(n: int, m: int, count: int) -> None:
    layers = [LayerShape(f"l{i}", 64, 32) for i in range(count)]
    plan = make_plan(layers, n, m / n)
    per_column = [sum(la.column == c for la in plan.layers) for c in range(plan.num_columns)]
    assert max(per_column) - min(per_column) <= 1
    one = 64.0**3 + 32.0**3
    load = plan.decomposition_cost()
    for c in range(plan.num_columns):
        members = [load[r] for r in plan.column_ranks(c)]
        assert max(members) - min(members) <= one
    assert max(load) - min(load) <= one


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("colocate", [True, False])
def test_greedy_bound(seed: int, colocate: bool) -> None:
    """Largest-first list scheduling: no load exceeds the mean plus the largest item."""
    rng = random.Random(100 + seed)
    n = rng.choice([2, 4, 8, 16])
    m = rng.choice([d for d in range(1, n + 1) if n % d == 0])
    layers = random_layers(rng, rng.randint(5, 80))
    plan = make_plan(layers, n, m / n, colocate_factors=colocate)
    items = [float(la.a_size) ** 3 + float(la.g_size) ** 3 for la in plan.layers]
    col_load = [0.0] * plan.num_columns
    for la, cost in zip(plan.layers, items, strict=True):
        col_load[la.column] += cost
    assert max(col_load) <= sum(items) / plan.num_columns + max(items) + 1e-6
    rank_load = plan.decomposition_cost()
    factor_items = [float(s) ** 3 for la in plan.layers for s in (la.a_size, la.g_size)]
    largest = max(items) if colocate else max(factor_items)
    for c in range(plan.num_columns):
        members = [rank_load[r] for r in plan.column_ranks(c)]
        assert sum(members) == pytest.approx(col_load[c])
        assert max(members) <= col_load[c] / m + largest + 1e-6


def test_assignment_strategy_changes_the_cost() -> None:
    layers = [LayerShape("p", 20, 1), LayerShape("q", 15, 15), LayerShape("r", 14, 14)]
    # n³: p 8001 > q 6750 > r 5488, so p sits alone; n²: q 450 > p 401 > r 392, so q does.
    compute = make_plan(layers, 2, "mem-opt", "compute")
    assert compute.layer("q").column == compute.layer("r").column != compute.layer("p").column
    memory = make_plan(layers, 2, "mem-opt", "memory")
    assert memory.layer("p").column == memory.layer("r").column != memory.layer("q").column


# --- colocate_factors --------------------------------------------------------------------------


def test_colocate_off_splits_a_layer_over_two_ranks() -> None:
    plan = make_plan([LayerShape("x", 10, 20)], 4, 1.0, colocate_factors=False)
    la = plan.layer("x")
    # G is bigger, so it goes first to the least-loaded (lowest) rank, A to the next.
    assert (la.g_rank, la.a_rank) == (0, 1)
    on = make_plan([LayerShape("x", 10, 20)], 4, 1.0, colocate_factors=True).layer("x")
    assert on.a_rank == on.g_rank == 0


def test_colocate_off_uses_more_ranks() -> None:
    layers = [LayerShape(f"l{i}", 200, 150) for i in range(4)]
    on = make_plan(layers, 8, 1.0, colocate_factors=True)
    off = make_plan(layers, 8, 1.0, colocate_factors=False)
    busy_on = {r for la in on.layers for r in (la.a_rank, la.g_rank)}
    busy_off = {r for la in off.layers for r in (la.a_rank, la.g_rank)}
    assert len(busy_on) == 4 and len(busy_off) == 8
    assert off.imbalance() < on.imbalance()


def test_colocate_off_with_one_worker_keeps_both_on_it() -> None:
    plan = make_plan([LayerShape("x", 10, 20)], 4, "mem-opt", colocate_factors=False)
    la = plan.layer("x")
    assert la.a_rank == la.g_rank == la.column


# --- fractions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fraction", "n", "m"),
    [
        ("mem-opt", 8, 1),
        ("hybrid-opt", 8, 4),
        ("comm-opt", 8, 8),
        ("COMM-OPT", 8, 8),
        ("Mem-Opt", 1, 1),
        ("hybrid-opt", 1, 1),
        (0, 8, 1),
        (0.0, 1024, 1),
        (1, 8, 8),
        (0.5, 2, 1),
        (0.25, 16, 4),
        (1 / 3, 6, 2),
        (1 / 1024, 1024, 1),
        (1e-9, 16, 1),
    ],
)
def test_resolve_grad_workers(fraction: float | str, n: int, m: int) -> None:
    assert resolve_grad_workers(fraction, n) == m
    assert make_plan([LayerShape("x", 2, 2)], n, fraction).grad_workers == m


def test_fraction_zero_means_one_over_n() -> None:
    for n in (1, 3, 8, 1024):
        assert make_plan([LayerShape("x", 2, 2)], n, 0) == make_plan(
            [LayerShape("x", 2, 2)], n, 1 / n
        )


@pytest.mark.parametrize(
    ("fraction", "n"), [(0.8, 6), ("hybrid-opt", 3), (0.3, 1024), (0.75, 4), (2 / 3, 9)]
)
def test_impossible_fraction_refused(fraction: float | str, n: int) -> None:
    with pytest.raises(ValueError, match="grad_worker_fraction") as info:
        make_plan([LayerShape("x", 2, 2)], n, fraction)
    assert "divide" in str(info.value)
    assert "\n" not in str(info.value)


BAD_ARGUMENTS = [
    # (kwargs for make_plan, exception, message fragment)
    ({"world_size": 0}, ValueError, "world_size"),
    ({"world_size": -4}, ValueError, "world_size"),
    ({"world_size": 2.0}, ValueError, "world_size"),
    ({"world_size": True}, ValueError, "world_size"),
    ({"grad_worker_fraction": -0.1}, ValueError, "grad_worker_fraction"),
    ({"grad_worker_fraction": 1.5}, ValueError, "grad_worker_fraction"),
    ({"grad_worker_fraction": math.nan}, ValueError, "grad_worker_fraction"),
    ({"grad_worker_fraction": math.inf}, ValueError, "grad_worker_fraction"),
    ({"grad_worker_fraction": "half"}, ValueError, "grad_worker_fraction"),
    ({"grad_worker_fraction": None}, TypeError, "grad_worker_fraction"),
    ({"grad_worker_fraction": True}, TypeError, "grad_worker_fraction"),
    ({"assignment_strategy": "time"}, ValueError, "assignment_strategy"),
    ({"layers": [LayerShape("x", 2, 2), LayerShape("x", 3, 3)]}, ValueError, "unique"),
]


@pytest.mark.parametrize(("kwargs", "exc", "fragment"), BAD_ARGUMENTS)
def test_bad_arguments(kwargs: dict[str, object], exc: type[Exception], fragment: str) -> None:
    call: dict[str, object] = {"layers": [LayerShape("x", 2, 2)], "world_size": 4}
    call.update(kwargs)
    with pytest.raises(exc, match=fragment):
        make_plan(**call)  # type: ignore[arg-type]


@pytest.mark.parametrize(("a", "g"), [(0, 1), (1, 0), (-3, 4)])
def test_layer_shape_rejects_non_positive_sides(a: int, g: int) -> None:
    with pytest.raises(ValueError, match="factor sides must be positive"):
        LayerShape("x", a, g)


# --- load and imbalance ------------------------------------------------------------------------


def test_decomposition_cost_and_imbalance() -> None:
    layers = [LayerShape("a", 4, 2), LayerShape("b", 3, 1), LayerShape("c", 2, 2)]
    plan = make_plan(layers, 2, 1.0)
    # compute costs 72, 28, 16: 'a' on rank 0, then 'b' and 'c' on rank 1.
    assert plan.decomposition_cost() == [72.0, 44.0]
    assert plan.decomposition_cost("memory") == [20.0, 18.0]
    assert plan.imbalance() == pytest.approx(72 / 58)


@pytest.mark.parametrize("shapes", [resnet50_shapes, bert_large_shapes])
def test_real_models_at_1024_ranks(shapes: object) -> None:
    layers = shapes()  # type: ignore[operator]
    for fraction in ("mem-opt", 1 / 32, "hybrid-opt", "comm-opt"):
        plan = make_plan(layers, 1024, fraction, colocate_factors=False)
        assert isinstance(plan, WorkPlan)
        assert len(plan.layers) == len(layers)
        # Only as many ranks can be busy as there are factors.
        busy = {r for la in plan.layers for r in (la.a_rank, la.g_rank)}
        assert len(busy) <= 2 * len(layers)
        assert plan.imbalance() >= 1.0
