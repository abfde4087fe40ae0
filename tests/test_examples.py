"""The example runs alone and under torchrun (env:// rendezvous, DDP, gloo)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ddp_digits.py"


def run(command: list[str]) -> str:
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def final_loss(output: str) -> float:
    line = next(line for line in output.splitlines() if line.startswith("final training loss"))
    return float(line.split()[-1])


@pytest.mark.timeout(200)
def test_example_single_process() -> None:
    output = run([sys.executable, str(EXAMPLE), "--steps", "60"])
    assert final_loss(output) < 0.5
    assert "comm-opt" in output


@pytest.mark.timeout(200)
def test_example_under_torchrun_with_two_ranks() -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(EXAMPLE), "--steps", "60", "--fraction", "0.5"]
    output = run(command)
    assert final_loss(output) < 0.5
    assert "mem-opt, 1 gradient worker(s)" in output
