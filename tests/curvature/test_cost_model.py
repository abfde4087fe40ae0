"""The cost model's weights (:class:`kaisa.curvature.costs.CostModel`) and what they weigh.

The defaults are pinned (the automatic choice depends on them), every weight
is checked, :func:`~kaisa.curvature.costs.side_cost` weighs decompositions by
the model it is given, and the cost model and the budget load without torch.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from typing import Any

import pytest

from kaisa.curvature.costs import (
    DEFAULT_COST_MODEL,
    OVERSAMPLING,
    SUBSPACE_ITERATIONS,
    CostModel,
    SideSpec,
    side_cost,
)


def test_the_default_weights() -> None:
    assert dataclasses.asdict(DEFAULT_COST_MODEL) == {
        "eigh": 8.0,
        "cholesky_inverse": 4.0,
        "capture": 2.0,
        "apply": 2.0,
        "operator": 3.5e6,
    }
    assert CostModel() == DEFAULT_COST_MODEL
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_COST_MODEL.eigh = 1.0  # type: ignore[misc]


def test_weights_are_kept_as_floats() -> None:
    model = CostModel(eigh=20, cholesky_inverse=3, capture=1, apply=0.5, operator=1000)
    assert dataclasses.asdict(model) == {
        "eigh": 20.0,
        "cholesky_inverse": 3.0,
        "capture": 1.0,
        "apply": 0.5,
        "operator": 1000.0,
    }
    assert all(type(value) is float for value in dataclasses.astuple(model))
    assert CostModel(eigh=8) == DEFAULT_COST_MODEL


FIELDS = ("eigh", "cholesky_inverse", "capture", "apply")


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize(
    ("value", "error"),
    [
        (0, ValueError),
        (-1.0, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        (10**400, ValueError),
        (True, TypeError),
        ("2", TypeError),
        (None, TypeError),
    ],
    ids=repr,
)
def test_a_bad_weight_is_refused_by_name(field: str, value: Any, error: type[Exception]) -> None:
    message = f"CostModel.{field} must be a finite number > 0; got "
    with pytest.raises(error, match=f"^{message.replace('.', '[.]')}"):
        CostModel(**{field: value})
    with pytest.raises(error, match=f"CostModel.{field} "):
        dataclasses.replace(DEFAULT_COST_MODEL, **{field: value})


MODEL = CostModel(eigh=20.0, cholesky_inverse=6.0, capture=1.0, apply=3.0)


@pytest.mark.parametrize("n", [1, 7, 64, 300])
def test_side_cost_weighs_the_decompositions_by_the_model(n: int) -> None:
    k = max(1, n // 4)
    width = min(n, k + OVERSAMPLING)
    iterations = (SUBSPACE_ITERATIONS + 1) * (n * n * width + 2.0 * n * width * width)
    for model in (DEFAULT_COST_MODEL, MODEL):
        refreshes = {
            ("exact", "eigen"): model.eigh * n**3,
            ("exact", "inverse"): model.cholesky_inverse * n**3,
            (f"lowrank:{k}", "eigen"): iterations + model.eigh * width**3,
            ("kvec", "eigen"): n,
            ("diagonal", "eigen"): n,
        }
        for (spec, method), refresh in refreshes.items():
            weighed = side_cost(SideSpec.parse(spec), n, method, cost_model=model)
            assert weighed.refresh == refresh, (spec, method)
            # The preconditioning's work and the counts of numbers do not depend on it.
            default = side_cost(SideSpec.parse(spec), n, method)
            assert dataclasses.replace(weighed, refresh=default.refresh) == default


def test_side_cost_refuses_what_is_not_a_cost_model() -> None:
    with pytest.raises(TypeError, match=r"cost_model must be a CostModel; got dict"):
        side_cost(SideSpec("exact"), 4, cost_model={"eigh": 8.0})  # type: ignore[arg-type]


def test_the_cost_model_and_the_budget_load_without_torch() -> None:
    code = (
        "import sys\n"
        "from kaisa.curvature.budget import LayerWork, choose_curvature\n"
        "from kaisa.curvature.costs import CostModel\n"
        "work = [LayerWork.from_rows('l', 65, 64, 16.0)]\n"
        "choose_curvature(work, 0.1, cost_model=CostModel(eigh=20.0))\n"
        "assert 'torch' not in sys.modules, 'the cost model imported torch'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
