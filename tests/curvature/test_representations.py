"""Curvature representations (spec §8) against dense float64 references.

Every :class:`Side` says which ``n × n`` matrix it stands for (``dense()``) and
applies ``(F/s + γI)⁻¹`` along one dimension (``solve``); here both are checked
against explicit inverses, known spectra and the formulas of the docstrings.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kaisa.curvature.block import KroneckerBlock
from kaisa.curvature.costs import SideSpec, side_cost
from kaisa.curvature.linalg import DecompositionError, damped_inverse, precondition_eigen
from kaisa.curvature.representations import (
    OVERSAMPLING,
    DiagonalSide,
    ExactSide,
    KroneckerVectorSide,
    LowRankSide,
    Side,
    make_side,
    split_damping,
)

D = torch.float64
CPU = torch.device("cpu")
DAMPINGS = [1e-3, 0.1, 3.0]


def spd(n: int, rank: int | None = None) -> torch.Tensor:
    m = torch.randn(n, rank or n, dtype=D)
    return m @ m.T / (rank or n)


def with_spectrum(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q diag(λ) Qᵀ, Q)`` for a random orthogonal ``Q``."""
    n = values.numel()
    q = torch.linalg.qr(torch.randn(n, n, dtype=D)).Q
    return (q * values) @ q.T, q


def moments(n: int) -> torch.Tensor:
    """Two moment rows: a mean row and a mean squared row (>= the mean squared)."""
    mean = torch.randn(n, dtype=D)
    return torch.stack([mean, mean**2 + torch.rand(n, dtype=D) + 0.1])


def eye(n: int) -> torch.Tensor:
    return torch.eye(n, dtype=D)


def side(
    kind: str,
    n: int,
    *,
    relative: bool = False,
    name: str = "layer.a",
    rank: int = 2,
    method: str = "eigen",
) -> Side:
    """A fresh side of ``n`` (``rank`` for 'lowrank', ``method`` for 'exact')."""
    spec = SideSpec("lowrank", rank) if kind == "lowrank" else SideSpec.parse(kind)
    return make_side(
        spec, name, n, method=method, device=CPU, factor_dtype=D, inv_dtype=D, relative=relative
    )


def lowrank(
    n: int, k: int, factor: torch.Tensor, *, relative: bool = False, name: str = "layer.a"
) -> LowRankSide:
    s = side("lowrank", n, rank=k, relative=relative, name=name)
    assert isinstance(s, LowRankSide)
    s.factor.copy_(factor)
    s.refresh(0.1)
    return s


def dense_solve(
    matrix: torch.Tensor, dense: torch.Tensor, damping: float, dim: int
) -> torch.Tensor:
    """``inv(dense + γI) @ M`` (dim 0) or ``M @ inv(dense + γI)`` (dim 1), explicitly."""
    inverse = torch.linalg.inv(dense + damping * eye(dense.shape[0]))
    out: torch.Tensor = inverse @ matrix if dim == 0 else matrix @ inverse
    return out


def operand(n: int, dim: int) -> torch.Tensor:
    return torch.randn(n, 4, dtype=D) if dim == 0 else torch.randn(3, n, dtype=D)


def tight(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)


# -- low rank --------------------------------------------------------------------


@pytest.mark.parametrize("relative", [False, True])
def test_lowrank_at_full_rank_is_the_exact_eigen_method(relative: bool) -> None:
    n = 7
    factor = spd(n) * 5.0
    low = lowrank(n, n, factor, relative=relative)
    exact = side("exact", n, relative=relative, method="eigen")
    exact.factor.copy_(factor)
    exact.refresh(0.1)
    tight(low.dense(), factor)
    _, _, sigma = low.state
    assert float(sigma[0]) == 0.0  # nothing is left outside the basis at k = n
    torch.testing.assert_close(low.mean_eigenvalue(), torch.trace(factor) / n)
    for damping in DAMPINGS:
        for dim in (0, 1):
            m = operand(n, dim)
            tight(low.solve(m, damping, dim), exact.solve(m, damping, dim))
            # and both are the explicit damped inverse of F/s
            s = torch.trace(factor) / n if relative else 1.0
            tight(low.solve(m, damping, dim), dense_solve(m, factor / s, damping, dim))


@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize(("n", "k"), [(6, 1), (6, 3), (6, 5), (20, 1), (20, 3), (20, 12)])
def test_lowrank_solve_is_the_inverse_of_its_own_approximation(
    relative: bool, n: int, k: int
) -> None:
    """At k < n the solve inverts ``U diag(λ) Uᵀ + σ(I − UUᵀ)`` exactly."""
    factor = spd(n) * 3.0
    low = lowrank(n, k, factor, relative=relative)
    u, values, sigma = low.state
    assert u.shape == (n, k) and values.shape == (k,) and sigma.shape == (1,)
    tight(u.T @ u, eye(k))  # orthonormal basis
    tight(u.T @ factor @ u, torch.diag(values))  # Ritz pairs of F
    assert bool((values[:-1] >= values[1:]).all())
    if n <= k + OVERSAMPLING:  # the iteration spans everything: the exact top k
        tight(values, torch.linalg.eigvalsh(factor).flip(0)[:k])
    approx = low.dense()
    tight(approx, approx.T)
    tight(approx, (u * values) @ u.T + sigma[0] * (eye(n) - u @ u.T))
    # trace is kept: σ is the mean of what the basis leaves out
    torch.testing.assert_close(torch.trace(approx), torch.trace(factor), rtol=1e-12, atol=0)
    torch.testing.assert_close(low.mean_eigenvalue(), torch.trace(approx) / n)
    s = low.mean_eigenvalue() if relative else torch.tensor(1.0, dtype=D)
    if relative:
        torch.testing.assert_close(s, torch.trace(factor) / n)
    for damping in DAMPINGS:
        for dim in (0, 1):
            m = operand(n, dim)
            tight(low.solve(m, damping, dim), dense_solve(m, approx / s, damping, dim))


@pytest.mark.parametrize("relative", [False, True])
def test_lowrank_solve_keeps_the_operand_dtype(relative: bool) -> None:
    low = lowrank(6, 2, spd(6), relative=relative)
    m = torch.randn(6, 3, dtype=torch.float32)
    out = low.solve(m, 0.1, 0)
    assert out.dtype == torch.float32
    expected = dense_solve(m.to(D), low.dense() / low.scale(), 0.1, 0).float()
    torch.testing.assert_close(out, expected)


def spectrum_with_gap(n: int, top: tuple[float, ...], rest: tuple[float, float]) -> torch.Tensor:
    return torch.cat(
        [torch.tensor(top, dtype=D), torch.linspace(rest[1], rest[0], n - len(top), dtype=D)]
    )


def top_error(low: LowRankSide, values: torch.Tensor) -> tuple[float, float]:
    k = low.rank
    _, got, sigma = low.state
    return (
        float((got - values[:k]).abs().max()),
        float((sigma[0] - values[k:].mean()).abs()),
    )


def test_lowrank_captures_the_top_of_a_known_spectrum() -> None:
    # n well above k + OVERSAMPLING, so the subspace iteration is not a full eigh.
    n, k = 30, 4
    assert n > k + OVERSAMPLING
    values = spectrum_with_gap(n, (10.0, 7.0, 5.0, 3.0), (1e-3, 1e-2))
    factor, q = with_spectrum(values)
    low = lowrank(n, k, factor)
    u, got, sigma = low.state
    torch.testing.assert_close(got, values[:k], rtol=0, atol=1e-8)
    torch.testing.assert_close(sigma[0], values[k:].mean(), rtol=0, atol=1e-8)
    # the basis spans the top eigenvectors
    top = q[:, :k]
    torch.testing.assert_close(u @ u.T, top @ top.T, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.trace(low.dense()), torch.trace(factor), rtol=1e-12, atol=0)
    first = top_error(low, values)
    low.refresh(0.1)  # warm start from the previous Ritz vectors
    second = top_error(low, values)
    assert second[0] <= max(first[0], 1e-12) and second[1] <= max(first[1], 1e-12)


def test_lowrank_warm_start_converges_further() -> None:
    """A smaller gap: one refresh is off, the next (warm-started) one is much closer.

    The first basis is seeded by the side's name, so without the warm start a
    second refresh of the same factor would give exactly the same error.
    """
    n, k = 30, 4
    values = spectrum_with_gap(n, (10.0, 7.0, 5.0, 3.0), (0.1, 1.0))
    factor, _ = with_spectrum(values)
    low = lowrank(n, k, factor)
    errors = [top_error(low, values)]
    for _ in range(3):
        low.refresh(0.1)
        errors.append(top_error(low, values))
    assert errors[0][0] > 1e-5  # the gap really is too small for one refresh
    for before, after in itertools.pairwise(errors):
        assert after[0] < 0.1 * before[0]
        assert after[1] < 0.1 * before[1]
    torch.testing.assert_close(low.state[1], values[:k], rtol=0, atol=1e-6)


def test_lowrank_first_basis_depends_on_the_factor_only() -> None:
    """Every rank refreshing the same factor gets the same state, whatever the layer's
    name (DDP prefixes 'module.') and the global random state."""
    n, k = 25, 3
    factor = spd(n)
    one = lowrank(n, k, factor)
    torch.manual_seed(1234)  # the global RNG must not matter
    two = lowrank(n, k, factor, name="module.other")
    for a, b in zip(one.state, two.state, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_lowrank_rank_above_the_side_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'lowrank:6'.*above the factor's side 5.*1 <= k <= 5"):
        side("lowrank", 5, rank=6)
    side("lowrank", 5, rank=5)  # k = n is allowed
    with pytest.raises(ValueError, match=r"factor A: 'lowrank:8'.*side 7"):
        block("lowrank:8", "exact")
    with pytest.raises(ValueError, match=r"factor G: 'lowrank:6'.*side 5"):
        block("exact", "lowrank:6")


# -- Kronecker vector and diagonal ---------------------------------------------------


@pytest.mark.parametrize("relative", [False, True])
def test_kvec_is_sherman_morrison_of_the_mean_outer_product(relative: bool) -> None:
    n = 6
    s = side("kvec", n, relative=relative)
    mean = torch.randn(n, dtype=D) * 2.0
    s.factor[0] = mean
    s.factor[1] = mean**2 + 1.0  # must not enter
    s.refresh(0.1)
    outer = torch.outer(mean, mean)
    tight(s.dense(), outer)
    torch.testing.assert_close(s.mean_eigenvalue(), mean.dot(mean) / n)
    scale = mean.dot(mean) / n if relative else 1.0
    for damping in DAMPINGS:
        for dim in (0, 1):
            m = operand(n, dim)
            tight(s.solve(m, damping, dim), dense_solve(m, outer / scale, damping, dim))


@pytest.mark.parametrize("relative", [False, True])
def test_kvec_of_a_zero_mean_is_the_damping_alone(relative: bool) -> None:
    s = side("kvec", 4, relative=relative)
    s.refresh(0.1)  # the identity moments: mean 0
    m = torch.randn(4, 3, dtype=D)
    tight(s.solve(m, 0.5, 0), m / 0.5)


@pytest.mark.parametrize("relative", [False, True])
def test_diagonal_is_the_mean_squared_row(relative: bool) -> None:
    n = 6
    s = side("diagonal", n, relative=relative)
    rows = moments(n)
    s.factor.copy_(rows)
    s.refresh(0.1)
    d = rows[1]
    tight(s.dense(), torch.diag(d))
    torch.testing.assert_close(s.mean_eigenvalue(), d.mean())
    scale = d.mean() if relative else 1.0
    for damping in DAMPINGS:
        inv = 1.0 / (d / scale + damping)
        m0, m1 = operand(n, 0), operand(n, 1)
        tight(s.solve(m0, damping, 0), inv[:, None] * m0)
        tight(s.solve(m1, damping, 1), m1 * inv[None, :])
        tight(s.solve(m0, damping, 0), dense_solve(m0, torch.diag(d) / scale, damping, 0))


@pytest.mark.parametrize("kind", ["exact", "lowrank", "kvec", "diagonal"])
def test_state_is_a_snapshot_written_in_place(kind: str) -> None:
    """A refresh writes into the same tensors (the broadcast buffers); a fold does not."""
    n = 5
    s = side(kind, n)
    buffers = s.state_tensors()
    identity = s.dense().clone()
    batch = spd(n) if s.capture == "gram" else moments(n)
    s.fold(batch, 0.0)
    tight(s.dense(), identity)  # no refresh yet: still the identity's state
    s.refresh(0.1)
    assert all(a is b for a, b in zip(s.state_tensors(), buffers, strict=True))
    refreshed = s.dense().clone()
    s.fold(batch * 3.0, 0.0)
    tight(s.dense(), refreshed)


def test_moments_sides_start_as_the_identity_moments() -> None:
    for kind in ("kvec", "diagonal"):
        s = side(kind, 4)
        tight(s.factor, torch.stack([torch.zeros(4, dtype=D), torch.ones(4, dtype=D)]))
    tight(side("diagonal", 4).dense(), eye(4))


# -- specs -------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["exact", "lowrank:64", "lowrank:1", "kvec", "diagonal"])
def test_spec_round_trip(text: str) -> None:
    spec = SideSpec.parse(text)
    assert str(spec) == text
    assert SideSpec.parse(str(spec)) == spec
    assert SideSpec.parse(spec) is spec


def test_spec_parse_fields_and_spelling() -> None:
    assert SideSpec.parse("lowrank:64") == SideSpec("lowrank", 64)
    assert SideSpec.parse(" LowRank : 8 ") == SideSpec("lowrank", 8)
    assert SideSpec.parse("KVEC") == SideSpec("kvec")
    assert SideSpec.parse("exact").capture == "gram"
    assert SideSpec.parse("lowrank:3").capture == "gram"
    assert SideSpec.parse("kvec").capture == SideSpec.parse("diagonal").capture == "moments"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "foo",
            r"curvature representation must be one of 'exact', 'lowrank', 'kvec', "
            r"'diagonal'.*got 'foo'",
        ),
        ("foo:3", r"curvature representation must be one of .*got 'foo'"),
        ("", r"curvature representation must be 'exact', 'lowrank:K', 'kvec' or 'diagonal'"),
        ("low rank", r"curvature representation must be 'exact', 'lowrank:K'.*got 'low rank'"),
        ("lowrank:-1", r"curvature representation must be .*'lowrank:K'.*got 'lowrank:-1'"),
        ("lowrank:x", r"curvature representation must be .*got 'lowrank:x'"),
        ("lowrank", r"'lowrank' needs its rank: 'lowrank:K' with K >= 1; got 'lowrank'"),
        ("lowrank:0", r"'lowrank' representation needs a rank k >= 1.*got 0"),
        ("exact:3", r"only 'lowrank' takes a rank; got 'exact' with 3"),
        ("kvec:2", r"only 'lowrank' takes a rank; got 'kvec' with 2"),
    ],
)
def test_spec_bad_text_is_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SideSpec.parse(text)


def test_spec_bad_fields_are_refused() -> None:
    with pytest.raises(ValueError, match=r"needs a rank k >= 1.*got True"):
        SideSpec("lowrank", True)
    with pytest.raises(ValueError, match=r"needs a rank k >= 1.*got None"):
        SideSpec("lowrank")
    with pytest.raises(ValueError, match=r"needs a rank k >= 1.*got 2.0"):
        SideSpec("lowrank", 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a string"):
        SideSpec.parse(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="curvature representation must be"):
        block("bogus", "exact")


# -- blocks with mixed sides ---------------------------------------------------------

A_SIZE, G_SIZE = 7, 5


def block(
    a_spec: str,
    g_spec: str,
    *,
    relative: bool = False,
    method: str = "eigen",
    outer: bool = False,
) -> KroneckerBlock:
    return KroneckerBlock(
        "layer",
        A_SIZE,
        G_SIZE,
        device=CPU,
        factor_dtype=D,
        inv_dtype=D,
        method=method,  # type: ignore[arg-type]
        eigen_outer_product=outer,
        damping_mode="relative" if relative else "absolute",
        a_spec=a_spec,
        g_spec=g_spec,
    )


def batch_for(spec: str, n: int, scale: float) -> torch.Tensor:
    if SideSpec.parse(spec).capture == "gram":
        return spd(n) * scale
    rows = moments(n)
    return torch.stack([rows[0] * math.sqrt(scale), rows[1] * scale])


def reference_dense(spec: str, batch: torch.Tensor, refreshed: Side) -> torch.Tensor:
    """The matrix a side stands for, from its batch where that is known in closed form."""
    kind = SideSpec.parse(spec).kind
    if kind == "exact":
        return batch
    if kind == "kvec":
        return torch.outer(batch[0], batch[0])
    if kind == "diagonal":
        return torch.diag(batch[1])
    return refreshed.dense()  # low rank: its own approximation (checked above)


MIXED = [
    ("lowrank:3", "exact"),
    ("exact", "lowrank:2"),
    ("lowrank:3", "lowrank:5"),
    ("kvec", "diagonal"),
    ("diagonal", "kvec"),
    ("lowrank:3", "kvec"),
    ("diagonal", "exact"),
    ("exact", "kvec"),
    ("kvec", "kvec"),
]


@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize(
    ("method", "outer"), [("eigen", False), ("eigen", True), ("inverse", False)]
)
@pytest.mark.parametrize(("a_spec", "g_spec"), MIXED)
def test_mixed_block_solves_side_by_side_with_split_damping(
    a_spec: str, g_spec: str, method: str, outer: bool, relative: bool
) -> None:
    b = block(a_spec, g_spec, relative=relative, method=method, outer=outer)
    assert not b.exact and not b.eigen_outer_product
    assert [str(s) for s in b.specs] == [a_spec, g_spec]
    # Very different scales, so that a wrong (or swapped) π-split shows.
    a_batch, g_batch = batch_for(a_spec, A_SIZE, 50.0), batch_for(g_spec, G_SIZE, 0.02)
    b.fold(a_batch, g_batch, 0.0)
    damping = 0.03
    assert b.decompose("a", damping) and b.decompose("g", damping)
    b.finish_update(damping)
    a_dense = reference_dense(a_spec, a_batch, b.sides["a"])
    g_dense = reference_dense(g_spec, g_batch, b.sides["g"])
    mean_a, mean_g = torch.trace(a_dense) / A_SIZE, torch.trace(g_dense) / G_SIZE
    if relative:
        s_a, s_g = mean_a, mean_g
        gamma_a = gamma_g = math.sqrt(damping)
    else:
        s_a = s_g = torch.tensor(1.0, dtype=D)
        pi = math.sqrt(float(mean_a) / float(mean_g))
        gamma_a, gamma_g = math.sqrt(damping) * pi, math.sqrt(damping) / pi
    assert gamma_a * gamma_g == pytest.approx(damping, rel=1e-12)
    grad = torch.randn(G_SIZE, A_SIZE, dtype=D)
    expected = (
        torch.linalg.inv(g_dense / s_g + gamma_g * eye(G_SIZE))
        @ grad
        @ torch.linalg.inv(a_dense / s_a + gamma_a * eye(A_SIZE))
    )
    torch.testing.assert_close(b.precondition(grad, damping), expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("outer", [False, True])
def test_all_exact_block_is_still_the_exact_kronecker_solve(relative: bool, outer: bool) -> None:
    b = block("exact", "exact", relative=relative, outer=outer)
    assert b.exact and b.eigen_outer_product == outer
    a, g = spd(A_SIZE) * 50.0, spd(G_SIZE) * 0.02
    b.fold(a, g, 0.0)
    damping = 0.03
    assert b.decompose("a", damping) and b.decompose("g", damping)
    b.finish_update(damping)
    if relative:
        a, g = a / (torch.trace(a) / A_SIZE), g / (torch.trace(g) / G_SIZE)
    grad = torch.randn(G_SIZE, A_SIZE, dtype=D)
    big = torch.kron(g, a) + damping * eye(A_SIZE * G_SIZE)
    expected = torch.linalg.solve(big, grad.reshape(-1)).reshape(grad.shape)
    torch.testing.assert_close(b.precondition(grad, damping), expected, rtol=1e-9, atol=1e-10)
    # and this is not what the side-by-side solve gives
    root = math.sqrt(damping)
    split = torch.linalg.solve(g + root * eye(G_SIZE), grad) @ torch.linalg.inv(
        a + root * eye(A_SIZE)
    )
    assert not torch.allclose(b.precondition(grad, damping), split, rtol=1e-3, atol=0)


def test_split_damping() -> None:
    assert split_damping(0.04, 100.0, 0.01, relative=True) == pytest.approx((0.2, 0.2))
    gamma_a, gamma_g = split_damping(0.04, 100.0, 0.01, relative=False)
    assert gamma_a == pytest.approx(0.2 * 100.0) and gamma_g == pytest.approx(0.2 / 100.0)
    assert gamma_a * gamma_g == pytest.approx(0.04)
    # a zero (or degenerate) scale falls back to √γ each
    assert split_damping(0.04, 0.0, 1.0, relative=False) == pytest.approx((0.2, 0.2))
    assert split_damping(0.04, 1.0, 0.0, relative=False) == pytest.approx((0.2, 0.2))
    assert split_damping(0.04, 1e-300, 1e300, relative=False) == pytest.approx((0.2, 0.2))


def test_mixed_block_folds_moments_from_the_identity_moments() -> None:
    b = block("kvec", "diagonal")
    a_rows, g_rows = moments(A_SIZE), moments(G_SIZE)
    assert b.a.shape == (2, A_SIZE) and b.g.shape == (2, G_SIZE)
    b.fold(a_rows, g_rows, 0.25)
    identity = torch.stack([torch.zeros(A_SIZE, dtype=D), torch.ones(A_SIZE, dtype=D)])
    tight(b.a, 0.25 * identity + 0.75 * a_rows)


def test_make_side_builds_each_kind() -> None:
    kw: dict[str, object] = {"device": CPU, "factor_dtype": D, "inv_dtype": D, "relative": False}
    for text, cls in [
        ("exact", ExactSide),
        ("lowrank:2", LowRankSide),
        ("kvec", KroneckerVectorSide),
        ("diagonal", DiagonalSide),
    ]:
        made = make_side(SideSpec.parse(text), "x", 4, method="eigen", **kw)  # type: ignore[arg-type]
        assert type(made) is cls and str(made.spec) == text
    inverse = make_side(SideSpec("exact"), "x", 4, method="inverse", **kw)  # type: ignore[arg-type]
    assert isinstance(inverse, ExactSide) and inverse.method == "inverse"


# -- forced failures -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["exact", "lowrank", "kvec", "diagonal"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_factor_is_refused_and_state_kept(kind: str, bad: float) -> None:
    n = 9
    s = side(kind, n, rank=3)
    s.fold(spd(n) if s.capture == "gram" else moments(n), 0.0)
    s.refresh(0.1)
    before = [t.clone() for t in s.state]
    basis = getattr(s, "warm_basis", None)
    basis = basis.clone() if basis is not None else None
    m = torch.randn(n, 3, dtype=D)
    expected = s.solve(m, 0.1, 0)
    s.factor[0, 1] = bad
    with pytest.raises(DecompositionError, match="NaN or Inf"):
        s.refresh(0.1)
    for old, new in zip(before, s.state, strict=True):
        torch.testing.assert_close(new, old, rtol=0, atol=0)
    if basis is not None:
        torch.testing.assert_close(s.warm_basis, basis, rtol=0, atol=0)  # type: ignore[attr-defined]
    torch.testing.assert_close(s.solve(m, 0.1, 0), expected, rtol=0, atol=0)


def test_lowrank_eigh_failure_is_a_decomposition_error(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 20
    low = lowrank(n, 3, spd(n))
    before = [t.clone() for t in low.state]
    basis = low.warm_basis.clone()  # type: ignore[union-attr]

    def broken(*_: object, **__: object) -> None:
        raise torch.linalg.LinAlgError("forced failure")  # type: ignore[attr-defined]

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    low.factor.copy_(spd(n))
    with pytest.raises(DecompositionError, match=r"low-rank refresh failed.*forced failure"):
        low.refresh(0.1)
    for old, new in zip(before, low.state, strict=True):
        torch.testing.assert_close(new, old, rtol=0, atol=0)
    torch.testing.assert_close(low.warm_basis, basis, rtol=0, atol=0)


@pytest.mark.parametrize(("a_spec", "g_spec"), [("lowrank:3", "exact"), ("kvec", "diagonal")])
def test_block_decompose_of_a_non_finite_factor_warns_and_keeps_state(
    a_spec: str, g_spec: str
) -> None:
    b = block(a_spec, g_spec)
    b.fold(batch_for(a_spec, A_SIZE, 1.0), batch_for(g_spec, G_SIZE, 1.0), 0.0)
    assert b.decompose("a", 0.1) and b.decompose("g", 0.1)
    before = {k: [t.clone() for t in v] for k, v in b.second_order.items()}
    grad = torch.randn(G_SIZE, A_SIZE, dtype=D)
    expected = b.precondition(grad, 0.1)
    b.a[0, 0] = float("nan")
    b.g[1, 0] = float("inf")
    for which in ("a", "g"):
        with pytest.warns(RuntimeWarning, match=rf"factor {which.upper()} could not be decomposed"):
            assert not b.decompose(which, 0.1)
    for which, tensors in before.items():
        for old, new in zip(tensors, b.second_order[which], strict=True):
            torch.testing.assert_close(new, old, rtol=0, atol=0)
    torch.testing.assert_close(b.precondition(grad, 0.1), expected, rtol=0, atol=0)


# -- checkpoints ---------------------------------------------------------------------


def refreshed_block(a_spec: str, g_spec: str) -> KroneckerBlock:
    b = block(a_spec, g_spec, relative=True)
    b.fold(batch_for(a_spec, A_SIZE, 2.0), batch_for(g_spec, G_SIZE, 0.5), 0.0)
    b.fold(batch_for(a_spec, A_SIZE, 2.0), batch_for(g_spec, G_SIZE, 0.5), 0.7)
    assert b.decompose("a", 0.1) and b.decompose("g", 0.1)
    return b


@pytest.mark.parametrize(
    ("a_spec", "g_spec"), [("lowrank:3", "exact"), ("kvec", "diagonal"), ("exact", "lowrank:2")]
)
def test_mixed_block_state_dict_round_trip(a_spec: str, g_spec: str) -> None:
    original = refreshed_block(a_spec, g_spec)
    state = original.state_dict()
    assert state["representation"] == [a_spec, g_spec]
    restored = block(a_spec, g_spec, relative=True)
    assert not restored.has_second_order
    restored.load_state_dict(state)
    assert restored.updates == original.updates == 2
    torch.testing.assert_close(restored.a, original.a, rtol=0, atol=0)
    torch.testing.assert_close(restored.g, original.g, rtol=0, atol=0)
    for which in ("a", "g"):
        for x, y in zip(
            restored.sides[which].state,
            original.sides[which].state,
            strict=True,
        ):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    grad = torch.randn(G_SIZE, A_SIZE, dtype=D)
    torch.testing.assert_close(
        restored.precondition(grad, 0.1), original.precondition(grad, 0.1), rtol=0, atol=0
    )
    # the saved state is a copy: later changes to the original do not reach it
    saved = state["a"].clone()  # type: ignore[attr-defined]
    original.fold(batch_for(a_spec, A_SIZE, 9.0), batch_for(g_spec, G_SIZE, 9.0), 0.0)
    torch.testing.assert_close(state["a"], saved, rtol=0, atol=0)


def snapshot(b: KroneckerBlock) -> list[torch.Tensor]:
    out = [b.a.clone(), b.g.clone()]
    for which in ("a", "g"):
        out += [t.clone() for t in b.sides[which].state]
    return out


@pytest.mark.parametrize(
    ("saved", "named"),
    [
        (("exact", "exact"), r"\['exact', 'exact'\]"),
        (("lowrank:2", "kvec"), r"\['lowrank:2', 'kvec'\]"),
        (("kvec", "lowrank:3"), r"\['kvec', 'lowrank:3'\]"),
    ],
)
def test_loading_other_representations_is_refused(saved: tuple[str, str], named: str) -> None:
    target = refreshed_block("lowrank:3", "kvec")
    before = snapshot(target)
    updates = target.updates
    if saved == ("exact", "exact"):
        # a checkpoint from before representations existed: no 'representation' key
        source = refreshed_block("exact", "exact")
        state = source.state_dict()
        del state["representation"]
    else:
        state = refreshed_block(*saved).state_dict()
    with pytest.raises(
        ValueError,
        match=rf"layer 'layer': the state dict holds representations {named}.*"
        r"\['lowrank:3', 'kvec'\]",
    ):
        target.load_state_dict(state)
    after = snapshot(target)
    assert target.updates == updates
    for x, y in zip(before, after, strict=True):
        torch.testing.assert_close(y, x, rtol=0, atol=0)


def test_loading_second_order_state_of_other_shapes_is_refused() -> None:
    """Same representation names, other state: an 'inverse' checkpoint into an 'eigen' block."""
    source = block("exact", "exact", method="inverse")
    source.fold(spd(A_SIZE), spd(G_SIZE), 0.0)
    assert source.decompose("a", 0.1) and source.decompose("g", 0.1)
    target = block("exact", "exact", method="eigen")
    target.fold(spd(A_SIZE), spd(G_SIZE), 0.0)
    assert target.decompose("a", 0.1) and target.decompose("g", 0.1)
    before = snapshot(target)
    with pytest.raises(ValueError, match=r"second-order state of 'a' does not match"):
        target.load_state_dict(source.state_dict())
    assert target.updates == 1
    for x, y in zip(before, snapshot(target), strict=True):
        torch.testing.assert_close(y, x, rtol=0, atol=0)


# -- costs -------------------------------------------------------------------------


def test_lowrank_cost_matches_its_state_and_grows_linearly() -> None:
    k = 4
    for n in (8, 16, 40):
        cost = side_cost(SideSpec("lowrank", k), n)
        assert cost.state == n * k + k + 1
        held = side("lowrank", n, rank=k).allocate()
        assert sum(t.numel() for t in held) == cost.state
        assert cost.factor == n * n
    apply = [side_cost(SideSpec("lowrank", k), n).apply_per_column for n in (16, 32, 64)]
    assert apply[1] == pytest.approx(2 * apply[0]) and apply[2] == pytest.approx(2 * apply[1])
    # cheaper to apply than the exact side once n is well above k
    assert side_cost(SideSpec("lowrank", k), 64).apply_per_column < (
        side_cost(SideSpec("exact"), 64).apply_per_column
    )
    # the rank is clipped to the side
    assert side_cost(SideSpec("lowrank", 100), 10).state == 10 * 10 + 10 + 1


@pytest.mark.parametrize("kind", ["kvec", "diagonal"])
def test_moments_cost_matches_the_side(kind: str) -> None:
    for n in (3, 16, 50):
        cost = side_cost(SideSpec(kind), n)  # type: ignore[arg-type]
        assert cost.factor == 2 * n
        s = side(kind, n)
        assert s.factor.numel() == cost.factor
        assert sum(t.numel() for t in s.allocate()) == cost.state == n
        assert cost.apply_per_column <= 4 * n


def test_exact_cost_matches_the_side() -> None:
    n = 6
    for method, state in (("eigen", n * n + n), ("inverse", n * n)):
        cost = side_cost(SideSpec("exact"), n, method)
        s = side("exact", n, method=method)
        assert cost.factor == s.factor.numel() == n * n
        assert sum(t.numel() for t in s.allocate()) == cost.state == state


@pytest.mark.parametrize(
    ("spec", "method"),
    [
        ("exact", "eigen"),
        ("exact", "inverse"),
        ("lowrank:3", "eigen"),
        ("kvec", "eigen"),
        ("diagonal", "eigen"),
    ],
)
def test_solve_coefficients_follow_the_state_and_the_damping(spec: str, method: str) -> None:
    """Cached per state and damping: a refresh, a load or another damping recomputes them."""
    side = make_side(
        SideSpec.parse(spec),
        "layer.a",
        6,
        method=method,
        device=torch.device("cpu"),
        factor_dtype=torch.float64,
        inv_dtype=torch.float64,
        relative=True,
    )
    m = torch.randn(6, 4, dtype=torch.float64)

    def fresh(damping: float) -> torch.Tensor:
        """The solve with nothing cached."""
        side.invalidate()
        return side.solve(m, damping, dim=0)

    def fold_and_refresh(seed: int) -> None:
        torch.manual_seed(seed)
        rows = torch.randn(20, 6, dtype=torch.float64)
        batch = (
            rows.T @ rows / 20
            if side.capture == "gram"
            else torch.stack([rows.mean(0), (rows**2).mean(0)])
        )
        side.fold(batch, 0.0)
        side.refresh(0.1)

    fold_and_refresh(0)
    first = side.solve(m, 0.1, dim=0)
    assert torch.equal(side.solve(m, 0.1, dim=0), first)  # cached: the same values
    assert torch.equal(first, fresh(0.1))
    other = side.solve(m, 0.3, dim=0)  # another damping: recomputed
    if method != "inverse":  # (the inverse holds its refresh's damping)
        assert not torch.allclose(other, first)
    assert torch.equal(other, fresh(0.3))
    fold_and_refresh(1)  # a refresh: recomputed
    assert torch.equal(side.solve(m, 0.1, dim=0), fresh(0.1))
    assert not torch.allclose(side.solve(m, 0.1, dim=0), first)
    for target in side.state:  # written in place (a broadcast received), then invalidated
        target.mul_(2.0)
    side.invalidate()
    assert torch.equal(side.solve(m, 0.1, dim=0), fresh(0.1))


# -- relative damping: one scale, decided and applied by the Side base class ------------


def _refreshed(kind: str, n: int, relative: bool, method: str = "eigen") -> Side:
    s = side(kind, n, relative=relative, method=method)
    s.fold(batch_for("exact" if s.capture == "gram" else kind, n, 7.0), 0.0)
    s.refresh(0.1)
    return s


@pytest.mark.parametrize("kind", ["exact", "lowrank", "kvec", "diagonal"])
def test_absolute_damping_leaves_the_state_unscaled(kind: str) -> None:
    s = _refreshed(kind, 6, relative=False)
    assert all(t is u for t, u in zip(s.scaled_state(), s.state, strict=True))
    assert s.scaled_factor() is s.factor
    assert float(s.scale()) == 1.0
    assert s.scaled_mean_eigenvalue() == float(s.mean_eigenvalue())


@pytest.mark.parametrize("kind", ["exact", "lowrank", "kvec", "diagonal"])
def test_relative_damping_divides_what_scales_with_the_factor(kind: str) -> None:
    s = _refreshed(kind, 6, relative=True)
    scale = s.scale()
    assert torch.equal(scale, s.mean_eigenvalue().clamp(min=torch.finfo(D).tiny))
    scaled = s.scaled_state()
    powers = {"exact": (0, 1), "lowrank": (0, 1, 1), "kvec": (0.5,), "diagonal": (1,)}[kind]
    for got, raw, power in zip(scaled, s.state, powers, strict=True):
        if power == 0:
            assert got is raw
        else:
            assert torch.equal(got, raw / (scale if power == 1 else scale.sqrt()))
    # the matrix the scaled state stands for has unit mean eigenvalue
    assert s.scaled_mean_eigenvalue() == 1.0
    tight(torch.trace(s.dense()) / 6 / scale, torch.tensor(1.0, dtype=D))


@pytest.mark.parametrize("relative", [False, True])
def test_the_solve_coefficients_are_the_scaled_formulas_bit_for_bit(relative: bool) -> None:
    exact = _refreshed("exact", 5, relative)
    _, values = exact.state
    inv = (values / exact.scale()).add_(0.1).reciprocal_()
    assert torch.equal(exact.coefficients(0.1)[1], inv.unsqueeze(1))
    low = _refreshed("lowrank", 5, relative)
    _, values, sigma = low.state
    s = low.scale()
    rest = 1.0 / (sigma[0] / s + 0.1)
    coefficient = (values / s).add_(0.1).reciprocal_().sub_(rest)
    _, got, got_rest = low.coefficients(0.1)
    assert torch.equal(got, coefficient.unsqueeze(1)) and torch.equal(got_rest, rest)
    kvec = _refreshed("kvec", 5, relative)
    b = kvec.state[0] / kvec.scale().sqrt()
    got_b, denominator = kvec.coefficients(0.1)
    assert torch.equal(got_b, b) and torch.equal(denominator, 0.1 + b.dot(b))
    diagonal = _refreshed("diagonal", 5, relative)
    inv = (diagonal.state[0] / diagonal.scale()).add_(0.1).reciprocal_()
    assert torch.equal(diagonal.coefficients(0.1)[0], inv.unsqueeze(1))


@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16])
def test_the_exact_inverse_is_scaled_by_its_factor_diagonal_at_refresh(
    factor_dtype: torch.dtype,
) -> None:
    s = make_side(
        SideSpec("exact"),
        "x",
        5,
        method="inverse",
        device=CPU,
        factor_dtype=factor_dtype,
        inv_dtype=torch.float32,
        relative=True,
    )
    s.fold(spd(5).to(factor_dtype) * 40.0, 0.0)
    s.refresh(0.1)
    # the mean of the diagonal in float32 (the decomposition's dtype), cast back
    mean = s.factor.diagonal().to(torch.float32).mean().to(factor_dtype)
    expected = damped_inverse(s.factor / mean, 0.1, torch.float32)
    assert torch.equal(s.state[0], expected)


@pytest.mark.parametrize("outer", [False, True])
def test_the_exact_block_solves_with_the_sides_scaled_eigenvalues(outer: bool) -> None:
    b = KroneckerBlock(
        "l",
        A_SIZE,
        G_SIZE,
        device=CPU,
        factor_dtype=D,
        inv_dtype=D,
        method="eigen",
        eigen_outer_product=outer,
        damping_mode="relative",
    )
    b.allocate_second_order()
    b.fold(spd(A_SIZE) * 50.0, spd(G_SIZE) * 1e-3, 0.0)
    for which in ("a", "g"):
        b.decompose(which, 0.1)  # type: ignore[arg-type]
    b.finish_update(0.1)
    a, g = b.sides["a"], b.sides["g"]
    da, dg = a.scaled_state()[1], g.scaled_state()[1]
    for got, side_ in ((da, a), (dg, g)):
        values = side_.state[1]
        assert torch.equal(got, values / values.mean().clamp(min=torch.finfo(D).tiny))
    grad = torch.randn(G_SIZE, A_SIZE, dtype=D)
    qa, qg = a.state[0], g.state[0]
    expected = precondition_eigen(grad, qa, qg, da=da, dg=dg, damping=0.1)
    torch.testing.assert_close(b.precondition(grad, 0.1), expected, rtol=1e-12, atol=0)
