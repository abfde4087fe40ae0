"""The KAISA cost model (spec §5): memory held and elements sent, per rank.

Pure functions of a :class:`~kaisa.distributed.plan.WorkPlan`; nothing here
starts a process, so the cost of any world size can be printed in advance.

Units are *elements* (multiply by the element size for bytes). Communication
is counted per rank as the sum, over the collective calls the rank takes part
in, of the number of elements of the tensor passed to the call (the root of a
broadcast and its receivers all count the whole tensor). For a layer whose
factors have sides ``a`` (input side) and ``g`` (output side):

* **factor all-reduce**, per factor-update step, every rank, only when
  ``N > 1``: ``Σ (a² + g²)``, or ``Σ (a(a+1)/2 + g(g+1)/2)`` with
  ``symmetry_aware`` (upper triangles only);
* **inverse broadcast**, per inverse-update step, only for the layers whose
  gradient-worker column contains the rank, only when ``m > 1``: eigen
  method ``a² + a + g² + g`` (eigenvectors and eigenvalues of both factors;
  the outer product is formed after the broadcast), inverse method
  ``a² + g²``;
* **gradient broadcast**, every step, only when ``m < N``: ``Σ a·g`` over all
  layers (each rank takes part in one broadcast per layer, in its row).

Memory: the factors of every layer, ``Σ (a² + g²)``, on every rank; the
second-order state only for the layers of the rank's column: eigen
``a² + g² + a + g``, or ``a² + g² + a + g + a·g`` with the precomputed
eigenvalue outer product; inverse ``a² + g²``. (The spec counts ``a² + g² + a·g``
for the outer product; kaisa also keeps the ``a + g`` eigenvalues so that a
failed decomposition leaves a consistent eigenbasis and spectrum to fall back
on, on every gradient worker alike.)

Sides held in another representation (spec §8) count their own sizes
(:func:`kaisa.curvature.costs.side_cost`): a ``'lowrank:K'`` side holds and
broadcasts ``n·k + k + 1`` numbers of state (its factor is still ``n²``); a
``'kvec'`` or ``'diagonal'`` side holds and all-reduces ``2n`` numbers of
factor (the mean row and the mean squared row) and ``n`` of state. In a layer
with any non-exact side, an exact side uses the eigen form whatever the
compute method, and there is no eigenvalue outer product. Every per-layer
function takes the two specs (default exact, the formulas above).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kaisa.choices import COMPUTE_METHODS, ComputeMethod
from kaisa.curvature.costs import SideCost, SideSpec, side_cost
from kaisa.distributed.plan import LayerAssignment, WorkPlan
from kaisa.validation import check_count, one_of

__all__ = [
    "ComputeMethod",
    "CostSummary",
    "MaxMean",
    "RankMemory",
    "RankTraffic",
    "bucket_layers",
    "factor_allreduce_elements",
    "factor_elements",
    "grad_broadcast_elements",
    "inverse_broadcast_elements",
    "rank_memory",
    "rank_traffic",
    "second_order_elements",
    "summarize",
]


# --- per-layer element counts ----------------------------------------------------------------


def _sides(
    a: int, g: int, a_spec: str, g_spec: str, compute_method: str
) -> tuple[SideCost, SideCost, bool]:
    """The two sides' costs and whether the layer is solved exactly (both sides exact)."""
    sa, sg = SideSpec.parse(a_spec), SideSpec.parse(g_spec)
    exact = sa.kind == "exact" and sg.kind == "exact"
    method = compute_method if exact else "eigen"
    return side_cost(sa, a, method), side_cost(sg, g, method), exact


def factor_elements(a: int, g: int, a_spec: str = "exact", g_spec: str = "exact") -> int:
    """Elements of one layer's two Kronecker factors (``a² + g²`` when both are held whole)."""
    ca, cg, _ = _sides(a, g, a_spec, g_spec, "eigen")
    return ca.factor + cg.factor


def second_order_elements(
    a: int,
    g: int,
    compute_method: ComputeMethod = "eigen",
    eigen_outer_product: bool = True,
    a_spec: str = "exact",
    g_spec: str = "exact",
) -> int:
    """Elements of one layer's second-order state on one of its gradient workers."""
    compute_method = one_of("compute_method", compute_method, COMPUTE_METHODS)
    ca, cg, exact = _sides(a, g, a_spec, g_spec, compute_method)
    total = ca.state + cg.state
    if exact and compute_method == "eigen" and eigen_outer_product:
        total += a * g
    return total


def factor_allreduce_elements(
    a: int, g: int, symmetry_aware: bool = False, a_spec: str = "exact", g_spec: str = "exact"
) -> int:
    """Elements one layer contributes to the factor all-reduce."""
    total = 0
    for n, spec in ((a, a_spec), (g, g_spec)):
        if SideSpec.parse(spec).capture == "moments":
            total += 2 * n
        elif symmetry_aware:
            total += n * (n + 1) // 2
        else:
            total += n * n
    return total


def inverse_broadcast_elements(
    a: int,
    g: int,
    compute_method: ComputeMethod = "eigen",
    a_spec: str = "exact",
    g_spec: str = "exact",
) -> int:
    """Elements of one layer's second-order broadcasts (A's and G's together)."""
    compute_method = one_of("compute_method", compute_method, COMPUTE_METHODS)
    ca, cg, _ = _sides(a, g, a_spec, g_spec, compute_method)
    return ca.state + cg.state


def grad_broadcast_elements(a: int, g: int) -> int:
    """Elements of one layer's preconditioned-gradient broadcast, ``a·g``."""
    return a * g


def bucket_layers(sizes: Sequence[tuple[str, int]], cap_mb: float) -> list[tuple[str, ...]]:
    """The factor all-reduce's buckets: layer names, in reverse registration order.

    ``sizes``: each layer's payload elements, in registration order; a bucket
    closes before a layer that would take it past ``cap_mb`` MiB of float32
    payload (a layer larger than the cap has a bucket of its own). The
    communicator sends these buckets; the cost model counts them
    (:mod:`kaisa.distributed.fraction`).
    """
    cap = max(1, int(cap_mb * 2**20 / 4))  # elements of float32 payload
    buckets: list[tuple[str, ...]] = []
    current: list[str] = []
    size = 0
    for name, numel in reversed(sizes):
        if current and size + numel > cap:
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(name)
        size += numel
    if current:
        buckets.append(tuple(current))
    return buckets


# --- per rank ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankMemory:
    """Elements one rank holds: Kronecker factors and second-order state."""

    factors: int
    second_order: int

    @property
    def total(self) -> int:
        return self.factors + self.second_order


@dataclass(frozen=True)
class RankTraffic:
    """Elements one rank passes to collectives, by kind.

    ``factor_allreduce`` is per factor-update step, ``inverse_broadcast`` per
    inverse-update step and ``grad_broadcast`` per step.
    """

    factor_allreduce: int
    inverse_broadcast: int
    grad_broadcast: int

    def per_step(self, factor_update_steps: int = 1, inv_update_steps: int = 1) -> float:
        """Average elements per step when factors update every ``factor_update_steps``
        steps and second-order state every ``inv_update_steps`` steps."""
        check_count(factor_update_steps, "factor_update_steps", 1, type_error=ValueError)
        check_count(inv_update_steps, "inv_update_steps", 1, type_error=ValueError)
        return (
            self.factor_allreduce / factor_update_steps
            + self.inverse_broadcast / inv_update_steps
            + self.grad_broadcast
        )


def _column_layers(plan: WorkPlan, column: int) -> list[LayerAssignment]:
    return [la for la in plan.layers if la.column == column]


def _memory(
    factors: int,
    own: Iterable[LayerAssignment],
    compute_method: ComputeMethod,
    eigen_outer_product: bool,
) -> RankMemory:
    """Memory of a rank whose column owns ``own``, given the plan's factor total."""
    return RankMemory(
        factors=factors,
        second_order=sum(
            second_order_elements(
                la.a_size, la.g_size, compute_method, eigen_outer_product, la.a_spec, la.g_spec
            )
            for la in own
        ),
    )


def _traffic(
    plan: WorkPlan,
    allreduce: int,
    grad: int,
    own: Iterable[LayerAssignment],
    compute_method: ComputeMethod,
) -> RankTraffic:
    """Traffic of a rank whose column owns ``own``, given the plan's all-reduce and
    gradient-broadcast totals (which every rank shares)."""
    n, m = plan.world_size, plan.grad_workers
    inverse_broadcast = (
        sum(
            inverse_broadcast_elements(la.a_size, la.g_size, compute_method, la.a_spec, la.g_spec)
            for la in own
        )
        if m > 1
        else 0
    )
    return RankTraffic(
        factor_allreduce=allreduce if n > 1 else 0,
        inverse_broadcast=inverse_broadcast,
        grad_broadcast=grad if m < n else 0,
    )


def _factor_total(plan: WorkPlan) -> int:
    return sum(factor_elements(la.a_size, la.g_size, la.a_spec, la.g_spec) for la in plan.layers)


def _allreduce_total(plan: WorkPlan, symmetry_aware: bool) -> int:
    return sum(
        factor_allreduce_elements(la.a_size, la.g_size, symmetry_aware, la.a_spec, la.g_spec)
        for la in plan.layers
    )


def _grad_total(plan: WorkPlan) -> int:
    return sum(grad_broadcast_elements(la.a_size, la.g_size) for la in plan.layers)


def rank_memory(
    plan: WorkPlan,
    rank: int,
    compute_method: ComputeMethod = "eigen",
    eigen_outer_product: bool = True,
) -> RankMemory:
    """Elements ``rank`` holds under ``plan``.

    ``eigen_outer_product`` (``compute_eigenvalue_outer_product``) only
    matters for the eigen method.
    """
    compute_method = one_of("compute_method", compute_method, COMPUTE_METHODS)
    check_count(rank, "rank", 0, high=plan.world_size, type_error=ValueError)
    own = _column_layers(plan, plan.column_of(rank))
    return _memory(_factor_total(plan), own, compute_method, eigen_outer_product)


def rank_traffic(
    plan: WorkPlan,
    rank: int,
    compute_method: ComputeMethod = "eigen",
    symmetry_aware: bool = False,
) -> RankTraffic:
    """Elements ``rank`` passes to each kind of collective under ``plan``."""
    compute_method = one_of("compute_method", compute_method, COMPUTE_METHODS)
    check_count(rank, "rank", 0, high=plan.world_size, type_error=ValueError)
    own = _column_layers(plan, plan.column_of(rank))
    return _traffic(
        plan, _allreduce_total(plan, symmetry_aware), _grad_total(plan), own, compute_method
    )


# --- over all ranks ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MaxMean:
    """The largest value over the ranks and the mean over the ranks."""

    max: float
    mean: float

    @staticmethod
    def of(values: Sequence[float]) -> MaxMean:
        """Max and mean of one value per rank (or per group of equally many ranks)."""
        if not values:
            raise ValueError("MaxMean.of needs at least one value")
        return MaxMean(max=max(values), mean=sum(values) / len(values))

    def scaled(self, factor: float) -> MaxMean:
        return MaxMean(self.max * factor, self.mean * factor)


@dataclass(frozen=True)
class CostSummary:
    """The cost model of one plan, summarised over the ranks (elements).

    ``factor_allreduce`` is per factor-update step, ``inverse_broadcast`` per
    inverse-update step, ``grad_broadcast`` per step and ``per_step`` the
    average per step given ``factor_update_steps`` and ``inv_update_steps``.
    ``imbalance`` is the largest rank's decomposition cost (``n³``) over the
    mean.
    """

    world_size: int
    grad_workers: int
    strategy_name: str
    compute_method: ComputeMethod
    eigen_outer_product: bool
    symmetry_aware: bool
    factor_update_steps: int
    inv_update_steps: int
    factors: MaxMean
    second_order: MaxMean
    memory_total: MaxMean
    factor_allreduce: MaxMean
    inverse_broadcast: MaxMean
    grad_broadcast: MaxMean
    per_step: MaxMean
    imbalance: float

    @property
    def fraction(self) -> float:
        """The gradient-worker fraction ``m / N``."""
        return self.grad_workers / self.world_size

    def to_dict(self, bytes_per_element: int = 4) -> dict[str, object]:
        """A JSON-ready view; memory also in MB (10⁶ bytes) at ``bytes_per_element``."""

        def mm(x: MaxMean, scale: float = 1.0) -> dict[str, float]:
            return {"max": x.max * scale, "mean": x.mean * scale}

        mb = bytes_per_element / 1e6
        return {
            "world_size": self.world_size,
            "grad_workers": self.grad_workers,
            "fraction": self.fraction,
            "strategy": self.strategy_name,
            "compute_method": self.compute_method,
            "eigen_outer_product": self.eigen_outer_product,
            "symmetry_aware": self.symmetry_aware,
            "factor_update_steps": self.factor_update_steps,
            "inv_update_steps": self.inv_update_steps,
            "memory_elements": {
                "factors": mm(self.factors),
                "second_order": mm(self.second_order),
                "total": mm(self.memory_total),
            },
            "memory_mb": {
                "bytes_per_element": bytes_per_element,
                "factors": mm(self.factors, mb),
                "second_order": mm(self.second_order, mb),
                "total": mm(self.memory_total, mb),
            },
            "elements_sent": {
                "factor_allreduce_per_factor_update": mm(self.factor_allreduce),
                "inverse_broadcast_per_inverse_update": mm(self.inverse_broadcast),
                "grad_broadcast_per_step": mm(self.grad_broadcast),
                "average_per_step": mm(self.per_step),
            },
            "imbalance": self.imbalance,
        }


def summarize(
    plan: WorkPlan,
    compute_method: ComputeMethod = "eigen",
    eigen_outer_product: bool = True,
    symmetry_aware: bool = False,
    factor_update_steps: int = 1,
    inv_update_steps: int = 1,
) -> CostSummary:
    """Max and mean over the ranks of every quantity of the cost model.

    Ranks of the same column hold and send exactly the same, and every column
    has ``m`` ranks, so the statistics are taken over the columns: the work is
    ``O(layers + columns)`` whatever the world size.
    """
    compute_method = one_of("compute_method", compute_method, COMPUTE_METHODS)
    check_count(factor_update_steps, "factor_update_steps", 1, type_error=ValueError)
    check_count(inv_update_steps, "inv_update_steps", 1, type_error=ValueError)
    own: list[list[LayerAssignment]] = [[] for _ in range(plan.num_columns)]
    for la in plan.layers:
        own[la.column].append(la)
    factors = _factor_total(plan)
    allreduce, grad = _allreduce_total(plan, symmetry_aware), _grad_total(plan)
    memory = [_memory(factors, layers, compute_method, eigen_outer_product) for layers in own]
    traffic = [_traffic(plan, allreduce, grad, layers, compute_method) for layers in own]
    return CostSummary(
        world_size=plan.world_size,
        grad_workers=plan.grad_workers,
        strategy_name=plan.strategy_name,
        compute_method=compute_method,
        eigen_outer_product=eigen_outer_product,
        symmetry_aware=symmetry_aware,
        factor_update_steps=factor_update_steps,
        inv_update_steps=inv_update_steps,
        factors=MaxMean.of([x.factors for x in memory]),
        second_order=MaxMean.of([x.second_order for x in memory]),
        memory_total=MaxMean.of([x.total for x in memory]),
        factor_allreduce=MaxMean.of([t.factor_allreduce for t in traffic]),
        inverse_broadcast=MaxMean.of([t.inverse_broadcast for t in traffic]),
        grad_broadcast=MaxMean.of([t.grad_broadcast for t in traffic]),
        per_step=MaxMean.of([t.per_step(factor_update_steps, inv_update_steps) for t in traffic]),
        imbalance=plan.imbalance(),
    )
