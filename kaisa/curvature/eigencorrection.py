"""Eigenvalue-corrected K-FAC (spec §11): the Kronecker eigenbases, rescaled from the gradients.

K-FAC's exact solve divides the rotated gradient ``V = Q_Gᵀ ∇ Q_A`` by the
products of the factors' eigenvalues ``λ_G λ_Aᵀ``. Those products are the
Kronecker approximation of the curvature's diagonal *in the Kronecker
eigenbasis*; eigenvalue correction (George et al. 2018, EKFAC) replaces them
by a running average of what that diagonal measures, the squared rotated
gradient::

    S ← ξ S + (1 − ξ) V²                     (element-wise, every step)
    P = Q_G [V ⊘ (S + γ s̄)^p] Q_Aᵀ

``p = ½`` is Adam's second moment in the Kronecker eigenbasis, as SOAP runs
Adam in Shampoo's; it is what ``eigenvalue_correction='adam'`` uses. ``p = 1``
is EKFAC's solve, whose paper estimates ``S`` from per-example gradients:
with the batch gradient's square it is not offered, because that ``S`` is
about ``1/B`` of the per-example one when noise dominates, and the steps come
out far too large (measured on the equivalence tests' attention model: the
weights moved by 20–40 in one step at lr 0.1 where the exact solve moves them
by 0.004). ``s̄`` is ``mean(S)`` under relative damping and 1 under absolute.
A side held diagonal (the budget's cheapest representation) has the identity
as its eigenbasis: its rotation is skipped (``Q = None`` below), so a layer
with one exact and one diagonal side is corrected in the exact side's basis
only (a one-sided eigenbasis) and a layer with two diagonal sides gets
per-coordinate second moments. Low-rank and Kronecker-vector sides have no
explicit basis; a layer with one of them is not corrected.
The bases come from the factors and are refreshed at the inverse interval;
``S`` follows the gradients at every step, which is what lets a stale basis
keep its scale right. With ``S = λ_G λ_Aᵀ`` and ``p = 1``
this is the exact eigen solve of spec §4.

``S`` has the weight's shape and lives with the layer's gradient workers (the
ranks that precondition it, KAISA's placement): every gradient worker sees the
same averaged gradient and so holds the same ``S``; nothing is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kaisa.choices import EigenCorrection

__all__ = ["Basis", "EigenScales", "corrected_solve", "correction_power", "rotate_in", "rotate_out"]

#: A side's eigenbasis ``Q``, or ``None`` for the identity (a diagonal side).
Basis = torch.Tensor | None


def correction_power(correction: EigenCorrection) -> float:
    """``p`` of the corrected solve: ½ for ``'adam'``."""
    if correction == "adam":
        return 0.5
    raise ValueError(f"no eigenvalue correction power for {correction!r}")


def rotate_in(grad: torch.Tensor, qa: Basis, qg: Basis, dtype: torch.dtype) -> torch.Tensor:
    """``V = Q_Gᵀ ∇ Q_A`` in ``dtype`` (a new tensor); a ``None`` basis is the identity."""
    v = grad.to(dtype, copy=True)
    if qg is not None:
        v = qg.t() @ v
    if qa is not None:
        v = v @ qa
    return v


def rotate_out(v: torch.Tensor, qa: Basis, qg: Basis) -> torch.Tensor:
    """``Q_G V Q_Aᵀ``; a ``None`` basis is the identity."""
    if qg is not None:
        v = qg @ v
    if qa is not None:
        v = v @ qa.t()
    return v


def _dtype(qa: Basis, qg: Basis, scales: torch.Tensor) -> torch.dtype:
    basis = qa if qa is not None else qg
    return basis.dtype if basis is not None else scales.dtype


def corrected_solve(
    grad: torch.Tensor,
    qa: Basis,
    qg: Basis,
    scales: torch.Tensor,
    damping: float,
    power: float,
    relative: bool,
) -> torch.Tensor:
    """``P = Q_G [(Q_Gᵀ ∇ Q_A) ⊘ (S + γ s̄)^p] Q_Aᵀ`` for a ``(g, a)`` gradient.

    ``None`` for a basis: the identity (a diagonal side). Computed in the
    bases' dtype (``S``'s when both are ``None``), returned in ``grad``'s.
    """
    v = rotate_in(grad, qa, qg, _dtype(qa, qg, scales))
    v.div_(_denominator(scales, damping, power, relative))
    return rotate_out(v, qa, qg).to(grad.dtype)


def _denominator(
    scales: torch.Tensor, damping: float, power: float, relative: bool
) -> torch.Tensor:
    shift = damping * scales.mean() if relative else damping
    # (An all-zero S, a layer whose gradient was 0: P = 0 rather than 0/0.)
    denominator = (scales + shift).clamp_min_(torch.finfo(scales.dtype).tiny)
    return denominator.sqrt_() if power == 0.5 else denominator.pow_(power)


@dataclass
class EigenScales:
    """The running average ``S`` of one layer's squared rotated gradient, and its count.

    ``updates``: steps folded in so far; the ``k``-th uses the decay
    ``min(ξ, k/(k+1))``, so the first replaces the start (a zero ``S`` is
    never divided by) and the average is an equal-weight mean until the
    exponential one takes over (as ``factor_init='first_batch'`` does for the
    factors).
    """

    scales: torch.Tensor
    updates: int = 0

    @staticmethod
    def zeros(g_size: int, a_size: int, device: torch.device, dtype: torch.dtype) -> EigenScales:
        return EigenScales(torch.zeros(g_size, a_size, device=device, dtype=dtype))

    def solve(
        self,
        grad: torch.Tensor,
        qa: Basis,
        qg: Basis,
        damping: float,
        decay: float,
        power: float,
        relative: bool,
    ) -> torch.Tensor:
        """Fold this step's rotated gradient into ``S``, then the corrected solve.

        ``None`` for a basis: the identity (a diagonal side).
        """
        v = rotate_in(grad, qa, qg, _dtype(qa, qg, self.scales))
        k = self.updates
        xi = min(decay, k / (k + 1))
        folded = (self.scales * xi).addcmul_(v, v, value=1.0 - xi)
        # An overflowed gradient must not poison S for the rest of the run (no
        # host sync: S stays as it was when anything is not finite).
        self.scales.copy_(torch.where(torch.isfinite(folded).all(), folded, self.scales))
        self.updates += 1
        v.div_(_denominator(self.scales, damping, power, relative))
        return rotate_out(v, qa, qg).to(grad.dtype)

    def nbytes(self) -> int:
        return self.scales.numel() * self.scales.element_size()
