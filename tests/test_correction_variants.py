"""``benchmarks/correction_variants.py`` runs against the library as it is.

Its variants patch kaisa's internals (the capture's ``accumulate``, the
eigenvalue correction's ``divisor``, the blocks' refresh), so a change of
those signatures, or a side kind a variant did not know (low-rank sides are
corrected since session 29), broke three of them without a test noticing.
Each run is a separate process: the patches are global. The configuration
holds ``gpt``'s wide sides in rank 128 (``time_budget=1.25``), so exact,
diagonal and low-rank sides all meet each variant.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_loader import ROOT
from test_demo_lm import write_corpus

KFAC = (
    '{"time_budget": 1.25, "eigenvalue_correction": "ekfac", "factor_update_steps": 2, '
    '"inv_update_steps": 2}'
)


def _run(script: str, corpus: Path, out: Path, *variant: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *variant, "--workload", "gpt",
           "--arm", "kaisa-adamw", "--seeds", "0", "--max-steps", "3", "--threads", "1",
           "--kfac", KFAC, "--text-dir", str(corpus), "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text().splitlines()[-1])


@pytest.mark.timeout(600)
def test_the_variants_run_on_exact_diagonal_and_low_rank_sides(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "fortunes")
    out = tmp_path / "rows.jsonl"
    plain = _run("steps_probe.py", corpus, out)
    assert any("lowrank" in side for pair in plain["specs"].values() for side in pair)
    for variant in (["--token-scales"], ["--project-scales"], ["--match-scales"]):
        row = _run("correction_variants.py", corpus, out, *variant)
        assert row["stopped_at"] == 3 and math.isfinite(row["last"])
        assert row["variant"] == f"{variant[0]} on"
    # A power of 1 is the library's own divisor: the same run, bit for bit.
    same = _run("correction_variants.py", corpus, out, "--scale-power", "1")
    assert same["variant"] == "--scale-power 1.0" and same["last"] == plain["last"]
