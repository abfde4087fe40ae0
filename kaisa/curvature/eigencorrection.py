"""Eigenvalue-corrected K-FAC (spec §11): the Kronecker eigenbases, rescaled from the gradients.

K-FAC's exact solve divides the rotated gradient ``V = Q_Gᵀ ∇ Q_A`` by the
products of the factors' eigenvalues ``λ_G λ_Aᵀ``. Those products are the
Kronecker approximation of the curvature's diagonal *in the Kronecker
eigenbasis*; eigenvalue correction (George et al. 2018, EKFAC) replaces them
by a running average of what that diagonal measures, the squared rotated
gradient::

    S ← ξ S + (1 − ξ) V²                     (element-wise, every step)

Two solves use it (``eigenvalue_correction``):

``'ekfac'``, EKFAC's solve at the factors' scale::

    Ŝ = S · μ / mean(S),   μ = mean(λ_G λ_Aᵀ) = mean(λ_G) · mean(λ_A)
    P = Q_G [V ⊘ (Ŝ + γ)] Q_Aᵀ

``μ`` is the factors' own measure of the layer's curvature in total (the
trace of ``G ⊗ A`` over its size), taken as the damping sees them: 1 under
relative damping, where each factor is divided by its mean eigenvalue. The
factors say how much curvature the layer has; ``S`` says how it is spread
over the eigen-directions. EKFAC's paper estimates ``S`` from per-example
gradients. The batch gradient's square is about ``1/B`` of that where noise
dominates (and larger where the mean gradient dominates), so used as it is
the steps come out far too large (on the equivalence tests' attention model
the weights moved by 20–40 in one step at lr 0.1, where K-FAC's solve moves
them by 0.004). Rescaled to ``μ``, the batch size drops out. With
``S ∝ λ_G λ_Aᵀ`` this is K-FAC's exact eigen solve (spec §4) in either
damping mode.

``'adam'``, Adam's second moment in the Kronecker eigenbasis (as SOAP runs
Adam in Shampoo's)::

    P = Q_G [V ⊘ (S + γ s̄)^½] Q_Aᵀ,   s̄ = mean(S) (relative) or 1 (absolute)

A side held diagonal (the budget's cheapest representation) has the identity
as its eigenbasis: its rotation is skipped (``Q = None`` below), so a layer
with one exact and one diagonal side is corrected in the exact side's basis
only (a one-sided eigenbasis) and a layer with two diagonal sides gets
per-coordinate second moments. Low-rank and Kronecker-vector sides have no
explicit basis; a layer with one of them is not corrected.
The bases come from the factors and are refreshed at the inverse interval;
``S`` follows the gradients at every step, which is what lets a stale basis
keep its scale right.

``S`` has the weight's shape and lives with the layer's gradient workers (the
ranks that precondition it, KAISA's placement): every gradient worker sees the
same averaged gradient and so holds the same ``S``; nothing is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kaisa.choices import EigenCorrection

__all__ = ["Basis", "EigenScales", "corrected_solve", "divisor", "rotate_in", "rotate_out"]

#: A side's eigenbasis ``Q``, or ``None`` for the identity (a diagonal side).
Basis = torch.Tensor | None


def rotate_in(grad: torch.Tensor, qa: Basis, qg: Basis, dtype: torch.dtype) -> torch.Tensor:
    """``V = Q_Gᵀ ∇ Q_A`` in ``dtype`` (a new tensor); a ``None`` basis is the identity."""
    if qg is None and qa is None:
        return grad.to(dtype, copy=True)
    v = grad.to(dtype)  # (a product below makes the new tensor)
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


def divisor(
    scales: torch.Tensor,
    damping: float,
    correction: EigenCorrection,
    relative: bool,
    kron_mean: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """What the rotated gradient is divided by, element-wise (a new tensor, never 0).

    ``'ekfac'``: ``S·μ/mean(S) + γ``, ``μ = kron_mean`` the mean of the
    eigenvalue products as the damping sees them (1 under relative damping);
    ``'adam'``: ``(S + γ s̄)^½`` (module docstring).
    """
    tiny = torch.finfo(scales.dtype).tiny
    if correction == "ekfac":
        mu = torch.as_tensor(kron_mean, dtype=scales.dtype, device=scales.device)
        # (An all-zero S, a layer whose gradient was 0: Ŝ = 0 and P = 0, not 0/0.)
        ratio = mu / scales.mean().clamp_min(tiny)
        # (No tensor made from γ: on a GPU that would be a host copy per layer and step.)
        out = torch.mul(scales, ratio).add_(damping)
        return out if damping > tiny else out.clamp_min_(tiny)
    if correction == "adam":
        shift = damping * scales.mean() if relative else damping
        return (scales + shift).clamp_min_(tiny).sqrt_()
    raise ValueError(f"no eigenvalue-corrected solve for {correction!r}")


def corrected_solve(
    grad: torch.Tensor,
    qa: Basis,
    qg: Basis,
    scales: torch.Tensor,
    damping: float,
    correction: EigenCorrection,
    relative: bool,
    kron_mean: torch.Tensor | float = 1.0,
    *,
    rotated: torch.Tensor | None = None,
) -> torch.Tensor:
    """``P = Q_G [(Q_Gᵀ ∇ Q_A) ⊘ D] Q_Aᵀ`` for a ``(g, a)`` gradient, ``D`` = :func:`divisor`.

    ``None`` for a basis: the identity (a diagonal side). Computed in the
    bases' dtype (``S``'s when both are ``None``), returned in ``grad``'s.
    ``rotated``: ``Q_Gᵀ ∇ Q_A`` already computed (:func:`rotate_in`; divided in place).
    """
    v = rotate_in(grad, qa, qg, _dtype(qa, qg, scales)) if rotated is None else rotated
    v.div_(divisor(scales, damping, correction, relative, kron_mean))
    return rotate_out(v, qa, qg).to(grad.dtype)


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
        correction: EigenCorrection,
        relative: bool,
        kron_mean: torch.Tensor | float = 1.0,
    ) -> torch.Tensor:
        """Fold this step's rotated gradient into ``S``, then the corrected solve.

        ``None`` for a basis: the identity (a diagonal side).
        """
        v = rotate_in(grad, qa, qg, _dtype(qa, qg, self.scales))
        k = self.updates
        xi = min(decay, k / (k + 1))
        folded = (self.scales * xi).addcmul_(v, v, value=1.0 - xi)
        # An overflowed gradient must not poison S for the rest of the run (no
        # host sync: S stays as it was when anything is not finite). One
        # reduction tells: a NaN or inf entry makes the sum NaN or inf (so does
        # a sum of finite entries past the dtype's range, which keeps S too).
        finite = torch.isfinite(folded.sum())
        torch.where(finite, folded, self.scales, out=self.scales)
        self.updates += 1
        return corrected_solve(
            grad, qa, qg, self.scales, damping, correction, relative, kron_mean, rotated=v
        )

    def nbytes(self) -> int:
        return self.scales.numel() * self.scales.element_size()
