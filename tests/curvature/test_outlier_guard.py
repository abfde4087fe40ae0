"""The outlier guard's rule on one block: what the update after a held batch decides.

A batch factor over ``OUTLIER_RATIO`` times its running average is held; the
next update is folded as usual when it is back within ``RESCALE_RATIO`` of the
average (the held batch was an outlier) and restarts the average when it is
still beyond it (the scale changed). The factors here are multiples of the
identity, so every trace and fold is known in closed form (float64).
"""

from __future__ import annotations

import pytest
import torch

from kaisa.curvature.block import OUTLIER_RATIO, RESCALE_RATIO, KroneckerBlock

D = torch.float64
SIZE = 3
DECAY = 0.9


def fresh() -> KroneckerBlock:
    return KroneckerBlock(
        "layer",
        SIZE,
        SIZE,
        device=torch.device("cpu"),
        factor_dtype=D,
        inv_dtype=D,
        method="eigen",
        eigen_outer_product=False,
    )


def block() -> KroneckerBlock:
    b = fresh()
    eye = torch.eye(SIZE, dtype=D)
    assert b.fold_unless_outlier(eye, eye, DECAY, [SIZE, SIZE, SIZE, SIZE]) == "folded"
    return b  # both averages now the identity (trace SIZE), one update folded


def offer(b: KroneckerBlock, g_scale: float) -> str:
    """A batch with ``A = I`` and ``G = g_scale·I``, its traces read as the front door does."""
    eye = torch.eye(SIZE, dtype=D)
    a_batch, g_batch = eye, g_scale * eye
    traces = [float(t) for t in b.traces(a_batch, g_batch)]
    return b.fold_unless_outlier(a_batch, g_batch, DECAY, traces)


def g_scale(b: KroneckerBlock) -> float:
    return float(b.g.diagonal().mean())


@pytest.mark.parametrize("next_scale", [1.0, 20.0, 0.99 * RESCALE_RATIO])
def test_a_held_batch_followed_by_the_average_scale_was_an_outlier(next_scale: float) -> None:
    b = block()
    assert offer(b, 2 * OUTLIER_RATIO) == "held"
    assert g_scale(b) == 1.0 and b.outliers == 1  # never entered
    assert offer(b, next_scale) == "spike"
    assert b.outliers == 0
    assert g_scale(b) == pytest.approx(DECAY + (1 - DECAY) * next_scale, rel=1e-12)


@pytest.mark.parametrize(
    "next_scale", [1.01 * RESCALE_RATIO, 50.0, 300.0, 0.99 * OUTLIER_RATIO, 5 * OUTLIER_RATIO]
)
def test_a_held_batch_followed_by_a_scale_still_far_beyond_restarts_the_average(
    next_scale: float,
) -> None:
    """A scale that changed (attention's query and key factors as it starts to learn:
    ×1600–9800 in one update, ×110–700 in the next) is taken in from the second batch."""
    b = block()
    assert offer(b, 2 * OUTLIER_RATIO) == "held"
    assert offer(b, next_scale) == "rescaled"
    assert b.outliers == 0
    assert g_scale(b) == pytest.approx(next_scale, rel=1e-12)  # the average restarted from it
    # From the new scale on, batches near it are ordinary ones.
    assert offer(b, next_scale * 2) == "folded"


def test_without_a_held_batch_a_large_but_not_outlying_batch_is_folded() -> None:
    b = block()
    assert offer(b, 0.99 * OUTLIER_RATIO) == "folded"
    assert g_scale(b) == pytest.approx(DECAY + (1 - DECAY) * 0.99 * OUTLIER_RATIO, rel=1e-12)


def test_the_first_update_is_never_held() -> None:
    assert offer(fresh(), 1e6) == "folded"
