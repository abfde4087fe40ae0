"""HSDP and tensor parallelism against one process: the distances the docs' table reports.

Runs the worker functions of ``tests/integrations/test_hsdp.py`` (4 gloo
processes, a 2 × 2 replicate × shard mesh) and
``tests/integrations/test_tensor_parallel.py`` (tensor parallelism alone on
2 processes, and 2 × 2 tensor × data parallelism on 4) and prints, per case
and ``grad_worker_fraction``, the largest distance over the ranks between the
weights (and the factors) after 3 steps and those of one process training
the whole model on the whole batch; ``raw`` is the distance without kaisa.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/parallel_equivalence.py

About two minutes on two shared CPU cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "integrations"), str(ROOT / "tests" / "distributed")]

import test_hsdp as hsdp  # noqa: E402
import test_tensor_parallel as tp  # noqa: E402
from harness import run_distributed  # noqa: E402


def main() -> None:
    runs = run_distributed(hsdp._hsdp_case, 4, timeout=300)
    batches = [hsdp._whole_batch(step) for step in range(hsdp.STEPS)]
    raw = hsdp._train(hsdp._model(), batches, None)
    for fraction in hsdp.FRACTIONS:
        want = hsdp._train(hsdp._model(), batches, fraction)
        weights = max(hsdp._distance(r[str(fraction)]["weights"], want["weights"]) for r in runs)
        factors = max(hsdp._distance(r[str(fraction)]["factors"], want["factors"]) for r in runs)
        away = hsdp._distance(raw["weights"], want["weights"])
        print(
            f"HSDP 2x2   f={fraction:<9} weights {weights:.1e}  factors {factors:.1e}  "
            f"raw {away:.2g}"
        )
    for name, worker, world, replicas in (
        ("TP", tp._tp_alone, 2, 1),
        ("TPxDP 2x2", tp._tp_dp, 4, 2),
    ):
        runs = run_distributed(worker, world, timeout=300)
        single = tp._single(replicas)
        for fraction in tp.FRACTIONS:
            want = single[fraction]
            weights = max(tp._distance(r[fraction]["weights"], want["weights"]) for r in runs)
            factors = max(tp._distance(r[fraction]["factors"], want["factors"]) for r in runs)
            away = min(tp._distance(r["None"]["weights"], want["weights"]) for r in runs)
            print(
                f"{name:<10} f={fraction:<9} weights {weights:.1e}  factors {factors:.1e}  "
                f"raw {away:.2g}"
            )
        if name == "TP":
            want = tp._train_sequence(tp._sequence_model())
            weights = max(tp._distance(r["sequence"]["weights"], want["weights"]) for r in runs)
            factors = max(tp._distance(r["sequence"]["factors"], want["factors"]) for r in runs)
            print(
                f"TP seq     (row-wise output Shard(1)) weights {weights:.1e}  "
                f"factors {factors:.1e}"
            )


if __name__ == "__main__":
    main()
