"""``benchmarks/precondition_cost.py`` runs against the library as it is.

The script reaches into the preconditioner (its roster and its
preconditioning pass) to time that pass alone; a rename inside the library
broke it once without any test noticing. One small model, a few calls.
"""

from __future__ import annotations

from types import ModuleType

import pytest
from script_loader import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("benchmarks/precondition_cost.py", "precondition_cost_under_test")


def test_measure_times_the_preconditioning_pass(bench: ModuleType) -> None:
    result = bench.measure("small_cnn", warmup=2, repeats=2)
    assert result["layers"] == 4  # SmallCNN's two convolutions and two Linear layers
    assert result["adamw_step_ms"] > 0 and result["kaisa_step_ms"] > 0
    assert result["ratio"] == pytest.approx(result["kaisa_step_ms"] / result["adamw_step_ms"])
    assert result["operator_calls"] == []  # counted only when asked


def test_measure_takes_options_and_counts_operator_calls(bench: ModuleType) -> None:
    ekfac = {"eigenvalue_correction": "ekfac"}
    result = bench.measure("small_cnn", warmup=2, repeats=2, profile=True, kfac=ekfac)
    assert result["layers"] == 4
    # The pass ran operators of its own (beyond the gradients' restore): the rotations'
    # products and the running average of their squares (the correction's addcmul_).
    calls = dict(result["operator_calls"])
    assert any(name in calls for name in ("aten::mm", "aten::matmul"))
    assert "aten::addcmul_" in calls


def test_measure_takes_the_language_model(bench: ModuleType) -> None:
    """``gpt`` on its own batch (windows of bytes), not Fashion-MNIST's images."""
    result = bench.measure("gpt", warmup=2, repeats=2)
    assert result["layers"] == 15  # two embeddings, 3 blocks of 4 Linear layers, the head
    assert result["precondition_ms"] > 0 and result["kaisa_step_ms"] > 0


def test_flops_count_the_rotations_of_every_exact_side(bench: ModuleType) -> None:
    """With every side exact and the eigenvalue correction, one pass is the rotation
    into and out of each layer's eigenbasis: ``2(g²a + ga²)`` multiply-adds a layer."""
    exact = {"curvature": "exact", "eigenvalue_correction": "ekfac"}
    result = bench.measure("gpt", warmup=2, repeats=2, kfac=exact, flops=True)
    d, vocab, context = 128, 256, 64
    shapes = [(d, vocab), (d, context), (vocab, d)]  # the two embeddings' (g, a), the head's
    shapes += [(3 * d, d + 1), (d, d + 1), (4 * d, d + 1), (d, 4 * d + 1)] * 3  # the blocks
    expected = sum(4 * g * a * (g + a) for g, a in shapes) / 1e9
    assert result["product_gflop"] == pytest.approx(expected, rel=1e-9)
    assert result["product_ms"] > 0
    assert bench.measure("gpt", warmup=2, repeats=2)["product_gflop"] is None  # only when asked


def test_product_rate_is_in_gflop_per_second(bench: ModuleType) -> None:
    """A float32 product on any CPU runs at 0.1–10 000 GFLOP/s: a rate off by the
    thousand either way (seconds or milliseconds taken for the other) falls outside."""
    rate = bench.product_rate(size=256, repeats=3)
    assert 0.1 < rate < 1e4
