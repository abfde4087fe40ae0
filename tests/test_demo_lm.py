"""The suite's language-model workload (``gpt``): configuration, loss metric, runs, outputs.

The corpus is a few hundred short records in the ``fortunes`` layout written
by the tests (records separated by ``%`` lines, ``.dat`` and ``.u8``
companions), repetitive enough that a few dozen steps bring the validation
loss well below its starting ln 256 = 5.55 nats per byte. Everything runs
with one torch thread.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import math
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from script_loader import load_script

from kaisa.curvature.costs import SideSpec
from kaisa.demo.cli import build_config, main, parse_args
from kaisa.demo.compare import summarize_suite
from kaisa.demo.config import (
    ARM_NAMES,
    DEFAULT_LR_FILE,
    METRICS,
    WORKLOAD_FALLBACK_LRS,
    WORKLOADS,
    DemoConfig,
    SuiteConfig,
    make_arm,
    read_lr_table,
    resolve_lr,
)
from kaisa.demo.report import format_summary, format_table, summary_markdown
from kaisa.demo.text import DEFAULT_TEXT_DIR, load_text_corpus
from kaisa.demo.train import train_arm, train_arms_in_lockstep

SENTENCES = [
    "the cat sat on the mat.",
    "a bird in the hand is worth two in the bush.",
    "all that glitters is not gold.",
    "the early bird catches the worm.",
]
#: A short run of the gpt workload on the tiny corpus: 24 steps of 8 windows.
TINY_LM_ARGS = ["--workload", "gpt", "--steps", "24", "--warmup-steps", "4", "--batch-size",
                "8", "--eval-every", "4", "--target", "4.5", "--seeds", "0", "--threads", "1",
                "--no-progress"]  # fmt: skip


def write_corpus(directory: Path, records: int = 400) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(2):
        name = f"sayings{f}"
        body = [
            f"{SENTENCES[(i + f) % 4]}\n\t\t-- proverb {i % 9}"
            for i in range(f * records, (f + 1) * records)
        ]
        (directory / name).write_text("\n%\n".join(body) + "\n%\n")
        (directory / f"{name}.dat").write_bytes(bytes(range(256)))
        os.symlink(name, directory / f"{name}.u8")
    return directory


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("fortunes"))


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _suite(*args: str) -> SuiteConfig:
    return build_config(parse_args(["--out", "unused", *args]))


def _demo_lr(arm: str) -> float:
    """The demo's rate for ``arm`` on gpt: the sweep file's, else the fallback table's."""
    return resolve_lr("gpt", arm, {}, read_lr_table(DEFAULT_LR_FILE))[0]


def _lm_config(
    corpus_dir: Path, arms: tuple[str, ...], *extra: str, **changes: object
) -> DemoConfig:
    config = _suite("--text-dir", str(corpus_dir), *TINY_LM_ARGS, "--arms", ",".join(arms), *extra)
    return dataclasses.replace(config.workloads[0], progress=False, **changes)  # type: ignore[arg-type]


# --- the workload's configuration ------------------------------------------------------


def test_the_gpt_workload_is_measured_by_validation_loss() -> None:
    w = WORKLOADS["gpt"]
    assert (w.model, w.dataset, w.metric, w.higher_is_better) == (
        "gpt",
        "fortunes",
        "val_loss",
        False,
    )
    assert w.target == 2.10 and "1.998" in w.note and not w.provisional  # calibrated (s17)
    assert (w.batch_size, w.steps, w.eval_every, w.context) == (16, 1500, 50, 64)
    assert all(WORKLOADS[n].metric == "accuracy" for n in ("gap_cnn", "small_cnn", "vit"))
    config = _suite("--workload", "gpt").workloads[0]
    assert (config.metric, config.dataset, config.target) == ("val_loss", "fortunes", 2.1)
    assert (config.batch_size, config.max_steps, config.warmup_steps) == (16, 1500, 100)
    assert (config.eval_every, config.context, config.near_margin) == (50, 64, 0.05)
    assert config.data_dir == os.environ.get("KAISA_TEXT_DIR", DEFAULT_TEXT_DIR)
    # The image workloads keep theirs.
    gap = _suite("--workload", "gap_cnn").workloads[0]
    assert (gap.metric, gap.batch_size, gap.max_steps, gap.warmup_steps, gap.eval_every) == (
        "accuracy", 128, None, None, 100)  # fmt: skip


def test_gpt_learning_rates_come_from_its_own_unswept_fallback_row(tmp_path: Path) -> None:
    empty = tmp_path / "lrs.json"
    empty.write_text(json.dumps({"lrs": {}}))
    config = _suite("--workload", "gpt", "--lr-file", str(empty)).workloads[0]
    by_name = {a.name: a for a in config.arms}
    assert [a.name for a in config.arms] == list(ARM_NAMES)
    assert {n: a.lr for n, a in by_name.items()} == WORKLOAD_FALLBACK_LRS["gpt"] == {
        "sgd": 0.3, "kaisa-sgd": 0.3, "adamw": 3e-3, "kaisa-adamw": 3e-3, "soap": 3e-3,
        "muon": 0.02}  # fmt: skip
    assert all(a.lr_source == "fallback table for gpt (not swept)" for a in config.arms)
    muon = by_name["muon"].hyperparameters()
    assert muon["adamw_lr"] == pytest.approx(3e-3)
    # Both Muon groups shrink their weights by the same lr * wd per step.
    assert muon["lr"] * muon["weight_decay"] == pytest.approx(3e-3 * muon["adamw_weight_decay"])
    # Other workloads keep the suite's fallback and Muon ratio.
    gap = {
        a.name: a
        for a in _suite("--workload", "gap_cnn", "--lr-file", str(empty)).workloads[0].arms
    }
    assert gap["sgd"].lr == 0.1 and gap["muon"].hyperparameters()["adamw_lr"] == pytest.approx(2e-3)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--workload", "gpt", "--target", "1.4"], {"gpt": 1.4}),
        (["--workload", "gpt", "--target", "2"], {"gpt": 2.0}),  # a loss may exceed 1
        (["--workload", "gap_cnn,gpt", "--target", "gap_cnn=0.9,gpt=1.6"],
         {"gap_cnn": 0.9, "gpt": 1.6}),
        (["--workload", "gap_cnn,gpt", "--target", "gpt=1.6"], {"gap_cnn": 0.91, "gpt": 1.6}),
        (["--quick", "--workload", "gap_cnn,gpt"], {"gap_cnn": 0.85, "gpt": 2.1}),
    ],
)  # fmt: skip
def test_targets_per_workload(args: list[str], expected: dict[str, float]) -> None:
    assert {w.name: w.target for w in _suite(*args).workloads} == expected


def test_the_quick_preset_leaves_the_language_model_its_budget() -> None:
    gap, gpt = _suite("--quick", "--workload", "gap_cnn,gpt").workloads
    assert (gap.epochs, gap.max_steps) == (1, None)
    assert (gpt.max_steps, gpt.target, gpt.batch_size) == (1500, 2.1, 16)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--target", "0.9"], "one value for workloads measured differently"),
        (["--workload", "gpt", "--target", "0"], "impossible target validation loss 0"),
        (["--workload", "gpt", "--target", "-1"], "must be a positive number"),
        (["--workload", "gpt", "--target", "inf"], "--target"),
        (["--workload", "gpt", "--target", "vit=0.9"], "vit not among the selected workloads"),
        (["--workload", "gpt", "--target", "gpt=x"], "--target"),
        (["--workload", "gap_cnn,gpt", "--target", "gap_cnn=1.5"], "impossible target accuracy"),
    ],
)
def test_bad_targets_are_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    code = main([*args, "--out", str(tmp_path / "o")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("kaisa demo: error: ") and expected in lines[0], lines[0]


def test_budget_and_warmup_options() -> None:
    steps = _suite("--workload", "gap_cnn,gpt", "--steps", "200").workloads
    assert [w.max_steps for w in steps] == [200, 200]
    epochs = _suite("--workload", "gap_cnn,gpt", "--epochs", "2").workloads
    assert [(w.epochs, w.max_steps) for w in epochs] == [(2, None), (2, None)]
    warm = _suite("--workload", "gap_cnn,gpt", "--warmup-epochs", "0.5").workloads
    assert [(w.warmup_epochs, w.warmup_steps) for w in warm] == [(0.5, None), (0.5, None)]
    warm = _suite("--workload", "gap_cnn,gpt", "--warmup-steps", "7").workloads
    assert [w.warmup_steps for w in warm] == [7, 7]
    both = _suite("--workload", "gap_cnn,gpt", "--batch-size", "32", "--eval-every", "10")
    assert [(w.batch_size, w.eval_every) for w in both.workloads] == [(32, 10), (32, 10)]
    again = SuiteConfig.from_json(json.loads(json.dumps(both.to_json())))
    assert again == both


def test_the_loss_metric_is_reached_at_or_below_the_target() -> None:
    loss, acc = METRICS["val_loss"], METRICS["accuracy"]
    assert loss.reached(1.5, 1.5) and loss.reached(1.2, 1.5) and not loss.reached(1.51, 1.5)
    assert acc.reached(0.91, 0.91) and not acc.reached(0.90, 0.91)
    assert loss.near(1.54, 1.5, 0.05) and not loss.near(1.5, 1.5, 0.05)
    assert not loss.near(1.56, 1.5, 0.05) and acc.near(0.905, 0.91, 0.01)
    assert loss.best([2.0, 1.4, 1.6]) == 1.4 and acc.best([0.8, 0.9]) == 0.9
    assert loss.target_text(1.5) == "validation loss 1.50 nats/byte"
    assert acc.target_text(0.91) == "91.0%"


# --- training --------------------------------------------------------------------------


def test_stop_at_target_stops_at_the_first_loss_at_or_below_it(corpus_dir: Path) -> None:
    data = load_text_corpus(corpus_dir)
    # A fixed rate (the fallback table's), not the sweep file's: what is
    # tested is the stop, on a tiny run whose learning it checks first.
    config = _lm_config(corpus_dir, ("adamw",), "--lr", "adamw=0.003")
    arm = config.arms[0]
    full = train_arm(data, config, arm, 0)
    assert full.metric == "val_loss" and full.steps == 24
    losses = [p.test_loss for p in full.points]
    assert losses[0] < math.log(256) + 0.5 and losses[-1] < losses[0] - 1.0  # it learns
    hit = full.first_reaching(config.target)
    assert hit is not None and hit.step < full.steps
    assert hit.test_loss <= config.target
    assert all(p.test_loss > config.target for p in full.points if p.step < hit.step)
    stopped = train_arm(data, config, arm, 0, stop_at_target=True)
    assert stopped.steps == hit.step
    assert [p.step for p in stopped.points] == [p.step for p in full.points if p.step <= hit.step]
    assert stopped.final_value == hit.test_loss == stopped.best_value
    summary = stopped.summary(config.target)
    assert summary["steps_to_target"] == hit.step and summary["final_val_loss"] == hit.test_loss
    assert "final_test_accuracy" not in summary
    # Just above the target, evaluations come four times as often.
    near = [b.step - a.step for a, b in zip(full.points, full.points[1:], strict=False)]
    assert set(near) <= {1, 4}


def test_step_limit_ends_the_run_on_the_full_budgets_schedule(corpus_dir: Path) -> None:
    data = load_text_corpus(corpus_dir)
    config = _lm_config(corpus_dir, ("sgd",), target=0.01)
    full = train_arm(data, config, config.arms[0], 0)
    limited = train_arm(data, dataclasses.replace(config, step_limit=10), config.arms[0], 0)
    assert limited.steps == 10 and limited.points[-1].step == 10
    assert [(p.step, p.test_loss) for p in limited.points[:-1]] == [
        (p.step, p.test_loss) for p in full.points if p.step < 10
    ]


def test_every_arm_sees_the_same_batches_and_lockstep_changes_nothing(corpus_dir: Path) -> None:
    data = load_text_corpus(corpus_dir)
    config = _lm_config(corpus_dir, ("sgd", "kaisa-adamw"), max_steps=8, eval_every=4)
    seen: dict[int, list[torch.Tensor]] = {}
    original = type(data).sample_batch

    def spy(self: object, batch: int, context: int, generator: torch.Generator) -> object:
        x, y = original(self, batch, context, generator)  # type: ignore[arg-type]
        seen.setdefault(id(generator), []).append(x)
        return x, y

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(data), "sample_batch", spy)
        together = train_arms_in_lockstep(data, config, config.arms, 0)
    first, second = seen.values()
    assert len(first) == len(second) == 8
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    alone = [train_arm(data, config, arm, 0) for arm in config.arms]
    for t, a in zip(together, alone, strict=True):
        assert [(p.step, p.test_loss, p.train_loss) for p in t.points] == [
            (p.step, p.test_loss, p.train_loss) for p in a.points
        ]


def test_each_arm_trains_the_gpt(corpus_dir: Path) -> None:
    """Every arm at its gpt fallback LR takes finite steps (SOAP when heavyball is installed)."""
    data = load_text_corpus(corpus_dir)
    names = [a for a in ARM_NAMES if a != "soap" or importlib.util.find_spec("heavyball")]
    config = _lm_config(corpus_dir, tuple(names), max_steps=3, eval_every=3)
    runs = train_arms_in_lockstep(data, config, config.arms, 0)
    assert [r.arm for r in runs] == names
    for run in runs:
        assert run.steps == 3 and not run.diverged, run.arm
        assert all(math.isfinite(p.test_loss) and math.isfinite(p.train_loss) for p in run.points)
        assert (run.kfac_seconds > 0) == run.arm.startswith("kaisa"), run.arm
    muon = next(r for r in runs if r.arm == "muon").optimizer_info
    assert len(muon["muon_matrices"]) == 12 and not muon["muon_conv_filters"]


@pytest.mark.parametrize("tied", [False, True])
def test_muon_takes_every_linear_weight_inside_the_blocks(tied: bool) -> None:
    from kaisa.demo.optimizers import build_optimizer, muon_param_split
    from kaisa.models import GPT

    model = GPT(tied_head=tied)
    split = muon_param_split(model)
    blocks = [f"blocks.{i}.{w}.weight" for i in range(3)
              for w in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]  # fmt: skip
    assert list(split.matrices) == blocks and not split.filters
    names = dict(model.named_parameters())
    matrices = {n for n in split.adamw if names[n].ndim == 2}
    assert matrices == {"tok_embed.weight", "pos_embed.weight"} | (
        set() if tied else {"head.weight"}
    )
    assert sorted([*split.matrices, *split.adamw]) == sorted(names)
    opt, _ = build_optimizer(model, make_arm("muon", 0.02, adamw_lr_ratio=0.15))
    scales = sorted(g["lr_scale"] for g in opt.param_groups)
    assert scales == [0.15, 1.0]


# --- the whole suite -------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_the_demo_records_the_intervals_stretch(
    corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Factors and inverses every step, every side exact (by the budget, or given)
    # and a tolerance at which bases are kept: the intervals stretch, and the
    # results and the summary say by how much, with and without a choice.
    cases = (
        (["--time-budget", "100"], "factors/inverses every 1/1 steps"),
        (["--curvature", "exact"], "no automatic choice, intervals as given"),
    )
    for given, choice_line in cases:
        out = tmp_path / given[0].strip("-")
        code = main(["--text-dir", str(corpus_dir), "--out", str(out), *TINY_LM_ARGS,
                     "--arms", "kaisa-adamw", "--factor-update-steps", "1",
                     "--inv-update-steps", "1", "--eigenbasis-tolerance", "0.9",
                     "--adaptive-intervals", "on", *given])  # fmt: skip
        captured = capsys.readouterr()
        assert code == 0, captured.err
        results = json.loads((out / "gpt" / "results.json").read_text())
        stretch = results["arms"]["kaisa-adamw"]["interval_stretch"]
        assert stretch["factor"] in (2, 4, 8) and stretch["changes"] >= 1
        assert f"{choice_line} (adaptive_intervals: x{stretch['factor']} at the end" in (
            captured.out
        )


@pytest.mark.timeout(240)
def test_demo_on_the_language_model(
    corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = ["--text-dir", str(corpus_dir), "--out", str(out), *TINY_LM_ARGS,
            "--arms", "adamw,kaisa-adamw"]  # fmt: skip
    code = main(args)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    text = captured.out
    assert "gpt: target validation loss 4.50 nats/byte, 24 steps, batch 8 x 64 bytes" in text
    assert "data: the fortunes text corpus: 2 text files, 800 records" in text
    assert "time to loss 4.50" in text and "final val loss" in text
    assert "reached validation loss 4.50 nats/byte in" in text or "did not reach" in text
    results = json.loads((out / "gpt" / "results.json").read_text())
    assert results["metric"] == "val_loss" and results["higher_is_better"] is False
    assert results["target"] == 4.5 and "target_accuracy" not in results
    assert results["metric_unit"] == "nats/byte"
    corpus = results["shared"]["corpus"]
    assert corpus["files"] == 2 and corpus["records"] == 800
    assert corpus["train_bytes"] + corpus["val_bytes"] > 20_000
    assert (results["shared"]["max_steps"], results["shared"]["context"]) == (24, 64)
    for name in ("adamw", "kaisa-adamw"):
        arm = results["arms"][name]
        assert arm["seeds_reaching_target"] == 1, name
        assert arm["final_val_loss"] <= 4.5 and "final_test_accuracy" not in arm
        assert arm["steps_to_target"] == arm["per_seed"][0]["steps_to_target"] < 24
        assert arm["hyperparameters"]["lr"] == _demo_lr(name)
    assert results["comparisons"]["kaisa-adamw"]["vs_base"]["arm"] == "adamw"
    # The language-model profile's adaptive intervals (their multiplier and its
    # changes), and stale_refresh (on by default): how often it found the
    # curvature stale.
    stretch = results["arms"]["kaisa-adamw"]["interval_stretch"]
    assert set(stretch) == {"factor", "changes", "stale_refreshes"}
    assert stretch["factor"] in (1, 2, 4, 8) and stretch["stale_refreshes"] >= 0
    with (out / "gpt" / "evaluations.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["arm"] for r in rows} == {"adamw", "kaisa-adamw"}
    assert all(0 < float(r["test_loss"]) < 6 for r in rows)
    assert (out / "gpt" / "val_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "gpt" / "accuracy.png").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["workload"], r["arm"], r["metric"]) for r in summary["rows"]] == [
        ("gpt", "adamw", "val_loss"), ("gpt", "kaisa-adamw", "val_loss")]  # fmt: skip
    assert summary["workloads"]["gpt"]["target"] == 4.5
    assert summary["rows"][1]["profile"] == "language-model"  # the model's, taken by default
    assert "AdamW + KAISA: profile language-model: " in (out / "summary.md").read_text()
    assert "gpt validation loss <= 4.50 nats/byte in 24 steps" in (out / "summary.md").read_text()


def test_a_missing_corpus_says_how_to_install_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--workload", "gpt", "--text-dir", str(tmp_path / "none"), "--out", str(tmp_path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "text corpus directory not found" in lines[0]
    assert "apt-get update && apt-get install -y fortunes" in lines[0]


def test_tables_and_summary_over_both_kinds_of_workload() -> None:
    def results(workload: str, metric: str, target: float, t: float | None) -> dict:
        arm = {"time_to_target_s": t, "per_seed": [{"seed": 0, "time_to_target_s": t}],
               "seeds": 1, "seeds_reaching_target": int(t is not None),
               "steps_to_target": None if t is None else 10 * t, "seconds_per_step": 0.05,
               "kfac_seconds_per_step": None, "peak_memory_mb": 100.0,
               "hyperparameters": {"lr": 0.003}}  # fmt: skip
        key = METRICS[metric].key
        arm[f"final_{key}"] = 1.42 if metric == "val_loss" else 0.915
        arms = {"adamw": arm}
        comp = {"adamw": {"vs_best": {"arm": None, "time_ratio": None, "per_seed": {},
                                      "per_seed_median": None},
                          "vs_fewest_steps": {"arm": None, "steps_ratio": None}}}  # fmt: skip
        doc = {"workload": workload, "metric": metric, "target": target, "arm_order": ["adamw"],
               "arms": arms, "comparisons": comp, "provisional": False,
               "shared": {"epochs": 1, "seeds": [0], "stop_at_target": True,
                          "max_steps": 1500 if metric == "val_loss" else None}}  # fmt: skip
        if metric == "accuracy":
            doc["target_accuracy"] = target
        return doc

    lm = results("gpt", "val_loss", 1.5, 30.0)
    table = format_table(lm)
    assert table.startswith("gpt: target validation loss 1.50 nats/byte, 1500 steps")
    assert "time to loss 1.50" in table and "final val loss" in table and "1.4200" in table
    assert "'final' is the loss there" in table
    assert "steps vs fewest" in table and "(none)" in table
    image = results("gap_cnn", "accuracy", 0.91, 40.0)
    assert "time to 91.0%" in format_table(image) and "91.50%" in format_table(image)
    summary = summarize_suite([image, lm])
    rows = {r["workload"]: r for r in summary["rows"]}
    assert rows["gap_cnn"]["target_accuracy"] == 0.91 and "metric" not in rows["gap_cnn"]
    assert rows["gpt"]["metric"] == "val_loss" and rows["gpt"]["target"] == 1.5
    text = format_summary(summary)
    assert "Targets: gap_cnn 91.0% in 1 epoch(s), gpt validation loss <= 1.50 nats/byte in 1500 " \
           "steps." in text  # fmt: skip
    row = "| gpt | AdamW | 1/1 | 300 | (none) | 50.0 | 30.0 s | (none) | - |"
    assert row in summary_markdown(summary)


# --- the steps probe --------------------------------------------------------------------


def _probe() -> ModuleType:
    return load_script("benchmarks/steps_probe.py", "steps_probe_under_test")


def _probe_rows(
    probe: Any, corpus_dir: Path, out: Path, arm: str, *flag_sets: list[str]
) -> list[dict[str, Any]]:
    """One 3-step probe of ``arm`` on ``gpt`` (seed 0) per set of flags; the rows written."""
    for flags in flag_sets:
        code = probe.main(["--workload", "gpt", "--arm", arm, "--seeds", "0",
                           "--max-steps", "3", "--text-dir", str(corpus_dir), "--out", str(out),
                           *flags])  # fmt: skip
        assert code == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.timeout(120)
def test_steps_probe_runs_any_arm_on_the_language_model(
    corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    probe = _probe()
    out = tmp_path / "probe.jsonl"
    for arm in ("adamw", "kaisa-sgd"):
        code = probe.main(["--workload", "gpt", "--arm", arm, "--seeds", "0", "--max-steps", "6",
                           "--text-dir", str(corpus_dir), "--out", str(out)])  # fmt: skip
        assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    assert rows == printed
    assert [(r["arm"], r["lr"], r["stopped_at"]) for r in rows] == [
        ("adamw", _demo_lr("adamw"), 6), ("kaisa-sgd", _demo_lr("kaisa-sgd"), 6)]  # fmt: skip
    for r in rows:
        assert r["metric"] == "val_loss" and r["target"] == 2.1 and r["steps"] is None
        source = resolve_lr("gpt", r["arm"], {}, read_lr_table(DEFAULT_LR_FILE))[1]
        assert math.isfinite(r["last"]) and r["lr_source"].startswith(source.split(" (")[0])
    assert "intervals" in rows[1] and "intervals" not in rows[0]
    specs = rows[1]["specs"]  # the automatic choice's representations, every layer's
    assert {"tok_embed", "blocks.0.attn.qkv", "head"} <= set(specs)
    assert all(len(pair) == 2 and all(SideSpec.parse(s) for s in pair) for pair in specs.values())
    for r in rows:  # the training clock (wall_s is rounded to 0.1 s), kaisa's share of it
        assert 0 < r["train_s"] <= r["wall_s"] + 0.1
        assert r["library"] is not None and r["library"].split("-")[0].isalnum()  # its commit
    assert rows[0]["kfac_s"] == 0.0 and 0 < rows[1]["kfac_s"] < rows[1]["train_s"]
    # With stale_refresh (the default) the row counts the refreshes and the stale ones.
    assert rows[1]["side_refreshes"] > 0 and rows[1]["stale_refreshes"] >= 0
    assert "stale_refreshes" not in rows[0]
    # The language-model profile (the default on gpt) keeps bases within a tolerance
    # and stretches the intervals: the row counts the bases kept and the multiplier.
    assert 0 <= rows[1]["kept_eigenbases"] <= rows[1]["side_refreshes"]
    assert rows[1]["interval_stretch"] in (1, 2, 4, 8)
    # The 'general' profile has neither.
    general = _probe_rows(probe, corpus_dir, tmp_path / "general.jsonl", "kaisa-adamw",
                          ["--kfac", '{"profile": "general"}'])[0]  # fmt: skip
    assert "kept_eigenbases" not in general and "interval_stretch" not in general
    # With eigenbasis_tolerance given the row counts the refreshes and the bases kept
    # (and with adaptive_intervals the intervals' multiplier at the end).
    kfac = (
        '{"curvature": "exact", "factor_update_steps": 1, "inv_update_steps": 1, '
        '"eigenbasis_tolerance": 0.5, "adaptive_intervals": true}'
    )
    code = probe.main(["--workload", "gpt", "--arm", "kaisa-adamw", "--seeds", "0",
                       "--max-steps", "4", "--kfac", kfac, "--text-dir", str(corpus_dir),
                       "--out", str(out)])  # fmt: skip
    assert code == 0
    last = json.loads(out.read_text().splitlines()[-1])
    assert last["side_refreshes"] > 0 and 0 <= last["kept_eigenbases"] <= last["side_refreshes"]
    assert last["interval_stretch"] in (1, 2, 4, 8) and last["interval_changes"] >= 0
    assert 0 < last["kfac_s"] < last["train_s"]
    with pytest.raises(SystemExit):
        probe.main(["--workload", "gpt", "--arm", "adamw", "--kfac", '{"damping": 0.1}',
                    "--text-dir", str(corpus_dir), "--out", str(out)])  # fmt: skip
    # --phase F,I@S: intervals 1 before step 2, then --kfac's 3: inverse updates
    # at steps 0, 1 and 3 of 6, against 0 and 3 without the phase.
    every3 = (
        '{"curvature": "exact", "factor_update_steps": 3, "inv_update_steps": 3, '
        '"eigenbasis_tolerance": 0.5}'
    )
    for phase in ([], ["--phase", "1,1@2"]):
        code = probe.main(["--workload", "gpt", "--arm", "kaisa-adamw", "--seeds", "0",
                           "--max-steps", "6", "--kfac", every3, "--text-dir", str(corpus_dir),
                           "--out", str(out), *phase])  # fmt: skip
        assert code == 0
    plain, phased = (json.loads(line) for line in out.read_text().splitlines()[-2:])
    assert plain["phase"] is None and phased["phase"] == "1,1@2"
    assert 2 * phased["side_refreshes"] == 3 * plain["side_refreshes"] > 0
    for bad in (["--phase", "2@10"], ["--phase", "2,2@ten"]):
        with pytest.raises(SystemExit):
            probe.main(["--workload", "gpt", "--arm", "kaisa-adamw", "--kfac", every3,
                        "--text-dir", str(corpus_dir), "--out", str(out), *bad])  # fmt: skip
    with pytest.raises(SystemExit):  # the intervals after the phase must be given
        probe.main(["--workload", "gpt", "--arm", "kaisa-adamw", "--phase", "2,2@10",
                    "--text-dir", str(corpus_dir), "--out", str(out)])  # fmt: skip


@pytest.mark.timeout(180)
def test_steps_probe_swaps_in_the_tied_zero_head_and_huggingface_models_for_its_run_only(
    corpus_dir: Path, tmp_path: Path
) -> None:
    from kaisa.demo import train as demo_train

    probe = _probe()
    tied = probe.tied_gpt("gpt", context=16)
    assert tied.head.weight is tied.tok_embed.weight
    zero = probe.zero_head_gpt("gpt", context=16)
    assert zero.head.weight is not zero.tok_embed.weight
    assert not zero.head.weight.any() and zero.tok_embed.weight.any()
    original = demo_train.build_demo_model, demo_train._make_preconditioner
    out = tmp_path / "probe.jsonl"
    runs = [["--tied-head"], ["--zero-head"]]
    if importlib.util.find_spec("transformers") is not None:
        hf = probe.hf_gpt2("gpt", context=16)
        assert hf(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 256)
        assert hf.lm.lm_head.weight is hf.lm.transformer.wte.weight
        llama = probe.hf_llama("gpt", context=16)
        assert llama(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 256)
        assert llama.lm.lm_head.weight is not llama.lm.model.embed_tokens.weight
        gemma = probe.hf_gemma("gpt", context=16)
        assert gemma(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 256)
        assert gemma.lm.lm_head.weight is gemma.lm.model.embed_tokens.weight
        opt = probe.hf_opt("gpt", context=16)
        assert opt(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 256)
        assert opt.lm.lm_head.weight is opt.lm.model.decoder.embed_tokens.weight
        bert = probe.hf_bert("gpt", context=16)
        assert bert(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 256)
        assert (
            bert.lm.cls.predictions.decoder.weight is bert.lm.bert.embeddings.word_embeddings.weight
        )
        assert bert.lm.config.is_decoder
        runs += [["--hf-gpt2"], ["--hf-llama"], ["--hf-gemma"], ["--hf-opt"], ["--hf-bert"]]
    for flags in runs:
        code = probe.main(["--workload", "gpt", "--arm", "kaisa-adamw", "--seeds", "0",
                           "--max-steps", "3", "--text-dir", str(corpus_dir), "--out", str(out),
                           *flags])  # fmt: skip
        assert code == 0
        # The demo's own builders are back after the run.
        assert (demo_train.build_demo_model, demo_train._make_preconditioner) == original
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["tied_head"] is True and "model" not in rows[0]
    assert rows[1]["zero_head"] is True and "tied_head" not in rows[1]
    if len(rows) > 2:
        assert rows[2]["model"] == "hf-gpt2" and "tied_head" not in rows[2]
        assert rows[3]["model"] == "hf-llama" and "tied_head" not in rows[3]
        assert rows[4]["model"] == "hf-gemma" and "tied_head" not in rows[4]
        assert rows[5]["model"] == "hf-opt" and "tied_head" not in rows[5]
        assert rows[6]["model"] == "hf-bert" and "tied_head" not in rows[6]
    for r in rows:
        assert r["stopped_at"] == 3 and math.isfinite(r["last"])
    for bad in (["--workload", "vit", "--arm", "adamw", "--tied-head"],
                ["--workload", "vit", "--arm", "adamw", "--hf-llama"],
                ["--workload", "gpt", "--arm", "adamw", "--tied-head", "--hf-gpt2"],
                ["--workload", "gpt", "--arm", "adamw", "--hf-gpt2", "--hf-llama"]):  # fmt: skip
        with pytest.raises(SystemExit):
            probe.main([*bad, "--out", str(out)])
    builders = (probe.tied_gpt, probe.zero_head_gpt, probe.hf_gpt2, probe.hf_llama,
                probe.hf_gemma, probe.hf_opt, probe.hf_bert)  # fmt: skip
    for build in builders:
        with pytest.raises(ValueError, match="gpt workload"):
            build("vit", context=16)


@pytest.mark.timeout(120)
def test_steps_probe_puts_kaisa_in_front_of_muon(
    corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kaisa.demo import train as demo_train
    from kaisa.demo.optimizers import OptimizerChain

    probe = _probe()
    built: list[tuple[str, bool, object]] = []
    real_build = demo_train.build_optimizer

    def spy(model: torch.nn.Module, arm: object) -> object:
        optimizer, info = real_build(model, arm)  # type: ignore[arg-type]
        built.append((arm.optimizer, arm.kfac is not None, optimizer))  # type: ignore[attr-defined]
        return optimizer, info

    monkeypatch.setattr(demo_train, "build_optimizer", spy)
    out = tmp_path / "probe.jsonl"
    own, muon = _probe_rows(probe, corpus_dir, out, "kaisa-adamw", [], ["--behind", "muon"])
    assert own["behind"] is None and muon["behind"] == "muon"
    # Muon's own rate for the workload by default, and a kaisa run (its choice recorded).
    assert own["lr"] == _demo_lr("kaisa-adamw") and muon["lr"] == _demo_lr("muon")
    assert muon["arm"] == "kaisa-adamw" and "specs" in muon and muon["kfac_s"] > 0
    assert [(name, kfac) for name, kfac, _ in built] == [("adamw", True), ("muon", True)]
    chain = built[1][2]
    assert isinstance(chain, OptimizerChain)
    assert any(isinstance(o, torch.optim.Muon) for o in chain.optimizers)
    # --lr sets the rate of the optimizer behind.
    code = probe.main(["--workload", "gpt", "--arm", "kaisa-adamw", "--behind", "muon",
                       "--lr", "0.01", "--seeds", "0", "--max-steps", "1",
                       "--text-dir", str(corpus_dir), "--out", str(out)])  # fmt: skip
    assert code == 0 and json.loads(out.read_text().splitlines()[-1])["lr"] == 0.01
    for bad in (["--arm", "muon", "--behind", "muon"],
                ["--arm", "kaisa-adamw", "--behind", "soap"]):  # fmt: skip
        with pytest.raises(SystemExit):
            probe.main(["--workload", "gpt", *bad, "--text-dir", str(corpus_dir),
                        "--out", str(out)])  # fmt: skip


@pytest.mark.timeout(120)
def test_steps_probe_hands_demo_options_to_the_run(
    corpus_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kaisa.demo import train as demo_train

    probe = _probe()
    seen: list[tuple[int, int | None, int]] = []
    real_train = demo_train.train_arm

    def spy(data: object, config: object, *args: object, **kwargs: object) -> object:
        seen.append((config.batch_size, config.warmup_steps, config.eval_every))  # type: ignore[attr-defined]
        return real_train(data, config, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(demo_train, "train_arm", spy)
    out = tmp_path / "probe.jsonl"
    given_args = ["--demo-args", "--batch-size 4 --warmup-steps 2 --eval-every 3"]
    plain, given = _probe_rows(probe, corpus_dir, out, "adamw", [], given_args)
    # The workload's own batch and warm-up unless given; what ran is what the row says.
    assert seen == [(16, 100, 50), (4, 2, 3)]
    assert (plain["demo_args"], plain["batch_size"], plain["warmup_steps"]) == (None, 16, 100)
    assert given["demo_args"] == "--batch-size 4 --warmup-steps 2 --eval-every 3"
    assert (given["batch_size"], given["warmup_steps"]) == (4, 2)
    assert given["stopped_at"] == 3 and math.isfinite(given["last"])
    capsys.readouterr()
    # A demo option the demo refuses, and a string that does not split, end the probe
    # before any run, naming what was wrong.
    for bad, named in (("--batch-size 0", "--batch-size"), ("--warmup-steps '2", "--demo-args"),
                       ("--seeds 1,2", "--seeds"), ("--workload=vit", "--workload")):  # fmt: skip
        with pytest.raises(SystemExit):
            probe.main(["--workload", "gpt", "--arm", "adamw", "--demo-args", bad,
                        "--text-dir", str(corpus_dir), "--out", str(out)])  # fmt: skip
        assert named in capsys.readouterr().err
    # The probe's own integer option, with the demo's type for it.
    with pytest.raises(SystemExit):
        probe.main(["--workload", "gpt", "--arm", "adamw", "--max-steps", "0",
                    "--text-dir", str(corpus_dir), "--out", str(out)])  # fmt: skip
    assert "argument --max-steps: expected a positive integer, got '0'" in capsys.readouterr().err
    assert len(seen) == 2 and len(out.read_text().splitlines()) == 2


def _docs_block(path: str, marker: str) -> str:
    """The Python block of a docs page that contains ``marker``, dedented."""
    import textwrap

    text = (Path(__file__).resolve().parents[1] / path).read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python")[1:]]
    found = [textwrap.dedent(b) for b in blocks if marker in b]
    assert len(found) == 1, f"{path}: {len(found)} Python blocks contain {marker!r}"
    return found[0]


@pytest.mark.timeout(120)
def test_the_language_model_docs_recipe_in_front_of_muon_runs_as_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.nn.functional as F

    import kaisa
    from kaisa.demo.optimizers import muon_param_split
    from kaisa.models import GPT

    code = _docs_block("docs/language-models.md", "optimizer=muon")
    torch.manual_seed(0)
    model = GPT(d_model=32, n_layer=2, n_head=2, context=16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = torch.randint(0, 256, (6, 4, 17), generator=torch.Generator().manual_seed(0))
    batches = [(b[:, :-1], b[:, 1:]) for b in data]
    raw: list[torch.Tensor] = []
    seen: list[torch.Tensor] = []
    qkv = model.blocks[0].attn.qkv.weight
    real_pre_step, real_muon_step = kaisa.KFACPreconditioner.step, torch.optim.Muon.step

    def pre_step(self: kaisa.KFACPreconditioner) -> None:
        assert qkv.grad is not None
        raw.append(qkv.grad.clone())
        real_pre_step(self)

    def muon_step(self: torch.optim.Muon, *args: object) -> object:
        assert qkv.grad is not None
        seen.append(qkv.grad.clone())
        return real_muon_step(self, *args)

    monkeypatch.setattr(kaisa.KFACPreconditioner, "step", pre_step)
    monkeypatch.setattr(torch.optim.Muon, "step", muon_step)
    scope: dict[str, object] = {"model": model, "batches": batches, "torch": torch,
                                "F": F, "kaisa": kaisa}  # fmt: skip
    exec(compile(code, "docs/language-models.md", "exec"), scope)
    # The split is the suite's: the blocks' matrices to Muon, the rest to AdamW.
    names = {id(p): n for n, p in model.named_parameters()}
    hidden = [names[id(p)] for p in scope["hidden"]]  # type: ignore[attr-defined]
    assert hidden == list(muon_param_split(model).matrices)
    pre = scope["preconditioner"]
    assert isinstance(pre, kaisa.KFACPreconditioner)
    assert pre.hyperparameters().lr == 0.02  # KL clipping reads Muon's rate
    # Muon stepped on kaisa's preconditioned gradients, every step.
    assert len(raw) == len(seen) == len(batches)
    for r, s in zip(raw, seen, strict=True):
        assert torch.isfinite(s).all() and not torch.allclose(r, s, rtol=1e-3, atol=0)
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all() and not torch.equal(p, before[n]), n
