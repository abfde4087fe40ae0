"""``kaisa plan --memory-budget``: the fraction that fits, its modelled time, COMM-OPT and MEM-OPT.

The paper's fixed-memory-budget cases in simulation: ResNet-50 under 1 GiB
and BERT-Large under 6 GiB per rank (between MEM-OPT's and COMM-OPT's
memory), at 8, 64 and 1024 ranks. The printed choice is the one
:func:`~kaisa.distributed.fraction.choose_stable` makes in this process, each
fraction's memory is the cost model's (``kaisa.distributed.cost``), and a
budget no fraction meets is an error naming the smallest memory.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kaisa.cli.plan import main
from kaisa.distributed.cost import summarize
from kaisa.distributed.fraction import DEFAULT_LINK, FractionModel, choose_stable, format_bytes
from kaisa.distributed.layer_shapes import bert_large_shapes, resnet50_shapes

CASES = [
    ("resnet50", resnet50_shapes, "1GiB", 2**30),
    ("bert-large", bert_large_shapes, "6GiB", 6 * 2**30),
]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("world", [8, 64, 1024])
@pytest.mark.parametrize(("name", "shapes", "text", "budget"), CASES)
def test_the_budget_table_shows_the_choice_next_to_comm_opt_and_mem_opt(
    capsys: pytest.CaptureFixture[str],
    name: str,
    shapes: object,
    text: str,
    budget: int,
    world: int,
) -> None:
    layers = shapes()  # type: ignore[operator]
    expected = choose_stable(layers, world, DEFAULT_LINK, budget, FractionModel())
    code, out, err = run(
        capsys, "--model", name, "--world-size", str(world), "--memory-budget", text
    )
    assert code == 0 and err == ""
    chosen = expected.cost_of(expected.grad_workers)
    comm, mem = expected.cost_of(world), expected.cost_of(1)
    assert chosen is not None and comm is not None and mem is not None
    # The case the paper measures: COMM-OPT does not fit, MEM-OPT does, and the
    # choice is a fraction in between that is faster than MEM-OPT.
    assert comm.memory_bytes > budget >= chosen.memory_bytes >= mem.memory_bytes
    assert 1 < expected.grad_workers < world and chosen.time_s < mem.time_s
    line = next(x for x in out.splitlines() if "grad_worker_fraction='auto' chooses" in x)
    assert f"chooses m={expected.grad_workers} " in line
    assert f"{chosen.time_s * 1e3:.4g} ms/step (fits)" in line
    for label, cost, fits in (("COMM-OPT", comm, "does not fit"), ("MEM-OPT", mem, "fits")):
        shown = f"{label}: {format_bytes(cost.memory_bytes)}, {cost.time_s * 1e3:.4g} ms/step"
        assert f"{shown} ({fits})" in line
    assert sum(x.endswith("<- chosen") for x in out.splitlines()) == 1

    code, out, _ = run(
        capsys, "--model", name, "--world-size", str(world), "--memory-budget", text, "--json"
    )
    data = json.loads(out)
    assert data["memory_budget"] == budget and data["auto"]["grad_workers"] == expected.grad_workers
    by_m = {f["grad_workers"]: f for f in data["auto"]["fractions"]}
    for m in (1, expected.grad_workers, world):
        summary = summarize(
            FractionModel().plan(layers, world, m), factor_update_steps=10, inv_update_steps=100
        )
        assert by_m[m]["memory_bytes"] == int(summary.memory_total.max) * 4


def test_a_budget_below_every_fraction_is_an_error_naming_the_smallest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(
        capsys, "--model", "resnet50", "--world-size", "8", "--memory-budget", "500MB"
    )
    assert code == 2 and out == ""
    assert (
        "kaisa plan: error: kaisa: no grad_worker_fraction fits memory_budget=500000000 bytes"
        in err
    )
    mem = choose_stable(resnet50_shapes(), 8, DEFAULT_LINK, None).cost_of(1)
    assert mem is not None and f"memory_budget >= {mem.memory_bytes}" in err


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (("--memory-budget", "lots"), "argument --memory-budget: must be a number of bytes"),
        (("--memory-budget", "1GiB", "--link", "latency=1"), "argument --link lacks bandwidth"),
        (("--memory-budget", "1GiB", "--link", "latency=0,bandwidth=1,compute=1"), "latency_s"),
    ],
)
def test_bad_budget_and_link_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], text: str
) -> None:
    code, out, err = run(capsys, "--world-size", "8", *argv)
    assert code == 2 and out == "" and text in err


def test_a_link_changes_the_modelled_times_and_planning_stays_torch_free() -> None:
    code = (
        "import sys, io, contextlib\n"
        "from kaisa.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    assert main(['plan', '--model', 'bert-large', '--world-size', '1024', "
        "'--memory-budget', '6GiB', '--link', 'latency=1e-4,bandwidth=1e9,compute=1e12']) == 0\n"
        "assert 'torch' not in sys.modules, 'kaisa plan imported torch'\n"
        "print(out.getvalue())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "latency 122 us, bandwidth 1.07 GB/s, compute 1.1e+12" in result.stdout
