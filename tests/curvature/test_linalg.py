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
from kaisa.curvature.block import effective_decay

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


def make_block(
    method: str = "eigen",
    outer: bool = True,
    damping_mode: str = "absolute",
    factor_init: str = "identity",
) -> KroneckerBlock:
    return KroneckerBlock(
        "layer",
        5,
        3,
        device=torch.device("cpu"),
        factor_dtype=D,
        inv_dtype=D,
        method=method,  # type: ignore[arg-type]
        eigen_outer_product=outer,
        damping_mode=damping_mode,  # type: ignore[arg-type]
        factor_init=factor_init,  # type: ignore[arg-type]
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


@pytest.mark.parametrize(
    ("method", "outer"), [("eigen", True), ("eigen", False), ("inverse", False)]
)
@pytest.mark.parametrize("scale", [1e-12, 1.0, 1e6])
def test_relative_damping_is_the_solve_with_unit_mean_factors(
    method: str, outer: bool, scale: float
) -> None:
    """'relative': each factor divided by trace/size before the damped solve."""
    block = make_block(method, outer, damping_mode="relative")
    # Factors of very different scales: the result must not depend on them.
    a, g = spd(5) * scale, spd(3) * scale**0.5
    block.fold(a, g, 0.0)
    damping = 0.03
    for which in ("a", "g"):
        assert block.decompose(which, damping)  # type: ignore[arg-type]
    block.finish_update(damping)
    grad = torch.randn(3, 5, dtype=D)
    a_unit = a / (torch.trace(a) / 5)
    g_unit = g / (torch.trace(g) / 3)
    if method == "eigen":
        expected = kron_solve(grad, a_unit, g_unit, damping)
    else:
        expected = (
            torch.linalg.inv(g_unit + damping * torch.eye(3, dtype=D))
            @ grad
            @ torch.linalg.inv(a_unit + damping * torch.eye(5, dtype=D))
        )
    torch.testing.assert_close(block.precondition(grad, damping), expected, rtol=1e-8, atol=1e-10)


def test_relative_damping_of_a_zero_factor_is_finite() -> None:
    """A layer whose factors are all zero (never saw a gradient) gets ``∇ / γ``."""
    block = make_block(damping_mode="relative")
    block.fold(torch.zeros(5, 5, dtype=D), torch.zeros(3, 3, dtype=D), 0.0)
    assert block.decompose("a", 0.5) and block.decompose("g", 0.5)
    block.finish_update(0.5)
    grad = torch.randn(3, 5, dtype=D)
    torch.testing.assert_close(block.precondition(grad, 0.5), grad / 0.5)


def test_first_batch_init_is_a_running_mean_then_the_decay() -> None:
    """'first_batch': update k uses min(ξ, k/(k+1)); the identity never enters."""
    decay = 0.8  # k/(k+1) reaches 0.8 at k = 4
    block = make_block(factor_init="first_batch")
    batches = [(spd(5), spd(3)) for _ in range(7)]
    expected_a = torch.zeros(5, 5, dtype=D)
    for k, (a, g) in enumerate(batches):
        block.fold(a, g, decay)
        if k <= 4:
            expected_a = sum(b[0] for b in batches[: k + 1]) / (k + 1)  # type: ignore[assignment]
            expected_g = sum(b[1] for b in batches[: k + 1]) / (k + 1)
            torch.testing.assert_close(block.g, expected_g)
        else:
            expected_a = decay * expected_a + (1 - decay) * a
        torch.testing.assert_close(block.a, expected_a)
    assert block.updates == 7
    assert [effective_decay(0.8, k, "first_batch") for k in range(6)] == pytest.approx(
        [0.0, 0.5, 2 / 3, 0.75, 0.8, 0.8]
    )
    assert effective_decay(0.8, 0, "identity") == 0.8


def test_update_count_is_checkpointed() -> None:
    block = make_block(factor_init="first_batch")
    block.fold(spd(5), spd(3), 0.9)
    block.fold(spd(5), spd(3), 0.9)
    state = block.state_dict()
    restored = make_block(factor_init="first_batch")
    restored.load_state_dict(state)
    assert restored.updates == 2
    a, g = spd(5), spd(3)
    block.fold(a, g, 0.9)
    restored.fold(a, g, 0.9)
    torch.testing.assert_close(restored.a, block.a, rtol=0, atol=0)
    with pytest.raises(ValueError, match="'updates' must be an integer >= 0; got -1"):
        restored.load_state_dict({**state, "updates": -1})


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


def test_split_invariant_g_divides_delta_by_the_world_size() -> None:
    """N ranks, each δ N times one process's: δ/N in δᵀδ, Σδ and Σδ² (float64, exact)."""
    from kaisa.curvature.linalg import split_invariant_g

    delta = torch.randn(7, 3, dtype=torch.float64)
    for n in (1, 2, 4):
        gram = (n * delta).T @ (n * delta)
        moments = torch.stack([(n * delta).sum(0), ((n * delta) ** 2).sum(0)])
        split_invariant_g(gram, moments, n)
        torch.testing.assert_close(gram, delta.T @ delta, rtol=1e-15, atol=0)
        torch.testing.assert_close(moments[0], delta.sum(0), rtol=1e-15, atol=0)
        torch.testing.assert_close(moments[1], (delta**2).sum(0), rtol=1e-15, atol=0)
    split_invariant_g(None, None, 4)  # nothing captured: nothing to do


def test_finite_with_values_decides_per_tensor_with_one_reduction() -> None:
    from kaisa.curvature.linalg import finite_with_values

    big = torch.full((4,), 3e38)  # finite entries whose float32 sum overflows
    ok, values = finite_with_values([torch.ones(3), big], [torch.tensor(2.5), torch.tensor(-1.0)])
    assert ok and values == [2.5, -1.0]
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.ones(5, dtype=torch.float16)
        t[2] = bad
        assert finite_with_values([torch.ones(2), t])[0] is False
    assert finite_with_values([]) == (True, [])
    # float64 values survive when a tensor is float64.
    _, (value,) = finite_with_values(
        [torch.ones(1, dtype=torch.float64)], [torch.tensor(1 / 3, dtype=torch.float64)]
    )
    assert value == 1 / 3


def test_all_finite_is_the_entrywise_check() -> None:
    """``all_finite`` (the refresh's check, one sum per tensor) says what
    ``torch.isfinite(t).all()`` says, for every tensor given."""
    from kaisa.curvature.linalg import all_finite

    generator = torch.Generator().manual_seed(0)
    cases = [
        torch.randn(6, 6, generator=generator),
        torch.full((4, 4), 3e38),  # finite, and the float32 sum overflows
        torch.full((3,), 6e4, dtype=torch.float16),  # finite, the half-precision sum would not be
        torch.zeros(0, 5),
        torch.randn(7, dtype=torch.float64, generator=generator),
    ]
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            t = torch.ones(5, 5, dtype=dtype)
            t[3, 1] = bad
            cases.append(t)
    both = torch.tensor([float("inf"), -float("inf")])  # sums to NaN
    cases.append(both)
    for t in cases:
        expected = bool(torch.isfinite(t).all())
        assert all_finite(t) is expected, t
        assert all_finite(torch.ones(2), t) is expected
        assert all_finite(t, torch.ones(3, dtype=torch.float64)) is expected
    assert all_finite() is True
