"""``adaptive_intervals``: the factor and inverse intervals stretched while bases stay kept.

The rule (:class:`kaisa.cadence.IntervalStretch`) alone, then through the
preconditioner: the intervals and the automatic decay in force, a run that
never stretches equal to the plain one, checkpoints, and refused options. The
ranks' agreement is checked in ``tests/distributed/test_equivalence.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_eigen_correction import _net, _train
from test_eigenbasis_tolerance import OPTIONS, _weights
from torch import nn

import kaisa
from kaisa.cadence import MAX_STRETCH, STALE_HIGH, STALE_LOW, IntervalStretch
from kaisa.options import auto_decay


def test_the_rule_doubles_below_the_low_share_and_halves_above_the_high_one() -> None:
    stretch = IntervalStretch(True)
    assert stretch.factor == 1
    # The first update is no evidence (the sides held their starting identity).
    assert not stretch.observe(10, 10) and stretch.factor == 1 and stretch.started
    # 10 keepable sides: 1 decomposed (10% < 20%) doubles, up to the maximum.
    factors, changed = [], 0
    for _ in range(5):
        changed += stretch.observe(10, 9)
        factors.append(stretch.factor)
    assert factors == [2, 4, 8, 8, 8] and MAX_STRETCH == 8
    # Between the two shares nothing changes (inclusive at both ends).
    assert not stretch.observe(10, 10 - round(10 * STALE_LOW))
    assert not stretch.observe(10, 10 - round(10 * STALE_HIGH))
    assert stretch.factor == 8
    # 5 of 10 decomposed (50% > 40%) halves, down to 1.
    factors = []
    for _ in range(5):
        changed += stretch.observe(10, 5)
        factors.append(stretch.factor)
    assert factors == [4, 2, 1, 1, 1]
    assert changed == 6  # observe() says when the multiplier moved
    # Nothing that could keep a basis: no evidence, no change.
    assert not stretch.observe(0, 0)
    off = IntervalStretch(False)
    assert not off.observe(10, 10) and off.factor == 1
    with pytest.raises(ValueError, match=r"kept \(11\) must be in \[0, keepable=10\]"):
        stretch.observe(10, 11)


def test_a_saved_multiplier_is_checked_before_it_is_restored() -> None:
    stretch = IntervalStretch(True)
    stretch.observe(4, 4)
    stretch.observe(4, 4)
    again = IntervalStretch(True)
    again.load_state_dict(stretch.state_dict())
    assert again.factor == 2 and again.state_dict() == {"factor": 2, "started": True}
    for bad, error in (
        ({"factor": 3}, ValueError),
        ({"factor": 16}, ValueError),
        ({"factor": 0}, ValueError),
        ({"factor": True}, TypeError),
        ({}, TypeError),
        ({"factor": 2.0}, TypeError),
        ({"factor": 1, "started": 1}, TypeError),
    ):
        with pytest.raises(error, match="interval_stretch"):
            again.load_state_dict(bad)
        assert again.factor == 2 and again.started
    # A checkpoint from before 'started' was written past the first update.
    fresh = IntervalStretch(True)
    fresh.load_state_dict({"factor": 1})
    assert fresh.started and fresh.observe(4, 4) and fresh.factor == 2
    unstarted = IntervalStretch(True)
    unstarted.load_state_dict({"factor": 1, "started": False})
    assert not unstarted.observe(4, 4) and unstarted.factor == 1


def test_bases_that_stay_put_stretch_the_intervals_and_the_decay_follows() -> None:
    model = _net()
    # At this tolerance every held basis is kept: the intervals double at each
    # inverse update (steps 2, 4, 8: the next multiple of the interval in force;
    # step 0's, the first, is no evidence) up to 8 times the given 2.
    pre = kaisa.KFACPreconditioner(
        model, eigenbasis_tolerance=0.9, adaptive_intervals=True, **OPTIONS
    )
    seen = []
    for step in range(40):
        _train(model, pre, range(step, step + 1))
        hyper = pre.hyperparameters()
        seen.append((pre.interval_stretch, hyper.factor_update_steps, hyper.inv_update_steps))
        assert hyper.factor_decay == auto_decay(hyper.factor_update_steps)
    assert seen[0] == seen[1] == (1, 2, 2)
    assert seen[2] == seen[3] == (2, 4, 4)
    assert seen[4] == seen[7] == (4, 8, 8)
    assert seen[8] == (8, 16, 16)
    assert seen[-1] == (8, 16, 16)
    assert pre.telemetry.interval_changes == 3
    assert pre.telemetry.summary()["interval_changes"] == 3
    # Refreshes at steps 0, 2, 4, 8, 16 and 32 only (two layers, two sides each).
    assert pre.telemetry.side_refreshes == 4 * 6
    assert "interval_stretch" in pre.state_dict()


def test_bases_that_always_go_stale_leave_the_run_as_it_was() -> None:
    # A zero tolerance decomposes every time: the multiplier stays 1 and the
    # run is the one without adaptive_intervals, bit for bit.
    runs = []
    for adaptive in (True, False):
        model = _net()
        pre = kaisa.KFACPreconditioner(
            model, eigenbasis_tolerance=0.0, adaptive_intervals=adaptive, **OPTIONS
        )
        _train(model, pre, range(30))
        runs.append((_weights(model), pre))
    assert runs[0][1].interval_stretch == 1 and runs[0][1].telemetry.interval_changes == 0
    assert torch.equal(runs[0][0], runs[1][0])
    assert "interval_stretch" not in runs[1][1].state_dict()


def test_a_resumed_run_continues_with_the_same_multiplier() -> None:
    def make(model: nn.Module) -> kaisa.KFACPreconditioner:
        return kaisa.KFACPreconditioner(
            model, eigenbasis_tolerance=0.1, adaptive_intervals=True, **OPTIONS
        )

    whole = _net()
    pre_whole = make(whole)
    _train(whole, pre_whole, range(40))
    first = _net()
    pre_first = make(first)
    _train(first, pre_first, range(13))
    assert pre_first.interval_stretch > 1  # (the check below has teeth)
    model_state = copy.deepcopy(first.state_dict())
    kfac_state = copy.deepcopy(pre_first.state_dict())
    resumed = _net()
    resumed.load_state_dict(model_state)
    pre_resumed = make(resumed)
    pre_resumed.load_state_dict(kfac_state)
    assert pre_resumed.interval_stretch == pre_first.interval_stretch
    _train(resumed, pre_resumed, range(13, 40))
    assert torch.equal(_weights(resumed), _weights(whole))
    assert pre_resumed.interval_stretch == pre_whole.interval_stretch


def test_a_bad_saved_multiplier_is_refused_and_changes_nothing() -> None:
    model = _net()
    pre = kaisa.KFACPreconditioner(
        model, eigenbasis_tolerance=0.9, adaptive_intervals=True, **OPTIONS
    )
    _train(model, pre, range(3))
    before = copy.deepcopy(pre.state_dict())
    bad = copy.deepcopy(before)
    bad["interval_stretch"] = {"factor": 3}
    bad["steps"] = 1
    with pytest.raises(ValueError, match="'interval_stretch' factor must be a power of 2"):
        pre.load_state_dict(bad)
    after = pre.state_dict()
    assert after["steps"] == before["steps"]
    assert after["interval_stretch"] == before["interval_stretch"]
    bad["interval_stretch"] = [2]
    with pytest.raises(TypeError, match="'interval_stretch' must be a dict"):
        pre.load_state_dict(bad)
    # A checkpoint written without the option starts the multiplier at 1.
    plain = kaisa.KFACPreconditioner(_net(), eigenbasis_tolerance=0.9, **OPTIONS)
    _train(plain.model, plain, range(3))
    pre.load_state_dict(plain.state_dict())
    assert pre.interval_stretch == 1


def test_refused_options_name_themselves() -> None:
    with pytest.raises(ValueError, match="give eigenbasis_tolerance too"):
        kaisa.KFACPreconditioner(_net(), adaptive_intervals=True, **OPTIONS)
    with pytest.raises(ValueError, match="factor_update_steps is a schedule"):
        kaisa.KFACPreconditioner(
            _net(),
            eigenbasis_tolerance=0.05,
            adaptive_intervals=True,
            **{**OPTIONS, "factor_update_steps": lambda step: 2},
        )
    with pytest.raises(TypeError, match="adaptive_intervals"):
        kaisa.KFACPreconditioner(
            _net(),
            eigenbasis_tolerance=0.05,
            adaptive_intervals="yes",  # type: ignore[arg-type]
            **OPTIONS,
        )
    # Intervals left to kaisa are stretched too (the chosen ones).
    model = _net()
    pre = kaisa.KFACPreconditioner(
        model, eigenbasis_tolerance=0.9, adaptive_intervals=True, curvature="exact", lr=0.1
    )
    _train(model, pre, range(1))
    chosen = pre.curvature_choice
    assert chosen is not None and pre.interval_stretch == 1  # (step 0: no evidence)
    _train(model, pre, range(1, chosen.inv_update_steps + 1))
    assert pre.interval_stretch == 2
    hyper = pre.hyperparameters()
    assert hyper.factor_update_steps == 2 * chosen.factor_update_steps
    assert hyper.inv_update_steps == 2 * chosen.inv_update_steps


def test_no_basis_to_follow_is_said_once_and_the_intervals_stay() -> None:
    model = _net()
    pre = kaisa.KFACPreconditioner(
        model,
        eigenbasis_tolerance=0.9,
        adaptive_intervals=True,
        **{**OPTIONS, "curvature": "diagonal"},
    )
    with pytest.warns(RuntimeWarning, match="no side here holds one") as caught:
        _train(model, pre, range(10))
    assert sum("adaptive_intervals" in str(w.message) for w in caught) == 1
    assert pre.interval_stretch == 1 and pre.hyperparameters().factor_update_steps == 2
