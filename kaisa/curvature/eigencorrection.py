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
per-coordinate second moments. A low-rank side holds its factor's top ``k``
eigenvectors ``U`` and one value for the rest of its space: its rotation is
``Uᵀ``, and ``S`` gets one more row (G) or column (A) for the rest, the
mean square of the gradient's component outside ``U``'s span per direction
of the other side (one value where both sides are low-rank):
:func:`rotate_partial`, :func:`partial_solve`. The rest is formed by
projection and never rotated into, so a rank-``k`` side costs products
with ``k`` columns, not ``n``. Kronecker-vector sides have no explicit
basis; a layer with one is not corrected.
The bases come from the factors and are refreshed at the inverse interval;
``S`` follows the gradients at every step, which is what lets a stale basis
keep its scale right.

``S`` has the weight's shape and lives with the layer's gradient workers (the
ranks that precondition it, KAISA's placement): every gradient worker sees the
same averaged gradient and so holds the same ``S``; nothing is sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kaisa.choices import EigenCorrection

__all__ = [
    "Basis",
    "EigenScales",
    "PartialRotation",
    "corrected_solve",
    "divisor",
    "has_rest",
    "partial_solve",
    "rotate_in",
    "rotate_out",
    "rotate_partial",
    "scale_counts",
    "scale_length",
]

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
    shares: torch.Tensor | None = None,
    mean: float | None = None,
) -> torch.Tensor:
    """What the rotated gradient is divided by, element-wise (a new tensor, never 0).

    ``'ekfac'``: ``S·μ/mean(S) + γ``, ``μ = kron_mean`` the mean of the
    eigenvalue products as the damping sees them (1 under relative damping);
    ``'adam'``: ``(S + γ s̄)^½`` (module docstring). ``shares``: the share of
    the layer's coordinates each entry of ``S`` stands for (summing to 1; a
    low-rank side's rest stands for many, see :func:`scale_counts`), which
    the mean weighs by; ``None``: an equal share each. ``mean``: that mean
    already read on the host (:meth:`EigenScales.solve` on a CPU); ``None``:
    computed here, without leaving the device.
    """
    tiny = torch.finfo(scales.dtype).tiny
    m: torch.Tensor | float = (
        mean if mean is not None else (scales.mean() if shares is None else (scales * shares).sum())
    )
    if correction == "ekfac":
        # (An all-zero S, a layer whose gradient was 0: Ŝ = 0 and P = 0, not 0/0.)
        ratio: torch.Tensor | float
        if isinstance(m, float) and not isinstance(kron_mean, torch.Tensor):
            ratio = kron_mean / max(m, tiny)  # on the host: no 0-d tensor operations
        else:
            mu = torch.as_tensor(kron_mean, dtype=scales.dtype, device=scales.device)
            ratio = mu / torch.as_tensor(m, dtype=scales.dtype, device=scales.device).clamp_min(
                tiny
            )
        # (No tensor made from γ: on a GPU that would be a host copy per layer and step.)
        out = torch.mul(scales, ratio).add_(damping)
        return out if damping > tiny else out.clamp_min_(tiny)
    if correction == "adam":
        shift = damping * m if relative else damping
        return (scales + shift).clamp_min_(tiny).sqrt_()
    raise ValueError(f"no eigenvalue-corrected solve for {correction!r}")


def _reads_on_host(t: torch.Tensor) -> bool:
    """Whether reading a scalar of ``t`` costs no device sync (it lives in host memory)."""
    return t.device.type == "cpu"


def has_rest(basis: Basis) -> bool:
    """Whether ``basis`` is a low-rank side's ``U`` (``n × k``, ``k < n``): a rest is left."""
    return basis is not None and basis.shape[1] < basis.shape[0]


def scale_length(size: int, rank: int | None) -> int:
    """Entries of ``S`` along a side of ``size``: one per eigen-direction, and one for the
    rest of a low-rank side (``rank`` its ``k``; ``None`` for an exact or diagonal side)."""
    return size if rank is None or rank >= size else rank + 1


def scale_counts(
    g_size: int, a_size: int, g_rank: int | None, a_rank: int | None, like: torch.Tensor
) -> torch.Tensor | None:
    """How many coordinates each entry of ``S`` stands for; ``None`` when every entry is one."""
    sides = ((g_size, scale_length(g_size, g_rank)), (a_size, scale_length(a_size, a_rank)))
    if all(n == size for size, n in sides):
        return None
    lengths = []
    for size, n in sides:
        counts = torch.ones(n, dtype=like.dtype, device=like.device)
        counts[-1] = size - (n - 1)  # 1 where the side has no rest
        lengths.append(counts)
    return torch.outer(lengths[0], lengths[1])


def _left(q: Basis, m: torch.Tensor) -> torch.Tensor:
    return m if q is None else q.t() @ m


def _left_back(q: Basis, m: torch.Tensor) -> torch.Tensor:
    return m if q is None else q @ m


def _right(m: torch.Tensor, q: Basis) -> torch.Tensor:
    return m if q is None else m @ q


def _right_back(m: torch.Tensor, q: Basis) -> torch.Tensor:
    return m if q is None else m @ q.t()


@dataclass
class PartialRotation:
    """A gradient ``∇`` seen from bases of which one or both are low-rank (``U``, ``n × k``).

    In each side's ``[U, rest]`` split ``∇`` has four blocks: ``T = U_Gᵀ ∇ U_A``
    (``k_G × k_A``, one coordinate each), ``R_G = (I − U_GU_Gᵀ) ∇ U_A`` (one
    mean square per A-direction), ``R_A = U_Gᵀ ∇ (I − U_AU_Aᵀ)`` (one per
    G-direction) and ``R = (I − U_GU_Gᵀ) ∇ (I − U_AU_Aᵀ)`` (one mean square).
    ``squares`` gathers them as ``S`` holds them: ``[[T², R_A], [R_G, R]]`` (the
    rest rows and columns only for low-rank sides). An exact side's basis is
    square (no rest), a diagonal side's ``None`` (the identity). The rest
    blocks are formed, not inferred from norms: ``‖x‖² − ‖Uᵀx‖²`` loses its
    digits where ``x`` lies almost in ``U``'s span (a gradient's rows lie
    mostly in the span of ``A``'s top eigenvectors), and a rest's small
    divisor would magnify what rounding left.
    """

    top: torch.Tensor
    squares: torch.Tensor
    rest_g: torch.Tensor | None
    rest_a: torch.Tensor | None
    rest_both: torch.Tensor | None


def rotate_partial(grad: torch.Tensor, qa: Basis, qg: Basis, dtype: torch.dtype) -> PartialRotation:
    """:class:`PartialRotation` of a ``(g, a)`` gradient, in ``dtype``."""
    w = grad.to(dtype)
    m, n = w.shape
    has_g, has_a = has_rest(qg), has_rest(qa)
    rest_g = rest_a = rest_both = None
    if has_g:
        right = _right(w, qa)  # ∇ U_A
        top = _left(qg, right)
        assert qg is not None
        rest_g = right - qg @ top
    if has_a:
        assert qa is not None
        left = _left(qg, w)  # U_Gᵀ ∇
        if not has_g:
            top = left @ qa
        rest_a = left - top @ qa.t()
        if has_g:
            assert qg is not None and rest_g is not None
            rest_both = (w - qg @ left) - rest_g @ qa.t()
    k_g, k_a = top.shape
    squares = top.square()
    if rest_a is not None:
        column = rest_a.square().sum(1, keepdim=True).div_(n - k_a)
        squares = torch.cat([squares, column], 1)
    if rest_g is not None:
        row = rest_g.square().sum(0, keepdim=True).div_(m - k_g)
        if rest_both is not None:
            both = rest_both.square().sum().div((m - k_g) * (n - k_a))
            row = torch.cat([row, both.reshape(1, 1)], 1)
        squares = torch.cat([squares, row], 0)
    return PartialRotation(top, squares, rest_g, rest_a, rest_both)


def partial_solve(
    rotation: PartialRotation, qa: Basis, qg: Basis, divided_by: torch.Tensor
) -> torch.Tensor:
    """``P`` from a :class:`PartialRotation` and the divisor of each entry of ``S``.

    Each block is divided by its entries (``T`` coordinate by coordinate, a
    rest block by its one value per direction of the other side) and rotated
    back: ``P = (U_G (T ⊘ D_T) + R_G ⊘ D_G) U_Aᵀ + U_G (R_A ⊘ D_A) + R / D_R``,
    the products in whichever of two orders takes fewer multiply-adds.
    """
    top = rotation.top
    k_g, k_a = top.shape
    x = top / divided_by[:k_g, :k_a]
    rest_g = None if rotation.rest_g is None else rotation.rest_g / divided_by[k_g, :k_a]
    rest_a = None if rotation.rest_a is None else rotation.rest_a / divided_by[:k_g, k_a : k_a + 1]
    # With an A rest, U_G [X U_Aᵀ + R_A ⊘ D_A] (+ (R_G ⊘ D_G) U_Aᵀ) takes one product
    # with U_G where the order below takes two: fewer multiply-adds unless a G rest
    # makes the gradient wider than tall.
    if rest_a is not None and (rest_g is None or rest_g.shape[0] >= rest_a.shape[1]):
        out = _left_back(qg, _right_back(x, qa).add_(rest_a))
        if rest_g is not None:
            out = out.add_(_right_back(rest_g, qa))
    else:
        inner = _left_back(qg, x)  # (g, k_a)
        if rest_g is not None:
            inner = inner + rest_g
        out = _right_back(inner, qa)
        if rest_a is not None:
            out = out + _left_back(qg, rest_a)
    if rotation.rest_both is not None:
        out = out + rotation.rest_both / divided_by[k_g, k_a]
    return out


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
    mean: float | None = None,
) -> torch.Tensor:
    """``P = Q_G [(Q_Gᵀ ∇ Q_A) ⊘ D] Q_Aᵀ`` for a ``(g, a)`` gradient, ``D`` = :func:`divisor`.

    ``None`` for a basis: the identity (a diagonal side). Computed in the
    bases' dtype (``S``'s when both are ``None``), returned in ``grad``'s.
    ``rotated``: ``Q_Gᵀ ∇ Q_A`` already computed (:func:`rotate_in`; divided in place).
    ``mean``: ``mean(S)`` already read on the host (:func:`divisor`).
    """
    v = rotate_in(grad, qa, qg, _dtype(qa, qg, scales)) if rotated is None else rotated
    v.div_(divisor(scales, damping, correction, relative, kron_mean, mean=mean))
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
    #: The share of the layer's coordinates each entry stands for (:func:`scale_counts`
    #: over their total), which :func:`divisor`'s mean weighs by; ``None``: equal shares.
    shares: torch.Tensor | None = None

    @staticmethod
    def zeros(
        g_size: int,
        a_size: int,
        device: torch.device,
        dtype: torch.dtype,
        g_rank: int | None = None,
        a_rank: int | None = None,
    ) -> EigenScales:
        """``S = 0`` for a ``(g_size, a_size)`` layer; a side of rank ``k`` (low-rank)
        gets ``k`` entries and one for its rest (:func:`scale_length`)."""
        shape = (scale_length(g_size, g_rank), scale_length(a_size, a_rank))
        scales = torch.zeros(shape, device=device, dtype=dtype)
        counts = scale_counts(g_size, a_size, g_rank, a_rank, scales)
        shares = None if counts is None else counts / (g_size * a_size)
        return EigenScales(scales, shares=shares)

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
        dtype = _dtype(qa, qg, self.scales)
        partial = rotate_partial(grad, qa, qg, dtype) if has_rest(qa) or has_rest(qg) else None
        k = self.updates
        xi = min(decay, k / (k + 1))
        if partial is not None:
            folded = (self.scales * xi).add_(partial.squares, alpha=1.0 - xi)
        else:
            v = rotate_in(grad, qa, qg, dtype)
            folded = (self.scales * xi).addcmul_(v, v, value=1.0 - xi)
        # An overflowed gradient must not poison S for the rest of the run: S
        # stays as it was when anything is not finite. One reduction tells: a
        # NaN or inf entry makes the sum NaN or inf (so does a sum of finite
        # entries past the dtype's range, which keeps S too).
        total = folded.sum()
        mean = None
        if _reads_on_host(folded):
            # On the host reading the sum costs nothing: a branch replaces the
            # masked copy, and the sum gives the mean the divisor needs.
            value = float(total)
            if math.isfinite(value):
                self.scales = folded
                shares = self.shares
                mean = value / folded.numel() if shares is None else float(folded.mul(shares).sum())
        else:  # no host sync on an accelerator
            torch.where(torch.isfinite(total), folded, self.scales, out=self.scales)
        self.updates += 1
        if partial is not None:
            d = divisor(self.scales, damping, correction, relative, kron_mean, self.shares, mean)
            return partial_solve(partial, qa, qg, d).to(grad.dtype)
        return corrected_solve(
            grad,
            qa,
            qg,
            self.scales,
            damping,
            correction,
            relative,
            kron_mean,
            rotated=v,
            mean=mean,
        )

    def nbytes(self) -> int:
        return self.scales.numel() * self.scales.element_size()
