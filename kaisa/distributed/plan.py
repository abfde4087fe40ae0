"""The KAISA work plan: who does what, as a pure function of shapes and sizes.

Given the sides of every registered layer's Kronecker factors, the world size
``N`` and the gradient-worker fraction ``f``, the plan fixes (spec §5):

* ``m = max(1, round(f·N))`` gradient workers per layer (``N % m == 0``);
* a grid of ``m`` rows and ``N/m`` columns, rank ``r`` at row ``r // (N/m)``
  and column ``r % (N/m)``; a column is a *gradient-worker group*, a row a
  *receiver group*;
* for each layer, the column that owns it and, inside it, the rank that
  decomposes ``A`` and the rank that decomposes ``G``.

Placement is greedy, largest layer first, onto the least-loaded column and then
the least-loaded rank(s) of that column, with cost ``n³`` ('compute') or ``n²``
('memory') for a factor of side ``n``. Ties go to the lowest index, so every
rank computes the same plan without talking to the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kaisa.choices import ASSIGNMENT_STRATEGIES, NAMED_FRACTIONS, AssignmentStrategy
from kaisa.curvature.costs import DEFAULT_COST_MODEL, SideSpec, side_cost
from kaisa.validation import check_count, one_of

FractionSpec = float | str


@dataclass(frozen=True)
class LayerShape:
    """A registered layer as the plan sees it: a name, its factor sides and their
    representations (spec §8: ``'exact'``, ``'lowrank:K'``, ``'kvec'``, ``'diagonal'``)."""

    name: str
    a_size: int
    g_size: int
    a_spec: str = "exact"
    g_spec: str = "exact"

    def __post_init__(self) -> None:
        if self.a_size < 1 or self.g_size < 1:
            raise ValueError(
                f"layer {self.name!r}: factor sides must be positive, got "
                f"a_size={self.a_size}, g_size={self.g_size}"
            )
        for which, text, size in (("A", self.a_spec, self.a_size), ("G", self.g_spec, self.g_size)):
            spec = SideSpec.parse(text)
            spec.check_size(size, f"layer {self.name!r}, factor {which}")
            object.__setattr__(self, f"{which.lower()}_spec", str(spec))


@dataclass(frozen=True)
class LayerAssignment:
    """Where one layer's work happens.

    ``column`` indexes the gradient-worker group; ``grad_workers`` are its
    ranks (the ranks that hold the layer's second-order state and compute its
    preconditioned gradient); ``a_rank`` / ``g_rank`` decompose the factors;
    ``a_spec`` / ``g_spec`` are the factors' representations.
    """

    name: str
    a_size: int
    g_size: int
    column: int
    a_rank: int
    g_rank: int
    grad_workers: tuple[int, ...]
    a_spec: str = "exact"
    g_spec: str = "exact"


@dataclass(frozen=True)
class WorkPlan:
    """The complete placement for one world size and fraction."""

    world_size: int
    grad_workers: int
    assignment_strategy: AssignmentStrategy
    colocate_factors: bool
    layers: tuple[LayerAssignment, ...]
    _by_name: dict[str, LayerAssignment] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {la.name: la for la in self.layers})

    @property
    def num_columns(self) -> int:
        """Number of gradient-worker groups, ``N / m``."""
        return self.world_size // self.grad_workers

    @property
    def strategy_name(self) -> str:
        """'mem-opt', 'comm-opt' or 'hybrid-opt' (one rank is both ends)."""
        if self.grad_workers == self.world_size:
            return "comm-opt"
        if self.grad_workers == 1:
            return "mem-opt"
        return "hybrid-opt"

    def column_ranks(self, column: int) -> tuple[int, ...]:
        """Ranks of gradient-worker group ``column`` (top to bottom)."""
        cols = self.num_columns
        return tuple(column + row * cols for row in range(self.grad_workers))

    def row_ranks(self, row: int) -> tuple[int, ...]:
        """Ranks of receiver group ``row`` (left to right)."""
        cols = self.num_columns
        return tuple(row * cols + c for c in range(cols))

    def row_of(self, rank: int) -> int:
        return rank // self.num_columns

    def column_of(self, rank: int) -> int:
        return rank % self.num_columns

    def layer(self, name: str) -> LayerAssignment:
        return self._by_name[name]

    def is_grad_worker(self, name: str, rank: int) -> bool:
        """Whether ``rank`` holds second-order state for layer ``name``."""
        return self.column_of(rank) == self._by_name[name].column

    def gradient_source(self, name: str, rank: int) -> int:
        """The rank of ``rank``'s row that computes layer ``name``'s gradient."""
        return self.row_of(rank) * self.num_columns + self._by_name[name].column

    def decomposition_cost(self, strategy: AssignmentStrategy | None = None) -> list[float]:
        """Per-rank decomposition cost under ``strategy`` (default: the plan's)."""
        cost = _cost_fn(strategy or self.assignment_strategy)
        load = [0.0] * self.world_size
        for la in self.layers:
            load[la.a_rank] += cost(la.a_size, la.a_spec)
            load[la.g_rank] += cost(la.g_size, la.g_spec)
        return load

    def imbalance(self) -> float:
        """Largest rank's decomposition cost over the mean ('compute' cost)."""
        load = self.decomposition_cost("compute")
        mean = sum(load) / len(load)
        return max(load) / mean if mean > 0 else 1.0

    def describe(self) -> str:
        """A human-readable table of the plan."""
        lines = [
            f"world size {self.world_size}, {self.grad_workers} gradient worker(s) per layer "
            f"({self.strategy_name}), {self.num_columns} column(s), "
            f"strategy {self.assignment_strategy!r}, colocate_factors={self.colocate_factors}",
            f"{'layer':<40} {'A':>6} {'G':>6} {'A held as':>12} {'G held as':>12} "
            f"{'column':>6} {'A rank':>6} {'G rank':>6}",
        ]
        for la in self.layers:
            lines.append(
                f"{la.name:<40} {la.a_size:>6} {la.g_size:>6} {la.a_spec:>12} {la.g_spec:>12} "
                f"{la.column:>6} {la.a_rank:>6} {la.g_rank:>6}"
            )
        return "\n".join(lines)


def _cost_fn(strategy: AssignmentStrategy) -> Callable[[int, str], float]:
    """Cost of refreshing a factor of side ``n`` held as ``spec``.

    'compute': ``n³`` for an exact factor, a low-rank or vector side's refresh
    work in the same units; 'memory': the numbers of second-order state
    (``n²`` for an exact factor).
    """

    def cost(n: int, spec: str) -> float:
        parsed = SideSpec.parse(spec)
        if parsed.kind == "exact":
            return float(n) ** (3 if strategy == "compute" else 2)
        side = side_cost(parsed, n)
        return (
            side.refresh / DEFAULT_COST_MODEL.eigh if strategy == "compute" else float(side.state)
        )

    return cost


def resolve_grad_workers(grad_worker_fraction: FractionSpec, world_size: int) -> int:
    """Number of gradient workers per layer, ``m``, for a fraction and world size.

    ``grad_worker_fraction`` is a float in ``[0, 1]`` (``0`` means ``1/N``) or
    one of 'comm-opt' (1), 'hybrid-opt' (1/2) and 'mem-opt' (1/N).
    """
    check_count(world_size, "world_size", 1, type_error=ValueError)
    if isinstance(grad_worker_fraction, str):
        key = grad_worker_fraction.lower()
        if key == "auto":
            raise ValueError(
                "grad_worker_fraction='auto' is chosen by the preconditioner at construction "
                "(kaisa.distributed.fraction); a plan needs the number of gradient workers"
            )
        if key not in NAMED_FRACTIONS:
            raise ValueError(
                f"grad_worker_fraction must be a float in [0, 1] or one of "
                f"{', '.join(map(repr, NAMED_FRACTIONS))}; got {grad_worker_fraction!r} "
                "(or 'auto': chosen for memory_budget)"
            )
        fraction = {"comm-opt": 1.0, "hybrid-opt": 0.5, "mem-opt": 0.0}[key]
    elif isinstance(grad_worker_fraction, (int, float)) and not isinstance(
        grad_worker_fraction, bool
    ):
        fraction = float(grad_worker_fraction)
        if not (0.0 <= fraction <= 1.0) or math.isnan(fraction):
            raise ValueError(
                f"grad_worker_fraction must be in [0, 1] (0 means 1/world_size); "
                f"got {grad_worker_fraction!r}"
            )
    else:
        raise TypeError(
            f"grad_worker_fraction must be a float or one of "
            f"{', '.join(map(repr, NAMED_FRACTIONS))}; got {type(grad_worker_fraction).__name__}"
        )
    if fraction == 0.0:
        fraction = 1.0 / world_size
    m = max(1, round(fraction * world_size))
    if world_size % m != 0:
        allowed = [d / world_size for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"grad_worker_fraction={grad_worker_fraction!r} gives {m} gradient workers per "
            f"layer, which does not divide world size {world_size}; allowed fractions are "
            + ", ".join(f"{a:g}" for a in allowed)
        )
    return m


def make_plan(
    layers: Sequence[LayerShape],
    world_size: int,
    grad_worker_fraction: FractionSpec = "comm-opt",
    assignment_strategy: AssignmentStrategy = "compute",
    colocate_factors: bool = True,
) -> WorkPlan:
    """Compute the work plan (pure: the same inputs give the same plan on every rank)."""
    assignment_strategy = one_of("assignment_strategy", assignment_strategy, ASSIGNMENT_STRATEGIES)
    names = [layer.name for layer in layers]
    if len(set(names)) != len(names):
        raise ValueError("layer names in a work plan must be unique")
    m = resolve_grad_workers(grad_worker_fraction, world_size)
    columns = world_size // m
    cost = _cost_fn(assignment_strategy)

    column_load = [0.0] * columns
    rank_load = [0.0] * world_size
    placed: dict[str, LayerAssignment] = {}
    # Largest first; the stable sort keeps registration order among equals.
    order = sorted(
        range(len(layers)),
        key=lambda i: (
            -(cost(layers[i].a_size, layers[i].a_spec) + cost(layers[i].g_size, layers[i].g_spec))
        ),
    )
    for i in order:
        layer = layers[i]
        ca, cg = cost(layer.a_size, layer.a_spec), cost(layer.g_size, layer.g_spec)
        column = min(range(columns), key=lambda c: (column_load[c], c))
        column_load[column] += ca + cg
        ranks = tuple(column + row * columns for row in range(m))

        def least_loaded(ranks: tuple[int, ...] = ranks) -> int:
            return min(ranks, key=lambda r: (rank_load[r], r))

        if colocate_factors:
            a_rank = g_rank = least_loaded()
            rank_load[a_rank] += ca + cg
        else:
            # Bigger factor first so the two halves land on different ranks.
            first_is_a = ca >= cg
            r1 = least_loaded()
            rank_load[r1] += ca if first_is_a else cg
            r2 = least_loaded()
            rank_load[r2] += cg if first_is_a else ca
            a_rank, g_rank = (r1, r2) if first_is_a else (r2, r1)
        placed[layer.name] = LayerAssignment(
            name=layer.name,
            a_size=layer.a_size,
            g_size=layer.g_size,
            column=column,
            a_rank=a_rank,
            g_rank=g_rank,
            grad_workers=ranks,
            a_spec=layer.a_spec,
            g_spec=layer.g_spec,
        )
    return WorkPlan(
        world_size=world_size,
        grad_workers=m,
        assignment_strategy=assignment_strategy,
        colocate_factors=colocate_factors,
        layers=tuple(placed[name] for name in names),
    )
