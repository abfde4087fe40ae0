"""The budget's clock calibration (``calibrate_budget``, spec §8).

:func:`kaisa.curvature.budget.time_scale` by hand; the preconditioner with a
fake clock (``time.perf_counter`` replaced, so the measured passes and
captures are exact): the choice is made again :data:`CALIBRATION_STEPS` steps
after the first, with the allowance scaled, and kept from then on, across
checkpoints; ``calibrate_budget=False`` keeps the cost model's choice.
Several ranks: ``tests/distributed/test_auto_choice.py``.
"""

from __future__ import annotations

import dataclasses
import io
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.autochoice import CALIBRATION_STEPS
from kaisa.curvature.budget import MAX_TIME_SCALE, LayerWork, choose_curvature, time_scale
from kaisa.curvature.costs import DEFAULT_COST_MODEL, CostModel

# -- time_scale, by hand --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratio", "scale"),
    [
        (0.3, 1.0),  # faster than modelled: never below the model
        (1.0, 1.0),
        (1.4, 1.0),
        (2**0.5, 2**0.5),
        (1.99, 2**0.5),
        (2.0, 2.0),
        (2.38, 2.0),
        (2.9, 2**1.5),
        (15.9, 8 * 2**0.5),
        (16.0, 16.0),
        (1e6, MAX_TIME_SCALE),
    ],
)
def test_time_scale_is_the_measured_ratio_rounded_down_to_a_power_of_root_two(
    ratio: float, scale: float
) -> None:
    training = 5e6
    capture_work, capture_seconds = 3e6, 0.002
    # Passes worth ratio * training modelled multiply-adds at the capture speed.
    seconds = ratio * training * capture_seconds / (capture_work * DEFAULT_COST_MODEL.capture)
    assert time_scale(seconds, capture_seconds, capture_work, training) == pytest.approx(scale)


@pytest.mark.parametrize(
    "values",
    [(0.0, 1.0, 1.0, 1.0), (1.0, 0.0, 1.0, 1.0), (1.0, 1.0, -1.0, 1.0), (float("nan"), 1, 1, 1)],
)
def test_time_scale_without_a_usable_measurement_is_one(values: tuple[float, ...]) -> None:
    assert time_scale(*values) == 1.0


def test_time_scale_weighs_the_captures_by_the_cost_model() -> None:
    """Captures that weigh twice as much make the same passes worth twice the work."""
    training, capture_work, capture_seconds = 5e6, 3e6, 0.002
    seconds = 1.5 * training * capture_seconds / (capture_work * DEFAULT_COST_MODEL.capture)
    assert time_scale(seconds, capture_seconds, capture_work, training) == pytest.approx(2**0.5)
    double = dataclasses.replace(DEFAULT_COST_MODEL, capture=2 * DEFAULT_COST_MODEL.capture)
    assert time_scale(
        seconds, capture_seconds, capture_work, training, cost_model=double
    ) == pytest.approx(2**1.5)
    with pytest.raises(TypeError, match=r"cost_model must be a CostModel; got float"):
        time_scale(seconds, capture_seconds, capture_work, training, cost_model=2.0)  # type: ignore[arg-type]


def test_a_scale_widens_the_allowance_as_a_larger_budget_would() -> None:
    work = [
        LayerWork.from_rows(f"l{i}", a, g, 40.0) for i, (a, g) in enumerate([(65, 64), (129, 10)])
    ]
    for scale in (1.0, 2.0, 4.0, 16.0):
        scaled = choose_curvature(work, 0.05, scale=scale, calibrated=True)
        plain = choose_curvature(work, 0.05 * scale)
        assert (scaled.specs, scaled.factor_update_steps, scaled.inv_update_steps) == (
            plain.specs,
            plain.factor_update_steps,
            plain.inv_update_steps,
        )
        assert (scaled.time_scale, scaled.calibrated, scaled.budget) == (scale, True, 0.05)


@pytest.mark.parametrize("scale", [0.5, MAX_TIME_SCALE * 2, float("nan"), True, "2"])
def test_choose_curvature_refuses_a_bad_scale(scale: Any) -> None:
    work = [LayerWork.from_rows("l", 8, 8, 4.0)]
    with pytest.raises((TypeError, ValueError), match=r"scale must be a number in \[1, 16\]"):
        choose_curvature(work, 0.1, scale=scale)


# -- the preconditioner, on a fake clock -------------------------------------------------------


class Clock:
    """``time.perf_counter``: a microsecond per call, plus what a forward pass 'takes'."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now


class SlowMLP(nn.Module):
    """Two Linear layers whose forward pass costs ``pass_seconds`` on the fake clock."""

    def __init__(self, clock: Clock, pass_seconds: float) -> None:
        super().__init__()
        self.clock, self.pass_seconds = clock, pass_seconds
        self.fc1 = nn.Linear(64, 48)
        self.fc2 = nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += self.pass_seconds
        return self.fc2(torch.tanh(self.fc1(x)))


ROWS = 32
#: A cost model whose operator calls cost nothing: the clock alone widens the allowance here.
NO_OPERATORS = CostModel(operator=1e-12)


def mlp_work() -> list[LayerWork]:
    return [LayerWork.from_rows("fc1", 65, 48, ROWS), LayerWork.from_rows("fc2", 49, 10, ROWS)]


def train(model: nn.Module, pre: kaisa.KFACPreconditioner, steps: range) -> list[Any]:
    """SGD steps; the preconditioner's choice after each."""
    choices = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(ROWS, 64, generator=gen), torch.randint(0, 10, (ROWS,), generator=gen)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None and torch.isfinite(p.grad).all()
                p.sub_(0.05 * p.grad)
        choices.append(pre.curvature_choice)
    return choices


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(time, "perf_counter", fake)
    return fake


@pytest.mark.filterwarnings("ignore:kaisa. time_budget")
def test_a_slow_iteration_widens_the_budget_after_calibration(clock: Clock) -> None:
    torch.manual_seed(0)
    model = SlowMLP(clock, pass_seconds=1.0)  # far slower than its multiply-adds
    pre = kaisa.KFACPreconditioner(
        model, lr=0.1, time_budget=0.01, calibrate_budget=True, cost_model=NO_OPERATORS
    )
    choices = train(model, pre, range(CALIBRATION_STEPS + 5))
    # The rule with the side the first choice protected (found from its grams).
    protect = choices[0].protected if choices[0] is not None else None
    first = choose_curvature(mlp_work(), 0.01, protect=protect)
    calibrated = choose_curvature(
        mlp_work(), 0.01, scale=MAX_TIME_SCALE, calibrated=True, protect=protect
    )
    # The scenario has teeth: the wider allowance buys more curvature.
    assert calibrated.specs != first.specs or (
        calibrated.factor_update_steps,
        calibrated.inv_update_steps,
    ) != (first.factor_update_steps, first.inv_update_steps)
    assert choices[:CALIBRATION_STEPS] == [first] * CALIBRATION_STEPS
    assert choices[CALIBRATION_STEPS:] == [calibrated] * 5
    assert [tuple(map(str, la.block.specs)) for la in pre.layers] == list(calibrated.specs.values())
    assert pre.hyperparameter("factor_update_steps") == calibrated.factor_update_steps
    assert pre.hyperparameter("inv_update_steps") == calibrated.inv_update_steps
    # Every block decomposed at the calibration step: preconditioning goes on.
    assert all(la.block.has_second_order for la in pre.layers)


@pytest.mark.filterwarnings("ignore:kaisa. time_budget")
def test_an_iteration_as_fast_as_modelled_keeps_the_choice(clock: Clock) -> None:
    model = SlowMLP(clock, pass_seconds=0.0)
    pre = kaisa.KFACPreconditioner(
        model, lr=0.1, time_budget=0.01, calibrate_budget=True, cost_model=NO_OPERATORS
    )
    choices = train(model, pre, range(CALIBRATION_STEPS + 2))
    first = choose_curvature(mlp_work(), 0.01)
    last = choices[-1]
    assert last is not None and last.calibrated and last.time_scale == 1.0
    assert (last.specs, last.factor_update_steps, last.inv_update_steps) == (
        first.specs,
        first.factor_update_steps,
        first.inv_update_steps,
    )


@pytest.mark.filterwarnings("ignore:kaisa. time_budget")
def test_calibrate_budget_false_keeps_the_cost_models_choice(clock: Clock) -> None:
    model = SlowMLP(clock, pass_seconds=1.0)
    pre = kaisa.KFACPreconditioner(
        model, lr=0.1, time_budget=0.01, calibrate_budget=False, cost_model=NO_OPERATORS
    )
    choices = train(model, pre, range(CALIBRATION_STEPS + 3))
    assert choices[0] is not None
    expected = choose_curvature(mlp_work(), 0.01, protect=choices[0].protected)
    assert choices == [expected] * (CALIBRATION_STEPS + 3)


def test_calibrate_budget_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="calibrate_budget must be True or False"):
        kaisa.KFACPreconditioner(nn.Linear(4, 2), lr=0.1, calibrate_budget=1)  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:kaisa. time_budget")
def test_a_calibrated_choice_survives_a_checkpoint(clock: Clock) -> None:
    torch.manual_seed(0)
    model = SlowMLP(clock, pass_seconds=1.0)
    pre = kaisa.KFACPreconditioner(
        model, lr=0.1, time_budget=0.01, calibrate_budget=True, cost_model=NO_OPERATORS
    )
    train(model, pre, range(CALIBRATION_STEPS + 2))
    choice = pre.curvature_choice
    assert choice is not None and choice.calibrated
    buffer = io.BytesIO()
    torch.save(pre.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer)
    fresh_model = SlowMLP(clock, pass_seconds=0.0)  # would measure a scale of 1
    fresh_model.load_state_dict(model.state_dict())
    fresh = kaisa.KFACPreconditioner(
        fresh_model, lr=0.1, time_budget=0.01, calibrate_budget=True, cost_model=NO_OPERATORS
    )
    fresh.load_state_dict(state)
    assert train(fresh_model, fresh, range(CALIBRATION_STEPS + 2)) == [choice] * (
        CALIBRATION_STEPS + 2
    )


@pytest.mark.filterwarnings("ignore:kaisa. time_budget")
def test_a_choice_saved_before_calibration_is_calibrated_after_loading(clock: Clock) -> None:
    torch.manual_seed(0)
    model = SlowMLP(clock, pass_seconds=1.0)
    pre = kaisa.KFACPreconditioner(
        model, lr=0.1, time_budget=0.01, calibrate_budget=True, cost_model=NO_OPERATORS
    )
    train(model, pre, range(2))
    state = pre.state_dict()
    # A checkpoint written before the clock calibration (and the protected side)
    # existed lacks their fields: it protects nothing.
    saved_choice = dict(state["curvature_choice"])
    assert (saved_choice.pop("time_scale"), saved_choice.pop("calibrated")) == (1.0, False)
    saved_choice.pop("protected")
    state["curvature_choice"] = saved_choice
    fresh = kaisa.KFACPreconditioner(
        model, lr=0.1, time_budget=0.01, calibrate_budget=True, cost_model=NO_OPERATORS
    )
    fresh.load_state_dict(state)
    choices = train(model, fresh, range(2, 2 + CALIBRATION_STEPS + 1))
    assert choices[-1] == choose_curvature(mlp_work(), 0.01, scale=MAX_TIME_SCALE, calibrated=True)
    assert not any(c.calibrated for c in choices[:-1])


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("calibrated", 1, "'calibrated' must be True or False"),
        ("time_scale", 0.5, r"'time_scale' must be a number in \[1, 16\]"),
        ("time_scale", "2", r"'time_scale' must be a number in \[1, 16\]"),
    ],
)
@pytest.mark.filterwarnings("ignore:kaisa. time_budget")
def test_a_malformed_calibration_in_a_checkpoint_is_refused(
    clock: Clock, key: str, value: object, error: str
) -> None:
    model = SlowMLP(clock, pass_seconds=0.0)
    pre = kaisa.KFACPreconditioner(
        model, lr=0.1, time_budget=0.01, calibrate_budget=True, cost_model=NO_OPERATORS
    )
    train(model, pre, range(1))
    state = pre.state_dict()
    state["curvature_choice"] = {**state["curvature_choice"], key: value}
    fresh = kaisa.KFACPreconditioner(
        SlowMLP(clock, 0.0),
        lr=0.1,
        time_budget=0.01,
        calibrate_budget=True,
        cost_model=NO_OPERATORS,
    )
    with pytest.raises((TypeError, ValueError), match=error):
        fresh.load_state_dict(state)
    assert fresh.curvature_choice is None and fresh.steps == 0  # nothing changed
