"""Eigenvalue correction and grafting against dense float64 references (spec §11)."""

from __future__ import annotations

import pytest
import torch

from kaisa.curvature.eigencorrection import EigenScales, corrected_solve, correction_power
from kaisa.curvature.grafting import graft
from kaisa.curvature.linalg import precondition_eigen

D = torch.float64


def _orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=D))
    return q.contiguous()  # (torch.kron of QR's column-major Q with an identity fails)


def _dense_solve(
    grad: torch.Tensor, qa: torch.Tensor, qg: torch.Tensor, diag: torch.Tensor
) -> torch.Tensor:
    """``(Q_G ⊗ Q_A) diag(1/diag) (Q_G ⊗ Q_A)ᵀ vec(∇)`` with an explicit Kronecker product."""
    q = torch.kron(qg, qa)  # row-major vec: index (i, j) -> i * a + j
    return (q @ ((q.t() @ grad.reshape(-1)) / diag.reshape(-1))).reshape(grad.shape)


@pytest.mark.parametrize("power", [1.0, 0.5])
@pytest.mark.parametrize("relative", [False, True])
def test_the_corrected_solve_is_the_dense_kronecker_system(power: float, relative: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    g, a = 5, 4
    qa, qg = _orthogonal(a, gen), _orthogonal(g, gen)
    scales = torch.rand(g, a, generator=gen, dtype=D) + 0.1
    grad = torch.randn(g, a, generator=gen, dtype=D)
    damping = 0.03
    shift = damping * scales.mean() if relative else damping
    expected = _dense_solve(grad, qa, qg, (scales + shift) ** power)
    got = corrected_solve(grad, qa, qg, scales, damping, power, relative)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("identity", ["a", "g", "both"])
def test_a_diagonal_sides_basis_is_the_identity(identity: str) -> None:
    """``None`` for a basis (a diagonal side): the dense system with ``Q = I`` there."""
    gen = torch.Generator().manual_seed(3)
    g, a = 5, 4
    qa, qg = _orthogonal(a, gen), _orthogonal(g, gen)
    if identity in ("a", "both"):
        qa_used, qa = None, torch.eye(a, dtype=D)
    else:
        qa_used = qa
    if identity in ("g", "both"):
        qg_used, qg = None, torch.eye(g, dtype=D)
    else:
        qg_used = qg
    scales = torch.rand(g, a, generator=gen, dtype=D) + 0.1
    grad = torch.randn(g, a, generator=gen, dtype=D)
    expected = _dense_solve(grad, qa, qg, (scales + 0.03 * scales.mean()).sqrt())
    got = corrected_solve(grad, qa_used, qg_used, scales, 0.03, 0.5, relative=True)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    running = EigenScales(torch.zeros(g, a, dtype=D))
    before = grad.clone()
    first = running.solve(grad, qa_used, qg_used, 0.03, 0.95, 0.5, relative=True)
    torch.testing.assert_close(grad, before, rtol=0, atol=0)  # the gradient is not overwritten
    v = qg.t() @ grad @ qa
    torch.testing.assert_close(running.scales, v * v, rtol=1e-12, atol=1e-12)
    assert first.dtype == grad.dtype


def test_with_the_eigenvalue_products_it_is_the_exact_eigen_solve() -> None:
    """``S = λ_G λ_Aᵀ``, ``p = 1``: spec §4's solve."""
    gen = torch.Generator().manual_seed(1)
    g, a = 6, 3
    qa, qg = _orthogonal(a, gen), _orthogonal(g, gen)
    da, dg = torch.rand(a, generator=gen, dtype=D), torch.rand(g, generator=gen, dtype=D)
    grad = torch.randn(g, a, generator=gen, dtype=D)
    exact = precondition_eigen(grad, qa, qg, da=da, dg=dg, damping=0.01)
    got = corrected_solve(grad, qa, qg, torch.outer(dg, da), 0.01, 1.0, relative=False)
    torch.testing.assert_close(got, exact, rtol=1e-12, atol=1e-12)


def test_the_running_average_of_squared_rotated_gradients() -> None:
    """The first step replaces, then an equal-weight mean, then the decay (first_batch rule)."""
    gen = torch.Generator().manual_seed(2)
    g, a = 3, 4
    qa, qg = _orthogonal(a, gen), _orthogonal(g, gen)
    scales = EigenScales.zeros(g, a, torch.device("cpu"), D)
    grads = [torch.randn(g, a, generator=gen, dtype=D) for _ in range(5)]
    decay = 0.6
    expected = torch.zeros(g, a, dtype=D)
    for k, grad in enumerate(grads):
        got = scales.solve(grad, qa, qg, 0.02, decay, 0.5, relative=True)
        v = qg.t() @ grad @ qa
        xi = min(decay, k / (k + 1))
        expected = xi * expected + (1 - xi) * v * v
        torch.testing.assert_close(scales.scales, expected, rtol=1e-12, atol=1e-14)
        shift = 0.02 * expected.mean()
        torch.testing.assert_close(
            got, _dense_solve(grad, qa, qg, (expected + shift).sqrt()), rtol=1e-12, atol=1e-12
        )
    assert scales.updates == 5


def test_a_non_finite_gradient_leaves_the_scales_as_they_were() -> None:
    gen = torch.Generator().manual_seed(3)
    eye3, eye2 = torch.eye(3, dtype=D), torch.eye(2, dtype=D)
    scales = EigenScales.zeros(2, 3, torch.device("cpu"), D)
    scales.solve(torch.randn(2, 3, generator=gen, dtype=D), eye3, eye2, 0.1, 0.9, 1.0, True)
    before = scales.scales.clone()
    bad = torch.full((2, 3), float("inf"), dtype=D)
    scales.solve(bad, eye3, eye2, 0.1, 0.9, 1.0, True)
    assert torch.equal(scales.scales, before)


def test_a_zero_gradient_gives_a_zero_step_not_nan() -> None:
    eye = torch.eye(2, dtype=D)
    scales = EigenScales.zeros(2, 2, torch.device("cpu"), D)
    out = scales.solve(torch.zeros(2, 2, dtype=D), eye, eye, 0.1, 0.9, 1.0, True)
    assert torch.equal(out, torch.zeros(2, 2, dtype=D))


def test_correction_powers() -> None:
    assert correction_power("adam") == 0.5
    with pytest.raises(ValueError, match="'off'"):
        correction_power("off")


def test_grafting_keeps_the_direction_and_takes_the_raw_norm() -> None:
    gen = torch.Generator().manual_seed(4)
    p = torch.randn(4, 5, generator=gen, dtype=D)
    g = torch.randn(4, 5, generator=gen, dtype=D)
    direction = p / p.norm()
    graft(p, g)
    torch.testing.assert_close(p.norm(), g.norm(), rtol=1e-14, atol=0.0)
    torch.testing.assert_close(p / p.norm(), direction, rtol=1e-14, atol=1e-15)
    zero = torch.zeros(2, 2, dtype=D)
    graft(zero, torch.ones(2, 2, dtype=D))
    assert torch.equal(zero, torch.zeros(2, 2, dtype=D))
