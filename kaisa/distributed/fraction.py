"""``grad_worker_fraction='auto'``: the fraction that fits a memory budget and is fastest.

A pure function of the layer shapes, the world size, a per-rank memory budget
and three speeds (a :class:`Link`): the latency and bandwidth of one message
between two ranks and the multiply-add rate of one rank.
Nothing here imports torch, so ``kaisa plan --memory-budget`` answers for
any world size; :mod:`kaisa.distributed.probe` measures the speeds on a
process group and settles the choice at construction.

The model (per rank, averaged per step, every phase paced by its slowest
rank, since each ends in a collective that waits for every member):

* memory: the Kronecker factors (every rank, ``factor_bytes`` per element)
  plus the largest column's second-order state (``state_bytes`` per
  element), as :mod:`kaisa.distributed.cost` counts them;
* the factor all-reduce over the ``N`` ranks, per factor update, as a ring:
  ``2(N−1)·buckets·latency + 2(N−1)/N·bytes/bandwidth``, the buckets as the
  communicator makes them (:func:`~kaisa.distributed.cost.bucket_layers`);
  the same for every fraction;
* decompositions, per inverse update: the busiest rank's refresh work
  (:func:`~kaisa.curvature.costs.side_cost`, weighed by the
  :class:`~kaisa.curvature.costs.CostModel`) over the multiply-add rate;
* the inverse broadcast, per inverse update, inside a column of ``m`` ranks:
  two broadcasts per side of each of the busiest column's layers
  (eigenvectors and eigenvalues), as a binomial tree:
  ``⌈log₂ m⌉·(calls·latency + bytes/bandwidth)``;
* preconditioning, per step: the busiest column's solve work over the rate
  (each rank solves only its column's layers);
* the gradient broadcast, per step, inside a row of ``N/m`` ranks: one
  broadcast per layer, ``⌈log₂(N/m)⌉·(layers·latency + bytes/bandwidth)``.

The probe times all-reduces on the whole group and reads the per-message
latency and bandwidth off them through the ring's formula
(:mod:`kaisa.distributed.probe`). Real collectives differ (NCCL pipelines a
broadcast along a ring, gloo sends from the root to each peer in turn):
these are the model's assumptions, written down. The bucket size does not
change the choice in this model (the all-reduce costs every fraction alike,
and overlap with the backward pass is not modelled), so ``allreduce_bucket_cap_mb``
is kept as given.

The choice: the fraction with the least modelled time among those whose
memory fits the budget (ties: less memory, then fewer gradient workers); no
fraction fits: :class:`MemoryBudgetError` naming the smallest memory that
would do. Measured speeds are rounded to powers of two
(:meth:`Link.rounded`), so that the same machine gives the same choice run
after run; a measurement within an eighth of a power of two of a rounding
boundary is tried on both sides, and if the choice differs there the one
with less memory is taken (:func:`choose_stable`): a measurement that could
flip the choice from run to run does not decide it.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

from kaisa.choices import COMPUTE_METHODS, ComputeMethod
from kaisa.curvature.costs import DEFAULT_COST_MODEL, CostModel, SideSpec, side_cost
from kaisa.distributed.cost import (
    bucket_layers,
    factor_allreduce_elements,
    factor_elements,
    grad_broadcast_elements,
    inverse_broadcast_elements,
    second_order_elements,
)
from kaisa.distributed.plan import LayerShape, WorkPlan, make_plan
from kaisa.validation import one_of

__all__ = [
    "BOUNDARY_MARGIN",
    "DEFAULT_LINK",
    "LINK_ENV",
    "FractionChoice",
    "FractionCost",
    "FractionModel",
    "Link",
    "MemoryBudgetError",
    "choose",
    "choose_stable",
    "format_bytes",
    "parse_bytes",
]

#: The environment variable that gives the speeds instead of the probe:
#: ``latency=SECONDS,bandwidth=BYTES_PER_S,compute=MULTIPLY_ADDS_PER_S``.
LINK_ENV = "KAISA_LINK"
#: A measurement this close (in powers of two) to a rounding boundary is tried on both sides.
BOUNDARY_MARGIN = 0.125

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: object, name: str = "memory_budget") -> int:
    """A number of bytes from ``2GiB``, ``1.5e9``, ``512MB`` or a number (> 0).

    Units: B, kB/MB/GB/TB (powers of 10), KiB/MiB/GiB/TiB (powers of 2),
    any case. Raises ``TypeError``/``ValueError`` naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(
            f"{name} must be a number of bytes or a string such as '2GiB'; got {value!r}"
        )
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{name} must be a number of bytes with an optional unit (B, kB, MB, GB, TB, "
                f"KiB, MiB, GiB, TiB), such as '2GiB'; got {value!r}"
            )
        number = float(match.group(1)) * _UNITS[unit]
    else:
        number = float(value)
    if not math.isfinite(number) or number < 1:
        raise ValueError(f"{name} must be a finite number of bytes >= 1; got {value!r}")
    return int(number)


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it above 1 (``'1.50 GiB'``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


class MemoryBudgetError(ValueError):
    """No gradient-worker fraction fits the memory budget (names the smallest that would do)."""


@dataclass(frozen=True)
class Link:
    """The speeds of the model: one collective's latency, the bandwidth, the compute rate.

    ``latency_s``: seconds one message between two ranks costs whatever its
    size; ``bandwidth``: bytes per second of one such message;
    ``compute_rate``: multiply-adds per second of one rank's matrix
    products (the unit of :class:`~kaisa.curvature.costs.CostModel`'s
    weights). Each must be a finite number > 0.
    """

    latency_s: float
    bandwidth: float
    compute_rate: float

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"Link.{f.name} must be a finite number > 0; got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"Link.{f.name} must be a finite number > 0; got {value!r}")
            object.__setattr__(self, f.name, float(value))

    @staticmethod
    def parse(text: str, where: str = LINK_ENV) -> Link:
        """``latency=2e-5,bandwidth=1e10,compute=1e13`` (every key once) as a :class:`Link`."""
        keys = {"latency": "latency_s", "bandwidth": "bandwidth", "compute": "compute_rate"}
        values: dict[str, float] = {}
        for part in text.split(","):
            key, _, number = part.partition("=")
            key = key.strip().lower()
            if key not in keys or keys[key] in values:
                raise ValueError(
                    f"{where} must be latency=SECONDS,bandwidth=BYTES_PER_S,"
                    f"compute=MULTIPLY_ADDS_PER_S (each once); got {text!r}"
                )
            try:
                values[keys[key]] = float(number)
            except ValueError:
                raise ValueError(
                    f"{where}: {key} must be a number; got {number.strip()!r}"
                ) from None
        if len(values) != 3:
            missing = sorted(k for k, f in keys.items() if f not in values)
            raise ValueError(f"{where} lacks {', '.join(missing)}; got {text!r}")
        try:
            return Link(**values)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None

    def rounded(self) -> Link:
        """Each speed rounded to the nearest power of two (in log scale)."""
        return Link(*(2.0 ** round(math.log2(getattr(self, f.name))) for f in fields(self)))

    def neighbours(self, margin: float = BOUNDARY_MARGIN) -> list[Link]:
        """The rounded links a measurement near a rounding boundary could give.

        One link when no speed lies within ``margin`` (in powers of two) of a
        boundary; otherwise both roundings of each such speed (at most 8).
        """
        options: list[tuple[float, ...]] = []
        for f in fields(self):
            exponent = math.log2(getattr(self, f.name))
            low = math.floor(exponent)
            if abs(exponent - low - 0.5) < margin:
                options.append((2.0**low, 2.0 ** (low + 1)))
            else:
                options.append((2.0 ** round(exponent),))
        return [Link(*values) for values in itertools.product(*options)]

    def describe(self) -> str:
        return (
            f"latency {self.latency_s * 1e6:.3g} us, bandwidth {self.bandwidth / 1e9:.3g} GB/s, "
            f"compute {self.compute_rate:.3g} multiply-adds/s"
        )

    def to_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: The speeds ``kaisa plan`` assumes unless ``--link`` gives others: a GPU
#: cluster's order of magnitude (20 us per message, 10 GB/s per link, 10¹³
#: multiply-adds per second), not a measurement.
DEFAULT_LINK = Link(latency_s=2e-5, bandwidth=1e10, compute_rate=1e13)

#: The parts of a fraction's modelled time, in order.
TIME_PARTS = (
    "factor_allreduce",
    "decomposition",
    "inverse_broadcast",
    "precondition",
    "grad_broadcast",
)


@dataclass(frozen=True)
class FractionCost:
    """One fraction under the model: memory per rank (bytes) and time per step (seconds).

    ``seconds`` holds each part of :data:`TIME_PARTS`, averaged per step.
    """

    world_size: int
    grad_workers: int
    factor_bytes: int
    second_order_bytes: int
    seconds: Mapping[str, float]

    @property
    def memory_bytes(self) -> int:
        return self.factor_bytes + self.second_order_bytes

    @property
    def time_s(self) -> float:
        return sum(self.seconds[part] for part in TIME_PARTS)

    @property
    def strategy_name(self) -> str:
        if self.grad_workers == self.world_size:
            return "comm-opt"
        return "mem-opt" if self.grad_workers == 1 else "hybrid-opt"

    @property
    def fraction(self) -> float:
        return self.grad_workers / self.world_size

    def to_dict(self) -> dict[str, object]:
        return {
            "grad_workers": self.grad_workers,
            "fraction": self.fraction,
            "strategy": self.strategy_name,
            "memory_bytes": self.memory_bytes,
            "factor_bytes": self.factor_bytes,
            "second_order_bytes": self.second_order_bytes,
            "time_s": self.time_s,
            "seconds": dict(self.seconds),
        }


@dataclass(frozen=True)
class FractionModel:
    """The settings the model needs besides shapes, world size and speeds.

    Defaults are the preconditioner's (float32 factors and state, factors
    every 10 steps and second-order state every 100, the communicator's 25
    MiB buckets).
    """

    compute_method: ComputeMethod = "eigen"
    eigen_outer_product: bool = True
    symmetry_aware: bool = False
    assignment_strategy: str = "compute"
    colocate_factors: bool = True
    factor_update_steps: int = 10
    inv_update_steps: int = 100
    bucket_cap_mb: float = 25.0
    factor_bytes: int = 4
    state_bytes: int = 4
    grad_bytes: int = 4
    cost_model: CostModel = DEFAULT_COST_MODEL

    def __post_init__(self) -> None:
        one_of("compute_method", self.compute_method, COMPUTE_METHODS)

    def plan(self, shapes: Sequence[LayerShape], world_size: int, grad_workers: int) -> WorkPlan:
        return make_plan(
            shapes,
            world_size,
            grad_workers / world_size,
            self.assignment_strategy,  # type: ignore[arg-type]
            self.colocate_factors,
        )

    def cost(self, plan: WorkPlan, link: Link) -> FractionCost:
        """The model of ``plan`` (see the module docstring)."""
        method, n, m = self.compute_method, plan.world_size, plan.grad_workers
        weights = self.cost_model
        refresh = [0.0] * n
        columns: dict[int, list[float]] = {}  # column -> [state elements, calls, solve work, bytes]
        for la in plan.layers:
            sa, sg = SideSpec.parse(la.a_spec), SideSpec.parse(la.g_spec)
            exact = sa.kind == "exact" and sg.kind == "exact"
            side_method = method if exact else "eigen"
            ca = side_cost(sa, la.a_size, side_method, cost_model=weights)
            cg = side_cost(sg, la.g_size, side_method, cost_model=weights)
            refresh[la.a_rank] += ca.refresh
            refresh[la.g_rank] += cg.refresh
            col = columns.setdefault(la.column, [0.0, 0.0, 0.0, 0.0])
            col[0] += second_order_elements(
                la.a_size, la.g_size, method, self.eigen_outer_product, la.a_spec, la.g_spec
            )
            col[1] += 4 if side_method == "eigen" else 2
            col[2] += (ca.apply_per_column * la.g_size + cg.apply_per_column * la.a_size) * (
                weights.apply
            )
            col[3] += (
                inverse_broadcast_elements(la.a_size, la.g_size, method, la.a_spec, la.g_spec)
                * self.state_bytes
            )
        alpha, beta, rate = link.latency_s, link.bandwidth, link.compute_rate
        sizes = [
            (
                la.name,
                factor_allreduce_elements(
                    la.a_size, la.g_size, self.symmetry_aware, la.a_spec, la.g_spec
                ),
            )
            for la in plan.layers
        ]
        allreduce = 0.0
        if n > 1:
            buckets = len(bucket_layers(sizes, self.bucket_cap_mb))
            payload = sum(s for _, s in sizes) * self.factor_bytes
            allreduce = 2 * (n - 1) * (buckets * alpha + payload / (n * beta))
        inverse_bc = 0.0
        if m > 1:
            rounds = math.ceil(math.log2(m))
            inverse_bc = rounds * max(c[1] * alpha + c[3] / beta for c in columns.values())
        grad_bc = 0.0
        if m < n:
            rounds = math.ceil(math.log2(n // m))
            elements = sum(grad_broadcast_elements(la.a_size, la.g_size) for la in plan.layers)
            grad_bc = rounds * (len(plan.layers) * alpha + elements * self.grad_bytes / beta)
        seconds = {
            "factor_allreduce": allreduce / self.factor_update_steps,
            "decomposition": max(refresh) / rate / self.inv_update_steps,
            "inverse_broadcast": inverse_bc / self.inv_update_steps,
            "precondition": max(c[2] for c in columns.values()) / rate,
            "grad_broadcast": grad_bc,
        }
        factors = sum(
            factor_elements(la.a_size, la.g_size, la.a_spec, la.g_spec) for la in plan.layers
        )
        return FractionCost(
            world_size=n,
            grad_workers=m,
            factor_bytes=int(factors * self.factor_bytes),
            second_order_bytes=int(max(c[0] for c in columns.values()) * self.state_bytes),
            seconds=seconds,
        )

    def plans(
        self,
        shapes: Sequence[LayerShape],
        world_size: int,
        grad_workers: Iterable[int] | None = None,
    ) -> list[WorkPlan]:
        """The plan of each number of gradient workers (default: every divisor of the world)."""
        ms = (
            [d for d in range(1, world_size + 1) if world_size % d == 0]
            if grad_workers is None
            else sorted(set(grad_workers))
        )
        return [self.plan(shapes, world_size, m) for m in ms]


def choose(costs: Sequence[FractionCost], memory_budget: float | None) -> FractionCost:
    """The fastest of ``costs`` that fits ``memory_budget`` bytes per rank (``None``: any).

    Ties: less memory, then fewer gradient workers. Raises
    :class:`MemoryBudgetError` naming the smallest memory that would do when
    none fits.
    """
    if not costs:
        raise ValueError("choose needs at least one fraction's cost")
    fits = [c for c in costs if memory_budget is None or c.memory_bytes <= memory_budget]
    if not fits:
        least = min(costs, key=lambda c: (c.memory_bytes, c.grad_workers))
        raise MemoryBudgetError(
            f"kaisa: no grad_worker_fraction fits memory_budget={memory_budget:.0f} bytes "
            f"({format_bytes(float(memory_budget or 0))}) per rank at world size "
            f"{least.world_size}: the smallest is {least.memory_bytes} bytes "
            f"({format_bytes(least.memory_bytes)}: {format_bytes(least.factor_bytes)} of "
            f"factors on every rank and {format_bytes(least.second_order_bytes)} of "
            f"second-order state) with {least.grad_workers} gradient worker(s) per layer "
            f"({least.strategy_name}); give memory_budget >= {least.memory_bytes}, or hold "
            "large factors in less memory (curvature='lowrank:K', 'kvec', 'diagonal')"
        )
    return min(fits, key=lambda c: (c.time_s, c.memory_bytes, c.grad_workers))


@dataclass(frozen=True)
class FractionChoice:
    """The number of gradient workers in force and, for ``'auto'``, how it was chosen.

    ``auto``: chosen by :func:`choose_stable` (else given by the user);
    ``link``: the rounded speeds the choice was made with; ``boundary``: a
    measurement lay near a rounding boundary and the choice would differ on
    its other side (the one with less memory was taken); ``costs``: every
    fraction's model (empty for a given fraction); ``restored``: adopted
    from a checkpoint.
    """

    world_size: int
    grad_workers: int
    auto: bool = False
    memory_budget: float | None = None
    link: Link | None = None
    boundary: bool = False
    costs: tuple[FractionCost, ...] = field(default=(), compare=False)
    restored: bool = False

    @property
    def fraction(self) -> float:
        return self.grad_workers / self.world_size

    def cost_of(self, grad_workers: int) -> FractionCost | None:
        return next((c for c in self.costs if c.grad_workers == grad_workers), None)

    def describe(self) -> str:
        """The choice, and each fraction's memory and modelled time (for the log)."""
        if not self.auto:
            return f"{self.grad_workers} gradient worker(s) per layer (given)"
        budget = "none" if self.memory_budget is None else format_bytes(self.memory_budget)
        lines = [
            f"grad_worker_fraction='auto': {self.grad_workers} of {self.world_size} rank(s) "
            f"per layer (fraction {self.fraction:g}), memory budget {budget} per rank, "
            f"{self.link.describe() if self.link else 'no link'}"
            + (
                "; a measurement lay at a rounding boundary: the fraction with less memory "
                "of the two was taken"
                if self.boundary
                else ""
            )
            + ("; restored from a checkpoint" if self.restored else ""),
            f"{'m':>6} {'strategy':<10} {'memory':>11} {'fits':>4} {'ms/step':>10}",
        ]
        for c in self.costs:
            fits = self.memory_budget is None or c.memory_bytes <= self.memory_budget
            mark = " <-" if c.grad_workers == self.grad_workers else ""
            lines.append(
                f"{c.grad_workers:>6} {c.strategy_name:<10} {format_bytes(c.memory_bytes):>11} "
                f"{'yes' if fits else 'no':>4} {c.time_s * 1e3:>10.4g}{mark}"
            )
        return "\n".join(lines)

    def state_dict(self) -> dict[str, object] | None:
        """What a checkpoint records (``None`` for a given fraction)."""
        if not self.auto:
            return None
        return {
            "world_size": self.world_size,
            "grad_workers": self.grad_workers,
            "memory_budget": self.memory_budget,
            "link": None if self.link is None else self.link.to_dict(),
            "boundary": self.boundary,
        }

    @staticmethod
    def from_state(saved: object, where: str) -> tuple[int, int]:
        """``(world_size, grad_workers)`` of a checkpoint's record, checked for form."""
        keys = {"world_size", "grad_workers", "memory_budget", "link", "boundary"}
        if not isinstance(saved, Mapping) or set(saved) != keys:
            raise ValueError(f"{where} must be a dict with the keys {sorted(keys)}; got {saved!r}")
        n, m = saved["world_size"], saved["grad_workers"]
        for name, value in (("world_size", n), ("grad_workers", m)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {name} must be an integer >= 1; got {value!r}")
        if n % m:
            raise ValueError(f"{where}: grad_workers={m} does not divide world_size={n}")
        return n, m

    def adopt(self, grad_workers: int) -> FractionChoice:
        """This choice with ``grad_workers`` restored from a checkpoint."""
        return replace(self, grad_workers=grad_workers, restored=True)


def choose_stable(
    shapes: Sequence[LayerShape],
    world_size: int,
    measured: Link,
    memory_budget: float | None,
    model: FractionModel | None = None,
    margin: float = BOUNDARY_MARGIN,
) -> FractionChoice:
    """The ``'auto'`` choice for measured speeds, reproducible run to run (module docstring).

    The speeds are rounded to powers of two; a speed within ``margin`` of a
    rounding boundary is tried on both sides, and when the choices there
    differ the one with less memory (then fewer gradient workers) wins.
    Raises :class:`MemoryBudgetError` when no fraction fits.
    """
    model = model or FractionModel()
    plans = model.plans(shapes, world_size)
    rounded = measured.rounded()
    costs = tuple(model.cost(plan, rounded) for plan in plans)
    chosen = choose(costs, memory_budget)
    picks = {chosen.grad_workers: chosen}
    for link in measured.neighbours(margin):
        if link != rounded:
            other = choose([model.cost(plan, link) for plan in plans], memory_budget)
            picks.setdefault(other.grad_workers, other)
    boundary = len(picks) > 1
    if boundary:
        m = min(picks.values(), key=lambda c: (c.memory_bytes, c.grad_workers)).grad_workers
        chosen = next(c for c in costs if c.grad_workers == m)
    return FractionChoice(
        world_size=world_size,
        grad_workers=chosen.grad_workers,
        auto=True,
        memory_budget=memory_budget,
        link=rounded,
        boundary=boundary,
        costs=costs,
    )
