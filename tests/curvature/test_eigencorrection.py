"""Eigenvalue correction and grafting against dense float64 references (spec §11)."""

from __future__ import annotations

import pytest
import torch

from kaisa.curvature.block import KroneckerBlock
from kaisa.curvature.eigencorrection import EigenScales, corrected_solve, divisor
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


def _expected_divisor(
    scales: torch.Tensor, damping: float, correction: str, relative: bool, kron_mean: float
) -> torch.Tensor:
    """The module docstring's divisors, written out."""
    if correction == "ekfac":
        return scales * (kron_mean / scales.mean()) + damping
    return (scales + (damping * scales.mean() if relative else damping)) ** 0.5


@pytest.mark.parametrize("correction", ["ekfac", "adam"])
@pytest.mark.parametrize("relative", [False, True])
def test_the_corrected_solve_is_the_dense_kronecker_system(correction: str, relative: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    g, a = 5, 4
    qa, qg = _orthogonal(a, gen), _orthogonal(g, gen)
    scales = torch.rand(g, a, generator=gen, dtype=D) + 0.1
    grad = torch.randn(g, a, generator=gen, dtype=D)
    damping, kron_mean = 0.03, 1.0 if relative else 2.7
    diag = _expected_divisor(scales, damping, correction, relative, kron_mean)
    got = corrected_solve(
        grad, qa, qg, scales, damping, correction, relative, torch.tensor(kron_mean, dtype=D)
    )
    torch.testing.assert_close(got, _dense_solve(grad, qa, qg, diag), rtol=1e-12, atol=1e-12)


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
    got = corrected_solve(grad, qa_used, qg_used, scales, 0.03, "adam", relative=True)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    expected = _dense_solve(grad, qa, qg, scales / scales.mean() + 0.03)
    got = corrected_solve(grad, qa_used, qg_used, scales, 0.03, "ekfac", relative=True)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    running = EigenScales(torch.zeros(g, a, dtype=D))
    before = grad.clone()
    first = running.solve(grad, qa_used, qg_used, 0.03, 0.95, "adam", relative=True)
    torch.testing.assert_close(grad, before, rtol=0, atol=0)  # the gradient is not overwritten
    v = qg.t() @ grad @ qa
    torch.testing.assert_close(running.scales, v * v, rtol=1e-12, atol=1e-12)
    assert first.dtype == grad.dtype


@pytest.mark.parametrize("batch_scale", [1.0, 1e-3])
def test_ekfac_with_the_eigenvalue_products_is_the_exact_eigen_solve(batch_scale: float) -> None:
    """``S = c·λ_G λ_Aᵀ``: spec §4's solve whatever ``c`` (the batch gradient's 1/B), both
    damping modes (under relative damping the factors are divided by their mean eigenvalue)."""
    gen = torch.Generator().manual_seed(1)
    g, a = 6, 3
    qa, qg = _orthogonal(a, gen), _orthogonal(g, gen)
    da, dg = torch.rand(a, generator=gen, dtype=D), torch.rand(g, generator=gen, dtype=D)
    grad = torch.randn(g, a, generator=gen, dtype=D)
    scales = batch_scale * torch.outer(dg, da)
    absolute = precondition_eigen(grad, qa, qg, da=da, dg=dg, damping=0.01)
    mu = dg.mean() * da.mean()
    got = corrected_solve(grad, qa, qg, scales, 0.01, "ekfac", relative=False, kron_mean=mu)
    torch.testing.assert_close(got, absolute, rtol=1e-12, atol=1e-12)
    relative = precondition_eigen(grad, qa, qg, da=da / da.mean(), dg=dg / dg.mean(), damping=0.01)
    got = corrected_solve(grad, qa, qg, scales, 0.01, "ekfac", relative=True)
    torch.testing.assert_close(got, relative, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("correction", ["ekfac", "adam"])
def test_the_running_average_of_squared_rotated_gradients(
    correction: str, scalar_reads: str
) -> None:
    """The first step replaces, then an equal-weight mean, then the decay (first_batch rule)."""
    gen = torch.Generator().manual_seed(2)
    g, a = 3, 4
    qa, qg = _orthogonal(a, gen), _orthogonal(g, gen)
    scales = EigenScales.zeros(g, a, torch.device("cpu"), D)
    grads = [torch.randn(g, a, generator=gen, dtype=D) for _ in range(5)]
    decay = 0.6
    expected = torch.zeros(g, a, dtype=D)
    for k, grad in enumerate(grads):
        got = scales.solve(grad, qa, qg, 0.02, decay, correction, relative=True)
        v = qg.t() @ grad @ qa
        xi = min(decay, k / (k + 1))
        expected = xi * expected + (1 - xi) * v * v
        torch.testing.assert_close(scales.scales, expected, rtol=1e-12, atol=1e-14)
        diag = _expected_divisor(expected, 0.02, correction, True, 1.0)
        torch.testing.assert_close(got, _dense_solve(grad, qa, qg, diag), rtol=1e-12, atol=1e-12)
    assert scales.updates == 5


@pytest.mark.parametrize("entry", [float("inf"), float("-inf"), float("nan"), 1e200])
@pytest.mark.parametrize("everywhere", [True, False])
def test_a_non_finite_gradient_leaves_the_scales_as_they_were(
    entry: float, everywhere: bool, scalar_reads: str
) -> None:
    """Every entry bad, or one (1e200 squares past float64's range)."""
    gen = torch.Generator().manual_seed(3)
    eye3, eye2 = torch.eye(3, dtype=D), torch.eye(2, dtype=D)
    scales = EigenScales.zeros(2, 3, torch.device("cpu"), D)
    scales.solve(torch.randn(2, 3, generator=gen, dtype=D), eye3, eye2, 0.1, 0.9, "ekfac", True)
    before = scales.scales.clone()
    bad = torch.randn(2, 3, generator=gen, dtype=D)
    if everywhere:
        bad.fill_(entry)
    else:
        bad[1, 2] = entry
    scales.solve(bad, eye3, eye2, 0.1, 0.9, "ekfac", True)
    assert torch.equal(scales.scales, before)


@pytest.mark.parametrize("correction", ["ekfac", "adam"])
@pytest.mark.parametrize("relative", [False, True])
def test_a_zero_gradient_gives_a_zero_step_not_nan(
    correction: str, relative: bool, scalar_reads: str
) -> None:
    eye = torch.eye(2, dtype=D)
    scales = EigenScales.zeros(2, 2, torch.device("cpu"), D)
    out = scales.solve(torch.zeros(2, 2, dtype=D), eye, eye, 0.1, 0.9, correction, relative)
    assert torch.equal(out, torch.zeros(2, 2, dtype=D))


def test_no_divisor_without_a_correction() -> None:
    with pytest.raises(ValueError, match="'off'"):
        divisor(torch.ones(2, 2), 0.1, "off", True)  # type: ignore[arg-type]


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


def _spd(n: int, gen: torch.Generator) -> torch.Tensor:
    m = torch.randn(n, 2 * n, generator=gen, dtype=D)
    return m @ m.t() / (2 * n) + 0.1 * torch.eye(n, dtype=D)


@pytest.mark.parametrize("g_spec", ["exact", "diagonal"])
@pytest.mark.parametrize("relative", [False, True])
def test_an_ekfac_block_divides_by_s_at_its_factors_mean_product(
    g_spec: str, relative: bool
) -> None:
    """Through :class:`KroneckerBlock`: ``S`` folded, then rescaled to ``μ`` from the sides
    (``trace(A)/a · trace(G)/g`` under absolute damping, 1 under relative), against the
    dense Kronecker system; a diagonal side's basis is the identity."""
    gen = torch.Generator().manual_seed(5)
    a_size, g_size = 4, 3
    block = KroneckerBlock(
        "layer",
        a_size,
        g_size,
        device=torch.device("cpu"),
        factor_dtype=D,
        inv_dtype=D,
        method="eigen",
        eigen_outer_product=False,
        damping_mode="relative" if relative else "absolute",
        g_spec=g_spec,
        correction="ekfac",
        correction_decay=0.9,
    )
    a, g = _spd(a_size, gen), _spd(g_size, gen)
    g_batch = g if g_spec == "exact" else torch.stack([torch.zeros(g_size, dtype=D), g.diagonal()])
    block.fold(a, g_batch, 0.0)
    for which in ("a", "g"):
        assert block.decompose(which, 0.01)  # type: ignore[arg-type]
    block.finish_update(0.01)
    assert block.eigen_scales is not None
    start = torch.rand(g_size, a_size, generator=gen, dtype=D) + 0.5
    block.eigen_scales.scales.copy_(start)
    block.eigen_scales.updates = 100  # past the equal-weight start: the decay applies
    grad = torch.randn(g_size, a_size, generator=gen, dtype=D)
    got = block.precondition(grad, 0.01)
    qa = torch.linalg.eigh(a).eigenvectors.contiguous()
    qg = torch.linalg.eigh(g).eigenvectors.contiguous()
    if g_spec == "diagonal":
        qg = torch.eye(g_size, dtype=D)
    v = qg.t() @ grad @ qa
    scales = 0.9 * start + 0.1 * v * v
    mu = 1.0 if relative else float(a.trace() / a_size * g.trace() / g_size)
    expected = _dense_solve(grad, qa, qg, _expected_divisor(scales, 0.01, "ekfac", relative, mu))
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
