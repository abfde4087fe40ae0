"""``benchmarks/common.py``: the helpers the benchmark scripts share."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

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


def test_library_commit_names_the_checkout_and_its_changes(tmp_path: Path) -> None:
    common = load_script("benchmarks/common.py", "benchmarks_common_under_test")
    here = common.library_commit()  # the imported kaisa: this checkout
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert here is not None and re.fullmatch(rf"{head}(-dirty)?", here)
    assert common.library_commit(tmp_path) is None  # not a git checkout
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("x = 1\n")
    for args in (
        ["init", "-q"],
        ["add", "."],
        ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one"],
    ):
        subprocess.run(["git", "-C", str(repo), *args], check=True)
    clean = common.library_commit(repo / "pkg")
    assert clean is not None and not clean.endswith("-dirty")
    (repo / "pkg" / "a.py").write_text("x = 2\n")
    assert common.library_commit(repo / "pkg") == f"{clean}-dirty"
