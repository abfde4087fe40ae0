"""Each string option's allowed values come from one place (kaisa.choices)."""

from __future__ import annotations

import argparse

import pytest
from torch import nn

import kaisa
from kaisa import choices, validation
from kaisa.cli.plan import _parser as plan_parser
from kaisa.demo.cli import _parser as demo_parser
from kaisa.distributed.plan import resolve_grad_workers


def _choices(parser: argparse.ArgumentParser, flag: str) -> tuple[object, ...]:
    action = next(a for a in parser._actions if flag in a.option_strings)
    assert action.choices is not None
    return tuple(action.choices)


@pytest.mark.parametrize(
    ("option", "allowed"),
    [
        ("compute_method", choices.COMPUTE_METHODS),
        ("damping_mode", choices.DAMPING_MODES),
        ("factor_init", choices.FACTOR_INITS),
        ("conv_factor_estimator", choices.CONV_ESTIMATORS),
        ("assignment_strategy", choices.ASSIGNMENT_STRATEGIES),
    ],
)
def test_the_constructor_accepts_each_value_and_names_them_all_when_refusing(
    option: str, allowed: tuple[str, ...]
) -> None:
    for value in allowed:
        kaisa.KFACPreconditioner(nn.Linear(3, 2), lr=0.1, **{option: value})
    with pytest.raises(ValueError, match=option) as caught:
        kaisa.KFACPreconditioner(nn.Linear(3, 2), **{option: "bogus"})
    for value in allowed:
        assert repr(value) in str(caught.value)


def test_the_command_lines_offer_the_same_lists() -> None:
    demo = demo_parser()
    assert _choices(demo, "--conv-factor-estimator") == choices.CONV_ESTIMATORS
    assert _choices(demo, "--damping-mode") == choices.DAMPING_MODES
    assert _choices(demo, "--factor-init") == choices.FACTOR_INITS
    plan = plan_parser()
    assert _choices(plan, "--compute-method") == choices.COMPUTE_METHODS
    assert _choices(plan, "--assignment-strategy") == choices.ASSIGNMENT_STRATEGIES


def test_every_named_fraction_resolves_and_others_are_refused_naming_them() -> None:
    assert [resolve_grad_workers(name, 4) for name in choices.NAMED_FRACTIONS] == [4, 2, 1]
    with pytest.raises(ValueError) as caught:
        resolve_grad_workers("most-opt", 4)
    for name in choices.NAMED_FRACTIONS:
        assert repr(name) in str(caught.value)


def test_one_of_lowercases_and_names_the_argument() -> None:
    assert validation.one_of("compute_method", "EIGEN", choices.COMPUTE_METHODS) == "eigen"
    with pytest.raises(ValueError, match="compute_method must be one of 'eigen', 'inverse'"):
        validation.one_of("compute_method", 3, choices.COMPUTE_METHODS)
