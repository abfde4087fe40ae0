"""``benchmarks/field_embeddings.py``: the profile on a model of field embeddings."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from script_loader import load_script

from kaisa.profiles import model_profile


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    # Registered: its dataclasses look their module up by name.
    return load_script(
        "benchmarks/field_embeddings.py", "field_embeddings_under_test", register=True
    )


def test_the_model_reads_the_language_model_profile_and_looks_up_one_row_per_field(
    bench: ModuleType,
) -> None:
    model = bench.FieldModel()
    assert model_profile(model) == "language-model"
    ids = torch.zeros(2, 64, dtype=torch.long)
    ids[1, 3] = 16  # field 3's last value: row 3 * 17 + 16
    rows = model.table(ids + model.offsets)
    assert torch.equal(rows[1, 3], model.table.weight[3 * 17 + 16])
    assert torch.equal(rows[0, 3], model.table.weight[3 * 17])
    assert model(ids).shape == (2, 10)


def test_the_digits_split_is_fixed_and_holds_every_image_once(bench: ModuleType) -> None:
    first, again = bench.load_digits_fields(), bench.load_digits_fields()
    assert torch.equal(first.test_x, again.test_x) and torch.equal(first.train_y, again.train_y)
    assert first.test_x.shape == (bench.TEST_IMAGES, 64)
    assert first.train_x.shape[0] + first.test_x.shape[0] == 1797
    assert int(first.train_x.max()) == 16 and int(first.train_x.min()) == 0


@pytest.mark.timeout(120)
def test_every_arm_and_rate_runs_from_the_same_weights_and_reports_its_profile(
    bench: ModuleType,
) -> None:
    args = argparse.Namespace(
        arms=[*bench.ARMS.items(), ("skip", {"skip_layers": ["table"]})],
        lrs=[0.003, 0.01],
        max_steps=6,
        batch_size=16,
        eval_every=3,
        target=0.0,  # reached at the first evaluation
    )
    rows = bench.run_seed(args, bench.load_digits_fields(), seed=0)
    assert [(r["arm"], r["lr"]) for r in rows] == [
        (arm, lr) for arm in ("adamw", "kaisa-auto", "kaisa-general", "skip") for lr in args.lrs
    ]
    assert all(r["steps"] == 3 and r["time"] > 0 for r in rows)
    profiles = {r["arm"]: r.get("profile") for r in rows}
    assert profiles == {
        "adamw": None,
        "kaisa-auto": "language-model",
        "kaisa-general": "general",
        "skip": "language-model",
    }
    fewest = min(rows[:2], key=lambda r: (r["steps"], r["time"]))  # AdamW at its two rates
    summary = bench.arm_summaries(["adamw"], rows[:2], [fewest["seed"]])["adamw"]
    assert summary["best_lrs"] == [fewest["lr"]] and summary["median_time"] == fewest["time"]
    runs = [bench.make_run(arm, 0.01, 0, options) for arm, options in args.arms]
    for run in runs[1:]:
        for a, b in zip(runs[0].model.parameters(), run.model.parameters(), strict=True):
            assert torch.equal(a, b)


def test_an_added_arm_is_parsed_or_refused_by_name(bench: ModuleType) -> None:
    assert bench._arm('x={"kl_clip": null}') == ("x", {"kl_clip": None})
    for bad in ("x", "x={", "adamw={}", "x=[1]", '={"kl_clip": null}'):
        with pytest.raises(argparse.ArgumentTypeError, match="--arm"):
            bench._arm(bad)


@pytest.mark.timeout(120)
def test_main_writes_every_arms_summary(bench: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "fields.json"
    argv = ["--threads", "1", "--seeds", "0", "--lrs", "0.01", "--max-steps", "4",
            "--eval-every", "2", "--target", "0", "--arm", 'skip={"skip_layers": ["table"]}',
            "--json", str(out)]  # fmt: skip
    result = bench.main(argv)
    saved = json.loads(out.read_text())
    assert set(saved["summary"]) == {"adamw", "kaisa-auto", "kaisa-general", "skip"}
    assert saved["summary"]["kaisa-auto"]["steps"] == [2]
    assert result["target"] == saved["target"] == 0.0
