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
import torch
from script_loader import ROOT, load_script
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
    for variant in (["--separable", "elementwise"], ["--separable", "split", "--scale-every", "2"]):
        row = _run("correction_variants.py", corpus, out, *variant)
        assert row["stopped_at"] == 3 and math.isfinite(row["last"])
        assert row["last"] != plain["last"]  # the variant changed the solve
    # A power of 1 is the library's own divisor, and S folded every step its own
    # running average: the same run, bit for bit.
    same = _run("correction_variants.py", corpus, out, "--scale-power", "1")
    assert same["variant"] == "--scale-power 1.0" and same["last"] == plain["last"]
    same = _run("correction_variants.py", corpus, out, "--scale-every", "1")
    assert same["variant"] == "--scale-every 1" and same["last"] == plain["last"]


def _layout(g: int, a: int, g_rank: int | None, a_rank: int | None) -> tuple:
    """A positive ``S`` for a ``(g, a)`` layer with these ranks, and its shares."""
    from kaisa.curvature.eigencorrection import scale_counts, scale_length

    generator = torch.Generator().manual_seed(0)
    shape = (scale_length(g, g_rank), scale_length(a, a_rank))
    scales = torch.rand(shape, generator=generator, dtype=torch.float64) + 0.01
    counts = scale_counts(g, a, g_rank, a_rank, scales)
    return scales, None if counts is None else counts / (g * a)


@pytest.mark.parametrize("ranks", [(None, None), (3, None), (None, 4), (3, 4)])
def test_separable_divisors_against_dense_references(
    monkeypatch: pytest.MonkeyPatch, ranks: tuple
) -> None:
    """``--separable``'s divisors in float64, against the formulas written out densely:
    ``elementwise`` is the library's divisor of ``r cᵀ / m`` (the same as the library's
    own where ``S`` is rank one), ``split`` is ``(r̂ + √γ)(ĉ + √γ)``."""
    import kaisa.curvature.eigencorrection as ec

    monkeypatch.setattr(ec, "divisor", ec.divisor)  # (restored after the test)
    library = ec.divisor
    variants = load_script("benchmarks/correction_variants.py", "correction_variants_under_test")
    g, a, gamma = 7, 9, 1e-3
    scales, shares = _layout(g, a, *ranks)
    weights = torch.full_like(scales, 1.0 / scales.numel()) if shares is None else shares
    p, q = weights.sum(1), weights.sum(0)
    rows = torch.stack([sum(scales[i, j] * q[j] for j in range(len(q))) for i in range(len(p))])
    cols = torch.stack([sum(scales[i, j] * p[i] for i in range(len(p))) for j in range(len(q))])
    m = float((scales * weights).sum())
    rank_one = torch.outer(rows, cols) / m

    variants.separable("elementwise")
    got = ec.divisor(scales, gamma, "ekfac", True, 1.0, shares, None)
    torch.testing.assert_close(got, library(rank_one, gamma, "ekfac", True, 1.0, shares))
    # Where S is rank one already, the library's divisor.
    got = ec.divisor(rank_one, gamma, "ekfac", True, 1.0, shares, None)
    torch.testing.assert_close(got, library(rank_one, gamma, "ekfac", True, 1.0, shares))

    monkeypatch.setattr(ec, "divisor", library)
    variants.separable("split")
    got = ec.divisor(scales, gamma, "ekfac", True, 1.0, shares, None)
    r_hat, c_hat = rows / float((rows * p).sum()), cols / float((cols * q).sum())
    expected = torch.outer(r_hat + gamma**0.5, c_hat + gamma**0.5)
    torch.testing.assert_close(got, expected)
    # 'adam' is left to the library.
    torch.testing.assert_close(
        ec.divisor(scales, gamma, "adam", True, 1.0, shares, None),
        library(scales, gamma, "adam", True, 1.0, shares, None),
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag", ["--scale-every", "--row-cap", "--block-size"])
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_the_integer_options_refuse_what_is_not_a_positive_integer(flag: str, value: str) -> None:
    # The demo's own argparse type: the error names the option, what it takes and what
    # it got, and nothing runs (no patch is applied before the options are read).
    cmd = [sys.executable, str(ROOT / "benchmarks" / "correction_variants.py"), flag, value,
           "--workload", "gpt", "--arm", "kaisa-adamw"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert done.returncode == 2
    assert f"argument {flag}: expected a positive integer, got '{value}'" in done.stderr
