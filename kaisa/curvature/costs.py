"""Representations of a Kronecker factor as names and costs (spec §8), without torch.

:class:`SideSpec` names how one side of a layer's curvature is held
(``'exact'``, ``'lowrank:K'``, ``'kvec'``, ``'diagonal'``); :func:`side_cost`
is what holding it that way costs. The work plan, the cost model, ``kaisa
plan`` and the automatic choice read these; the tensors themselves are in
:mod:`kaisa.curvature.representations`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "APPLY_WEIGHT",
    "CAPTURE_WEIGHT",
    "CHOLESKY_INVERSE_COST",
    "EIGH_COST",
    "OVERSAMPLING",
    "SIDE_KINDS",
    "SUBSPACE_ITERATIONS",
    "Capture",
    "SideCost",
    "SideKind",
    "SideSpec",
    "side_cost",
]

Capture = Literal["gram", "moments"]
SideKind = Literal["exact", "lowrank", "kvec", "diagonal"]
SIDE_KINDS: tuple[SideKind, ...] = ("exact", "lowrank", "kvec", "diagonal")

#: Cost of one symmetric eigendecomposition of side ``n`` in multiply-adds of
#: ``n³``, as a training pass's multiply-adds run. ``torch.linalg.eigh`` takes
#: 9–23× the time of an ``n × n`` matrix product here, but large products run
#: 2–3× faster per multiply-add than a small CNN's forward and backward passes:
#: on GapCNN (2 threads) the refreshes of every layer took 30–37 ms against
#: 4.9 G multiply-adds modelled at 20, training 57 M multiply-adds per ms.
EIGH_COST = 8.0
#: Weight of a capture's multiply-adds (factor products) against a training
#: pass's: GapCNN's factor products ran at 26 M per ms, its training at 57.
CAPTURE_WEIGHT = 2.0
#: Weight of a preconditioning multiply-add (small products, gradient copies):
#: GapCNN's exact solves ran at about 30 M per ms.
APPLY_WEIGHT = 2.0
#: Cost of a Cholesky inverse of side ``n`` in multiply-adds of ``n³``.
CHOLESKY_INVERSE_COST = 4.0
#: Subspace iterations per low-rank refresh (each one ``F @ Q`` and a QR).
SUBSPACE_ITERATIONS = 2
#: Extra columns carried by the low-rank subspace iteration (dropped at the end).
OVERSAMPLING = 8


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
    ``refresh``: work of one refresh (decomposition) on its assigned rank;
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


def side_cost(spec: SideSpec, n: int, method: str = "eigen") -> SideCost:
    """:class:`SideCost` of a side of ``n`` held as ``spec`` (pure arithmetic)."""
    if spec.kind == "exact":
        if method == "inverse":
            return SideCost(CHOLESKY_INVERSE_COST * n**3, 2.0 * n * n, n * n, n * n)
        # Q_Gᵀ ∇ Q_A and back: two products of n² per column on each side.
        return SideCost(EIGH_COST * n**3, 2.0 * n * n, n * n, n * n + n)
    if spec.kind == "lowrank":
        k = min(int(spec.rank or n), n)
        width = min(n, k + OVERSAMPLING)
        refresh = (SUBSPACE_ITERATIONS + 1) * (n * n * width + 2.0 * n * width * width)
        refresh += EIGH_COST * width**3
        return SideCost(refresh, 4.0 * n * k + n, n * n, n * k + k + 1)
    if spec.kind == "kvec":
        return SideCost(n, 4.0 * n, 2 * n, n)
    return SideCost(n, 1.0 * n, 2 * n, n)
