"""``benchmarks/common.py``: the helpers the benchmark scripts share."""

from __future__ import annotations

import torch
from script_loader import load_script


def test_kfac_json_turns_torch_names_into_torch_attributes() -> None:
    common = load_script("benchmarks/common.py", "benchmarks_common_under_test")
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
