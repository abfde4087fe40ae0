"""A low-rank side under ``eigenbasis_tolerance``: the held ``U`` kept while it holds.

Float64 references: a kept refresh holds ``U`` bit for bit with ``λ =
diag(UᵀFU)`` and ``σ = (trace F − Σλ)/(n − k)`` of the new factor; a refresh
that does not keep is bit-identical to one without the tolerance; a span
that ``F`` still leaves in place but that is no longer its top ``k`` is
refreshed. Through the preconditioner (``tests/test_eigenbasis_tolerance.py``
holds the exact sides' counterparts): the telemetry counts the kept
low-rank refreshes, ``adaptive_intervals`` does not, and a resumed run
keeps the same ones.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_eigen_correction import _net, _train

import kaisa
from kaisa.curvature.costs import OVERSAMPLING, SideSpec
from kaisa.curvature.linalg import basis_holds
from kaisa.curvature.representations import LowRankSide, make_side

D = torch.float64
N, K = 30, 4


def low_side(tolerance: float | None, name: str = "layer.a") -> LowRankSide:
    side = make_side(
        SideSpec("lowrank", K),
        name,
        N,
        method="eigen",
        device=torch.device("cpu"),
        factor_dtype=D,
        inv_dtype=D,
        relative=True,
        basis_tolerance=tolerance,
    )
    assert isinstance(side, LowRankSide)
    return side


def factor_with(values: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    return (basis * values) @ basis.T


def gapped() -> tuple[torch.Tensor, torch.Tensor]:
    """``(λ, Q)``: four clear top eigenvalues above a flat rest, a random ``Q``."""
    values = torch.cat(
        [torch.tensor([10.0, 7.0, 5.0, 3.0], dtype=D), torch.linspace(0.01, 0.001, N - K, dtype=D)]
    )
    q = torch.linalg.qr(torch.randn(N, N, dtype=D, generator=torch.Generator().manual_seed(3))).Q
    return values, q


def converged(tolerance: float | None, factor: torch.Tensor) -> LowRankSide:
    """A side refreshed three times on ``factor`` (its warm basis has converged)."""
    side = low_side(tolerance)
    side.factor.copy_(factor)
    for _ in range(3):
        side.refresh(0.1)
    return side


def noise(scale: float, seed: int) -> torch.Tensor:
    return scale * torch.randn(N, N, dtype=D, generator=torch.Generator().manual_seed(seed))


def symmetric_noise(scale: float, seed: int) -> torch.Tensor:
    e = noise(scale, seed)
    return (e + e.T) / 2


def test_a_subspace_that_still_holds_is_kept_with_its_rayleigh_quotients() -> None:
    assert N > K + OVERSAMPLING  # a true subspace iteration, not a full decomposition
    values, q = gapped()
    side = converged(0.05, factor_with(values, q))
    held_u = side.state[0].clone()
    moved = factor_with(values, q) + symmetric_noise(1e-3, 1)
    side.factor.copy_(moved)
    side.refresh(0.1)
    assert side.basis_kept
    u, top, sigma = side.state
    assert torch.equal(u, held_u)
    torch.testing.assert_close(top, torch.diag(u.T @ moved @ u), rtol=1e-12, atol=1e-14)
    expected_sigma = (torch.trace(moved) - top.sum()) / (N - K)
    torch.testing.assert_close(sigma[0], expected_sigma, rtol=1e-12, atol=1e-14)
    # The approximation keeps the factor's trace, as a refresh does.
    torch.testing.assert_close(torch.trace(side.dense()), torch.trace(moved), rtol=1e-12, atol=0)


def test_a_subspace_that_moved_is_refreshed_as_without_the_tolerance() -> None:
    values, q = gapped()
    start = factor_with(values, q)
    # The same history (a tolerance would keep the second and third refreshes).
    with_tolerance, without = converged(None, start), converged(None, start)
    with_tolerance.basis_tolerance = 0.05
    # The top eigenvectors turn: U no longer spans an invariant subspace.
    skew = noise(0.3, 2)
    turn = torch.linalg.matrix_exp(skew - skew.T)
    turned = factor_with(values, turn @ q)
    assert basis_holds(turned @ with_tolerance.state[0], with_tolerance.state[0], 0.05) is None
    for side in (with_tolerance, without):
        side.factor.copy_(turned)
        side.refresh(0.1)
    assert not with_tolerance.basis_kept
    for got, expected in zip(with_tolerance.state, without.state, strict=True):
        assert torch.equal(got, expected)
    assert with_tolerance.warm_basis is not None and without.warm_basis is not None
    assert torch.equal(with_tolerance.warm_basis, without.warm_basis)


def test_a_span_left_in_place_but_no_longer_the_top_is_refreshed() -> None:
    values, q = gapped()
    side = converged(0.05, factor_with(values, q))
    # Same eigenvectors; the held span's values now sit below the rest's mean.
    swapped = values.clone()
    swapped[:K] = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=D)
    swapped[K:] = 5.0
    moved = factor_with(swapped, q)
    u = side.state[0]
    # The span is invariant and diagonalised: the product check alone would keep it.
    assert basis_holds(moved @ u, u, 0.05) is not None
    side.factor.copy_(moved)
    side.refresh(0.1)
    assert not side.basis_kept


def test_a_cold_refresh_never_keeps() -> None:
    # The identity leaves every span in place: only a warm basis is tested.
    side, plain = low_side(0.5), low_side(None)
    for s in (side, plain):
        s.factor.copy_(torch.eye(N, dtype=D))
        s.refresh(0.1)
    assert not side.basis_kept
    for got, expected in zip(side.state, plain.state, strict=True):
        assert torch.equal(got, expected)


# -- through the preconditioner -------------------------------------------------------------

OPTIONS = {
    # The second Linear's input side (13 wide) in rank 3: 11 columns iterated.
    "curvature": {"^2$": ("lowrank:3", "exact"), "^0$": "exact"},
    "factor_update_steps": 2,
    "inv_update_steps": 2,
    "lr": 0.1,
    "eigenbasis_tolerance": 0.3,
}


def _weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_kept_low_rank_refreshes_are_counted_but_do_not_stretch_the_intervals() -> None:
    model = _net()
    pre = kaisa.KFACPreconditioner(model, adaptive_intervals=True, **OPTIONS)
    (block,) = (layer.block for layer in pre._roster if layer.name == "2")
    low = block.sides["a"]
    assert isinstance(low, LowRankSide) and low.basis_tolerance == 0.3
    seen: list[tuple[int, int]] = []
    observe = pre._stretch.observe

    def record(keepable: int, kept: int) -> bool:
        seen.append((keepable, kept))
        return observe(keepable, kept)

    pre._stretch.observe = record  # type: ignore[method-assign]
    low_kept = 0
    for step in range(40):
        refreshes = pre.telemetry.side_refreshes
        _train(model, pre, range(step, step + 1))
        if pre.telemetry.side_refreshes > refreshes:
            low_kept += low.basis_kept
    assert low_kept > 0
    # The three exact sides are what the multiplier follows; the low-rank side is not.
    assert seen and all(keepable == 3 for keepable, _ in seen)
    assert pre.telemetry.kept_eigenbases == sum(kept for _, kept in seen) + low_kept


@pytest.mark.parametrize("tolerance", [0.3, None])
def test_a_resumed_run_keeps_the_same_low_rank_bases(tolerance: float | None) -> None:
    options = {**OPTIONS, "eigenbasis_tolerance": tolerance}
    whole = _net()
    pre_whole = kaisa.KFACPreconditioner(whole, **options)
    _train(whole, pre_whole, range(30))
    first = _net()
    pre_first = kaisa.KFACPreconditioner(first, **options)
    _train(first, pre_first, range(13))
    resumed = _net()
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    pre_resumed = kaisa.KFACPreconditioner(resumed, **options)
    pre_resumed.load_state_dict(copy.deepcopy(pre_first.state_dict()))
    _train(resumed, pre_resumed, range(13, 30))
    assert torch.equal(_weights(resumed), _weights(whole))
    kept = pre_first.telemetry.kept_eigenbases + pre_resumed.telemetry.kept_eigenbases
    assert kept == pre_whole.telemetry.kept_eigenbases
    if tolerance is None:
        assert kept == 0
