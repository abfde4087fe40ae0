"""``benchmarks/distributed_real.py``: real gloo ranks count what the cost model predicts.

The script checks every rank's memory and every collective's element count
against ``kaisa.distributed.cost`` and the simulation, and exits 1 on any
difference. With the automatic curvature choice (the default since it
landed) the first step all-reduces provisional exact factors, which the
model does not count, and the script failed its own check; it now holds the
representations the model assumes (an embedding's diagonal ``A``, every
other side exact), and the simulation it compares with counts the
embeddings too. Two ranks, the Transformer (embeddings included), two
fractions, six steps.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from script_loader import ROOT


@pytest.mark.timeout(300)
def test_measured_counts_equal_the_cost_model() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "distributed_real.py"), "--models",
           "transformer", "--world-sizes", "2", "--fractions", "mem-opt,comm-opt",
           "--steps", "6", "--timeout", "240"]  # fmt: skip
    done = subprocess.run(
        cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    # The memory and traffic table: one row per fraction, its last two columns the checks.
    rows = [line.split() for line in done.stdout.splitlines()]
    checked = [row for row in rows if row[:1] == ["transformer"] and row[-1] in ("✓", "✗")]
    assert [row[2] for row in checked] == ["mem-opt", "comm-opt"]
    assert all(row[-2:] == ["✓", "✓"] for row in checked), checked
