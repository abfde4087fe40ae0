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

import copy
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
    # Preconditioning past the run's last step is the library's run; stopping after
    # the first step changes it, and the steps after it capture nothing.
    same = _run("correction_variants.py", corpus, out, "--precondition-until", "3")
    assert same["variant"] == "--precondition-until 3" and same["last"] == plain["last"]
    early = _run("correction_variants.py", corpus, out, "--precondition-until", "1")
    assert early["stopped_at"] == 3 and early["last"] != plain["last"]


def test_precondition_until_detaches_after_its_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    import kaisa

    bench = load_script("benchmarks/correction_variants.py", "correction_variants_until")
    monkeypatch.setattr(kaisa.KFACPreconditioner, "step", kaisa.KFACPreconditioner.step)
    bench.precondition_until(2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    kfac = kaisa.KFACPreconditioner(model, lr=0.1, factor_update_steps=1, inv_update_steps=1)
    x = torch.randn(16, 6)
    for step in range(4):
        model.zero_grad()
        model(x).square().mean().backward()
        raw = [p.grad.clone() for p in model.parameters()]
        kfac.step()
        changed = any(
            not torch.equal(r, p.grad) for r, p in zip(raw, model.parameters(), strict=True)
        )
        assert changed == (step < 2)  # preconditioned twice, raw after
        if step == 1:
            state = copy.deepcopy(kfac.state_dict())
    # Nothing was captured or folded after the second step.
    assert kfac.steps == 2
    assert _identical(kfac.state_dict(), state)


def _identical(a: object, b: object) -> bool:
    """Nested state equal entry by entry, tensors bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    return a == b


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
@pytest.mark.parametrize(
    "flag", ["--scale-every", "--row-cap", "--block-size", "--precondition-until"]
)
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_the_integer_options_refuse_what_is_not_a_positive_integer(flag: str, value: str) -> None:
    # The demo's own argparse type: the error names the option, what it takes and what
    # it got, and nothing runs (no patch is applied before the options are read).
    cmd = [sys.executable, str(ROOT / "benchmarks" / "correction_variants.py"), flag, value,
           "--workload", "gpt", "--arm", "kaisa-adamw"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert done.returncode == 2
    assert f"argument {flag}: expected a positive integer, got '{value}'" in done.stderr
