"""Representations of a Kronecker factor as names and costs (spec §8), without torch.

:class:`SideSpec` names how one side of a layer's curvature is held
(``'exact'``, ``'lowrank:K'``, ``'kvec'``, ``'diagonal'``); :func:`side_cost`
is what holding it that way costs. The work plan, the cost model, ``kaisa
plan`` and the automatic choice read these; the tensors themselves are in
:mod:`kaisa.curvature.representations`.

Work is counted in multiply-adds and weighed by a :class:`CostModel`: how
many of a training pass's multiply-adds one multiply-add of each kind of
K-FAC work is worth (an eigendecomposition, a Cholesky inverse, a factor
product, a preconditioning product). The weights are properties of a
machine, not of the maths: :data:`DEFAULT_COST_MODEL` holds the ones the
automatic choice uses unless told otherwise, and
``benchmarks/cost_weights.py`` measures them on the machine it runs on and
prints the :class:`CostModel` to pass instead (``benchmarks/README.md``,
"Cost weights", records where the defaults came from).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Literal

__all__ = [
    "DEFAULT_COST_MODEL",
    "OVERSAMPLING",
    "SIDE_KINDS",
    "SUBSPACE_ITERATIONS",
    "Capture",
    "CostModel",
    "SideCost",
    "SideKind",
    "SideSpec",
    "check_cost_model",
    "side_cost",
]

Capture = Literal["gram", "moments"]
SideKind = Literal["exact", "lowrank", "kvec", "diagonal"]
SIDE_KINDS: tuple[SideKind, ...] = ("exact", "lowrank", "kvec", "diagonal")

#: Subspace iterations per low-rank refresh (each one ``F @ Q`` and a QR).
SUBSPACE_ITERATIONS = 2
#: Extra columns carried by the low-rank subspace iteration (dropped at the end).
OVERSAMPLING = 8


@dataclass(frozen=True)
class CostModel:
    """How much each kind of K-FAC work weighs against a training pass's multiply-adds.

    The unit of every cost is one multiply-add of the registered layers'
    forward and backward passes (a *training* multiply-add): the automatic
    choice (:func:`kaisa.curvature.budget.choose_curvature`) compares K-FAC's
    weighted work with the training work, so a weight is the ratio of a
    training pass's speed (multiply-adds per second) to that kind of work's.
    The weights depend on the machine and its libraries (a GPU runs large
    products and decompositions at other speeds than a CPU does), not on the
    model; ``benchmarks/cost_weights.py`` measures them and prints the
    :class:`CostModel` to pass (``choose_curvature(..., cost_model=...)``).

    Every weight must be a finite number > 0; ``CostModel()`` is
    :data:`DEFAULT_COST_MODEL`, and ``dataclasses.replace`` changes one weight.
    """

    #: One symmetric eigendecomposition of an ``n × n`` factor costs
    #: ``eigh · n³`` training multiply-adds (also the final ``eigh`` of a
    #: low-rank refresh, on its ``k +`` :data:`OVERSAMPLING` columns).
    eigh: float = 8.0
    #: One damped inverse of an ``n × n`` factor by Cholesky
    #: (``compute_method='inverse'``) costs ``cholesky_inverse · n³`` training
    #: multiply-adds.
    cholesky_inverse: float = 4.0
    #: One multiply-add of a capture (the factor products: a gram of the rows,
    #: or their moments, as the layer handler counts them) costs ``capture``
    #: training multiply-adds.
    capture: float = 2.0
    #: One multiply-add of preconditioning (the solves applied to a gradient
    #: every step, as :class:`SideCost` counts them) costs ``apply`` training
    #: multiply-adds.
    apply: float = 2.0
    #: One operator call of the model's forward or backward pass (a matrix
    #: product, a normalisation, an activation, a softmax: what the registered
    #: layers' multiply-adds do not count) costs ``operator`` training
    #: multiply-adds beyond its counted ones: the allowance grows with the
    #: iteration's real work (:func:`kaisa.curvature.budget.operator_scale`).
    #: Chosen so that the operator counts of the suite's image workloads give
    #: the scales their iterations measured on the clock (``benchmarks/README.md``,
    #: "Cost weights").
    operator: float = 3.5e6

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"CostModel.{field.name} must be a finite number > 0; got {value!r}"
                )
            try:
                weight = float(value)
            except OverflowError:  # an int too large for a float
                weight = math.inf
            if not math.isfinite(weight) or weight <= 0:
                raise ValueError(
                    f"CostModel.{field.name} must be a finite number > 0; got {value!r}"
                )
            object.__setattr__(self, field.name, weight)


#: The weights the automatic choice uses unless given others (see
#: :class:`CostModel` for what each one means).
DEFAULT_COST_MODEL = CostModel()


def check_cost_model(cost_model: object) -> CostModel:
    """``cost_model`` if it is a :class:`CostModel`; else ``TypeError``."""
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a CostModel; got {type(cost_model).__name__}")
    return cost_model


@dataclass(frozen=True)
class SideSpec:
    """One side's representation: a kind and, for ``'lowrank'``, its rank ``k``.

    Written as a string in options, plans and checkpoints: ``'exact'``,
    ``'lowrank:64'``, ``'kvec'``, ``'diagonal'`` (:meth:`parse`, :meth:`__str__`).
    """

    kind: SideKind
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SIDE_KINDS:
            raise ValueError(
                f"curvature representation must be one of {', '.join(map(repr, SIDE_KINDS))} "
                f"(lowrank as 'lowrank:K'); got {self.kind!r}"
            )
        if self.kind == "lowrank":
            if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
                raise ValueError(
                    "a 'lowrank' representation needs a rank k >= 1 ('lowrank:K'); "
                    f"got {self.rank!r}"
                )
        elif self.rank is not None:
            raise ValueError(f"only 'lowrank' takes a rank; got {self.kind!r} with {self.rank!r}")

    @staticmethod
    def parse(text: str | SideSpec) -> SideSpec:
        """``'exact'``, ``'lowrank:K'``, ``'kvec'`` or ``'diagonal'`` as a spec."""
        if isinstance(text, SideSpec):
            return text
        if not isinstance(text, str):
            raise TypeError(f"a curvature representation must be a string; got {text!r}")
        match = re.fullmatch(r"\s*([a-z]+)\s*(?::\s*(\d+)\s*)?", text.lower())
        if match is None:
            raise ValueError(
                "curvature representation must be 'exact', 'lowrank:K', 'kvec' or 'diagonal'; "
                f"got {text!r}"
            )
        kind, rank = match.group(1), match.group(2)
        if kind == "lowrank" and rank is None:
            raise ValueError(f"'lowrank' needs its rank: 'lowrank:K' with K >= 1; got {text!r}")
        return SideSpec(kind, int(rank) if rank is not None else None)  # type: ignore[arg-type]

    def check_size(self, size: int, where: str) -> None:
        """Refuse a low rank that is not below the factor's side."""
        if self.kind == "lowrank" and self.rank is not None and self.rank > size:
            raise ValueError(
                f"{where}: 'lowrank:{self.rank}' has a rank above the factor's side {size}; "
                f"allowed: 1 <= k <= {size}"
            )

    @property
    def capture(self) -> Capture:
        return "gram" if self.kind in ("exact", "lowrank") else "moments"

    def __str__(self) -> str:
        return f"lowrank:{self.rank}" if self.kind == "lowrank" else self.kind


@dataclass(frozen=True)
class SideCost:
    """What one side costs, in multiply-adds and numbers (elements).

    What a capture costs depends on the layer, not the representation's
    maths (a gram or moments of its rows; the shifted conv products are
    cheaper than plain ones): the layer handler says (``capture_work``).
    ``refresh``: work of one refresh (decomposition) on its assigned rank, a
    decomposition weighted by the :class:`CostModel`;
    ``apply_per_column``: work to precondition, per column of the other side
    (a ``(g, a)`` gradient has ``g`` columns for the ``A`` side and ``a`` for
    ``G``); ``factor``: numbers in the running average (held on every rank and
    all-reduced on factor-update steps); ``state``: numbers of second-order
    state (held by the gradient workers, broadcast inside the column after a
    refresh).
    """

    refresh: float
    apply_per_column: float
    factor: int
    state: int


def side_cost(
    spec: SideSpec,
    n: int,
    method: str = "eigen",
    *,
    cost_model: CostModel = DEFAULT_COST_MODEL,
) -> SideCost:
    """:class:`SideCost` of a side of ``n`` held as ``spec`` (pure arithmetic).

    A decomposition's work is weighted by ``cost_model`` (its ``eigh`` and
    ``cholesky_inverse``); the rest is plain multiply-adds (the caller weighs
    the preconditioning by ``cost_model.apply``).
    """
    check_cost_model(cost_model)
    if spec.kind == "exact":
        if method == "inverse":
            return SideCost(cost_model.cholesky_inverse * n**3, 2.0 * n * n, n * n, n * n)
        # Q_Gᵀ ∇ Q_A and back: two products of n² per column on each side.
        return SideCost(cost_model.eigh * n**3, 2.0 * n * n, n * n, n * n + n)
    if spec.kind == "lowrank":
        k = min(int(spec.rank or n), n)
        width = min(n, k + OVERSAMPLING)
        refresh = (SUBSPACE_ITERATIONS + 1) * (n * n * width + 2.0 * n * width * width)
        refresh += cost_model.eigh * width**3
        return SideCost(refresh, 4.0 * n * k + n, n * n, n * k + k + 1)
    if spec.kind == "kvec":
        return SideCost(n, 4.0 * n, 2 * n, n)
    return SideCost(n, 1.0 * n, 2 * n, n)
