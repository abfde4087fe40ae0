"""``stale_refresh``: factors and inverses every step while the curvature is stale.

The rule (:class:`kaisa.cadence.StaleRefresh`) alone, then through the
preconditioner: a drift of the preconditioned gradients' sizes cuts the
intervals to one step, which then double back to the ones given; a run whose
curvature never drifts equals the plain one; checkpoints; refused options.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_eigen_correction import _net, _train
from test_eigenbasis_tolerance import _weights
from torch import nn

import kaisa
from kaisa.cadence import DRIFT_FACTOR, DRIFT_LAYERS, DRIFT_SHARE, StaleRefresh
from kaisa.options import auto_decay


def test_the_rule_cuts_to_one_step_on_drift_and_doubles_back() -> None:
    watch = StaleRefresh(True)
    assert watch.cap is None and not watch.stale({"a": 1.0})  # no reference yet
    watch.refreshed({"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}, longest=16)
    assert watch.cap is None and watch.reference == {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
    # Moves of at most DRIFT_FACTOR either way are no drift.
    assert not watch.stale({"a": DRIFT_FACTOR, "b": 2.0 / DRIFT_FACTOR, "c": 3.0, "d": 4.0})
    # Two layers in four past the factor: stale (either way).
    assert DRIFT_SHARE == 0.25 and DRIFT_LAYERS == 2
    up, down = 1.01 * DRIFT_FACTOR, 0.99 * 2.0 / DRIFT_FACTOR
    assert watch.stale({"a": up, "b": down, "c": 3.0, "d": 4.0})
    # One layer alone is not the model's curvature, even when it is DRIFT_SHARE of them
    # (as the suite's SmallCNN's classifier was).
    assert not watch.stale({"a": 100.0, "b": 2.0, "c": 3.0, "d": 4.0})
    # In a larger model DRIFT_SHARE of the layers is needed: 2 of 8 are, 2 of 12 are not.
    wide = StaleRefresh(True)
    wide.refreshed({str(i): 1.0 for i in range(12)}, longest=16)
    assert wide.stale({str(i): 100.0 if i < 2 else 1.0 for i in range(8)})
    assert not wide.stale({str(i): 100.0 if i < 2 else 1.0 for i in range(12)})
    assert wide.stale({str(i): 100.0 if i < 3 else 1.0 for i in range(12)})
    # A model of one layer needs that layer only.
    single = StaleRefresh(True)
    single.refreshed({"a": 1.0}, longest=16)
    assert single.stale({"a": 100.0}) and not single.stale({"a": 2.0})
    # Layers without a reference are not counted (counted, 2 in 9 would not be stale),
    # nor ratios that are not finite and positive.
    unreferenced = {name: 1.0 for name in "efghi"}
    assert watch.stale({"a": 100.0, "b": 0.01, "c": 3.0, "d": 4.0, **unreferenced})
    assert not watch.stale({"a": float("nan"), "b": 0.0, "c": float("inf"), "e": 50.0})
    # follow(): a measured step that was not a refresh and drifted cuts the cap to 1
    # (the flags as every rank agreed on them: here, one rank).
    agree = list
    assert not watch.follow({"a": 1.0}, False, agree, longest=16) and watch.cap is None
    assert watch.follow({"a": 100.0}, False, agree, longest=16) and watch.cap == 1
    # Another rank's refresh wins over this rank's drift: new references, no cut.
    assert not watch.follow({"a": 100.0}, False, lambda flags: [True, True], longest=16)
    assert watch.cap == 2 and watch.reference["a"] == 100.0
    watch.cap = 1
    caps = []
    for _ in range(5):
        watch.refreshed({"a": 1.0}, longest=16)
        caps.append(watch.cap)
    assert caps == [2, 4, 8, None, None]  # at 16 the intervals given are back
    off = StaleRefresh(False)
    assert not off.enabled and off.cap is None


def _drifting_net() -> nn.Sequential:
    # A head that starts at zero (as timm's EVA-02 and BEiT start theirs near
    # zero): the hidden layer's gradients arrive only once the head has grown,
    # so its first factors go stale at once.
    model = _net()
    with torch.no_grad():
        model[2].weight.zero_()
    return model


OPTIONS = {"curvature": "exact", "factor_update_steps": 8, "inv_update_steps": 8, "lr": 0.1}


@pytest.mark.parametrize("intervals", [(8, 8), (16, 8)])
def test_drifting_curvature_refreshes_every_step_and_the_intervals_return(
    intervals: tuple[int, int],
) -> None:
    model = _drifting_net()
    factor_steps, inv_steps = intervals
    options = {**OPTIONS, "factor_update_steps": factor_steps, "inv_update_steps": inv_steps}
    pre = kaisa.KFACPreconditioner(model, stale_refresh=True, **options)
    seen = []
    for step in range(60):
        _train(model, pre, range(step, step + 1))
        hyper = pre.hyperparameters()
        seen.append((hyper.factor_update_steps, hyper.inv_update_steps))
        assert hyper.factor_decay == auto_decay(hyper.factor_update_steps)
    triggers = pre.telemetry.stale_refreshes
    assert triggers >= 1 and pre.telemetry.summary()["stale_refreshes"] == triggers
    # Cut to one step, then back to the intervals given (the cap goes when it
    # reaches the longer of the two).
    assert (1, 1) in seen and seen[-1] == intervals
    # Every trigger adds refreshes beyond the 60 / inv_steps of the schedule.
    on_schedule = 4 * len(range(0, 60, inv_steps))
    assert pre.telemetry.side_refreshes > on_schedule
    # The drift was real: without the option the same run refreshes on schedule only.
    plain_model = _drifting_net()
    plain = kaisa.KFACPreconditioner(plain_model, stale_refresh=False, **options)
    _train(plain_model, plain, range(60))
    assert plain.telemetry.side_refreshes == on_schedule
    assert plain.telemetry.stale_refreshes == 0


def test_the_automatic_decay_follows_the_cut_interval() -> None:
    model = _drifting_net()
    pre = kaisa.KFACPreconditioner(model, stale_refresh=True, curvature="exact", lr=0.1)
    decays = set()
    for step in range(40):
        _train(model, pre, range(step, step + 1))
        hyper = pre.hyperparameters()
        assert hyper.factor_decay == auto_decay(hyper.factor_update_steps)
        decays.add(hyper.factor_decay)
    assert pre.telemetry.stale_refreshes >= 1 and auto_decay(1) in decays


def test_curvature_that_stays_put_leaves_the_run_as_it_was() -> None:
    runs = []
    for stale in (True, False):
        model = _net()
        pre = kaisa.KFACPreconditioner(model, stale_refresh=stale, **OPTIONS)
        _train(model, pre, range(40))
        runs.append((_weights(model), pre))
    assert runs[0][1].telemetry.stale_refreshes == 0
    assert torch.equal(runs[0][0], runs[1][0])


def test_a_resumed_run_continues_with_the_same_cap_and_references() -> None:
    def make(model: nn.Module) -> kaisa.KFACPreconditioner:
        return kaisa.KFACPreconditioner(model, stale_refresh=True, **OPTIONS)

    whole = _drifting_net()
    pre_whole = make(whole)
    _train(whole, pre_whole, range(30))
    first = _drifting_net()
    pre_first = make(first)
    _train(first, pre_first, range(9))
    assert pre_first.telemetry.stale_refreshes >= 1  # (the check below has teeth)
    model_state = copy.deepcopy(first.state_dict())
    kfac_state = copy.deepcopy(pre_first.state_dict())
    assert kfac_state["stale_refresh"]["cap"] is not None
    resumed = _drifting_net()
    resumed.load_state_dict(model_state)
    pre_resumed = make(resumed)
    pre_resumed.load_state_dict(kfac_state)
    _train(resumed, pre_resumed, range(9, 30))
    assert torch.equal(_weights(resumed), _weights(whole))


def test_a_bad_saved_state_is_refused_and_changes_nothing() -> None:
    model = _drifting_net()
    pre = kaisa.KFACPreconditioner(model, stale_refresh=True, **OPTIONS)
    _train(model, pre, range(5))
    before = copy.deepcopy(pre.state_dict())
    for bad, error, match in (
        ({"cap": 3, "reference": {}}, ValueError, "power of 2"),
        ({"cap": 0, "reference": {}}, ValueError, "power of 2"),
        ({"cap": True, "reference": {}}, TypeError, "cap"),
        ({"cap": None, "reference": {"0": "x"}}, TypeError, "reference"),
        ({"cap": None, "reference": {"0": -1.0}}, ValueError, "reference"),
        ({"cap": None}, ValueError, "malformed"),
        ([1], TypeError, "must be a dict"),
    ):
        state = copy.deepcopy(before)
        state["stale_refresh"] = bad
        state["steps"] = 1
        with pytest.raises(error, match=match):
            pre.load_state_dict(state)
        after = pre.state_dict()
        assert after["steps"] == before["steps"]
        assert after["stale_refresh"] == before["stale_refresh"]
    # A checkpoint written without the option starts with no cap and no references.
    plain = kaisa.KFACPreconditioner(_net(), stale_refresh=False, **OPTIONS)
    _train(plain.model, plain, range(3))
    assert "stale_refresh" not in plain.state_dict()
    pre.load_state_dict(plain.state_dict())
    assert pre.state_dict()["stale_refresh"] == {"cap": None, "reference": {}}


def test_on_by_default_and_off_in_the_reference_defaults() -> None:
    assert kaisa.KFACPreconditioner(_net(), **OPTIONS).options.stale_refresh
    reference = kaisa.KFACPreconditioner.with_reference_defaults(_net(), lr=0.1)
    assert not reference.options.stale_refresh


def test_intervals_of_one_measure_nothing() -> None:
    # Nothing to shorten: no norms, no references, the run as without the option.
    runs = []
    for stale in (True, False):
        model = _drifting_net()
        options = {**OPTIONS, "factor_update_steps": 1, "inv_update_steps": 1}
        pre = kaisa.KFACPreconditioner(model, stale_refresh=stale, **options)
        _train(model, pre, range(12))
        runs.append(_weights(model))
        if stale:
            assert pre.state_dict()["stale_refresh"] == {"cap": None, "reference": {}}
    assert torch.equal(runs[0], runs[1])


def test_a_bad_flag_names_itself() -> None:
    with pytest.raises(TypeError, match="stale_refresh"):
        kaisa.KFACPreconditioner(_net(), stale_refresh="yes", **OPTIONS)  # type: ignore[arg-type]


def _layer_norms(model: nn.Sequential) -> dict[str, torch.Tensor]:
    """Each linear layer's gradient matrix ``[∇W, ∇b]``'s Frobenius norm, by layer name."""
    norms = {}
    for name in ("0", "2"):
        layer = model.get_submodule(name)
        assert layer.weight.grad is not None and layer.bias.grad is not None
        norms[name] = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1).norm()
    return norms


def test_the_ratios_are_the_preconditioned_over_the_raw_norms() -> None:
    # The reference after the first (refreshing) step is each layer's ‖P‖/‖∇‖
    # without KL clipping: checked against the gradients by hand.
    model = _net()
    options = {**OPTIONS, "kl_clip": None}
    del options["lr"]
    pre = kaisa.KFACPreconditioner(model, stale_refresh=True, **options)
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(3))
    torch.nn.functional.cross_entropy(model(x), torch.zeros(16, dtype=torch.long)).backward()
    raw = _layer_norms(model)
    pre.step()
    done = _layer_norms(model)
    reference = pre.state_dict()["stale_refresh"]["reference"]
    assert set(reference) == {"0", "2"}
    for name in ("0", "2"):
        assert math.isclose(reference[name], float(done[name] / raw[name]), rel_tol=1e-5)
