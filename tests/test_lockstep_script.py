"""``benchmarks/lockstep.py``: it times the arms and options it is given, for the steps asked.

The script compares one schedule of two arms against another (one step of
each in turn, turns of ``N``, one arm after the other); what it reports is
only worth reading if every run trains the named arms, with the demo options
given, for exactly ``--steps`` steps, on any workload.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
from script_loader import load_script
from test_demo import write_tiny
from test_demo_lm import write_corpus

SCHEDULES = ("step", "turn2", "alone")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("benchmarks/lockstep.py", "lockstep_under_test")


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _check(result: dict[str, object], arms: list[str], steps: int) -> None:
    assert result["arms"] == arms
    ms, counts = result["ms_per_step"], result["steps"]
    assert isinstance(ms, dict) and isinstance(counts, dict)
    assert sorted(ms) == sorted(SCHEDULES)
    for schedule in SCHEDULES:
        for arm in arms:
            assert counts[schedule][arm] == [steps]  # every run stopped where asked
            assert len(ms[schedule][arm]) == 1 and ms[schedule][arm][0] > 0
        ratio = result["second_over_first"][schedule]  # type: ignore[index]
        assert ratio == [pytest.approx(ms[schedule][arms[1]][0] / ms[schedule][arms[0]][0])]


def test_the_image_arms_train_the_steps_asked_with_the_options_given(
    bench: ModuleType, tmp_path: Path
) -> None:
    data = write_tiny(tmp_path / "fmnist")
    out = tmp_path / "lockstep.json"
    result = bench.main(
        [
            "--threads",
            "1",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--turn",
            "2",
            "--data-dir",
            str(data),
            "--demo-args",
            "--factor-update-steps 3 --damping 0.07",
            "--json",
            str(out),
        ]
    )
    _check(result, ["sgd", "kaisa-sgd"], 2)
    kfac = result["hyperparameters"]["kaisa-sgd"]["kfac"]
    assert kfac["factor_update_steps"] == 3 and kfac["damping"] == 0.07
    assert out.exists()


def test_the_language_model_is_cut_to_the_steps_asked(bench: ModuleType, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "fortunes")
    result = bench.main(
        ["--threads", "1", "--steps", "3", "--rounds", "1", "--turn", "2", "--workload", "gpt",
         "--arms", "muon,kaisa-adamw",
         "--demo-args", f"--text-dir {corpus} --batch-size 4 --eigenvalue-correction ekfac"]
    )  # fmt: skip
    _check(result, ["muon", "kaisa-adamw"], 3)
    assert result["hyperparameters"]["kaisa-adamw"]["kfac"]["eigenvalue_correction"] == "ekfac"


def test_it_refuses_anything_but_two_arms(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--arms", "sgd", "--steps", "1"])
    assert "--arms names two arms" in capsys.readouterr().err
