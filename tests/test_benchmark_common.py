"""``benchmarks/common.py``: the helpers the benchmark scripts share."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

COMMON = Path(__file__).resolve().parents[1] / "benchmarks" / "common.py"


def test_kfac_json_turns_torch_names_into_torch_attributes() -> None:
    spec = importlib.util.spec_from_file_location("benchmarks_common_under_test", COMMON)
    assert spec is not None and spec.loader is not None
    common = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = common  # (its dataclasses look their module up)
    try:
        spec.loader.exec_module(common)
    finally:
        del sys.modules[spec.name]
    got = common.kfac_json(
        '{"factor_product_dtype": "torch.bfloat16", "damping": 0.01, "curvature": "exact",'
        ' "skip_layers": ["torch.x"]}'
    )
    assert got == {
        "factor_product_dtype": torch.bfloat16,
        "damping": 0.01,
        "curvature": "exact",
        "skip_layers": ["torch.x"],  # only a whole string value is read as a torch name
    }
    assert common.kfac_json("[1, 2]") == [1, 2]
