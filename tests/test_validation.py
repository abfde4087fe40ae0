"""The argument checks of :mod:`kaisa.validation`: what each accepts and how it refuses.

Each refusal names the argument, says what is allowed and what was given:
a ``TypeError`` for a value of the wrong kind, a ``ValueError`` for one of
the right kind outside what is allowed.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from kaisa.validation import (
    Rule,
    check_count,
    check_dtype,
    check_flag,
    check_number,
    check_tensor,
    one_of,
)

CPU = torch.device("cpu")

# (call, exception, message fragment): every refusal of every check.
BAD: list[tuple[Callable[[], object], type[Exception], str]] = [
    # check_count
    (lambda: check_count(-1, "updates"), ValueError, "updates must be an integer >= 0; got -1"),
    (lambda: check_count(0, "steps", 1), ValueError, "steps must be an integer >= 1; got 0"),
    (lambda: check_count(2.0, "steps", 1), TypeError, "steps must be an integer >= 1; got 2.0"),
    (lambda: check_count(True, "updates"), TypeError, "updates must be an integer >= 0; got True"),
    (lambda: check_count("3", "updates"), TypeError, "updates must be an integer >= 0; got '3'"),
    (lambda: check_count(None, "updates"), TypeError, "got None"),
    (
        lambda: check_count(4, "rank", 0, high=4),
        ValueError,
        "rank must be an integer >= 0 and < 4; got 4",
    ),
    (
        lambda: check_count(-1, "rank", 0, high=4, type_error=ValueError),
        ValueError,
        "rank must be an integer >= 0 and < 4; got -1",
    ),
    (
        lambda: check_count(1.0, "world_size", 1, type_error=ValueError),
        ValueError,
        "world_size must be an integer >= 1; got 1.0",
    ),
    # check_number
    (lambda: check_number("1", "lr", low=0), TypeError, "lr must be a number >= 0; got '1'"),
    (lambda: check_number(True, "lr", low=0), TypeError, "lr must be a number >= 0; got True"),
    (lambda: check_number(None, "lr"), TypeError, "lr must be a number; got None"),
    (lambda: check_number(-1e-9, "lr", low=0), ValueError, "lr must be a number >= 0; got -1e-09"),
    (
        lambda: check_number(0, "kl_clip", low=0, low_open=True),
        ValueError,
        "kl_clip must be a number > 0; got 0",
    ),
    (
        lambda: check_number(1.0, "decay", low=0, high=1, high_open=True),
        ValueError,
        "decay must be a number >= 0 and < 1; got 1.0",
    ),
    (
        lambda: check_number(2, "fraction", high=1),
        ValueError,
        "fraction must be a number <= 1; got 2",
    ),
    (lambda: check_number(math.nan, "x"), ValueError, "x must be a number; got nan"),
    (lambda: check_number(math.inf, "x"), ValueError, "x must be a number; got inf"),
    (lambda: check_number(math.nan, "x", finite=False), ValueError, "got nan"),
    (
        lambda: check_number(math.inf, "x", high=10, finite=False),
        ValueError,
        "x must be a number <= 10; got inf",
    ),
    (
        lambda: check_number(1.5, "steps", low=1, integer=True),
        TypeError,
        "steps must be an integer >= 1; got 1.5",
    ),
    (
        lambda: check_number(0, "steps", low=1, integer=True),
        ValueError,
        "steps must be an integer >= 1; got 0",
    ),
    # Rule: a hyperparameter also allows a schedule, and says so for a non-number
    (
        lambda: Rule("lr", low=0.0).check("fast"),
        TypeError,
        "lr must be a number >= 0 or a callable step -> value; got 'fast'",
    ),
    (
        lambda: Rule("lr", low=0.0).check(-1.0, " (the schedule returned it at step 3)"),
        ValueError,
        "lr must be a number >= 0 (the schedule returned it at step 3); got -1.0",
    ),
    (
        lambda: Rule("steps", integer=True, low=1).check(2.5),
        TypeError,
        "steps must be an integer >= 1; got 2.5",
    ),
    # check_flag
    (lambda: check_flag("warn", 1), TypeError, "warn must be True or False; got 1"),
    (lambda: check_flag("warn", "yes"), TypeError, "warn must be True or False; got 'yes'"),
    (lambda: check_flag("warn", None), TypeError, "warn must be True or False; got None"),
    # one_of
    (
        lambda: one_of("compute_method", "svd", ("eigen", "inverse")),
        ValueError,
        "compute_method must be one of 'eigen', 'inverse'; got 'svd'",
    ),
    (
        lambda: one_of("compute_method", 3, ("eigen", "inverse")),
        ValueError,
        "compute_method must be one of 'eigen', 'inverse'; got 3",
    ),
    (lambda: one_of("mode", None, ("a",)), ValueError, "mode must be one of 'a'; got None"),
    # check_dtype
    (
        lambda: check_dtype("inv_dtype", torch.int32),
        TypeError,
        "inv_dtype must be a floating torch.dtype (torch.float16, torch.bfloat16, "
        "torch.float32, torch.float64) or None; got torch.int32",
    ),
    (
        lambda: check_dtype("inv_dtype", "float32"),
        TypeError,
        "inv_dtype must be a floating torch.dtype",
    ),
    (
        lambda: check_dtype("factor_dtype", None, allow_none=False),
        TypeError,
        "torch.float64); got None",
    ),
    (
        lambda: check_dtype("factor_dtype", torch.complex64, allow_none=False),
        TypeError,
        "torch.float64); got torch.complex64",
    ),
    # check_tensor
    (
        lambda: check_tensor([1.0], "factor A", (1,), CPU, None),
        TypeError,
        "factor A must be a tensor; got list",
    ),
    (
        lambda: check_tensor(torch.ones(2, dtype=torch.int64), "factor A", (2,), CPU, None),
        TypeError,
        "factor A must be a floating-point tensor; got dtype torch.int64",
    ),
    (
        lambda: check_tensor(torch.ones(2, 3), "factor A", (3, 2), CPU, None),
        ValueError,
        "factor A has shape (2, 3), expected (3, 2)",
    ),
    (
        lambda: check_tensor(torch.tensor([1.0, math.nan]), "factor A", (2,), CPU, None),
        ValueError,
        "factor A holds NaN or Inf",
    ),
    (
        lambda: check_tensor(
            torch.tensor([1e300], dtype=torch.float64), "factor A", (1,), CPU, torch.float32
        ),
        ValueError,
        "factor A holds NaN or Inf (as torch.float32)",
    ),
]


@pytest.mark.parametrize(("call", "error", "fragment"), BAD)
def test_a_bad_value_is_refused_naming_it(
    call: Callable[[], object], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error) as caught:
        call()
    assert type(caught.value) is error
    assert fragment in str(caught.value)


GOOD: list[tuple[Callable[[], object], object]] = [
    (lambda: check_count(0, "updates"), 0),
    (lambda: check_count(7, "steps", 1), 7),
    (lambda: check_count(3, "rank", 0, high=4), 3),
    (lambda: check_number(0, "lr", low=0), 0.0),
    (lambda: check_number(2, "x"), 2.0),
    (lambda: check_number(0.5, "decay", low=0, high=1, high_open=True), 0.5),
    (lambda: check_number(1, "fraction", low=0, high=1), 1.0),
    (lambda: check_number(3.0, "steps", low=1, integer=True), 3.0),
    (lambda: check_number(math.inf, "x", low=0, finite=False), math.inf),
    (lambda: Rule("damping", low=1e-30).check(1e-3), 1e-3),
    (lambda: check_flag("warn", True), True),
    (lambda: check_flag("warn", False), False),
    (lambda: one_of("compute_method", "EIGEN", ("eigen", "inverse")), "eigen"),
    (lambda: one_of("compute_method", "inverse", ("eigen", "inverse")), "inverse"),
    (lambda: check_dtype("inv_dtype", None), None),
    (lambda: check_dtype("inv_dtype", torch.bfloat16), torch.bfloat16),
    (lambda: check_dtype("factor_dtype", torch.float64, allow_none=False), torch.float64),
]


@pytest.mark.parametrize(("call", "expected"), GOOD)
def test_a_good_value_is_returned(call: Callable[[], object], expected: object) -> None:
    got = call()
    assert got == expected and type(got) is type(expected)


def test_check_tensor_casts_and_moves_without_touching_its_input() -> None:
    value = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    cast = check_tensor(value, "x", (2, 3), CPU, torch.float32)
    assert cast.dtype == torch.float32 and torch.equal(cast, value.float())
    assert value.dtype == torch.float64
    same = check_tensor(value, "x", (2, 3), CPU, None)
    assert same.dtype == torch.float64


def test_importing_the_checks_does_not_import_torch() -> None:
    code = "import sys, kaisa.validation; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
