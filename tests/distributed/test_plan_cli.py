"""``kaisa plan``: run in-process, output and JSON checked, errors on one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kaisa.cli import main as kaisa_main
from kaisa.cli.plan import default_grad_workers, main, parse_fraction, split_stages
from kaisa.distributed.cost import summarize
from kaisa.distributed.layer_shapes import (
    bert_base_shapes,
    bert_large_shapes,
    linear_shape,
    resnet50_shapes,
)
from kaisa.distributed.plan import make_plan


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--model", "resnet50", "--world-size", "8")
    assert code == 0 and err == ""
    assert "resnet50: 54 K-FAC layers, world size 8" in out
    assert "memory per rank, MB of float32" in out
    for name in ("mem-opt", "hybrid-opt", "comm-opt", "imbalance"):
        assert name in out
    # One memory row and one traffic row per divisor of 8.
    assert sum(line.lstrip().startswith(("1 ", "2 ", "4 ", "8 ")) for line in out.splitlines()) == 8


def test_json_matches_the_cost_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        *("--model", "bert-large", "--world-size", "1024", "--json", "--symmetry-aware"),
        *("--fraction", "mem-opt", "--fraction", "1/2", "--fraction", "comm-opt"),
        *("--factor-update-steps", "50", "--inv-update-steps", "500", "--no-colocate"),
    )
    assert code == 0
    data = json.loads(out)
    assert data["model"] == "bert-large" and data["num_layers"] == 145
    assert data["colocate_factors"] is False and data["symmetry_aware"] is True
    assert [f["grad_workers"] for f in data["fractions"]] == [1, 512, 1024]
    for entry, m in zip(data["fractions"], (1, 512, 1024), strict=True):
        plan = make_plan(bert_large_shapes(), 1024, m / 1024, colocate_factors=False)
        expected = summarize(
            plan, symmetry_aware=True, factor_update_steps=50, inv_update_steps=500
        ).to_dict()
        assert entry == json.loads(json.dumps(expected))
    assert "plan" not in data


def test_default_fractions_at_1024_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--world-size", "1024", "--json")
    assert code == 0
    ms = [f["grad_workers"] for f in json.loads(out)["fractions"]]
    assert ms == [2**k for k in range(11)]


@pytest.mark.parametrize("n", [1, 7, 12, 720, 1024, 5040])
def test_default_grad_workers(n: int) -> None:
    ms = default_grad_workers(n)
    assert ms == sorted(set(ms))
    assert all(n % m == 0 for m in ms)
    assert ms[0] == 1 and ms[-1] == n
    assert len(ms) <= 12
    if n % 2 == 0:
        assert n // 2 in ms
    if n <= 12:
        assert ms == [d for d in range(1, n + 1) if n % d == 0]


def test_show_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--world-size", "4", "--fraction", "0.5", "--show-plan")
    assert code == 0
    for layer in resnet50_shapes():
        assert layer.name in out
    assert "2 gradient worker(s) per layer (hybrid-opt)" in out
    code, out, _ = run(capsys, "--world-size", "4", "--show-plan", "comm-opt", "--json")
    data = json.loads(out)
    assert data["plan"]["grad_workers"] == 4
    assert len(data["plan"]["layers"]) == 54


def test_small_model_from_kaisa_models(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--model", "resnet20", "--world-size", "2", "--json")
    assert code == 0
    assert json.loads(out)["num_layers"] == 20


def test_dispatch_from_the_kaisa_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert kaisa_main(["plan", "--world-size", "2", "--fraction", "1"]) == 0
    assert "comm-opt" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        ([], "--world-size"),
        (["--world-size", "x"], "--world-size"),
        (["--world-size", "0"], "--world-size"),
        (["--world-size", "6", "--fraction", "0.8"], "grad_worker_fraction"),
        (["--world-size", "3", "--fraction", "hybrid-opt"], "grad_worker_fraction"),
        (["--world-size", "1024", "--fraction", "0.3"], "grad_worker_fraction"),
        (["--world-size", "4", "--fraction", "1.5"], "grad_worker_fraction"),
        (["--world-size", "4", "--fraction", "half"], "--fraction"),
        (["--world-size", "4", "--fraction", "1/0"], "--fraction"),
        (["--world-size", "4", "--show-plan", "0.75"], "grad_worker_fraction"),
        (["--world-size", "4", "--model", "vgg"], "--model"),
        (["--world-size", "4", "--assignment-strategy", "time"], "--assignment-strategy"),
        (["--world-size", "4", "--compute-method", "svd"], "--compute-method"),
        (["--world-size", "4", "--factor-update-steps", "0"], "--factor-update-steps"),
        (["--world-size", "4", "--inv-update-steps", "-1"], "--inv-update-steps"),
        (["--world-size", "4", "--frobnicate"], "unrecognized"),
        (["--world-size", "4", "--pipeline-stages", "3"], "--pipeline-stages"),
        (["--world-size", "4", "--pipeline-stages", "0"], "--pipeline-stages"),
        (["--world-size", "8", "--model", "small_cnn", "--pipeline-stages", "8"], "8 stages"),
        (["--world-size", "4", "--model", "no_such_module_xyz:build"], "cannot import"),
        (["--world-size", "4", "--model", "kaisa.models:nothing_here"], "no callable"),
        (["--world-size", "4", "--model", "json:dumps"], "--model"),
        (["--world-size", "4", "--model", ":build"], "package.module:factory"),
        # Issue 30, item 6f: refused at once, not exhausting the memory after a minute.
        (["--world-size", "1000000000"], "at most 65536 ranks"),
        (["--world-size", "65537", "--json"], "at most 65536 ranks"),
        # Issue 30, item 6f: every --model failure on one line (these were tracebacks).
        (["--world-size", "4", "--model", "..:build"], "cannot import '..': TypeError"),
        (["--world-size", "4", "--model", "sys:exit"], "sys:exit() raised SystemExit"),
    ],
)
def test_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("kaisa plan: error: ")
    assert fragment in err
    assert "Traceback" not in err


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0
    assert "--world-size" in out and "--fraction" in out


@pytest.mark.parametrize(
    ("text", "value"),
    [("mem-opt", "mem-opt"), ("Comm-Opt", "comm-opt"), ("0", 0.0), ("1/4", 0.25), ("0.5", 0.5)],
)
def test_parse_fraction(text: str, value: object) -> None:
    assert parse_fraction(text) == value


def test_planning_does_not_import_torch() -> None:
    """Importing torch alone takes longer than the answer may; the plan must not need it."""
    code = (
        "import sys\n"
        "from kaisa.cli import main\n"
        "assert main(['plan', '--model', 'bert-large', '--world-size', '1024', '--json']) == 0\n"
        "assert 'torch' not in sys.modules, 'kaisa plan imported torch'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


def test_pipeline_stages_split_the_layers_and_plan_each_over_its_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(
        capsys, "--model", "bert-base", "--world-size", "8", "--pipeline-stages", "2", "--json"
    )
    assert code == 0
    report = json.loads(out)
    assert (report["world_size"], report["pipeline_stages"], report["data_parallel_size"]) == (
        8,
        2,
        4,
    )
    names = [s.name for s in bert_base_shapes()]
    stages = report["stages"]
    assert len(stages) == 2
    # Contiguous, covering every layer once, of about equal weight.
    assert stages[0]["layers"] + stages[1]["layers"] == names
    sizes = {s.name: s.a_size * s.g_size for s in bert_base_shapes()}
    weights = [sum(sizes[n] for n in stage["layers"]) for stage in stages]
    assert max(weights) / min(weights) < 1.1
    for stage in stages:
        for fraction in stage["fractions"]:
            assert fraction["world_size"] == 4


def test_split_stages_leaves_a_layer_for_every_stage() -> None:
    # One huge layer first: every later stage still gets a layer.
    shapes = [linear_shape("big", 1000, 1000), *(linear_shape(f"s{i}", 4, 4) for i in range(3))]
    runs = split_stages(shapes, 3)
    assert [len(run) for run in runs] == [1, 1, 2]
    assert [s for run in runs for s in run] == shapes


def test_a_users_model_from_module_and_factory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_models_for_plan.py").write_text(
        "from torch import nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, _ = run(
        capsys, "--model", "my_models_for_plan:build", "--world-size", "2", "--json", "--show-plan"
    )
    assert code == 0
    report = json.loads(out)
    assert report["num_layers"] == 2
    layers = {la["name"]: (la["a_size"], la["g_size"]) for la in report["plan"]["layers"]}
    assert layers == {"0": (11, 20), "2": (21, 3)}


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("raise RuntimeError('no GPU here')\n", "cannot import 'broken_for_plan': RuntimeError"),
        ("def build(:\n", "cannot import 'broken_for_plan': SyntaxError"),
        ("import sys\ndef build():\n    sys.exit(3)\n", "build() raised SystemExit: 3"),
        (
            "from torch import nn\nclass Bad(nn.Module):\n"
            "    def named_modules(self, *a, **k):\n        raise KeyError('x')\n"
            "def build():\n    return Bad()\n",
            "reading the layers of broken_for_plan:build()'s model raised KeyError",
        ),
    ],
    ids=["import-raises", "syntax-error", "factory-exits", "layers-raise"],
)
def test_a_broken_users_model_is_one_line(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    source: str,
    fragment: str,
) -> None:
    """Issue 30, item 6f: the user's module failing in any way is one line, exit status 2."""
    (tmp_path / "broken_for_plan.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_for_plan", raising=False)
    code, out, err = run(capsys, "--model", "broken_for_plan:build", "--world-size", "2")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("kaisa plan: error: argument --model: ") and fragment in err, err
