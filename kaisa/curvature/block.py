"""One layer's curvature: two sides (``A`` and ``G``), each in its own representation.

A :class:`KroneckerBlock` owns one :class:`~kaisa.curvature.representations.Side`
per Kronecker factor: the running average and, on the ranks that are the
layer's gradient workers, the second-order state derived from it. With both
sides exact it solves spec §4's exact system; otherwise it applies the two
sides' damped inverses one after the other (spec §8). It is plain tensors and
the formulas of :mod:`kaisa.curvature.linalg` and
:mod:`kaisa.curvature.representations`; who computes which part and who
receives it is decided elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kaisa.choices import ComputeMethod, DampingMode, EigenCorrection, FactorInit
from kaisa.curvature.eigencorrection import EigenScales, scale_length
from kaisa.curvature.linalg import (
    DecompositionError,
    compute_dtype,
    eigen_error_bound,
    eigen_outer_inverse,
    precondition_eigen,
    precondition_inverse,
)
from kaisa.curvature.representations import (
    ExactSide,
    LowRankSide,
    Side,
    SideSpec,
    checkpoint_shapes,
    make_side,
    split_damping,
)
from kaisa.validation import check_count, check_tensor
from kaisa.warn import warn

Factor = Literal["a", "g"]


def effective_decay(decay: float, updates: int, init: FactorInit) -> float:
    """The decay used for a layer's factor update after ``updates`` earlier ones.

    ``'identity'`` (spec §3): always ``decay``. ``'first_batch'``:
    ``min(decay, k / (k + 1))`` at the ``k``-th update (``k = 0, 1, …``): the
    first update replaces the identity, the next ones keep the equal-weight mean
    of all batch factors so far, and from ``k / (k + 1) ≥ decay`` on it is the
    usual exponential average.
    """
    if init == "identity":
        return decay
    return min(decay, updates / (updates + 1))


#: A batch factor whose trace exceeds this multiple of its running average's
#: (after the first update) is held back: an outlier batch if the next factor
#: update is back at the average's scale, the start of a lasting change of
#: scale if the next one is still far beyond it (:data:`RESCALE_RATIO`; see
#: :data:`OUTLIER_PATIENCE`).
OUTLIER_RATIO = 1e3
#: After a held batch, a next factor update still beyond this multiple of the
#: running average (which the held batch never entered) shows that the scale
#: changed, and the average restarts from it; within it, the held batch was an
#: outlier. ``√OUTLIER_RATIO``, halfway on a log scale: one corrupted batch is
#: followed by ordinary ones (about 1x), while a scale that grows keeps its
#: growth. Measured (session 52): as HuggingFace BERT's attention starts to
#: learn, its query and key projections' ``G`` factors jump 1600-9800x their
#: averages in one update and stay 110-700x above them in the next.
RESCALE_RATIO = OUTLIER_RATIO**0.5
#: A side's eigendecomposition, run in float32, is redone in float64 when the
#: damped solve's error bound (:func:`~kaisa.curvature.linalg.eigen_error_bound`,
#: ``r = eps·λ_max / (λ_min + γ_eff)`` in the scaled eigenvalues) exceeds this.
#: Measured (``tests/curvature/test_eigen_accuracy.py``): float32 solves were
#: up to 1.1 × ``r`` off a float64 run (so within about 1% below it) and up to
#: 1200% off on ill-conditioned factors with small damping; with the
#: decomposition in float64 the solve is within 2.2e-3 of the exact solve of
#: the factor as held.
EIGEN_TOLERANCE = 1e-2
#: What is left after the float64 decomposition: the running average itself,
#: held in float32, made the solve up to this × ``r`` off a float64 run's on
#: the random (rotated) factors of the measurement, far less on graded ones
#: and on real layers (SmallCNN's 3137-wide ``fc1``: ``r = 0.27``, the float32
#: decomposition 0.56% off, the float64 one 1e-6); scaled by
#: ``eps(factor_dtype) / eps(float32)`` for bfloat16 factors.
FACTOR_ROUNDING = 0.03
#: Beyond this estimate of what the factors' own rounding leaves (``FACTOR_ROUNDING
#: · r``), the front door warns once per layer: only ``factor_dtype=torch.float64``
#: or a larger damping helps.
HELD_FACTOR_WARNING = 0.1

#: After this many consecutive held updates of a layer the next one beyond
#: :data:`RESCALE_RATIO` is taken in, and the running average restarts from
#: it: the scale has changed, not spiked. One: a lasting change (a
#: LayerScale's factor, ``γ²``-proportional, growing by orders of magnitude
#: from ``γ = 1e-6`` in its first steps; attention starting to learn) costs
#: one factor update, while one outlier batch among ordinary ones is still
#: refused.
OUTLIER_PATIENCE = 1

#: The side representations whose eigenbasis is explicit, so that the
#: eigenvalue correction can rotate into it: exact (``Q`` of the factor),
#: low-rank (its top ``k`` eigenvectors ``U``, and the rest of the space as one
#: direction per direction of the other side) and diagonal (the identity).
CORRECTED_KINDS = ("exact", "lowrank", "diagonal")

#: What :meth:`KroneckerBlock.fold_unless_outlier` did with a batch.
FoldStatus = Literal["folded", "held", "spike", "rescaled"]


def factor_trace(factor: torch.Tensor, capture: str) -> torch.Tensor:
    """The trace of a factor held as a gram (``n × n``) or as row moments (``2 × n``)."""
    return factor.diagonal().sum() if capture == "gram" else factor[1].sum()


def trace_ratio(batch_trace: float, running_trace: float) -> float:
    """A batch factor's trace over its running average's (0 while the average's is not positive)."""
    return batch_trace / running_trace if running_trace > 0.0 else 0.0


class KroneckerBlock:
    """The ``A`` side (``a_size``) and ``G`` side (``g_size``) of one layer.

    Each side is held as its :class:`SideSpec` says (default: both exact).
    Factors start as the identity (the moments of a ``'kvec'`` or
    ``'diagonal'`` side: mean 0, mean square 1). Second-order state is
    allocated only on ranks that need it (:meth:`allocate_second_order`),
    starting as that of the identity, so a failed first refresh leaves a
    well-defined state.

    ``factor_init='first_batch'`` makes the first factor update replace the
    identity (see :func:`effective_decay`). ``damping_mode='relative'`` divides
    each factor by its mean eigenvalue (``trace / size``) before damping:
    the exact eigen method solves ``(G ⊗ A / (m_G m_A) + γI)⁻¹ vec(∇)`` and the
    inverse method forms ``(F / m_F + γI)⁻¹``, so ``γ`` is relative to each
    layer's own curvature scale instead of absolute (spec §4 uses absolute).
    Each side computes and applies its scale (:meth:`Side.scale`,
    :meth:`Side.scaled_state`); the block only reads the scaled eigenvalues.
    A layer with a side that is not exact is solved side by side,
    ``P = (G/s_G + γ_G I)⁻¹ ∇ (A/s_A + γ_A I)⁻¹`` with ``γ_A γ_G = γ``
    (:func:`~kaisa.curvature.representations.split_damping`); its exact sides
    then use the eigen form whatever ``method`` says. ``basis_tolerance``
    (``eigenbasis_tolerance``): a refresh of an exact eigen side keeps the
    held eigenbasis while it diagonalises the factor to within this share
    (:func:`~kaisa.curvature.linalg.held_basis`), and refreshes only the
    eigenvalues.
    """

    def __init__(
        self,
        name: str,
        a_size: int,
        g_size: int,
        *,
        device: torch.device,
        factor_dtype: torch.dtype,
        inv_dtype: torch.dtype,
        method: ComputeMethod,
        eigen_outer_product: bool,
        damping_mode: DampingMode = "absolute",
        factor_init: FactorInit = "identity",
        a_spec: SideSpec | str = "exact",
        g_spec: SideSpec | str = "exact",
        correction: EigenCorrection = "off",
        correction_decay: float = 0.99,
        basis_tolerance: float | None = None,
    ) -> None:
        self.name = name
        self.damping_mode: DampingMode = damping_mode
        self.factor_init: FactorInit = factor_init
        #: Factor updates folded in so far (drives ``factor_init='first_batch'``).
        self.updates = 0
        #: Consecutive outlier batches refused (see :meth:`fold_unless_outlier`).
        self.outliers = 0
        self.a_size = a_size
        self.g_size = g_size
        self.method: ComputeMethod = method
        self.inv_dtype = inv_dtype
        specs = {"a": SideSpec.parse(a_spec), "g": SideSpec.parse(g_spec)}
        #: Both sides exact: spec §4's exact solve (eigen or inverse).
        self.exact = all(spec.kind == "exact" for spec in specs.values())
        side_method = method if self.exact else "eigen"
        #: Eigenvalue correction (``'ekfac'`` or ``'adam'``) of a layer whose sides have explicit
        #: eigenbases: exact (eigen method), low-rank (top ``k`` and a rest) or
        #: diagonal (the identity); ``'off'``
        #: for a layer with a Kronecker-vector side (spec §11).
        self.correction: EigenCorrection = (
            correction
            if side_method == "eigen"
            and all(spec.kind in CORRECTED_KINDS for spec in specs.values())
            else "off"
        )
        self.correction_decay = correction_decay
        self.eigen_outer_product = (
            eigen_outer_product and self.exact and method == "eigen" and self.correction == "off"
        )
        #: ``S`` of the corrected solve, on the ranks that precondition the layer.
        self.eigen_scales: EigenScales | None = None
        self.sides: dict[Factor, Side] = {}
        for which, size in (("a", a_size), ("g", g_size)):
            spec = specs[which]
            spec.check_size(size, f"layer {name!r}, factor {which.upper()}")
            self.sides[which] = make_side(  # type: ignore[index]
                spec,
                f"{name}.{which}",
                size,
                method=side_method,
                device=device,
                factor_dtype=factor_dtype,
                inv_dtype=inv_dtype,
                relative=damping_mode == "relative",
                basis_tolerance=basis_tolerance,
            )
        self.outer_inverse: torch.Tensor | None = None

    @property
    def specs(self) -> tuple[SideSpec, SideSpec]:
        """``(A's, G's)`` representations."""
        return self.sides["a"].spec, self.sides["g"].spec

    # -- factors ---------------------------------------------------------------
    @property
    def a(self) -> torch.Tensor:
        """The running average of ``A`` (its two moment rows for a moments side)."""
        return self.sides["a"].factor

    @property
    def g(self) -> torch.Tensor:
        """The running average of ``G`` (its two moment rows for a moments side)."""
        return self.sides["g"].factor

    def fold(self, a_batch: torch.Tensor, g_batch: torch.Tensor, decay: float) -> None:
        """Fold batch factors into the running averages (see :func:`effective_decay`)."""
        decay = effective_decay(decay, self.updates, self.factor_init)
        self.sides["a"].fold(a_batch, decay)
        self.sides["g"].fold(g_batch, decay)
        self.updates += 1

    def traces(self, a_batch: torch.Tensor, g_batch: torch.Tensor) -> list[torch.Tensor]:
        """``[tr A_batch, tr G_batch, tr A, tr G]`` (0-d tensors; read them in one sync)."""
        (a_spec, g_spec), sides = self.specs, self.sides
        return [
            factor_trace(a_batch, a_spec.capture),
            factor_trace(g_batch, g_spec.capture),
            factor_trace(sides["a"].factor, a_spec.capture),
            factor_trace(sides["g"].factor, g_spec.capture),
        ]

    def fold_unless_outlier(
        self, a_batch: torch.Tensor, g_batch: torch.Tensor, decay: float, traces: list[float]
    ) -> FoldStatus:
        """:meth:`fold`, unless the batch is an outlier (``traces`` from :meth:`traces`).

        After the first update, a batch whose ``A`` or ``G`` trace exceeds
        :data:`OUTLIER_RATIO` times the running average's is held back
        (``'held'``, not folded): one batch of inputs ×1e6 would otherwise
        dominate the average for hundreds of updates. The next update tells
        which it was. Back within :data:`RESCALE_RATIO` of the average: it is
        folded as usual, and the held batch proves an outlier (``'spike'``).
        Still beyond it (beyond the outlier ratio too, once
        :data:`OUTLIER_PATIENCE` updates were held): the scale has changed, as
        a LayerScale's does while ``γ`` grows from ``1e-6`` or attention's
        query and key factors do as it starts to learn, and the running
        average restarts from this batch (``'rescaled'``; the old average,
        under ``1/RESCALE_RATIO`` of it, is dropped). Otherwise ``'folded'``.
        """
        a_batch_trace, g_batch_trace, a_trace, g_trace = traces
        ratio = max(trace_ratio(a_batch_trace, a_trace), trace_ratio(g_batch_trace, g_trace))
        if ratio > OUTLIER_RATIO and self.updates > 0 and self.outliers < OUTLIER_PATIENCE:
            self.outliers += 1
            return "held"
        held, self.outliers = self.outliers, 0
        if held and ratio > RESCALE_RATIO:
            self.fold(a_batch, g_batch, 0.0)
            return "rescaled"
        self.fold(a_batch, g_batch, decay)
        return "spike" if held else "folded"

    def factor(self, which: Factor) -> torch.Tensor:
        return self.sides[which].factor

    # -- second-order state ------------------------------------------------------
    @property
    def has_second_order(self) -> bool:
        return any(side.state for side in self.sides.values())

    @property
    def second_order(self) -> dict[Factor, list[torch.Tensor]]:
        """Each allocated side's second-order tensors (``[Q, λ]``, ``[(F+γI)⁻¹]``, …)."""
        return {which: side.state for which, side in self.sides.items() if side.state}

    def allocate_second_order(self) -> None:
        """Give this rank second-order state: that of the identity factors (and ``S = 0``)."""
        if self.correction != "off" and self.eigen_scales is None:
            device = self.sides["a"].factor.device
            # S (squared gradients) is kept in at least float32: it does not fit float16.
            a_spec, g_spec = self.specs
            self.eigen_scales = EigenScales.zeros(
                self.g_size,
                self.a_size,
                device,
                compute_dtype(self.inv_dtype),
                g_rank=g_spec.rank,
                a_rank=a_spec.rank,
            )
        if self.has_second_order:
            return
        for side in self.sides.values():
            side.allocate()
        if self.eigen_outer_product:
            self.finish_update(0.0)

    def state_tensors(self, which: Factor) -> list[torch.Tensor]:
        """Buffers describing one side's second-order state (see :class:`Side`).

        This is what the refreshing rank broadcasts to the layer's other
        gradient workers; on those ranks the buffers are the receive targets.
        """
        self.allocate_second_order()
        return self.sides[which].state_tensors()

    def decompose(self, which: Factor, damping: float) -> bool:
        """Refresh one side's second-order state; ``False`` (state kept) on failure.

        A failure is warned about, at the user's line.
        """
        self.allocate_second_order()
        try:
            self.sides[which].refresh(damping)
        except DecompositionError as error:
            warn(
                f"kaisa: layer {self.name!r}: factor {which.upper()} could not be decomposed "
                f"({error}); keeping its previous second-order state",
            )
            return False
        return True

    def basis_kept(self, which: Factor) -> bool:
        """Whether side ``which``'s last refresh kept its held eigenbasis
        (``eigenbasis_tolerance``)."""
        side = self.sides[which]
        return isinstance(side, ExactSide) and side.basis_kept

    def can_keep_basis(self, which: Factor) -> bool:
        """Whether a refresh of side ``which`` may keep its eigenbasis: exact, eigen
        method, with ``eigenbasis_tolerance`` (``adaptive_intervals`` counts these)."""
        side = self.sides[which]
        return (
            isinstance(side, ExactSide)
            and side.method == "eigen"
            and side.basis_tolerance is not None
        )

    def refine(self, sides: Sequence[Factor], damping: float) -> dict[Factor, float]:
        """Redo in float64 the float32 eigendecompositions among ``sides`` that are too coarse.

        ``sides``: those this rank has just decomposed. A side held exact with
        the eigen method (and no eigenvalue correction) whose decomposition ran
        in float32 is decomposed again in float64 (and stored in
        ``inv_dtype``) when the damped solve's error bound exceeds
        :data:`EIGEN_TOLERANCE`: an ill-conditioned factor with small damping.
        In the exact solve the bound takes the other side's largest eigenvalue
        from its current state (refreshed just before when this rank
        decomposes both sides, ``colocate_factors``). One host sync.

        Returns, for each side redone, how far off a float64 run the solve may
        still be because the factor itself is held in ``factor_dtype``
        (:data:`FACTOR_ROUNDING`; a failed float64 attempt keeps the float32
        state and is not listed).
        """
        candidates = [which for which in sides if self._refinable(which)]
        if not candidates:
            return {}
        bounds = torch.stack([self._eigen_bound(which, damping) for which in candidates])
        redone: dict[Factor, float] = {}
        for which, bound in zip(candidates, bounds.tolist(), strict=True):
            if not bound > EIGEN_TOLERANCE:
                continue
            side = self.sides[which]
            assert isinstance(side, ExactSide)
            try:
                side.refresh_in_float64()
            except DecompositionError:
                continue
            held = torch.finfo(side.factor.dtype).eps / torch.finfo(torch.float32).eps
            redone[which] = FACTOR_ROUNDING * bound * held
        return redone

    def _refinable(self, which: Factor) -> bool:
        side = self.sides[which]
        return (
            isinstance(side, ExactSide)
            and side.method == "eigen"
            and not side.basis_kept  # its basis was decomposed before, and still fits
            and self.correction == "off"
            and compute_dtype(side.factor.dtype) != torch.float64
        )

    def _eigen_bound(self, which: Factor, damping: float) -> torch.Tensor:
        """:func:`eigen_error_bound` of one exact eigen side at ``damping`` (a 0-d tensor)."""
        side = self.sides[which]
        values = side.scaled_state()[1]
        eps = torch.finfo(compute_dtype(side.factor.dtype)).eps
        if self.exact:
            other = self.sides["g" if which == "a" else "a"]
            return eigen_error_bound(values, damping, eps, other.scaled_state()[1]).float()
        a, g = self.sides["a"], self.sides["g"]
        gamma_a, gamma_g = split_damping(
            damping, a.scaled_mean_eigenvalue(), g.scaled_mean_eigenvalue()
        )
        return eigen_error_bound(values, gamma_a if which == "a" else gamma_g, eps).float()

    def finish_update(self, damping: float) -> None:
        """After both sides' state is present: form ``1 ⊘ (λ_G λ_Aᵀ + γ)`` if asked.

        The eigenvalues are kept (``a + g`` elements) so that a later failed
        decomposition still leaves a consistent pair of eigenbasis and values.
        """
        for side in self.sides.values():
            side.invalidate()  # a column broadcast may have written the state
        if self.eigen_outer_product:
            # Computed in at least float32, stored in inv_dtype.
            outer = eigen_outer_inverse(*self._eigenvalues(), damping)
            self.outer_inverse = outer.to(self.inv_dtype)

    def _exact_sides(self) -> tuple[ExactSide, ExactSide]:
        a, g = self.sides["a"], self.sides["g"]
        assert isinstance(a, ExactSide) and isinstance(g, ExactSide)
        return a, g

    def _eigenvalues(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(λ_G, λ_A)`` as the damping sees them: those of ``G/s_G`` and ``A/s_A``
        (in at least float32)."""
        a, g = self._exact_sides()
        return g.scaled_state()[1], a.scaled_state()[1]

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        """The preconditioned gradient ``P`` for a ``(g_size, a_size)`` gradient."""
        if self.eigen_scales is not None:
            # Solved in at least float32 whatever inv_dtype (spec §4): work_state().
            a, g = self.sides["a"], self.sides["g"]
            qa, qg = (
                side.work_state()[0] if isinstance(side, (ExactSide, LowRankSide)) else None
                for side in (a, g)
            )
            relative = self.damping_mode == "relative"
            # μ, the mean eigenvalue product as the damping sees it ('ekfac'):
            # each scaled factor's mean is 1 under relative damping.
            kron_mean = 1.0 if relative else g.mean_eigenvalue() * a.mean_eigenvalue()
            return self.eigen_scales.solve(
                grad,
                qa,
                qg,
                damping,
                self.correction_decay,
                self.correction,
                relative,
                kron_mean,
            ).contiguous()
        if not self.exact:
            a, g = self.sides["a"], self.sides["g"]
            scales = a.scaled_mean_eigenvalue(), g.scaled_mean_eigenvalue()
            gamma_a, gamma_g = split_damping(damping, *scales)
            # Contiguous: the gradient broadcast sends tensors in memory order.
            return a.solve(g.solve(grad, gamma_g, dim=0), gamma_a, dim=1).contiguous()
        a, g = self._exact_sides()
        # Solved in at least float32 whatever inv_dtype (spec §4): work_state().
        if self.method == "eigen":
            qa, qg = a.work_state()[0], g.work_state()[0]
            if self.outer_inverse is not None:
                return precondition_eigen(grad, qa, qg, outer_inverse=self.outer_inverse)
            dg, da = self._eigenvalues()
            return precondition_eigen(grad, qa, qg, da=da, dg=dg, damping=damping)
        return precondition_inverse(grad, a.work_state()[0], g.work_state()[0])

    # -- accounting and checkpoints ----------------------------------------------
    def factor_bytes(self) -> int:
        return sum(side.factor_bytes() for side in self.sides.values())

    def second_order_bytes(self) -> int:
        total = sum(side.state_bytes() for side in self.sides.values())
        if self.outer_inverse is not None:
            total += self.outer_inverse.numel() * self.outer_inverse.element_size()
        if self.eigen_scales is not None:
            total += self.eigen_scales.nbytes()
        return total

    def state_dict(self) -> dict[str, object]:
        state: dict[str, object] = {
            "a": self.a.clone(),
            "g": self.g.clone(),
            "updates": self.updates,
            "outliers": self.outliers,
            "representation": [str(spec) for spec in self.specs],
        }
        if self.has_second_order:
            state["second_order"] = {
                k: [t.clone() for t in v] for k, v in self.second_order.items()
            }
        if self.outer_inverse is not None:
            state["outer_inverse"] = self.outer_inverse.clone()
        if self.eigen_scales is not None:
            state["eigen_scales"] = self.eigen_scales.scales.clone()
            state["eigen_scale_updates"] = self.eigen_scales.updates
        warm = {
            which: side.warm_basis.clone()
            for which, side in self.sides.items()
            if isinstance(side, LowRankSide) and side.warm_basis is not None
        }
        if warm:
            state["warm_start"] = warm
        return state

    def layout(self) -> BlockLayout:
        """What this block's checkpoints look like (see :func:`check_block_state`)."""
        return BlockLayout(
            self.name,
            self.a_size,
            self.g_size,
            self.specs,
            self.method,
            self.eigen_outer_product,
            device=self.a.device,
            factor_dtype=self.a.dtype,
            inv_dtype=self.inv_dtype,
            correction=self.correction != "off",
        )

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore a :meth:`state_dict`; all of it is checked first, a refused one changes nothing.

        A state without ``'representation'`` (written before representations
        existed) is read as both sides exact.
        """
        legacy = isinstance(state, Mapping) and "representation" not in state
        self.load_checked(check_block_state(state, self.layout(), legacy=legacy))

    def load_checked(self, checked: CheckedBlockState, second_order: bool = True) -> None:
        """Install a state :func:`check_block_state` accepted for :meth:`layout` (cannot fail).

        Without second-order state in ``checked`` (or with ``second_order``
        off) an allocated block goes back to the identity's state, which the
        caller recomputes from the loaded factors. Low-rank warm starts are
        the checkpoint's (``None`` where it has none).
        """
        self.a.copy_(checked.a)
        self.g.copy_(checked.g)
        self.updates = checked.updates
        self.outliers = checked.outliers
        if second_order and checked.second_order is not None:
            self.allocate_second_order()
            for which, tensors in checked.second_order.items():
                for target, value in zip(self.sides[which].state, tensors, strict=True):
                    target.copy_(value)
                self.sides[which].invalidate()
            if checked.outer_inverse is not None:
                self.outer_inverse = checked.outer_inverse.clone()
            if self.eigen_scales is not None and checked.eigen_scales is not None:
                scales, updates = checked.eigen_scales
                self.eigen_scales.scales.copy_(scales)
                self.eigen_scales.updates = updates
            elif self.eigen_scales is not None:  # none saved: S starts again
                self.eigen_scales.scales.zero_()
                self.eigen_scales.updates = 0
        elif self.has_second_order:
            for side in self.sides.values():
                side.state = []
                side.allocate()
            self.outer_inverse = None
            if self.eigen_outer_product:
                self.finish_update(0.0)
            if self.eigen_scales is not None:
                self.eigen_scales.scales.zero_()
                self.eigen_scales.updates = 0
        for which, side in self.sides.items():
            if isinstance(side, LowRankSide):
                basis = checked.warm_start.get(which)
                side.warm_basis = None if basis is None else basis.clone()


# -- checkpoints: what a block's state dict must hold ------------------------------------

_BLOCK_KEYS = (
    "a",
    "g",
    "updates",
    "outliers",
    "representation",
    "second_order",
    "outer_inverse",
    "warm_start",
    "eigen_scales",
    "eigen_scale_updates",
)
_REQUIRED_BLOCK_KEYS = ("a", "g", "updates", "representation")
#: Keys that only checkpoints written before representations hold (ignored).
_LEGACY_BLOCK_KEYS = ("outer_damping",)
_SIDES: tuple[Factor, Factor] = ("a", "g")


@dataclass(frozen=True)
class BlockLayout:
    """The checkpoint of a block with these sizes, representations and options.

    ``method`` and ``eigen_outer_product`` are the options as given: as in
    :class:`KroneckerBlock`, a layer with a side that is not exact holds its
    exact sides in the eigen form, and the outer product belongs to
    all-exact eigen layers only.
    """

    name: str
    a_size: int
    g_size: int
    specs: tuple[SideSpec, SideSpec]
    method: ComputeMethod
    eigen_outer_product: bool
    device: torch.device
    factor_dtype: torch.dtype
    inv_dtype: torch.dtype
    #: The eigenvalue correction is on (spec §11: its ``S`` is second-order state).
    correction: bool = False

    @property
    def exact(self) -> bool:
        return all(spec.kind == "exact" for spec in self.specs)

    @property
    def side_method(self) -> ComputeMethod:
        return self.method if self.exact else "eigen"

    @property
    def scale_shape(self) -> tuple[int, int]:
        """The shape of the eigenvalue correction's ``S`` (:func:`scale_length` per side)."""
        a_spec, g_spec = self.specs
        return scale_length(self.g_size, g_spec.rank), scale_length(self.a_size, a_spec.rank)

    @property
    def outer(self) -> bool:
        """Whether second-order state comes with ``1 ⊘ (λ_G λ_Aᵀ + γ)``."""
        return (
            self.eigen_outer_product
            and self.exact
            and self.method == "eigen"
            and not self.correction
        )


@dataclass(frozen=True)
class CheckedBlockState:
    """A block's state dict after :func:`check_block_state`: tensors cast, nothing missing.

    ``second_order`` is ``None`` when the state dict has none or the caller
    did not ask for it (``saved_second_order`` tells which).
    """

    a: torch.Tensor
    g: torch.Tensor
    updates: int
    outliers: int
    saved_second_order: bool
    second_order: dict[Factor, list[torch.Tensor]] | None
    outer_inverse: torch.Tensor | None
    warm_start: dict[Factor, torch.Tensor]
    #: ``(S, updates)`` of the eigenvalue correction, when saved and asked for.
    eigen_scales: tuple[torch.Tensor, int] | None = None


def _keys(state: Mapping[object, object], allowed: Sequence[str], where: str) -> None:
    unexpected = sorted(repr(key) for key in state if key not in allowed)
    if unexpected:
        raise ValueError(f"{where} holds unexpected keys {', '.join(unexpected)}")


def check_block_state(
    state: object,
    layout: BlockLayout,
    *,
    legacy: bool = False,
    second_order: bool = True,
) -> CheckedBlockState:
    """Check a block's state dict against ``layout`` completely, changing nothing.

    Keys, representations, factor shapes and dtypes, ``updates`` and ``outliers``, every
    second-order tensor's count and shape (for its side's representation and
    compute method), the eigenvalue outer product, the low-rank warm-start
    basis, and that every tensor is finite. Raises ``TypeError`` (wrong kind)
    or ``ValueError`` (wrong value) naming the layer and what is wrong.

    ``legacy``: a state written before representations existed (no
    ``'representation'``, optional ``'updates'``, both sides exact).
    ``second_order=False``: the second-order tensors are checked but not kept.
    """
    where = f"layer {layout.name!r}"
    if not isinstance(state, Mapping):
        raise TypeError(f"{where}: its state must be a dict; got {type(state).__name__}")
    _keys(state, _BLOCK_KEYS + (_LEGACY_BLOCK_KEYS if legacy else ()), f"{where}: its state")
    required = ("a", "g") if legacy else _REQUIRED_BLOCK_KEYS
    missing = [key for key in required if key not in state]
    if missing:
        raise ValueError(f"{where}: its state lacks the keys {missing}")
    saved = state.get("representation", ["exact", "exact"])
    if (
        not isinstance(saved, (list, tuple))
        or len(saved) != 2
        or not all(isinstance(text, str) for text in saved)
    ):
        raise TypeError(
            f"{where}: 'representation' must be a pair (A, G) of strings; got {saved!r}"
        )
    try:
        saved_specs = [str(SideSpec.parse(text)) for text in saved]
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: 'representation' {list(saved)!r}: {error}") from None
    mine = [str(spec) for spec in layout.specs]
    if saved_specs != mine:
        raise ValueError(
            f"{where}: the state dict holds representations {saved_specs} (A, G), this "
            f"preconditioner {mine}; pass the same curvature choice"
        )
    device = layout.device
    sizes: dict[Factor, int] = {"a": layout.a_size, "g": layout.g_size}
    shapes = {
        which: checkpoint_shapes(spec, sizes[which], layout.side_method)
        for which, spec in zip(_SIDES, layout.specs, strict=True)
    }
    a = check_tensor(state["a"], f"{where}: factor A", shapes["a"][0], device, layout.factor_dtype)
    g = check_tensor(state["g"], f"{where}: factor G", shapes["g"][0], device, layout.factor_dtype)
    updates = check_count(state.get("updates", 0), f"{where}: state dict 'updates'")
    outliers = check_count(state.get("outliers", 0), f"{where}: state dict 'outliers'")

    loaded: dict[Factor, list[torch.Tensor]] | None = None
    has_second = "second_order" in state
    if has_second:
        second = state["second_order"]
        if not isinstance(second, Mapping):
            raise TypeError(
                f"{where}: 'second_order' must be a dict of the sides 'a' and 'g'; "
                f"got {type(second).__name__}"
            )
        if set(second) != {"a", "g"}:
            raise ValueError(
                f"{where}: 'second_order' must hold the sides 'a' and 'g'; got "
                f"[{', '.join(sorted(repr(key) for key in second))}]"
            )
        loaded = {}
        for which, spec in zip(_SIDES, layout.specs, strict=True):
            tensors = second[which]
            expected = shapes[which][1]
            if not isinstance(tensors, (list, tuple)):
                raise TypeError(
                    f"{where}: second-order state of {which!r} must be a list of tensors; "
                    f"got {type(tensors).__name__}"
                )
            got = [
                tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in tensors
            ]
            if len(tensors) != len(expected) or any(
                isinstance(t, torch.Tensor) and tuple(t.shape) != shape
                for t, (_, shape) in zip(tensors, expected, strict=False)
            ):
                method = (
                    f" and compute method {layout.side_method!r}" if spec.kind == "exact" else ""
                )
                described = ", ".join(f"{name} {shape}" for name, shape in expected)
                raise ValueError(
                    f"{where}: second-order state of {which!r} does not match the "
                    f"representations {mine} (A, G){method}: expected {described}; got {got}"
                )
            loaded[which] = [
                check_tensor(
                    t, f"{where}: {name} of {which.upper()}", shape, device, layout.inv_dtype
                )
                for t, (name, shape) in zip(tensors, expected, strict=True)
            ]
    outer: torch.Tensor | None = None
    if "outer_inverse" in state:
        if not layout.outer:
            raise ValueError(
                f"{where}: the state dict holds an eigenvalue outer product ('outer_inverse'), "
                f"which this layer does not use (compute_method {layout.method!r}, "
                f"compute_eigenvalue_outer_product {layout.eigen_outer_product}, "
                f"representations {mine})"
            )
        if not has_second:
            raise ValueError(
                f"{where}: the state dict holds 'outer_inverse' without 'second_order'"
            )
        outer = check_tensor(
            state["outer_inverse"],
            f"{where}: eigenvalue outer product",
            (layout.g_size, layout.a_size),
            device,
            layout.inv_dtype,
        )
    elif layout.outer and has_second:
        raise ValueError(
            f"{where}: the state dict lacks 'outer_inverse', the eigenvalue outer product "
            "of its second-order state"
        )
    warm: dict[Factor, torch.Tensor] = {}
    if "warm_start" in state:
        bases = state["warm_start"]
        if not isinstance(bases, Mapping):
            raise TypeError(f"{where}: 'warm_start' must be a dict; got {type(bases).__name__}")
        _keys(bases, ("a", "g"), f"{where}: 'warm_start'")
        for which in _SIDES:
            if which not in bases:
                continue
            shape = shapes[which][2]
            if shape is None:
                raise ValueError(
                    f"{where}: 'warm_start' holds a basis for {which.upper()}, which is "
                    f"held as {mine[0 if which == 'a' else 1]!r} (only 'lowrank' has one)"
                )
            warm[which] = check_tensor(
                bases[which],
                f"{where}: low-rank warm-start basis of {which.upper()}",
                shape,
                device,
                None,
            )
    scales: tuple[torch.Tensor, int] | None = None
    if "eigen_scales" in state or "eigen_scale_updates" in state:
        if not layout.correction:
            raise ValueError(
                f"{where}: the state dict holds eigenvalue-corrected scales ('eigen_scales'), "
                "which this layer does not use (eigenvalue_correction 'off', or a "
                "Kronecker-vector side)"
            )
        if not has_second:
            raise ValueError(f"{where}: the state dict holds 'eigen_scales' without 'second_order'")
        if "eigen_scales" not in state or "eigen_scale_updates" not in state:
            raise ValueError(
                f"{where}: the state dict must hold both 'eigen_scales' and 'eigen_scale_updates'"
            )
        scales = (
            check_tensor(
                state["eigen_scales"],
                f"{where}: eigenvalue-corrected scales",
                layout.scale_shape,
                device,
                compute_dtype(layout.inv_dtype),
            ),
            check_count(state["eigen_scale_updates"], f"{where}: 'eigen_scale_updates'"),
        )
    _check_second_order_values(where, layout, loaded, outer, scales)
    if not second_order:
        loaded, outer, scales = None, None, None
    return CheckedBlockState(a, g, updates, outliers, has_second, loaded, outer, warm, scales)


def _orthonormality_tolerance(dtype: torch.dtype) -> float:
    """How far ``QᵀQ`` of a stored eigenbasis may be from ``I`` (entry-wise).

    ``1e-3`` in float32 and float64 (an eigendecomposition in float32 of a
    2048-wide factor is about 7e-6 off), ``16 eps`` in bfloat16 (0.125; a
    bfloat16-stored basis is about 4e-3 off). A basis that is not one (a
    corrupted or foreign tensor) is off by order 1.
    """
    return max(1e-3, 16 * torch.finfo(dtype).eps)


def _check_second_order_values(
    where: str,
    layout: BlockLayout,
    loaded: Mapping[Factor, Sequence[torch.Tensor]] | None,
    outer: torch.Tensor | None,
    scales: tuple[torch.Tensor, int] | None,
) -> None:
    """Check that finite second-order tensors are what their representation says they are.

    A finite but wrong state (eigenvalues negated, a basis that is not
    orthonormal, an eigenvalue outer product that is not ``1 ⊘ (λ_G λ_Aᵀ +
    γ)`` of the saved eigenvalues for one ``γ ≥ 0``, negative diagonals or
    scales, a damped inverse with a diagonal entry ``<= 0``) would
    precondition wrongly, even uphill, until the next inverse update: refused
    with a ``ValueError`` naming the layer, the side and the tensor. Computed
    in float64; nothing is changed.
    """
    d = torch.float64
    eigenvalues: dict[Factor, torch.Tensor] = {}
    for which, spec in zip(_SIDES, layout.specs, strict=True):
        tensors = None if loaded is None else loaded.get(which)
        if tensors is None:
            continue
        side = f"{where}: second-order state of {which.upper()}"
        values = [t.to(d) for t in tensors]
        basis: torch.Tensor | None = None
        nonnegative: list[tuple[str, torch.Tensor]] = []
        if spec.kind == "exact" and layout.side_method == "eigen":
            basis, eig = values
            nonnegative.append(("eigenvalues", eig))
            eigenvalues[which] = eig
        elif spec.kind == "exact":
            # (A damped inverse is positive definite; its diagonal is positive.
            # Nothing finer: an ill-conditioned one stored in float32 need not
            # pass a Cholesky test.)
            diagonal = values[0].diagonal()
            if float(diagonal.min()) <= 0.0:
                raise ValueError(
                    f"{side}: the damped inverse has a diagonal entry <= 0 (min "
                    f"{float(diagonal.min()):.3g}); the inverse of a damped factor is "
                    "positive definite"
                )
        elif spec.kind == "lowrank":
            basis, eig, sigma = values
            nonnegative += [("eigenvalues", eig), ("sigma", sigma)]
        elif spec.kind == "diagonal":
            nonnegative.append(("diagonal entries", values[0]))
        for name, tensor in nonnegative:
            if tensor.numel() and float(tensor.min()) < 0.0:
                raise ValueError(
                    f"{side}: negative {name} (min {float(tensor.min()):.3g}); the state "
                    "of a factor (positive semi-definite) has none"
                )
        if basis is not None:
            tolerance = _orthonormality_tolerance(tensors[0].dtype)
            eye = torch.eye(basis.shape[1], dtype=d, device=basis.device)
            error = float((basis.t() @ basis - eye).abs().max())
            if error > tolerance:
                raise ValueError(
                    f"{side}: the eigenbasis is not orthonormal (QᵀQ is {error:.3g} off the "
                    f"identity; tolerance {tolerance:g})"
                )
    if outer is not None and "a" in eigenvalues and "g" in eigenvalues:
        _check_outer_inverse(where, outer, eigenvalues["g"], eigenvalues["a"])
    if scales is not None and float(scales[0].min()) < 0.0:
        raise ValueError(
            f"{where}: negative eigenvalue-corrected scales (min "
            f"{float(scales[0].min()):.3g}); a running average of squares has none"
        )


def _check_outer_inverse(
    where: str, outer: torch.Tensor, g_values: torch.Tensor, a_values: torch.Tensor
) -> None:
    """``outer`` must be ``1 ⊘ (λ_G λ_Aᵀ / c + γ)`` with one ``γ ≥ 0``.

    ``c`` is 1 (absolute damping) or the product of the eigenvalues' means
    (relative damping); the checkpoint does not say which, so either is
    accepted.
    """
    if float(outer.min()) <= 0.0:
        raise ValueError(
            f"{where}: the eigenvalue outer product 'outer_inverse' has entries <= 0 (min "
            f"{float(outer.min()):.3g}); 1 ⊘ (λ_G λ_Aᵀ + γ) is positive"
        )
    d = torch.float64
    denominator = outer.to(d).reciprocal()
    products = torch.outer(g_values.to(d), a_values.to(d))
    means = float(g_values.mean().clamp(min=1e-300) * a_values.mean().clamp(min=1e-300))
    tolerance = 16 * torch.finfo(outer.dtype).eps * float(denominator.abs().max())
    for scale in (1.0, means):
        gamma = denominator - products / scale
        if float(gamma.max() - gamma.min()) <= tolerance and float(gamma.min()) >= -tolerance:
            return
    raise ValueError(
        f"{where}: the eigenvalue outer product 'outer_inverse' is not 1 ⊘ (λ_G λ_Aᵀ + γ) "
        "of the saved eigenvalues for any damping γ >= 0"
    )
