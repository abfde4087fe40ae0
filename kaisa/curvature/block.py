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

import warnings
from typing import Literal

import torch

from kaisa.curvature.linalg import (
    DecompositionError,
    eigen_outer_inverse,
    mean_scale,
    precondition_eigen,
    precondition_inverse,
)
from kaisa.curvature.representations import (
    ExactSide,
    LowRankSide,
    Side,
    SideSpec,
    make_side,
    split_damping,
)

ComputeMethod = Literal["eigen", "inverse"]
DampingMode = Literal["absolute", "relative"]
FactorInit = Literal["identity", "first_batch"]
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
    A layer with a side that is not exact is solved side by side,
    ``P = (G/s_G + γ_G I)⁻¹ ∇ (A/s_A + γ_A I)⁻¹`` with ``γ_A γ_G = γ``
    (:func:`~kaisa.curvature.representations.split_damping`); its exact sides
    then use the eigen form whatever ``method`` says.
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
    ) -> None:
        self.name = name
        self.damping_mode: DampingMode = damping_mode
        self.factor_init: FactorInit = factor_init
        #: Factor updates folded in so far (drives ``factor_init='first_batch'``).
        self.updates = 0
        self.a_size = a_size
        self.g_size = g_size
        self.method: ComputeMethod = method
        self.inv_dtype = inv_dtype
        specs = {"a": SideSpec.parse(a_spec), "g": SideSpec.parse(g_spec)}
        #: Both sides exact: spec §4's exact solve (eigen or inverse).
        self.exact = all(spec.kind == "exact" for spec in specs.values())
        side_method = method if self.exact else "eigen"
        self.eigen_outer_product = eigen_outer_product and self.exact and method == "eigen"
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
        """Give this rank second-order state: that of the identity factors."""
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
        """Refresh one side's second-order state; ``False`` (state kept) on failure."""
        self.allocate_second_order()
        try:
            self.sides[which].refresh(damping)
        except DecompositionError as error:
            warnings.warn(
                f"kaisa: layer {self.name!r}: factor {which.upper()} could not be decomposed "
                f"({error}); keeping its previous second-order state",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
        return True

    def finish_update(self, damping: float) -> None:
        """After both sides' state is present: form ``1 ⊘ (λ_G λ_Aᵀ + γ)`` if asked.

        The eigenvalues are kept (``a + g`` elements) so that a later failed
        decomposition still leaves a consistent pair of eigenbasis and values.
        """
        if self.eigen_outer_product:
            self.outer_inverse = eigen_outer_inverse(*self._eigenvalues(), damping)

    def _exact_sides(self) -> tuple[ExactSide, ExactSide]:
        a, g = self.sides["a"], self.sides["g"]
        assert isinstance(a, ExactSide) and isinstance(g, ExactSide)
        return a, g

    def _eigenvalues(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(λ_G, λ_A)`` as the damping sees them: raw, or divided by their means."""
        a, g = self._exact_sides()
        dg, da = g.eigen[1], a.eigen[1]
        if self.damping_mode == "relative":
            return dg / mean_scale(dg), da / mean_scale(da)
        return dg, da

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        """The preconditioned gradient ``P`` for a ``(g_size, a_size)`` gradient."""
        if not self.exact:
            a, g = self.sides["a"], self.sides["g"]
            relative = self.damping_mode == "relative"
            scales = (
                (1.0, 1.0)
                if relative
                else (
                    float(a.mean_eigenvalue()),
                    float(g.mean_eigenvalue()),
                )
            )
            gamma_a, gamma_g = split_damping(damping, *scales, relative=relative)
            # Contiguous: the gradient broadcast sends tensors in memory order.
            return a.solve(g.solve(grad, gamma_g, dim=0), gamma_a, dim=1).contiguous()
        a, g = self._exact_sides()
        if self.method == "eigen":
            qa, qg = a.eigen[0], g.eigen[0]
            if self.outer_inverse is not None:
                return precondition_eigen(grad, qa, qg, outer_inverse=self.outer_inverse)
            dg, da = self._eigenvalues()
            return precondition_eigen(grad, qa, qg, da=da, dg=dg, damping=damping)
        return precondition_inverse(grad, a.state_tensors()[0], g.state_tensors()[0])

    # -- accounting and checkpoints ----------------------------------------------
    def factor_bytes(self) -> int:
        return sum(side.factor_bytes() for side in self.sides.values())

    def second_order_bytes(self) -> int:
        total = sum(side.state_bytes() for side in self.sides.values())
        if self.outer_inverse is not None:
            total += self.outer_inverse.numel() * self.outer_inverse.element_size()
        return total

    def state_dict(self) -> dict[str, object]:
        state: dict[str, object] = {
            "a": self.a.clone(),
            "g": self.g.clone(),
            "updates": self.updates,
            "representation": [str(spec) for spec in self.specs],
        }
        if self.has_second_order:
            state["second_order"] = {
                k: [t.clone() for t in v] for k, v in self.second_order.items()
            }
        if self.outer_inverse is not None:
            state["outer_inverse"] = self.outer_inverse.clone()
        warm = {
            which: side.warm_basis.clone()
            for which, side in self.sides.items()
            if isinstance(side, LowRankSide) and side.warm_basis is not None
        }
        if warm:
            state["warm_start"] = warm
        return state

    def load_state_dict(self, state: dict[str, object]) -> None:
        a, g = state["a"], state["g"]
        if not isinstance(a, torch.Tensor) or not isinstance(g, torch.Tensor):
            raise TypeError(f"layer {self.name!r}: factors in the state dict must be tensors")
        saved = state.get("representation", ["exact", "exact"])
        mine = [str(spec) for spec in self.specs]
        if list(saved) != mine:  # type: ignore[call-overload]
            raise ValueError(
                f"layer {self.name!r}: the state dict holds representations {list(saved)} "  # type: ignore[call-overload]
                f"(A, G), this preconditioner {mine}; pass the same curvature choice"
            )
        if a.shape != self.a.shape or g.shape != self.g.shape:
            raise ValueError(
                f"layer {self.name!r}: state dict factors have shapes {tuple(a.shape)} and "
                f"{tuple(g.shape)}, expected {tuple(self.a.shape)} and {tuple(self.g.shape)}"
            )
        updates = state.get("updates", 0)
        if isinstance(updates, bool) or not isinstance(updates, int) or updates < 0:
            raise ValueError(
                f"layer {self.name!r}: state dict 'updates' must be an integer >= 0; "
                f"got {updates!r}"
            )
        second = state.get("second_order")
        loaded: dict[str, list[torch.Tensor]] = {}
        if isinstance(second, dict):
            for which, tensors in second.items():
                expected = self.sides[which].allocate() if which in self.sides else None
                if (
                    expected is None
                    or len(tensors) != len(expected)
                    or any(t.shape != e.shape for t, e in zip(tensors, expected, strict=False))
                ):
                    raise ValueError(
                        f"layer {self.name!r}: second-order state of {which!r} does not match "
                        f"the representations {[str(spec) for spec in self.specs]} (A, G)"
                    )
                loaded[which] = tensors
        self.a.copy_(a)
        self.g.copy_(g)
        self.updates = updates
        for which, tensors in loaded.items():
            for target, value in zip(self.sides[which].state, tensors, strict=True):  # type: ignore[index]
                target.copy_(value)
        warm = state.get("warm_start")
        if isinstance(warm, dict):
            for which, basis in warm.items():
                side = self.sides.get(which)
                if isinstance(side, LowRankSide) and isinstance(basis, torch.Tensor):
                    side.warm_basis = basis.to(device=self.a.device).clone()
        outer = state.get("outer_inverse")
        if isinstance(outer, torch.Tensor) and self.eigen_outer_product:
            self.outer_inverse = outer.to(device=self.a.device, dtype=self.inv_dtype).clone()
