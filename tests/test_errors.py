"""Every bad argument raises a clear error naming it (a table, as torch.optim does)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import kaisa


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"factor_update_steps": 0}, ValueError, r"factor_update_steps must be an integer >= 1; got 0"),
    ({"factor_update_steps": 2.5}, TypeError, r"factor_update_steps must be an integer"),
    ({"factor_update_steps": "10"}, TypeError, r"factor_update_steps must be an integer"),
    ({"inv_update_steps": -1}, ValueError, r"inv_update_steps must be an integer >= 1; got -1"),
    ({"damping": 0.0}, ValueError, r"damping must be a number >= 1e-12; got 0.0"),
    ({"damping": 1e-40}, ValueError, r"damping must be a number >= 1e-12; got 1e-40"),
    ({"damping": float("nan")}, ValueError, r"damping must be a number >= 1e-12; got nan"),
    ({"damping": True}, TypeError, r"damping must be a number"),
    ({"factor_decay": 1.0}, ValueError, r"factor_decay must be a number >= 0 and < 1; got 1.0"),
    ({"factor_decay": -0.1}, ValueError, r"factor_decay must be a number >= 0 and < 1"),
    ({"kl_clip": 0.0}, ValueError, r"kl_clip must be a number > 0; got 0.0"),
    ({"kl_clip": "off"}, TypeError, r"kl_clip must be a number"),
    ({"lr": -1.0}, ValueError, r"lr must be a number >= 0; got -1.0"),
    ({"accumulation_steps": 0}, ValueError, r"accumulation_steps must be an integer >= 1; got 0"),
    ({"accumulation_steps": 1.0}, TypeError, r"accumulation_steps must be an integer"),
    (
        {"allreduce_bucket_cap_mb": 0},
        ValueError,
        r"allreduce_bucket_cap_mb must be a finite number > 0",
    ),
    ({"allreduce_bucket_cap_mb": "25"}, TypeError, r"allreduce_bucket_cap_mb must be a number"),
    (
        {"assignment_strategy": "speed"},
        ValueError,
        r"assignment_strategy must be one of 'compute', 'memory'; got 'speed'",
    ),
    (
        {"compute_method": "svd"},
        ValueError,
        r"compute_method must be one of 'eigen', 'inverse'; got 'svd'",
    ),
    (
        {"damping_mode": "adaptive"},
        ValueError,
        r"damping_mode must be one of 'absolute', 'relative'; got 'adaptive'",
    ),
    (
        {"factor_init": "zeros"},
        ValueError,
        r"factor_init must be one of 'identity', 'first_batch'; got 'zeros'",
    ),
    ({"colocate_factors": 1}, TypeError, r"colocate_factors must be True or False; got 1"),
    ({"symmetry_aware": None}, TypeError, r"symmetry_aware must be True or False"),
    (
        {"compute_eigenvalue_outer_product": "yes"},
        TypeError,
        r"compute_eigenvalue_outer_product must be True or False",
    ),
    ({"update_factors_in_hook": 0}, TypeError, r"update_factors_in_hook must be True or False"),
    ({"grad_worker_fraction": 1.5}, ValueError, r"grad_worker_fraction must be in \[0, 1\]"),
    ({"grad_worker_fraction": -0.5}, ValueError, r"grad_worker_fraction must be in \[0, 1\]"),
    (
        {"grad_worker_fraction": "half"},
        ValueError,
        r"grad_worker_fraction must be a float in \[0, 1\] or one of "
        r"'comm-opt', 'hybrid-opt', 'mem-opt'; got 'half'",
    ),
    ({"grad_worker_fraction": None}, TypeError, r"grad_worker_fraction must be a float"),
    ({"grad_scaler": 3.0}, TypeError, r"grad_scaler must be a torch.amp.GradScaler, a callable"),
    ({"factor_dtype": "float32"}, TypeError, r"factor_dtype must be a floating torch.dtype"),
    ({"factor_dtype": torch.int32}, TypeError, r"factor_dtype must be a floating torch.dtype"),
    ({"factor_product_dtype": torch.int8}, TypeError, r"factor_product_dtype must be a floating"),
    ({"inv_dtype": torch.complex64}, TypeError, r"inv_dtype must be a floating torch.dtype"),
    ({"skip_layers": 3}, TypeError, r"skip_layers must be a regular expression or a list of them"),
    ({"skip_layers": ["("]}, ValueError, r"skip_layers holds an invalid regular expression '\('"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD, ids=[str(b[0]) for b in BAD])
def test_bad_argument(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        kaisa.KFACPreconditioner(model(), **kwargs)


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module; got str"):
        kaisa.KFACPreconditioner("resnet", lr=0.1)  # type: ignore[arg-type]


def test_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'dampening'"):
        kaisa.KFACPreconditioner(model(), lr=0.1, dampening=0.1)  # type: ignore[call-arg]


def test_good_values_are_accepted() -> None:
    pre = kaisa.KFACPreconditioner(
        model(),
        factor_update_steps=10,
        inv_update_steps=100,
        damping=lambda step: 0.01,
        kl_clip=None,
        grad_worker_fraction=0,
        skip_layers=r"^0$",
        factor_dtype=torch.float64,
        inv_dtype=None,
    )
    assert [layer.name for layer in pre.layers] == ["2"]
    assert pre.inv_dtype == torch.float64


def test_fraction_that_does_not_divide_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match=r"3 gradient workers per layer, which does not divide"):
        kaisa.make_plan([kaisa.LayerShape("l", 2, 2)], 4, 0.75)
