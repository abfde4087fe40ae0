"""Second-order state and preconditioning against dense float64 solves (spec §4)."""

from __future__ import annotations

import math

import pytest
import torch

from kaisa.curvature import (
    DecompositionError,
    KroneckerBlock,
    damped_inverse,
    eigen_outer_inverse,
    kl_clip_scale,
    precondition_eigen,
    precondition_inverse,
    symmetric_eigen,
)

D = torch.float64


def spd(n: int, rank: int | None = None) -> torch.Tensor:
    m = torch.randn(n, rank or n, dtype=D)
    return m @ m.T / (rank or n)


def kron_solve(
    grad: torch.Tensor, a: torch.Tensor, g: torch.Tensor, damping: float
) -> torch.Tensor:
    """``(G ⊗ A + γI)⁻¹ vec(∇)`` built explicitly (row-major vec of a (g, a) matrix)."""
    big = torch.kron(g, a) + damping * torch.eye(a.shape[0] * g.shape[0], dtype=D)
    return torch.linalg.solve(big, grad.reshape(-1)).reshape(grad.shape)


@pytest.mark.parametrize("damping", [1e-3, 0.1, 3.0])
@pytest.mark.parametrize("rank_deficient", [False, True])
def test_eigen_method_is_the_exact_kronecker_solve(damping: float, rank_deficient: bool) -> None:
    a, g = spd(6, 2 if rank_deficient else None), spd(4)
    grad = torch.randn(4, 6, dtype=D)
    qa, da = symmetric_eigen(a, D)
    qg, dg = symmetric_eigen(g, D)
    expected = kron_solve(grad, a, g, damping)
    got = precondition_eigen(grad, qa, qg, da=da, dg=dg, damping=damping)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
    outer = eigen_outer_inverse(dg, da, damping)
    got_outer = precondition_eigen(grad, qa, qg, outer_inverse=outer)
    torch.testing.assert_close(got_outer, expected, rtol=1e-9, atol=1e-9)


def test_inverse_method() -> None:
    a, g, damping = spd(5), spd(3), 0.05
    grad = torch.randn(3, 5, dtype=D)
    a_inv = damped_inverse(a, damping, D)
    g_inv = damped_inverse(g, damping, D)
    expected = (
        torch.linalg.inv(g + damping * torch.eye(3, dtype=D))
        @ grad
        @ torch.linalg.inv(a + damping * torch.eye(5, dtype=D))
    )
    torch.testing.assert_close(precondition_inverse(grad, a_inv, g_inv), expected)


def test_eigen_known_spectrum_and_clamping() -> None:
    q, _ = torch.linalg.qr(torch.randn(5, 5, dtype=D))
    values = torch.tensor([-1e-9, 0.5, 1.0, 2.0, 4.0], dtype=D)
    factor = q @ torch.diag(values) @ q.T
    vectors, got = symmetric_eigen(factor, D)
    torch.testing.assert_close(got, values.clamp(min=0), atol=1e-12, rtol=0)
    torch.testing.assert_close(vectors @ torch.diag(got) @ vectors.T, factor, atol=1e-8, rtol=0)


def test_decompositions_run_in_at_least_float32() -> None:
    factor = spd(4).to(torch.bfloat16)
    vectors, values = symmetric_eigen(factor, torch.bfloat16)
    assert vectors.dtype == values.dtype == torch.bfloat16
    assert damped_inverse(factor, 0.1, torch.float16).dtype == torch.float16


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_factor_is_refused(bad: float) -> None:
    factor = spd(3)
    factor[0, 1] = bad
    with pytest.raises(DecompositionError):
        symmetric_eigen(factor, D)
    with pytest.raises(DecompositionError):
        damped_inverse(factor, 0.1, D)


def test_kl_clip_matches_the_formula() -> None:
    pairs = [(torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)) for _ in range(3)]
    lr, kappa = 0.3, 1e-3
    s = lr**2 * sum(float((p * g).sum()) for p, g in pairs)
    expected = min(1.0, math.sqrt(kappa / abs(s)))
    assert kl_clip_scale(pairs, lr, kappa) == pytest.approx(expected, rel=1e-12)
    assert kl_clip_scale(pairs, lr, 1e9) == 1.0  # bound not reached: no clipping
    zero = [(torch.zeros(2, 2, dtype=D), torch.ones(2, 2, dtype=D))]
    assert kl_clip_scale(zero, lr, kappa) == 1.0
    assert kl_clip_scale([], lr, kappa) == 1.0
    nan = [(torch.full((2, 2), float("nan"), dtype=D), torch.ones(2, 2, dtype=D))]
    assert kl_clip_scale(nan, lr, kappa) == 1.0


def make_block(method: str = "eigen", outer: bool = True) -> KroneckerBlock:
    return KroneckerBlock(
        "layer",
        5,
        3,
        device=torch.device("cpu"),
        factor_dtype=D,
        inv_dtype=D,
        method=method,  # type: ignore[arg-type]
        eigen_outer_product=outer,
    )


@pytest.mark.parametrize(
    ("method", "outer"), [("eigen", True), ("eigen", False), ("inverse", False)]
)
def test_block_preconditions_like_the_dense_solve(method: str, outer: bool) -> None:
    block = make_block(method, outer)
    a, g = spd(5), spd(3)
    block.fold(a, g, 0.0)
    damping = 0.01
    for which in ("a", "g"):
        assert block.decompose(which, damping)  # type: ignore[arg-type]
    block.finish_update(damping)
    grad = torch.randn(3, 5, dtype=D)
    if method == "eigen":
        expected = kron_solve(grad, a, g, damping)
    else:
        expected = damped_inverse(g, damping, D) @ grad @ damped_inverse(a, damping, D)
    torch.testing.assert_close(block.precondition(grad, damping), expected, rtol=1e-9, atol=1e-9)


def test_running_average_folds_with_decay() -> None:
    block = make_block()
    a1, g1 = spd(5), spd(3)
    block.fold(a1, g1, 0.9)
    torch.testing.assert_close(block.a, 0.9 * torch.eye(5, dtype=D) + 0.1 * a1)
    torch.testing.assert_close(block.g, 0.9 * torch.eye(3, dtype=D) + 0.1 * g1)


def test_failed_decomposition_keeps_previous_state(monkeypatch: pytest.MonkeyPatch) -> None:
    block = make_block()
    block.fold(spd(5), spd(3), 0.0)
    assert block.decompose("a", 0.1) and block.decompose("g", 0.1)
    block.finish_update(0.1)
    before = {k: [t.clone() for t in v] for k, v in block.second_order.items()}
    grad = torch.randn(3, 5, dtype=D)
    expected = block.precondition(grad, 0.1)

    def broken(*_: object, **__: object) -> None:
        raise torch.linalg.LinAlgError("forced failure")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    block.fold(spd(5), spd(3), 0.5)
    with pytest.warns(RuntimeWarning, match="could not be decomposed"):
        assert not block.decompose("a", 0.1)
    block.finish_update(0.1)
    for which, tensors in before.items():
        for old, new in zip(tensors, block.second_order[which], strict=True):  # type: ignore[index]
            torch.testing.assert_close(old, new, rtol=0, atol=0)
    torch.testing.assert_close(block.precondition(grad, 0.1), expected, rtol=0, atol=0)


def test_eigh_retried_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.linalg.eigh
    seen: list[torch.dtype] = []

    def flaky(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(matrix.dtype)
        if matrix.dtype == torch.float32:
            raise torch.linalg.LinAlgError("no convergence")
        return real(matrix)  # type: ignore[no-any-return]

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    factor = spd(4).float()
    vectors, values = symmetric_eigen(factor, torch.float32)
    assert seen == [torch.float32, torch.float64]
    torch.testing.assert_close(vectors @ torch.diag(values) @ vectors.T, factor)
