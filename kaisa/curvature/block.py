"""One layer's curvature: Kronecker factors, second-order state, preconditioning.

A :class:`KroneckerBlock` owns the running averages ``A`` and ``G`` of one
layer and, on the ranks that are the layer's gradient workers, the
second-order state derived from them (eigenbases and eigenvalues, or damped
inverses). It is plain tensors and the formulas of :mod:`kaisa.curvature.linalg`;
who computes which part and who receives it is decided elsewhere.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

from kaisa.curvature.linalg import (
    DecompositionError,
    damped_inverse,
    eigen_outer_inverse,
    fold_running_average,
    mean_scale,
    precondition_eigen,
    precondition_inverse,
    symmetric_eigen,
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
    """Factors ``A`` (``a_size²``) and ``G`` (``g_size²``) and their second-order state.

    Factors start as the identity. Second-order state is allocated only on
    ranks that need it (:meth:`allocate_second_order`), starting as the exact
    decomposition of the identity, so a failed first decomposition leaves a
    well-defined state.

    ``factor_init='first_batch'`` makes the first factor update replace the
    identity (see :func:`effective_decay`). ``damping_mode='relative'`` divides
    each factor by its mean eigenvalue (``trace / size``) before damping:
    the eigen method solves ``(G ⊗ A / (m_G m_A) + γI)⁻¹ vec(∇)`` and the
    inverse method forms ``(F / m_F + γI)⁻¹``, so ``γ`` is relative to each
    layer's own curvature scale instead of absolute (spec §4 uses absolute).
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
    ) -> None:
        self.name = name
        self.damping_mode: DampingMode = damping_mode
        self.factor_init: FactorInit = factor_init
        #: Factor updates folded in so far (drives ``factor_init='first_batch'``).
        self.updates = 0
        self.a_size = a_size
        self.g_size = g_size
        self.method: ComputeMethod = method
        self.eigen_outer_product = eigen_outer_product and method == "eigen"
        self.inv_dtype = inv_dtype
        self.a = torch.eye(a_size, dtype=factor_dtype, device=device)
        self.g = torch.eye(g_size, dtype=factor_dtype, device=device)
        # Second-order state by factor: eigen -> [Q, λ]; inverse -> [(F + γI)⁻¹].
        self.second_order: dict[Factor, list[torch.Tensor]] = {}
        self.outer_inverse: torch.Tensor | None = None
        self.outer_damping: float | None = None

    # -- factors ---------------------------------------------------------------
    def fold(self, a_batch: torch.Tensor, g_batch: torch.Tensor, decay: float) -> None:
        """Fold batch factors into the running averages (see :func:`effective_decay`)."""
        decay = effective_decay(decay, self.updates, self.factor_init)
        fold_running_average(self.a, a_batch, decay)
        fold_running_average(self.g, g_batch, decay)
        self.updates += 1

    def factor(self, which: Factor) -> torch.Tensor:
        return self.a if which == "a" else self.g

    # -- second-order state ------------------------------------------------------
    @property
    def has_second_order(self) -> bool:
        return bool(self.second_order)

    def allocate_second_order(self) -> None:
        """Give this rank second-order state: the decomposition of the identity."""
        if self.second_order:
            return
        device = self.a.device
        for which, size in (("a", self.a_size), ("g", self.g_size)):
            state = [torch.eye(size, dtype=self.inv_dtype, device=device)]
            if self.method == "eigen":
                state.append(torch.ones(size, dtype=self.inv_dtype, device=device))
            self.second_order[which] = state  # type: ignore[index]
        if self.eigen_outer_product:
            self.finish_update(0.0)

    def state_tensors(self, which: Factor) -> list[torch.Tensor]:
        """Buffers describing one factor's decomposition: ``[Q, λ]`` (eigen) or ``[(F+γI)⁻¹]``.

        This is what the decomposing rank broadcasts to the layer's other
        gradient workers; on those ranks the buffers are the receive targets.
        """
        self.allocate_second_order()
        return self.second_order[which]

    def decompose(self, which: Factor, damping: float) -> bool:
        """Recompute one factor's second-order state; ``False`` (state kept) on failure."""
        buffers = self.state_tensors(which)
        factor = self.factor(which)
        try:
            if self.method == "eigen":
                q, values = symmetric_eigen(factor, self.inv_dtype)
                buffers[0].copy_(q)
                buffers[1].copy_(values)
            else:
                if self.damping_mode == "relative":
                    diagonal = factor.diagonal().to(
                        torch.promote_types(factor.dtype, torch.float32)
                    )
                    factor = factor / mean_scale(diagonal).to(factor.dtype)
                buffers[0].copy_(damped_inverse(factor, damping, self.inv_dtype))
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
        """After both factors' state is present: form ``1 ⊘ (λ_G λ_Aᵀ + γ)`` if asked.

        The eigenvalues are kept (``a + g`` elements) so that a later failed
        decomposition still leaves a consistent pair of eigenbasis and values.
        """
        if self.eigen_outer_product:
            self.outer_inverse = eigen_outer_inverse(*self._eigenvalues(), damping)
            self.outer_damping = damping

    def _eigenvalues(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(λ_G, λ_A)`` as the damping sees them: raw, or divided by their means."""
        dg, da = self.second_order["g"][1], self.second_order["a"][1]
        if self.damping_mode == "relative":
            return dg / mean_scale(dg), da / mean_scale(da)
        return dg, da

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        """The preconditioned gradient ``P`` for a ``(g_size, a_size)`` gradient."""
        if self.method == "eigen":
            qa, qg = self.second_order["a"][0], self.second_order["g"][0]
            if self.outer_inverse is not None:
                return precondition_eigen(grad, qa, qg, outer_inverse=self.outer_inverse)
            dg, da = self._eigenvalues()
            return precondition_eigen(grad, qa, qg, da=da, dg=dg, damping=damping)
        return precondition_inverse(grad, self.second_order["a"][0], self.second_order["g"][0])

    # -- accounting and checkpoints ----------------------------------------------
    def factor_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.g))

    def second_order_bytes(self) -> int:
        tensors = [t for ts in self.second_order.values() for t in ts]
        total = sum(t.numel() * t.element_size() for t in tensors)
        if self.outer_inverse is not None:
            total += self.outer_inverse.numel() * self.outer_inverse.element_size()
        return total

    def state_dict(self) -> dict[str, object]:
        state: dict[str, object] = {
            "a": self.a.clone(),
            "g": self.g.clone(),
            "updates": self.updates,
        }
        if self.second_order:
            state["second_order"] = {
                k: [t.clone() for t in v] for k, v in self.second_order.items()
            }
        if self.outer_inverse is not None:
            state["outer_inverse"] = self.outer_inverse.clone()
            state["outer_damping"] = self.outer_damping
        return state

    def load_state_dict(self, state: dict[str, object]) -> None:
        a, g = state["a"], state["g"]
        if not isinstance(a, torch.Tensor) or not isinstance(g, torch.Tensor):
            raise TypeError(f"layer {self.name!r}: factors in the state dict must be tensors")
        if a.shape != self.a.shape or g.shape != self.g.shape:
            raise ValueError(
                f"layer {self.name!r}: state dict factors have shapes {tuple(a.shape)} and "
                f"{tuple(g.shape)}, expected {tuple(self.a.shape)} and {tuple(self.g.shape)}"
            )
        self.a.copy_(a)
        self.g.copy_(g)
        updates = state.get("updates", 0)
        if isinstance(updates, bool) or not isinstance(updates, int) or updates < 0:
            raise ValueError(
                f"layer {self.name!r}: state dict 'updates' must be an integer >= 0; "
                f"got {updates!r}"
            )
        self.updates = updates
        second = state.get("second_order")
        if isinstance(second, dict):
            self.second_order = {
                which: [t.to(device=self.a.device, dtype=self.inv_dtype).clone() for t in tensors]
                for which, tensors in second.items()
            }
        outer = state.get("outer_inverse")
        if isinstance(outer, torch.Tensor):
            self.outer_inverse = outer.to(device=self.a.device, dtype=self.inv_dtype).clone()
            damping = state.get("outer_damping")
            self.outer_damping = float(damping) if isinstance(damping, (int, float)) else None
