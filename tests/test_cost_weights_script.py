"""``benchmarks/cost_weights.py`` runs against the cost model as it is.

``CostModel`` gained a weight (``operator``) that is fitted to the suite's
clock, not timed by this script, and the script died on it with a
``KeyError``. It now measures the weights it can and leaves the others at
their defaults. GapCNN at batch 8, one call per kind.
"""

from __future__ import annotations

import argparse
import dataclasses

from script_loader import load_script

from kaisa.curvature.costs import DEFAULT_COST_MODEL, CostModel


def test_measure_gives_the_timed_weights_and_leaves_the_rest_default() -> None:
    bench = load_script("benchmarks/cost_weights.py", "cost_weights_under_test")
    args = argparse.Namespace(device="cpu", batch_size=8, warmup=1, repeats=1, contiguous=False)
    result = bench.measure(args)
    assert set(result["weights"]) == {"eigh", "cholesky_inverse", "capture", "apply"}
    assert all(w > 0 for w in result["weights"].values())
    model = CostModel(**result["weights"])
    assert model.operator == DEFAULT_COST_MODEL.operator
    assert {f.name for f in dataclasses.fields(CostModel)} - set(result["weights"]) == {"operator"}
