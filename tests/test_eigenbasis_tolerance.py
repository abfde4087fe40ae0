"""``eigenbasis_tolerance`` through the preconditioner: stale bases refreshed, fitting ones kept.

The rule itself is checked against float64 references in
``tests/curvature/test_held_basis.py``, and across ranks and fractions in
``tests/distributed/test_equivalence.py`` and ``test_tied_distributed.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_eigen_correction import _net, _train
from torch import nn

import kaisa

OPTIONS = {
    "curvature": "exact",
    "factor_update_steps": 2,
    "inv_update_steps": 2,
    "lr": 0.1,
}


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _run(
    tolerance: float | None, steps: int = 40, **options: object
) -> tuple[nn.Module, kaisa.KFACPreconditioner, list[float]]:
    model = _net()
    pre = kaisa.KFACPreconditioner(model, eigenbasis_tolerance=tolerance, **{**OPTIONS, **options})
    losses = _train(model, pre, range(steps))
    return model, pre, losses


@pytest.mark.parametrize("correction", ["off", "ekfac"])
def test_a_tolerance_keeps_some_bases_and_still_trains(correction: str) -> None:
    model, pre, losses = _run(0.05, eigenvalue_correction=correction)
    telemetry = pre.telemetry
    # Two layers, two sides each, refreshed at every second step of 40.
    assert telemetry.side_refreshes == 4 * 20
    assert 0 < telemetry.kept_eigenbases < telemetry.side_refreshes
    assert telemetry.summary()["kept_eigenbases"] == telemetry.kept_eigenbases
    assert losses[-1] < 0.85 * losses[0]
    every, pre_every, _ = _run(None, eigenvalue_correction=correction)
    assert pre_every.telemetry.kept_eigenbases == 0
    assert pre_every.telemetry.side_refreshes == 4 * 20
    # Keeping bases changed the run (the check below has teeth).
    assert not torch.allclose(_weights(model), _weights(every), atol=1e-6)


def test_a_zero_tolerance_is_the_run_that_decomposes_every_time() -> None:
    # No factor here is exactly diagonal in its held basis: every refresh decomposes.
    model, pre, _ = _run(0.0)
    every, _, _ = _run(None)
    assert pre.telemetry.kept_eigenbases == 0
    assert torch.equal(_weights(model), _weights(every))


def test_a_kept_basis_is_the_held_one_and_its_values_the_rayleigh_quotients() -> None:
    model = _net()
    pre = kaisa.KFACPreconditioner(model, eigenbasis_tolerance=0.08, **OPTIONS)
    # At step 6 the sides' shares are 0.12, 0.04, 0.06 and 0.02: one is refreshed.
    _train(model, pre, range(6))
    before = pre.telemetry.kept_eigenbases
    sides = [(layer.block, which) for layer in pre.layers for which in ("a", "g")]
    held = [block.second_order[which][0].clone() for block, which in sides]
    _train(model, pre, range(6, 8))
    kept = 0
    for (block, which), old in zip(sides, held, strict=True):
        q, values = block.second_order[which]
        factor = (block.a if which == "a" else block.g).double()
        if torch.equal(q, old):  # kept: its values are diag(QᵀFQ) of the new factor
            kept += 1
            expected = torch.diag(q.double().T @ factor @ q.double())
            torch.testing.assert_close(values.double(), expected, rtol=1e-5, atol=1e-8)
        else:  # decomposed: the factor's own eigenpairs
            dense = (q.double() * values.double()) @ q.double().T
            torch.testing.assert_close(dense, factor, rtol=1e-4, atol=1e-6)
    assert kept == pre.telemetry.kept_eigenbases - before
    assert 0 < kept < len(sides)


def test_a_resumed_run_keeps_and_refreshes_the_same_bases() -> None:
    # The decision reads the held basis, which the checkpoint carries.
    model, pre, _ = _run(0.05, steps=40)
    first = _net()
    pre_first = kaisa.KFACPreconditioner(first, eigenbasis_tolerance=0.05, **OPTIONS)
    _train(first, pre_first, range(17))
    model_state = copy.deepcopy(first.state_dict())
    kfac_state = copy.deepcopy(pre_first.state_dict())
    resumed = _net()
    resumed.load_state_dict(model_state)
    pre_resumed = kaisa.KFACPreconditioner(resumed, eigenbasis_tolerance=0.05, **OPTIONS)
    pre_resumed.load_state_dict(kfac_state)
    _train(resumed, pre_resumed, range(17, 40))
    assert torch.equal(_weights(resumed), _weights(model))
    kept = pre_first.telemetry.kept_eigenbases + pre_resumed.telemetry.kept_eigenbases
    assert kept == pre.telemetry.kept_eigenbases


def test_the_tolerance_is_recorded_as_a_float() -> None:
    pre = kaisa.KFACPreconditioner(_net(), eigenbasis_tolerance=0, **OPTIONS)
    assert pre.options.eigenbasis_tolerance == 0.0
    assert isinstance(pre.options.eigenbasis_tolerance, float)
    assert kaisa.KFACPreconditioner(_net(), **OPTIONS).options.eigenbasis_tolerance is None


def test_fresh_bases_early_then_longer_intervals() -> None:
    """docs/language-models.md's recipe: a schedule of 2 before a step, 5 after.

    With the tolerance and the correction, the inverse updates fall on the
    schedule's steps (0, 2, 4; then 10, 15, ..., 35 of 40 steps), each
    refreshing the two layers' four sides, and the run trains.
    """

    def intervals(step: int) -> int:
        return 2 if step < 6 else 5

    model = _net()
    pre = kaisa.KFACPreconditioner(
        model,
        lr=0.1,
        curvature="exact",
        factor_update_steps=intervals,
        inv_update_steps=intervals,
        eigenbasis_tolerance=0.05,
        eigenvalue_correction="ekfac",
    )
    losses = _train(model, pre, range(40))
    assert pre.telemetry.side_refreshes == 4 * (3 + 6)
    assert losses[-1] < 0.85 * losses[0]
