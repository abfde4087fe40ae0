"""``fresh_start_steps``: factors and inverses at least every 2 steps at first.

The cap alone (:func:`kaisa.cadence.fresh_start_cap`), then through the
preconditioner: the intervals in force during and after it, the refreshes
they make, the adaptive multiplier held during it, the budget's choice costed
on the intervals after it, a resumed run, and the profiles' values.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_eigen_correction import _net, _train
from test_eigenbasis_tolerance import _weights
from test_profile import _tiny_gpt
from torch import nn

import kaisa
from kaisa.cadence import FRESH_START_INTERVAL, IntervalStretch, fresh_start_cap

EXACT = {"curvature": "exact", "lr": 0.1}


def test_the_cap_holds_the_intervals_to_two_steps_before_the_end_only() -> None:
    assert FRESH_START_INTERVAL == 2
    assert fresh_start_cap(None, 0, 10) == 2
    assert fresh_start_cap(None, 9, 10) == 2
    assert fresh_start_cap(None, 10, 10) is None
    # stale_refresh's cap: the smaller of the two while both hold.
    assert fresh_start_cap(1, 3, 10) == 1
    assert fresh_start_cap(4, 3, 10) == 2
    assert fresh_start_cap(4, 10, 10) == 4
    assert fresh_start_cap(None, 0, 0) is None  # 0: off


def test_the_multiplier_holds_during_it_and_counts_the_update_as_seen() -> None:
    stretch = IntervalStretch(True)
    # Every basis kept would double the multiplier; held, it stays.
    assert not stretch.observe(10, 10, hold=True) and stretch.factor == 1 and stretch.started
    assert not stretch.observe(10, 10, hold=True) and stretch.factor == 1
    # The first update after it counts (the one before it was seen).
    assert stretch.observe(10, 10) and stretch.factor == 2


def _intervals(fresh: int, steps: int, **options: object) -> tuple[list, kaisa.KFACPreconditioner]:
    model = _net()
    pre = kaisa.KFACPreconditioner(
        model,
        factor_update_steps=5,
        inv_update_steps=5,
        fresh_start_steps=fresh,
        stale_refresh=False,
        **{**EXACT, **options},
    )
    seen = []
    for step in range(steps):
        hyper = pre.hyperparameters()
        seen.append((hyper.factor_update_steps, hyper.inv_update_steps))
        _train(model, pre, range(step, step + 1))
    return seen, pre


def test_the_first_steps_refresh_every_two_steps_then_at_the_intervals_given() -> None:
    seen, pre = _intervals(7, 30)
    assert seen[:7] == [(2, 2)] * 7
    assert seen[7:] == [(5, 5)] * 23
    # Refreshes at steps 0, 2, 4, 6, then 10, 15, 20, 25 (two layers, two sides each).
    assert pre.telemetry.side_refreshes == 4 * 8
    # Off, the same model refreshes at steps 0, 5, ..., 25.
    seen, plain = _intervals(0, 30)
    assert seen == [(5, 5)] * 30
    assert plain.telemetry.side_refreshes == 4 * 6


def test_the_adaptive_multiplier_waits_for_the_end_of_it() -> None:
    # At this tolerance every held basis is kept: the multiplier would double at
    # each inverse update. It stays 1 through the fresh start (updates at steps
    # 0, 2, 4 and 6, each 2 steps from the last), and doubles at the first
    # update after it (step 10, the next multiple of 5), from step 11 on.
    seen, pre = _intervals(8, 40, eigenbasis_tolerance=0.9, adaptive_intervals=True)
    assert seen[:8] == [(2, 2)] * 8
    assert seen[8:11] == [(5, 5)] * 3
    assert seen[11] == (10, 10)
    assert pre.telemetry.interval_changes == 2 and pre.interval_stretch == 4  # steps 10, 20
    # Without a fresh start it doubles at step 5 (step 0 is no evidence).
    seen, _ = _intervals(0, 12, eigenbasis_tolerance=0.9, adaptive_intervals=True)
    assert seen[6] == (10, 10)


def test_the_budgets_choice_costs_the_intervals_after_it() -> None:
    # A budget between the costs of the sides at 2/2 and at 5/5: the choice
    # made during the fresh start is the one made at 5/5 without it.
    def chosen(fresh: int, interval: int) -> dict[str, tuple[str, str]]:
        model = _tiny_gpt()
        pre = kaisa.KFACPreconditioner(
            model,
            lr=0.1,
            profile="general",
            factor_update_steps=interval,
            inv_update_steps=interval,
            fresh_start_steps=fresh,
            time_budget=0.05,
        )
        ids = torch.randint(0, 31, (4, 9), generator=torch.Generator().manual_seed(0))
        logits = model(ids[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        pre.step()
        assert pre.curvature_choice is not None
        return pre.curvature_choice.specs

    at_five = chosen(0, 5)
    assert chosen(0, 2) != at_five  # (the check below has teeth)
    assert chosen(100, 5) == at_five


def test_a_resumed_run_is_the_unbroken_one() -> None:
    def make(model: nn.Module) -> kaisa.KFACPreconditioner:
        return kaisa.KFACPreconditioner(
            model,
            factor_update_steps=5,
            inv_update_steps=5,
            fresh_start_steps=9,
            eigenbasis_tolerance=0.1,
            adaptive_intervals=True,
            **EXACT,
        )

    whole = _net()
    _train(whole, make(whole), range(30))
    first = _net()
    pre_first = make(first)
    _train(first, pre_first, range(5))  # stopped inside the fresh start
    model_state = copy.deepcopy(first.state_dict())
    kfac_state = copy.deepcopy(pre_first.state_dict())
    resumed = _net()
    resumed.load_state_dict(model_state)
    pre_resumed = make(resumed)
    pre_resumed.load_state_dict(kfac_state)
    assert pre_resumed.hyperparameters().factor_update_steps == 2
    _train(resumed, pre_resumed, range(5, 30))
    assert torch.equal(_weights(resumed), _weights(whole))


def test_it_is_off_by_default_under_either_profile() -> None:
    for model in (_tiny_gpt(), _net()):
        assert kaisa.KFACPreconditioner(model, lr=0.1).options.fresh_start_steps == 0


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (2.5, TypeError), (True, TypeError), ("auto", TypeError)]
)
def test_a_bad_value_names_itself_and_changes_nothing(value: object, error: type) -> None:
    model = _net()
    before = [h for h in model._forward_pre_hooks.values()]
    with pytest.raises(error, match="fresh_start_steps"):
        kaisa.KFACPreconditioner(model, lr=0.1, fresh_start_steps=value)
    assert [h for h in model._forward_pre_hooks.values()] == before
