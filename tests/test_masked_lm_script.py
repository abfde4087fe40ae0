"""``benchmarks/masked_lm.py``: kaisa on HuggingFace's BERT trained on masked bytes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from script_loader import load_script
from test_demo_lm import write_corpus

from kaisa.demo.text import VOCAB_SIZE, load_text_corpus


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    # Registered: its dataclasses look their module up by name.
    return load_script("benchmarks/masked_lm.py", "masked_lm_under_test", register=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("fortunes"))


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_masking_follows_berts_rule_and_its_generator(bench: ModuleType) -> None:
    x = torch.randint(0, VOCAB_SIZE, (400, 250), generator=torch.Generator().manual_seed(0))
    inputs, targets = bench.mask_tokens(x, torch.Generator().manual_seed(1))
    again = bench.mask_tokens(x, torch.Generator().manual_seed(1))
    assert torch.equal(inputs, again[0]) and torch.equal(targets, again[1])
    chosen = targets != -100
    # Targets are the original bytes where chosen; the rest is never scored or changed.
    assert torch.equal(targets[chosen], x[chosen])
    assert torch.equal(inputs[~chosen], x[~chosen])
    assert abs(chosen.float().mean().item() - bench.MASK_RATE) < 0.005
    masked = (inputs == bench.MASK_ID) & chosen
    assert not (inputs[~chosen] == bench.MASK_ID).any()
    assert abs(masked.sum().item() / chosen.sum().item() - bench.MASKED) < 0.01
    # Of the rest: about half randomised (mostly to another byte), half kept.
    kept = (inputs == x) & chosen
    assert abs(kept.sum().item() / chosen.sum().item() - 0.1 - 0.1 / VOCAB_SIZE) < 0.01
    assert int(inputs.max()) == bench.MASK_ID and int(inputs.min()) >= 0


def test_validation_is_fixed_and_scores_the_masked_bytes_only(
    bench: ModuleType, corpus: Path
) -> None:
    data = load_text_corpus(corpus)
    first, again = bench.Validation.of(data, 16), bench.Validation.of(data, 16)
    assert torch.equal(first.inputs, again.inputs) and torch.equal(first.targets, again.targets)
    torch.manual_seed(0)
    model = bench.MaskedLM(16)
    loss = first.loss(model, chunk=7)  # chunks that do not divide the windows
    assert model.training
    with torch.no_grad():
        model.eval()
        logits = model(first.inputs).double()
    chosen = first.targets != -100
    dense = -logits.log_softmax(-1)[chosen].gather(1, first.targets[chosen][:, None]).mean()
    assert loss == pytest.approx(float(dense), rel=1e-5)


def test_kaisa_preconditions_berts_layers_and_its_tied_embedding(bench: ModuleType) -> None:
    run = bench.make_run("kaisa-adamw", "kaisa-adamw", {}, 1e-3, 0, 16)
    coverage = {t.parameter: t for t in run.preconditioner.coverage()}
    layer = "lm.bert.encoder.layer.0."
    for name in ("attention.self.query", "attention.self.key", "attention.output.dense",
                 "intermediate.dense", "output.dense"):  # fmt: skip
        assert coverage[f"{layer}{name}.weight"].kind != "raw"
    assert coverage["lm.bert.embeddings.word_embeddings.weight"].kind != "raw"
    assert coverage["lm.cls.predictions.transform.dense.weight"].kind != "raw"
    assert run.preconditioner.options.profile == "language-model"


@pytest.mark.timeout(300)
def test_every_arm_and_rate_starts_alike_sees_the_same_batches_and_trains(
    bench: ModuleType, corpus: Path
) -> None:
    argv = ["--lr-factors", "1", "--lr", "adamw=0.003,0.01",
            "--arm", 'exact={"curvature": "exact"}', "--total-steps", "6", "--warmup-steps", "2",
            "--eval-every", "3", "--batch", "4", "--context", "16", "--target", "99"]  # fmt: skip
    args = bench.parse(argv)
    data = load_text_corpus(corpus)
    rows = bench.run_seed(args, data, bench.Validation.of(data, 16), seed=0)
    names = ["adamw", "adamw", "muon", "soap", "kaisa-adamw", "exact"]
    assert [r["arm"] for r in rows] == names
    assert [r["lr"] for r in rows[:2]] == [0.003, 0.01]
    assert all(r["steps"] == 3 and r["time"] > 0 and r["curve"][0][0] == 3 for r in rows)
    assert rows[4]["profile"] == rows[5]["profile"] == "language-model"
    fastest = min(rows[:2], key=lambda r: (r["steps"], r["time"]))
    adamw = bench.arm_summaries(["adamw"], rows, [0])["adamw"]
    assert adamw["best_lrs"] == [fastest["lr"]] and adamw["median_time"] == fastest["time"]
    runs = [bench.make_run(n, b, k, 1e-3, 0, 16) for n, b, k in args.arm_list]
    for run in runs[1:]:
        for a, b in zip(runs[0].model.parameters(), run.model.parameters(), strict=True):
            assert torch.equal(a, b)
    batches = [data.sample_batch(4, 16, run.generator)[0] for run in runs]
    assert all(torch.equal(batches[0], b) for b in batches[1:])
    # Training moves the loss: AdamW alone for 6 steps at a high rate.
    run = bench.make_run("adamw", "adamw", None, 1e-2, 0, 16)
    run.schedule = lambda step: 1e-2
    validation = bench.Validation.of(data, 16)
    before = validation.loss(run.model)
    for step in range(6):
        bench.train_step(run, data, args, step)
    assert validation.loss(run.model) < before - 0.5


def test_bad_options_are_refused_by_name(bench: ModuleType, capsys: pytest.CaptureFixture) -> None:
    assert bench._variant('x={"kl_clip": null}') == ("x", {"kl_clip": None})
    for bad in ("x", "x={", "adamw={}", "kaisa-sgd={}", "x=[1]", '={"kl_clip": null}'):
        with pytest.raises(argparse.ArgumentTypeError, match="--arm"):
            bench._variant(bad)
    for bad in ("adamw", "adamw=", "adamw=0,1", "adamw=x"):
        with pytest.raises(argparse.ArgumentTypeError, match="--lr"):
            bench._rates(bad)
    for argv, named in (
        (["--arms", "adamw,lamb"], "--arms: unknown lamb"),
        (["--arms", "adamw", "--lr", "muon=0.01"], "--lr names muon"),
        (["--arms", "kaisa-adamw", "--arm", "x={}", "--arm", "x={}"], "arm names repeat"),
    ):
        with pytest.raises(SystemExit):
            bench.parse(argv)
        assert named in capsys.readouterr().err


def test_default_rates_are_the_suites_gpt_rates_times_the_factors(bench: ModuleType) -> None:
    from kaisa.demo.config import DEFAULT_LR_FILE, read_lr_table, resolve_lr

    arms = bench.ARMS + bench.EXTRA_ARMS
    args = bench.parse(["--lr-factors", "0.5,2", "--arms", ",".join(arms)])
    table = read_lr_table(DEFAULT_LR_FILE)
    for arm in arms:
        rate = resolve_lr("gpt", bench.optimizer_arm(arm), {}, table)[0]
        assert args.lrs[arm] == [rate * 0.5, rate * 2]


def test_sgd_behind_kaisa_is_sgd_with_momentum_and_the_defaults(bench: ModuleType) -> None:
    run = bench.make_run("kaisa-sgd", "kaisa-sgd", {}, 0.1, 0, 16)
    assert isinstance(run.optimizer, torch.optim.SGD)
    assert run.optimizer.param_groups[0]["momentum"] == 0.9
    assert run.preconditioner.options.profile == "language-model"
    assert bench.make_run("sgd", "sgd", None, 0.1, 0, 16).preconditioner is None


def test_kaisa_in_front_of_muon_builds_the_muon_arms_optimizers(bench: ModuleType) -> None:
    muon = bench.make_run("muon", "muon", None, 0.01, 0, 16)
    behind = bench.make_run("kaisa-muon", "kaisa-muon", {}, 0.01, 0, 16)
    assert type(behind.optimizer) is type(muon.optimizer)
    assert [g["lr"] for g in behind.optimizer.param_groups] == [
        g["lr"] for g in muon.optimizer.param_groups
    ]
    assert muon.preconditioner is None and behind.preconditioner is not None
    args = bench.parse(["--arms", "kaisa-muon", "--lr-factors", "1"])
    assert (
        args.lrs["kaisa-muon"] == bench.parse(["--arms", "muon", "--lr-factors", "1"]).lrs["muon"]
    )


@pytest.mark.timeout(300)
def test_main_writes_every_arms_summary(bench: ModuleType, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "mlm.json"
    argv = ["--threads", "1", "--seeds", "0", "--arms", "adamw,kaisa-adamw", "--lr-factors", "1",
            "--total-steps", "4", "--warmup-steps", "1", "--eval-every", "2", "--batch", "4",
            "--context", "16", "--target", "99", "--text-dir", str(corpus),
            "--json", str(out)]  # fmt: skip
    result = bench.main(argv)
    saved = json.loads(out.read_text())
    assert set(saved["summary"]) == {"adamw", "kaisa-adamw"}
    assert saved["summary"]["kaisa-adamw"]["steps"] == [2]
    assert result["target"] == saved["target"] == 99
    kaisa_row = next(r for r in saved["rows"] if r["arm"] == "kaisa-adamw")
    assert kaisa_row["preconditioned"].split("/")[0] != "0"
