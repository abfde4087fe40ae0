"""The matrix functions of K-FAC, as plain tensor functions (spec §3–4).

Everything here reads like the equations of the spec and is checked against
dense float64 references in ``tests/curvature``. Nothing here knows about
modules, hooks or ranks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch


class DecompositionError(RuntimeError):
    """A factor could not be decomposed (non-finite input or no convergence)."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype decompositions run in: at least float32 whatever the factor dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fold_running_average(factor: torch.Tensor, batch: torch.Tensor, decay: float) -> None:
    """``F ← ξ·F + (1 − ξ)·F_batch`` in place (``ξ = decay``)."""
    factor.mul_(decay).add_(batch.to(factor.dtype), alpha=1.0 - decay)


def symmetric_eigen(
    factor: torch.Tensor, out_dtype: torch.dtype, at_least: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``F = Q diag(λ) Qᵀ`` with ``λ`` clamped at 0; returns ``(Q, λ)`` in ``out_dtype``.

    Runs in at least float32 (``at_least=torch.float64``: in float64) and
    retries in float64 when the first attempt fails to converge. Raises
    :class:`DecompositionError` if the factor is not finite or both attempts
    fail, so the caller can keep its previous state.
    """
    if not all_finite(factor):
        raise DecompositionError("factor holds NaN or Inf")
    last_error: Exception | None = None
    first = torch.promote_types(compute_dtype(factor.dtype), at_least)
    for dtype in (first, torch.float64):
        try:
            values, vectors = torch.linalg.eigh(factor.to(dtype))
        except RuntimeError as error:  # torch.linalg.LinAlgError is a RuntimeError
            last_error = error
            continue
        if all_finite(values, vectors):
            return vectors.to(out_dtype), values.clamp_(min=0.0).to(out_dtype)
        last_error = DecompositionError("eigh returned non-finite values")
    raise DecompositionError(f"eigendecomposition failed: {last_error}") from last_error


def held_basis(
    factor: torch.Tensor, basis: torch.Tensor, tolerance: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(Q, diag(QᵀFQ))`` when the held basis ``Q`` still diagonalises ``F``; else ``None``.

    ``Q`` still diagonalises ``F`` when the off-diagonal share of ``M = QᵀFQ``,
    ``‖M − diag(M)‖_F / ‖M‖_F`` (in ``[0, 1]``; 0 for an eigenbasis of ``F``),
    is at most ``tolerance``. The diagonal (Rayleigh quotients, at least 0 for a
    positive semi-definite ``F``) then stands for the eigenvalues: the best
    values in that basis. For an orthogonal ``Q`` both norms are those of
    ``FQ`` and of ``FQ − Q diag(M)``, so one ``n × n`` product decides (a
    decomposition costs many), in at least float32, with one host sync: the
    check that lets a refresh keep its basis (``eigenbasis_tolerance``).
    """
    dtype = compute_dtype(factor.dtype)
    q = basis.to(dtype)
    fq = factor.to(dtype) @ q
    diagonal = (q * fq).sum(dim=0)
    off = (fq - q * diagonal).norm()
    if not bool(off <= tolerance * fq.norm()):
        return None
    return basis, diagonal.clamp_min(0)


def damped_inverse(factor: torch.Tensor, damping: float, out_dtype: torch.dtype) -> torch.Tensor:
    """``(F + γI)⁻¹`` via Cholesky in at least float32 (float64 on failure)."""
    if not all_finite(factor):
        raise DecompositionError("factor holds NaN or Inf")
    last_error: Exception | None = None
    for dtype in (compute_dtype(factor.dtype), torch.float64):
        damped = factor.to(dtype) + damping * torch.eye(
            factor.shape[0], dtype=dtype, device=factor.device
        )
        chol, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(chol)
        else:
            try:
                inverse = torch.linalg.inv(damped)
            except RuntimeError as error:
                last_error = error
                continue
        if all_finite(inverse):
            return inverse.to(out_dtype)
        last_error = DecompositionError("inverse has non-finite values")
    raise DecompositionError(f"inverse failed: {last_error}") from last_error


def mean_scale(values: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` as a 0-d tensor, never below the dtype's smallest normal.

    Relative damping's scale (read through
    :meth:`kaisa.curvature.representations.Side.scale`, its one user): a
    factor divided by its mean eigenvalue (``trace / size``) has unit mean
    scale, so one damping value means the same in every layer. A factor that
    is all zero keeps a positive divisor.
    """
    return values.mean().clamp(min=torch.finfo(values.dtype).tiny)


def eigen_error_bound(
    values: torch.Tensor, damping: float, eps: float, other: torch.Tensor | None = None
) -> torch.Tensor:
    """How far off a damped solve with an eigendecomposition of precision ``eps`` may be.

    ``values``: one side's eigenvalues as the damping sees them (scaled). The
    solve divides by ``λ + γ`` (a side solved on its own, ``γ`` its share of
    the damping) or, with ``other`` the other side's eigenvalues ``μ``, by
    ``λ μ + γ`` (the exact Kronecker solve). A backward-stable
    eigendecomposition in precision ``eps`` is exact for a factor off by
    about ``eps·λ_max``, so the solve may be off by up to

        r = eps·λ_max / (λ_min + γ_eff),   γ_eff = γ / μ_max (or γ)

    (relative error; the worst pair takes the other side's largest
    eigenvalue). A 0-d tensor: no host sync. Measured on random
    ill-conditioned factors (sides 16–128, eigenvalues spanning up to twelve
    decades, relative and absolute damping 1e-2 to 1e-8;
    ``tests/curvature/test_eigen_accuracy.py``): float32 solves were up to
    1.1 × ``r`` off a float64 run while ``r < 1`` (up to 1200% beyond), so
    ``r ≤ 1e-2`` keeps them within about 1%; with the decomposition alone in
    float64 (the state stored and applied in float32) they were within 2.2e-3
    of the exact solve of the factors as held, whatever ``r``. On a real layer
    (SmallCNN's 3137-wide ``fc1`` after 80 steps, damping 0.03 relative)
    ``r`` was 0.27 and the float32 solve 0.56% off.
    """
    shift: torch.Tensor | float = damping
    if other is not None:
        shift = damping / other.max().clamp(min=torch.finfo(other.dtype).tiny)
    return eps * values.max() / (values.min().clamp(min=0.0) + shift)


def eigen_outer_inverse(
    g_values: torch.Tensor, a_values: torch.Tensor, damping: float
) -> torch.Tensor:
    """``1 ⊘ (λ_G λ_Aᵀ + γ)``, the matrix the eigen method divides by."""
    return torch.outer(g_values, a_values).add_(damping).reciprocal_()


def precondition_eigen(
    grad: torch.Tensor,
    qa: torch.Tensor,
    qg: torch.Tensor,
    da: torch.Tensor | None = None,
    dg: torch.Tensor | None = None,
    damping: float = 0.0,
    outer_inverse: torch.Tensor | None = None,
) -> torch.Tensor:
    """The exact solve ``(G ⊗ A + γI)⁻¹ vec(∇)`` from the factors' eigenbases.

    ``V = Q_Gᵀ ∇ Q_A``, ``V ← V ⊘ (λ_G λ_Aᵀ + γ)``, ``P = Q_G V Q_Aᵀ``.
    ``grad`` is ``(g, a)``. Pass either ``outer_inverse`` (precomputed) or
    ``da``, ``dg`` and ``damping``. Computed in the eigenbases' dtype and
    returned in ``grad``'s dtype.
    """
    dtype = qa.dtype
    v = qg.t() @ grad.to(dtype) @ qa
    if outer_inverse is not None:
        v.mul_(outer_inverse)
    else:
        if da is None or dg is None:
            raise ValueError("precondition_eigen needs outer_inverse or both da and dg")
        v.div_(torch.outer(dg, da).add_(damping))
    return (qg @ v @ qa.t()).to(grad.dtype)


def precondition_inverse(
    grad: torch.Tensor, a_inverse: torch.Tensor, g_inverse: torch.Tensor
) -> torch.Tensor:
    """``P = (G + γI)⁻¹ ∇ (A + γI)⁻¹`` from precomputed damped inverses."""
    dtype = a_inverse.dtype
    return (g_inverse @ grad.to(dtype) @ a_inverse).to(grad.dtype)


def unscale(delta: torch.Tensor, scale: float) -> torch.Tensor:
    """``δ / scale`` (a new tensor), in a dtype with at least float32's range.

    A float16 ``δ`` comes back in float32: the unscaled values would flush to
    zero in float16's range.
    """
    if torch.finfo(delta.dtype).max < torch.finfo(torch.float32).max:
        return delta.float() / scale
    return delta / scale


def split_invariant_g(
    gram: torch.Tensor | None, moments: torch.Tensor | None, world_size: int
) -> None:
    """Divide ``δ`` by the world size in ``G``'s captures, in place (spec §3).

    Under data parallelism each rank's loss is its local mean, so its ``δ``
    is ``N`` times that of one process holding the whole batch; dividing it
    by ``N`` makes ``N`` ranks' averaged factors equal the single process's
    (batch-split invariance). ``gram`` (``δᵀδ``) scales by ``1/N²``;
    ``moments`` (``[Σδ; Σδ²]``) by ``1/N`` and ``1/N²``.
    """
    if world_size == 1:
        return
    n = float(world_size)
    if gram is not None:
        gram.div_(n * n)
    if moments is not None:
        moments[0].div_(n)
        moments[1].div_(n * n)


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every entry of every tensor is finite, as :func:`finite_with_values` decides it.

    One reduction per tensor (a sum, in at least float32) and one host sync;
    only a tensor whose sum is not finite is checked entry by entry. On the
    CPU ``torch.isfinite(t).all()`` of a ``3137 × 3137`` float32 factor took
    25–44 ms at 2 threads, its sum about 1 ms (``benchmarks/refresh_cost.py``):
    the check runs at every refresh.
    """
    return finite_with_values(tensors)[0]


def finite_with_values(
    tensors: Sequence[torch.Tensor], scalars: Sequence[torch.Tensor] = ()
) -> tuple[bool, list[float]]:
    """Whether every entry of ``tensors`` is finite, and ``scalars`` as floats: one host sync.

    A tensor whose sum is finite has only finite entries (NaN and ±inf
    propagate), so one reduction per tensor decides; a non-finite sum is
    re-checked entry by entry, as large finite entries can overflow it. Sums
    accumulate in at least float32 (never in half precision); the values
    travel in float64 only when some tensor already is (not every device
    has it).
    """
    summed = [t.sum(dtype=compute_dtype(t.dtype)) for t in tensors]
    summed += [t.to(compute_dtype(t.dtype)) for t in scalars]
    if not summed:
        return True, []
    common = functools.reduce(torch.promote_types, (v.dtype for v in summed))
    values = torch.stack([v.to(common) for v in summed]).tolist()
    sums, rest = values[: len(tensors)], values[len(tensors) :]
    finite = all(
        math.isfinite(value) or bool(t.isfinite().all())
        for value, t in zip(sums, tensors, strict=True)
    )
    return finite, rest


def kl_clip_scale(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], lr: float, kl_clip: float
) -> float:
    """``ν = min(1, sqrt(κ / |s|))`` with ``s = lr² Σ Σ (P ⊙ ∇)`` over ``(P, ∇)`` pairs.

    ``ν = 1`` when ``s = 0``. A non-finite ``s`` gives ``ν = 1`` so that the
    non-finite gradient reaches the optimizer (and an AMP ``GradScaler`` skips
    the step) instead of being silently zeroed.
    """
    if not pairs:
        return 1.0
    dtype = torch.float64 if any(p.dtype == torch.float64 for p, _ in pairs) else torch.float32
    total = abs(float(torch.stack([(p * g).sum(dtype=dtype) for p, g in pairs]).sum()))
    if total == 0.0 or lr == 0.0 or not math.isfinite(total):
        return 1.0
    # sqrt(κ / (lr² |Σ|)) without forming lr², which overflows for |lr| > 1e154.
    return min(1.0, math.sqrt(kl_clip / total) / abs(lr))
