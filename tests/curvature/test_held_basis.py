"""Keeping an eigenbasis while it still fits (``eigenbasis_tolerance``) against float64 references.

:func:`kaisa.curvature.linalg.held_basis` decides whether a held basis ``Q``
still diagonalises a factor ``F``: the off-diagonal share of ``QᵀFQ`` against
the tolerance. An exact side given the tolerance keeps ``Q`` and takes
``diag(QᵀFQ)`` as its eigenvalues when it does, and decomposes when it does
not; tied weights' shared bases follow the same rule.
"""

from __future__ import annotations

import math

import pytest
import torch

from kaisa.curvature.block import KroneckerBlock
from kaisa.curvature.linalg import held_basis
from kaisa.curvature.representations import ExactSide

D = torch.float64
CPU = torch.device("cpu")


def rotated(q: torch.Tensor, angle: float, i: int = 0, j: int = 1) -> torch.Tensor:
    """``Q`` with columns ``i`` and ``j`` turned by ``angle`` in their plane (still orthogonal)."""
    out = q.clone()
    c, s = math.cos(angle), math.sin(angle)
    out[:, i], out[:, j] = c * q[:, i] - s * q[:, j], s * q[:, i] + c * q[:, j]
    return out


def factor_with_basis(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(F, Q, λ)`` with ``F = Q diag(λ) Qᵀ``, distinct eigenvalues 1 … n."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(n, n, dtype=D, generator=gen)).Q
    values = torch.arange(1, n + 1, dtype=D)
    return (q * values) @ q.T, q, values


def share(f: torch.Tensor, q: torch.Tensor) -> float:
    """The off-diagonal share of ``QᵀFQ``, written out in float64."""
    m = q.T.double() @ f.double() @ q.double()
    return float((m - torch.diag(torch.diag(m))).norm() / m.norm())


def test_an_eigenbasis_is_kept_with_its_eigenvalues() -> None:
    f, q, values = factor_with_basis(6)
    held = held_basis(f, q, 1e-12)
    assert held is not None
    assert held[0] is q  # the held tensor itself: nothing is copied or recomputed
    torch.testing.assert_close(held[1], values, rtol=0, atol=1e-12)


@pytest.mark.parametrize("angle", [0.01, 0.1, 0.4])
def test_the_decision_is_the_off_diagonal_share_against_the_tolerance(angle: float) -> None:
    f, q, _ = factor_with_basis(7, seed=1)
    stale = rotated(q, angle, 2, 5)
    expected = share(f, stale)
    assert 0 < expected < 1
    assert held_basis(f, stale, expected * 0.999) is None
    kept = held_basis(f, stale, expected * 1.001)
    assert kept is not None
    # The eigenvalues it keeps are the Rayleigh quotients of the held basis.
    reference = torch.diag(stale.T @ f @ stale)
    torch.testing.assert_close(kept[1], reference, rtol=0, atol=1e-12)


def test_a_float32_basis_is_checked_in_float32_against_the_float64_share() -> None:
    f, q, _ = factor_with_basis(9, seed=2)
    stale = rotated(q, 0.2, 0, 8)
    expected = share(f, stale)
    f32, q32 = f.float(), stale.float()
    assert held_basis(f32, q32, expected * 0.99) is None
    kept = held_basis(f32, q32, expected * 1.01)
    assert kept is not None and kept[1].dtype == torch.float32
    torch.testing.assert_close(kept[1].double(), torch.diag(stale.T @ f @ stale), rtol=1e-5, atol=0)


def test_the_kept_values_are_never_negative() -> None:
    # A semi-definite factor whose held basis sees a zero eigenvalue as a
    # tiny negative Rayleigh quotient in rounding: clamped at 0.
    _, q, _ = factor_with_basis(5, seed=3)
    values = torch.tensor([0.0, 0.0, 1.0, 2.0, 3.0], dtype=D)
    singular = (q * values) @ q.T
    kept = held_basis(singular, q, 1e-6)
    assert kept is not None and bool((kept[1] >= 0).all())


def exact_side(n: int, tolerance: float | None, dtype: torch.dtype = D) -> ExactSide:
    return ExactSide(
        "layer.a",
        n,
        method="eigen",
        basis_tolerance=tolerance,
        device=CPU,
        factor_dtype=dtype,
        inv_dtype=dtype,
        relative=False,
    )


def test_an_exact_side_decomposes_then_keeps_then_decomposes_again() -> None:
    f, _, _ = factor_with_basis(6, seed=4)
    side = exact_side(6, tolerance=0.05)
    side.factor.copy_(f)
    side.refresh(damping=1e-3)  # from the identity basis: F is far from diagonal in it
    assert not side.basis_kept
    q0, v0 = (t.clone() for t in side.eigen)
    torch.testing.assert_close((q0 * v0) @ q0.T, f, rtol=0, atol=1e-12)

    # A small drift of the factor: the basis still fits and is kept, bit for bit.
    drift = 0.01 * factor_with_basis(6, seed=5)[0]
    side.factor.add_(drift)
    assert share(side.factor, q0) < 0.05
    side.refresh(damping=1e-3)
    assert side.basis_kept
    q1, v1 = side.eigen
    assert torch.equal(q1, q0)
    torch.testing.assert_close(v1, torch.diag(q0.T @ side.factor @ q0), rtol=0, atol=1e-12)
    # The side stands for F in the held basis: Q diag(QᵀFQ) Qᵀ.
    torch.testing.assert_close(side.dense(), (q0 * v1) @ q0.T, rtol=0, atol=1e-12)

    # A large change: the basis no longer fits, and the side decomposes.
    side.factor.copy_(factor_with_basis(6, seed=6)[0])
    assert share(side.factor, q0) > 0.05
    side.refresh(damping=1e-3)
    assert not side.basis_kept
    torch.testing.assert_close(side.dense(), side.factor, rtol=0, atol=1e-12)


def test_without_a_tolerance_every_refresh_decomposes() -> None:
    f, _, _ = factor_with_basis(5, seed=7)
    side = exact_side(5, tolerance=None)
    side.factor.copy_(f)
    side.refresh(damping=1e-3)
    side.factor.mul_(1.001)  # the same basis: a tolerance would keep it
    side.refresh(damping=1e-3)
    assert not side.basis_kept
    torch.testing.assert_close(side.dense(), side.factor, rtol=0, atol=1e-12)


def test_a_diagonal_factor_keeps_the_identity_basis() -> None:
    side = exact_side(4, tolerance=0.0)
    values = torch.tensor([3.0, 1.0, 4.0, 1.5], dtype=D)
    side.factor.copy_(torch.diag(values))
    side.refresh(damping=1e-3)
    assert side.basis_kept
    q, v = side.eigen
    assert torch.equal(q, torch.eye(4, dtype=D)) and torch.equal(v, values)


def test_a_kept_side_is_not_redone_in_float64() -> None:
    # An ill-conditioned float32 factor at small damping: its decomposition is
    # redone in float64 (refine), but a kept basis was not decomposed at all.
    _, q, _ = factor_with_basis(8, seed=8)
    values = torch.logspace(-7, 0, 8, dtype=D)
    f = (q * values) @ q.T
    block = KroneckerBlock(
        "fc",
        8,
        8,
        device=CPU,
        factor_dtype=torch.float32,
        inv_dtype=torch.float32,
        method="eigen",
        eigen_outer_product=False,
        basis_tolerance=0.5,
    )
    for which in ("a", "g"):
        block.sides[which].factor.copy_(f.float())
        assert block.decompose(which, damping=1e-9)  # type: ignore[arg-type]
    assert not block.basis_kept("a")
    assert block.refine(["a", "g"], damping=1e-9)  # decomposed: redone in float64
    for which in ("a", "g"):
        assert block.decompose(which, damping=1e-9)  # type: ignore[arg-type]
    assert block.basis_kept("a") and block.basis_kept("g")
    assert block.refine(["a", "g"], damping=1e-9) == {}
