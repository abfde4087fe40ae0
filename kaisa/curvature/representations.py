"""How one side of a layer's curvature is held: exact, low-rank, Kronecker vector, diagonal.

Each class here holds one Kronecker factor ``F`` (the ``A`` or the ``G`` of one
layer, of side ``n``) in one representation (spec §8) and knows, for that
representation:

* what it captures and folds into its running average (``capture``): the full
  matrix of row products (``'gram'``, ``n²`` numbers) or the first and second
  moments of the rows (``'moments'``, ``2n`` numbers: the mean row and the
  mean of the squared rows);
* how to refresh its second-order state from the running average
  (:meth:`Side.refresh`, on the rank the plan assigns) and which tensors carry
  that state to the layer's other gradient workers (:meth:`Side.state_tensors`);
* how to apply its damped inverse ``(F / s + γI)⁻¹`` to a gradient along one
  dimension (:meth:`Side.solve`), ``s`` the mean eigenvalue under relative
  damping and 1 otherwise. The base class decides and applies ``s``
  (:meth:`Side.scale`, :meth:`Side.scaled_state`, :meth:`Side.scaled_factor`);
  each representation does the maths of an unscaled matrix;
* what it costs (:class:`SideCost`): work per refresh and per
  preconditioning, and the numbers it holds and sends;
* :meth:`Side.dense`: the ``n × n`` matrix it stands for, which the tests invert
  densely in float64 to check :meth:`Side.solve`.

Representations (``SideSpec.kind``):

* ``'exact'``: ``F`` itself; eigen (``Q``, ``λ``) or damped inverse (spec §4).
* ``'lowrank'``: ``U diag(λ) Uᵀ + σ(I − UUᵀ)`` from the top ``k`` eigenpairs
  of ``F`` (subspace iteration warm-started from the previous basis), ``σ``
  the mean of the other eigenvalues; solved in ``O(n·k)`` per column.
* ``'kvec'``: ``ā āᵀ`` with ``ā`` the running mean of the rows (Eva, Zhang
  et al. 2023), solved by Sherman–Morrison; no decomposition.
* ``'diagonal'``: ``diag(E[row²])``, the diagonal of ``F``.

Nothing here knows modules, hooks or ranks. The specs and costs, which the
plan needs without torch, are in :mod:`kaisa.curvature.costs`.
"""

from __future__ import annotations

import math
import zlib
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kaisa.choices import COMPUTE_METHODS
from kaisa.curvature.costs import (
    OVERSAMPLING,
    SIDE_KINDS,
    SUBSPACE_ITERATIONS,
    Capture,
    SideCost,
    SideKind,
    SideSpec,
    side_cost,
)
from kaisa.validation import one_of

__all__ = [
    "OVERSAMPLING",
    "SIDE_KINDS",
    "SUBSPACE_ITERATIONS",
    "Capture",
    "DiagonalSide",
    "ExactSide",
    "KroneckerVectorSide",
    "LowRankSide",
    "Side",
    "SideCost",
    "SideKind",
    "SideSpec",
    "checkpoint_shapes",
    "make_side",
    "side_cost",
    "split_damping",
]

from kaisa.curvature.linalg import (
    DecompositionError,
    all_finite,
    compute_dtype,
    damped_inverse,
    fold_running_average,
    held_basis,
    mean_scale,
    symmetric_eigen,
)


def _seed_for(n: int, width: int) -> int:
    """The low-rank start's seed: the same on every rank, run and wrapper (DDP renames
    layers ``module.…``), so a refresh depends on the factor alone."""
    return zlib.crc32(f"kaisa-lowrank-{n}-{width}".encode()) & 0x7FFFFFFF


class Side(ABC):
    """One factor of one layer held in one representation (see the module docstring).

    Args:
        name: the layer and side, for messages and the low-rank seed.
        size: the factor's side ``n``.
        device, factor_dtype: where and in which dtype the running average lives.
        inv_dtype: dtype the second-order state is stored in. It is computed,
            and solves run, in at least float32 whatever this dtype
            (:attr:`work_dtype`, spec §4): a half-precision state is cast up
            once per refresh (:meth:`work_state`), never solved in.
        relative: damping relative to the factor's mean eigenvalue.
    """

    kind: ClassVar[SideKind]
    capture: ClassVar[Capture]

    def __init__(
        self,
        name: str,
        size: int,
        *,
        device: torch.device,
        factor_dtype: torch.dtype,
        inv_dtype: torch.dtype,
        relative: bool,
    ) -> None:
        self.name = name
        self.size = size
        self.inv_dtype = inv_dtype
        #: The dtype the state is computed and applied in: at least float32.
        self.work_dtype = compute_dtype(inv_dtype)
        self.relative = relative
        if self.capture == "gram":
            self.factor = torch.eye(size, dtype=factor_dtype, device=device)
        else:  # moments: row 0 the mean row, row 1 the mean squared row (identity: 0, 1)
            self.factor = torch.zeros(2, size, dtype=factor_dtype, device=device)
            self.factor[1].fill_(1.0)
        self.state: list[torch.Tensor] = []
        # (damping, tensors): what solve() needs besides the matrix, computed
        # once per state and damping (see coefficients()).
        self._coefficients: tuple[float, tuple[torch.Tensor, ...]] | None = None
        # The state in work_dtype when it is stored in a narrower one (see work_state()).
        self._work: list[torch.Tensor] | None = None

    @property
    def spec(self) -> SideSpec:
        return SideSpec(self.kind)

    def fold(self, batch: torch.Tensor, decay: float) -> None:
        """``F ← ξ·F + (1 − ξ)·F_batch`` (a gram, or the two moment rows)."""
        fold_running_average(self.factor, batch, decay)

    # -- second-order state -------------------------------------------------------
    def allocate(self) -> list[torch.Tensor]:
        """Second-order state on this rank: that of the identity factor (idempotent)."""
        if not self.state:
            self.state = self._identity_state()
            self.invalidate()
        return self.state

    def invalidate(self) -> None:
        """The state changed (a refresh, a broadcast received into it, a load)."""
        self._coefficients = None
        self._work = None

    def work_state(self) -> list[torch.Tensor]:
        """The second-order state in :attr:`work_dtype` (at least float32).

        The state's own tensors when it is stored in float32 or float64; a
        copy, made once per state (until :meth:`invalidate`), when it is stored
        in half precision: solving in float16 loses the small gradients and
        eigenvalue products entirely.
        """
        state = self.allocate()
        if all(t.dtype == self.work_dtype for t in state):
            return list(state)
        if self._work is None:
            self._work = [t.to(self.work_dtype) for t in state]
        return self._work

    def coefficients(self, damping: float) -> tuple[torch.Tensor, ...]:
        """What :meth:`solve` needs besides the matrix, for the current state.

        Derived from the state and ``damping`` alone, so it is computed once
        per state (until :meth:`invalidate`) and damping value rather than at
        every step: the same operations, the same values.
        """
        cached = self._coefficients
        if cached is None or cached[0] != damping:
            cached = (damping, self._solve_coefficients(self.scaled_state(), damping))
            self._coefficients = cached
        return cached[1]

    @abstractmethod
    def _solve_coefficients(
        self, state: list[torch.Tensor], damping: float
    ) -> tuple[torch.Tensor, ...]:
        """What :meth:`solve` needs to apply ``(M + γI)⁻¹``, ``M`` the matrix ``state`` stands for.

        ``state`` is :meth:`scaled_state`: the scale is already applied, so
        this is the maths of an unscaled matrix. Its tensors may be the state
        itself: compute out of place.
        """

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors a refresh writes and the column broadcast sends."""
        return self.allocate()

    def refresh(self, damping: float) -> None:
        """Recompute the second-order state from the running average.

        Raises :class:`DecompositionError` (state unchanged) when the factor is
        not finite or the decomposition fails.
        """
        if not all_finite(self.factor):
            raise DecompositionError("factor holds NaN or Inf")
        new = self._compute_state(damping)
        for old, value in zip(self.allocate(), new, strict=True):
            old.copy_(value)
        self.invalidate()

    # -- relative damping: decided and applied here only ---------------------------
    #: For each tensor of the state, the power of ``s`` it scales with when
    #: ``F`` becomes ``F/s``: 1 for eigenvalues and diagonals, 0.5 for a vector
    #: whose outer product is ``F``, 0 for what does not scale (a basis).
    #: Representations that damp at refresh instead use :meth:`scaled_factor`.
    state_powers: ClassVar[tuple[float, ...]]

    def scale(self) -> torch.Tensor:
        """``s``: the mean eigenvalue under relative damping, else 1 (a 0-d tensor).

        The only place relative damping's scale is computed: from
        :meth:`_scale_source` (by default :meth:`mean_eigenvalue`), floored
        at the dtype's smallest normal number (:func:`mean_scale`).
        """
        if not self.relative:
            return torch.ones((), dtype=self.work_dtype, device=self.factor.device)
        return mean_scale(self._scale_source())

    def _scale_source(self) -> torch.Tensor:
        """The eigenvalues (or their mean) whose mean is ``s``."""
        return self.mean_eigenvalue()

    def scaled_state(self) -> list[torch.Tensor]:
        """The second-order state of ``F/s``: each tensor divided by ``s`` to its power.

        What every :meth:`solve` and the block's exact eigen solve read, in
        :attr:`work_dtype`. Under absolute damping (``s = 1``) these are the
        tensors of :meth:`work_state` themselves.
        """
        state = self.work_state()
        powers = self._state_powers()
        if not self.relative or not any(powers):
            return list(state)
        s = self.scale()
        root = s.sqrt() if 0.5 in powers else s
        return [
            t if power == 0 else t / (s if power == 1 else root)
            for t, power in zip(state, powers, strict=True)
        ]

    def scaled_factor(self) -> torch.Tensor:
        """The running average of ``F/s``, for a representation that damps at refresh.

        Under absolute damping (``s = 1``) the running average itself.
        """
        if not self.relative:
            return self.factor
        return self.factor / self.scale().to(self.factor.dtype)

    def scaled_mean_eigenvalue(self) -> float:
        """The mean eigenvalue of ``F/s``, for splitting a layer's damping (a host sync).

        1 under relative damping (``F/s`` has unit mean eigenvalue: that is
        what ``s`` is for; no sync), ``F``'s own otherwise.
        """
        if self.relative:
            return 1.0
        return float(self.mean_eigenvalue())

    def _state_powers(self) -> tuple[float, ...]:
        return self.state_powers

    @abstractmethod
    def _identity_state(self) -> list[torch.Tensor]: ...

    @abstractmethod
    def _compute_state(self, damping: float) -> list[torch.Tensor]: ...

    @abstractmethod
    def mean_eigenvalue(self) -> torch.Tensor:
        """``trace(F)/n`` of the matrix the state stands for (0-d, :attr:`work_dtype`)."""

    @abstractmethod
    def solve(self, matrix: torch.Tensor, damping: float, dim: int) -> torch.Tensor:
        """``(F/s + γI)⁻¹`` applied along ``dim`` of a 2-D ``matrix``.

        ``dim=0``: ``(F/s + γI)⁻¹ M`` (the ``G`` side, ``M`` is ``(n, ·)``);
        ``dim=1``: ``M (F/s + γI)⁻¹`` (the ``A`` side, ``M`` is ``(·, n)``).
        Computed in :attr:`work_dtype` (at least float32), returned in ``matrix``'s.
        """

    @abstractmethod
    def dense(self) -> torch.Tensor:
        """The ``n × n`` matrix the current state stands for (tests, inspection)."""

    # -- accounting and checkpoints -----------------------------------------------
    def factor_bytes(self) -> int:
        return self.factor.numel() * self.factor.element_size()

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state)


def _along(matrix: torch.Tensor, dim: int) -> torch.Tensor:
    """``matrix`` with the side's dimension first (a view)."""
    return matrix if dim == 0 else matrix.t()


class ExactSide(Side):
    """``F`` itself: eigenbasis and eigenvalues (``method='eigen'``) or ``(F/s + γI)⁻¹``."""

    kind = "exact"
    capture = "gram"
    state_powers = (0.0, 1.0)  # Q, λ (the eigen method; see _state_powers)

    def __init__(
        self,
        name: str,
        size: int,
        *,
        method: str = "eigen",
        basis_tolerance: float | None = None,
        **kw: object,
    ) -> None:
        super().__init__(name, size, **kw)  # type: ignore[arg-type]
        self.method = one_of("compute_method", method, COMPUTE_METHODS)
        #: ``eigenbasis_tolerance`` (eigen method): a refresh keeps the held basis
        #: while it diagonalises the factor to within it (:func:`held_basis`).
        self.basis_tolerance = basis_tolerance
        #: Whether the last refresh kept the held basis (eigenvalues only refreshed).
        self.basis_kept = False

    def _identity_state(self) -> list[torch.Tensor]:
        eye = torch.eye(self.size, dtype=self.inv_dtype, device=self.factor.device)
        if self.method == "eigen":
            return [eye, torch.ones(self.size, dtype=self.inv_dtype, device=self.factor.device)]
        return [eye]

    def _compute_state(self, damping: float) -> list[torch.Tensor]:
        self.basis_kept = False
        if self.method == "eigen":
            if self.basis_tolerance is not None:
                held = held_basis(self.factor, self.allocate()[0], self.basis_tolerance)
                if held is not None:
                    self.basis_kept = True
                    return [held[0], held[1].to(self.inv_dtype)]
            q, values = symmetric_eigen(self.factor, self.inv_dtype)
            return [q, values]
        # Damped here, at refresh (spec §4): the scale is applied to the factor.
        return [damped_inverse(self.scaled_factor(), damping, self.inv_dtype)]

    def _state_powers(self) -> tuple[float, ...]:
        return (0.0, 1.0) if self.method == "eigen" else (0.0,)

    def refresh_in_float64(self) -> None:
        """:meth:`refresh` (eigen method) with the decomposition in float64, stored in
        ``inv_dtype``: for a factor whose float32 decomposition would make the damped
        solve inaccurate (:func:`~kaisa.curvature.linalg.eigen_error_bound`).

        Raises :class:`DecompositionError` (state unchanged) on failure.
        """
        q, values = symmetric_eigen(self.factor, self.inv_dtype, at_least=torch.float64)
        for old, value in zip(self.allocate(), (q, values), strict=True):
            old.copy_(value)
        self.invalidate()

    def _scale_source(self) -> torch.Tensor:
        if self.method == "eigen":
            return self.mean_eigenvalue()
        # The inverse is formed from the factor: its diagonal, in the decomposition's dtype.
        return self.factor.diagonal().to(compute_dtype(self.factor.dtype))

    def mean_eigenvalue(self) -> torch.Tensor:
        if self.method == "eigen":
            return self.work_state()[1].mean()
        return self.factor.diagonal().mean().to(self.work_dtype)

    @property
    def eigen(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Q, λ)`` of the eigen method, as stored (``inv_dtype``)."""
        q, values = self.allocate()
        return q, values

    def _solve_coefficients(
        self, state: list[torch.Tensor], damping: float
    ) -> tuple[torch.Tensor, ...]:
        if self.method == "inverse":
            # The inverse was formed with the damping of its refresh (spec §4).
            return (state[0],)
        q, values = state
        inv = values.add(damping).reciprocal_()
        return q, inv.unsqueeze(1)

    def solve(self, matrix: torch.Tensor, damping: float, dim: int) -> torch.Tensor:
        if self.method == "inverse":
            (inverse,) = self.coefficients(damping)
            m = matrix.to(inverse.dtype)
            out = inverse @ m if dim == 0 else m @ inverse
            return out.to(matrix.dtype)
        q, inv = self.coefficients(damping)
        m = _along(matrix.to(q.dtype), dim)
        out = q @ (inv * (q.t() @ m))
        return _along(out, dim).to(matrix.dtype)

    def dense(self) -> torch.Tensor:
        if self.method == "eigen":
            q, values = self.work_state()
            return (q * values) @ q.t()
        return self.factor.to(self.work_dtype)


class LowRankSide(Side):
    """``U diag(λ) Uᵀ + σ(I − UUᵀ)``: the top ``k`` eigenpairs and one scalar for the rest.

    The refresh runs :data:`SUBSPACE_ITERATIONS` steps of subspace iteration
    on ``k +`` :data:`OVERSAMPLING` columns, warm-started from the previous
    basis (a seeded Gaussian the first time; the basis is checkpointed, so a
    resumed run refreshes bit-identically), then a Rayleigh–Ritz step; ``σ``
    is ``(trace(F) − Σλ) / (n − k)`` (0 at ``k = n``, where this is the exact
    eigen method).
    """

    kind = "lowrank"
    capture = "gram"
    state_powers = (0.0, 1.0, 1.0)  # U, λ, σ

    def __init__(self, name: str, size: int, *, rank: int, **kw: object) -> None:
        super().__init__(name, size, **kw)  # type: ignore[arg-type]
        SideSpec("lowrank", rank).check_size(size, f"layer side {name!r}")
        self.rank = rank
        self.warm_basis: torch.Tensor | None = None  # the oversampled basis, for warm starts

    @property
    def spec(self) -> SideSpec:
        return SideSpec("lowrank", self.rank)

    def _identity_state(self) -> list[torch.Tensor]:
        n, k = self.size, self.rank
        device = self.factor.device
        u = torch.eye(n, k, dtype=self.inv_dtype, device=device)
        values = torch.ones(k, dtype=self.inv_dtype, device=device)
        sigma = torch.ones(1, dtype=self.inv_dtype, device=device)
        return [u, values, sigma]

    def _compute_state(self, damping: float) -> list[torch.Tensor]:
        n, k = self.size, self.rank
        dtype = compute_dtype(self.factor.dtype)
        factor = self.factor.to(dtype)
        width = min(n, k + OVERSAMPLING)
        basis = self.warm_basis
        if basis is None or basis.shape != (n, width) or basis.dtype != dtype:
            generator = torch.Generator(device="cpu").manual_seed(_seed_for(n, width))
            basis = torch.randn(n, width, generator=generator, dtype=dtype).to(factor.device)
            basis = torch.linalg.qr(basis).Q
        try:
            for _ in range(SUBSPACE_ITERATIONS):
                basis = torch.linalg.qr(factor @ basis).Q
            projected = basis.t() @ factor @ basis
            values, vectors = torch.linalg.eigh((projected + projected.t()) / 2)
        except RuntimeError as error:
            raise DecompositionError(f"low-rank refresh failed: {error}") from error
        if not all_finite(values, vectors):
            raise DecompositionError("low-rank refresh returned non-finite values")
        order = torch.argsort(values, descending=True)
        values, vectors = values[order], vectors[:, order]
        self.warm_basis = basis @ vectors  # the Ritz vectors: the best warm start
        u = self.warm_basis[:, :k]
        top = values[:k].clamp(min=0.0)
        rest = n - k
        trace = factor.diagonal().sum()
        sigma = ((trace - top.sum()) / rest).clamp(min=0.0) if rest else trace.new_zeros(())
        if not bool(torch.isfinite(sigma)):
            raise DecompositionError("low-rank refresh: the rest of the spectrum is not finite")
        return [u.to(self.inv_dtype), top.to(self.inv_dtype), sigma.reshape(1).to(self.inv_dtype)]

    def mean_eigenvalue(self) -> torch.Tensor:
        _, values, sigma = self.work_state()
        return (values.sum() + (self.size - self.rank) * sigma[0]) / self.size

    def _solve_coefficients(
        self, state: list[torch.Tensor], damping: float
    ) -> tuple[torch.Tensor, ...]:
        u, values, sigma = state
        rest = 1.0 / (sigma[0] + damping)
        coefficient = values.add(damping).reciprocal_().sub_(rest)
        return u, coefficient.unsqueeze(1), rest

    def solve(self, matrix: torch.Tensor, damping: float, dim: int) -> torch.Tensor:
        u, coefficient, rest = self.coefficients(damping)
        m = _along(matrix.to(u.dtype), dim)
        out = m * rest + u @ (coefficient * (u.t() @ m))
        return _along(out, dim).to(matrix.dtype)

    def dense(self) -> torch.Tensor:
        u, values, sigma = self.work_state()
        eye = torch.eye(self.size, dtype=u.dtype, device=u.device)
        return (u * values) @ u.t() + sigma[0] * (eye - u @ u.t())


class KroneckerVectorSide(Side):
    """``ā āᵀ`` from the running mean row ``ā`` (Eva); Sherman–Morrison, no decomposition.

    ``(b bᵀ + γI)⁻¹ v = (v − b (bᵀv) / (γ + bᵀb)) / γ`` with ``b = ā / √s``.
    """

    kind = "kvec"
    capture = "moments"
    state_powers = (0.5,)  # ā: ā āᵀ = F

    def _identity_state(self) -> list[torch.Tensor]:
        return [self.factor[0].to(self.inv_dtype).clone()]

    def _compute_state(self, damping: float) -> list[torch.Tensor]:
        return [self.factor[0].to(self.inv_dtype)]

    def mean_eigenvalue(self) -> torch.Tensor:
        (mean,) = self.work_state()
        return mean.dot(mean) / self.size

    def _solve_coefficients(
        self, state: list[torch.Tensor], damping: float
    ) -> tuple[torch.Tensor, ...]:
        (b,) = state  # ā/√s: (ā/√s)(ā/√s)ᵀ = F/s
        return b, damping + b.dot(b)

    def solve(self, matrix: torch.Tensor, damping: float, dim: int) -> torch.Tensor:
        b, denominator = self.coefficients(damping)
        m = _along(matrix.to(b.dtype), dim)
        projection = b @ m  # bᵀ v for every column
        out = (m - torch.outer(b, projection) / denominator) / damping
        return _along(out, dim).to(matrix.dtype)

    def dense(self) -> torch.Tensor:
        (mean,) = self.work_state()
        return torch.outer(mean, mean)


class DiagonalSide(Side):
    """``diag(E[row²])``, the diagonal of ``F``: the cheapest fallback."""

    kind = "diagonal"
    capture = "moments"
    state_powers = (1.0,)

    def _identity_state(self) -> list[torch.Tensor]:
        return [self.factor[1].to(self.inv_dtype).clone()]

    def _compute_state(self, damping: float) -> list[torch.Tensor]:
        return [self.factor[1].to(self.inv_dtype)]

    def mean_eigenvalue(self) -> torch.Tensor:
        return self.work_state()[0].mean()

    def _solve_coefficients(
        self, state: list[torch.Tensor], damping: float
    ) -> tuple[torch.Tensor, ...]:
        (diagonal,) = state
        inv = diagonal.add(damping).reciprocal_()
        return (inv.unsqueeze(1),)

    def solve(self, matrix: torch.Tensor, damping: float, dim: int) -> torch.Tensor:
        (inv,) = self.coefficients(damping)
        m = _along(matrix.to(inv.dtype), dim)
        return _along(inv * m, dim).to(matrix.dtype)

    def dense(self) -> torch.Tensor:
        return torch.diag(self.work_state()[0])


def make_side(
    spec: SideSpec,
    name: str,
    size: int,
    *,
    method: str,
    device: torch.device,
    factor_dtype: torch.dtype,
    inv_dtype: torch.dtype,
    relative: bool,
    basis_tolerance: float | None = None,
) -> Side:
    """The :class:`Side` for ``spec`` (``method`` and ``basis_tolerance`` matter to
    ``'exact'`` only)."""
    kw: dict[str, object] = {
        "device": device,
        "factor_dtype": factor_dtype,
        "inv_dtype": inv_dtype,
        "relative": relative,
    }
    if spec.kind == "exact":
        return ExactSide(name, size, method=method, basis_tolerance=basis_tolerance, **kw)
    if spec.kind == "lowrank":
        assert spec.rank is not None
        return LowRankSide(name, size, rank=spec.rank, **kw)
    if spec.kind == "kvec":
        return KroneckerVectorSide(name, size, **kw)  # type: ignore[arg-type]
    return DiagonalSide(name, size, **kw)  # type: ignore[arg-type]


#: Names of a side's second-order tensors, in :meth:`Side.state_tensors` order (messages).
_STATE_NAMES: dict[str, tuple[str, ...]] = {
    "exact-eigen": ("eigenvectors", "eigenvalues"),
    "exact-inverse": ("damped inverse",),
    "lowrank": ("basis U", "eigenvalues", "sigma"),
    "kvec": ("mean row",),
    "diagonal": ("diagonal",),
}


def checkpoint_shapes(
    spec: SideSpec, size: int, method: str = "eigen"
) -> tuple[tuple[int, ...], list[tuple[str, tuple[int, ...]]], tuple[int, ...] | None]:
    """What a side held as ``spec`` checkpoints, for validating a state dict.

    Returns the running average's shape, the second-order tensors' names and
    shapes (in :meth:`Side.state_tensors` order; ``method`` matters to
    ``'exact'`` only) and the low-rank warm-start basis's shape (``None`` for
    other kinds). Computed from the spec alone: nothing is allocated.
    """
    n = size
    factor = (n, n) if spec.capture == "gram" else (2, n)
    warm: tuple[int, ...] | None = None
    if spec.kind == "exact":
        key = f"exact-{method}"
        shapes: list[tuple[int, ...]] = [(n, n), (n,)] if method == "eigen" else [(n, n)]
    elif spec.kind == "lowrank":
        assert spec.rank is not None
        key, shapes = "lowrank", [(n, spec.rank), (spec.rank,), (1,)]
        warm = (n, min(n, spec.rank + OVERSAMPLING))
    else:
        key, shapes = spec.kind, [(n,)]
    return factor, list(zip(_STATE_NAMES[key], shapes, strict=True)), warm


def split_damping(
    damping: float, a_scale: float, g_scale: float, relative: bool = False
) -> tuple[float, float]:
    """``(γ_A, γ_G)`` with ``γ_A γ_G = γ`` for a layer solved side by side (spec §8).

    Martens & Grosse's π-split, ``γ_A = π√γ``, ``γ_G = √γ/π`` with
    ``π = √(mean eig(A) / mean eig(G))`` (``π = 1`` if either is 0), the means
    of the matrices the damping is added to
    (:meth:`Side.scaled_mean_eigenvalue`). Under relative damping both are 1,
    so ``√γ`` each; ``relative=True`` says so without the scales.
    """
    root = math.sqrt(damping)
    if relative or a_scale <= 0.0 or g_scale <= 0.0:
        return root, root
    pi = math.sqrt(a_scale / g_scale)
    if not math.isfinite(pi) or pi == 0.0:
        return root, root
    return root * pi, root / pi
