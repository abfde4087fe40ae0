"""The demo's code paths on a tiny Fashion-MNIST look-alike written by the tests.

The data set is a few hundred 28x28 images in the real IDX gzip format whose
class is a bright horizontal band at a class-dependent height, so a few
steps of training already separate the classes. Everything runs with one
torch thread.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kaisa.demo.cli import build_config, main, parse_args
from kaisa.demo.compare import _paired_ratios, compare_arms, summarize_suite
from kaisa.demo.config import (
    ARM_NAMES,
    FALLBACK_LRS,
    MUON_ADAMW_LR_RATIO,
    DemoConfig,
    SuiteConfig,
    make_arm,
)
from kaisa.demo.data import FILES, DatasetError, load_fashion_mnist, read_idx, write_idx
from kaisa.demo.report import format_summary, summary_markdown, verdict
from kaisa.demo.train import train_arms_in_lockstep, warmup_cosine

ROOT = Path(__file__).resolve().parents[1]
#: The ``kaisa`` console script's entry point, run by this interpreter.
KAISA = [sys.executable, "-c", "import sys; from kaisa.cli import main; sys.exit(main())"]
TINY_ARGS = [
    "--workload",
    "gap_cnn",
    "--arms",
    "sgd,kaisa",
    "--no-stop-at-target",
    "--epochs",
    "2",
    "--batch-size",
    "32",
    "--eval-every",
    "4",
    "--target",
    "0.3",
    "--seeds",
    "0,1",
    "--threads",
    "1",
    "--no-progress",
]


def _images(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.integers(0, 10, n).astype(np.uint8)
    images = rng.integers(0, 80, (n, 28, 28)).astype(np.uint8)
    for i, label in enumerate(labels):
        row = 2 + 2 * int(label)
        images[i, row : row + 3, :] = 240
    return images, labels


def write_tiny(directory: Path, n_train: int = 256, n_test: int = 64) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    x, y = _images(rng, n_train)
    write_idx(directory / FILES["train_images"], x)
    write_idx(directory / FILES["train_labels"], y)
    x, y = _images(rng, n_test)
    write_idx(directory / FILES["test_images"], x)
    write_idx(directory / FILES["test_labels"], y)
    return directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("fmnist"))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _check_outputs(
    out: Path,
    arms: tuple[str, ...] = ("sgd", "kaisa-sgd"),
    workload: str = "gap_cnn",
    kfac: dict[str, object] | None = None,
) -> dict[str, object]:
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["workload"], r["arm"]) for r in summary["rows"]] == [(workload, a) for a in arms]
    assert (out / "summary.md").read_text().startswith("# kaisa demo: summary over workloads")
    out = out / workload
    results = json.loads((out / "results.json").read_text())
    assert results["workload"] == workload
    assert results["target_accuracy"] == pytest.approx(0.3)
    assert set(results["arms"]) == set(arms)
    for name in arms:
        arm = results["arms"][name]
        for key in (
            "time_to_target_s",
            "epochs_to_target",
            "final_test_accuracy",
            "seconds_per_step",
            "hyperparameters",
        ):
            assert key in arm, key
        assert arm["time_to_target_s"] is None or arm["time_to_target_s"] > 0
        assert 0.0 <= arm["final_test_accuracy"] <= 1.0
        assert arm["seconds_per_step"] > 0
        assert arm["hyperparameters"]["lr"] > 0
    for name in set(arms) & {"kaisa-sgd", "kaisa-adamw"}:
        kaisa_arm = results["arms"][name]
        # The library's defaults: the demo passes no K-FAC option of its own.
        assert kaisa_arm["hyperparameters"]["kfac"] == (kfac or {})
        assert kaisa_arm["kfac_options"]["lr"] == "callable"
        assert 0.0 < kaisa_arm["kfac_share"] < 1.0
        assert kaisa_arm["kfac_phase_seconds"]
        for run in kaisa_arm["per_seed"]:
            assert 0.0 <= run["kl_clipped_fraction"] <= 1.0
            assert run["kfac_share"] == pytest.approx(run["kfac_seconds"] / run["train_seconds"])
    if {"sgd", "kaisa-sgd"} <= set(arms):
        base = results["comparisons"]["kaisa-sgd"]["vs_base"]
        assert base["arm"] == "sgd"
        sgd_times = {r["seed"]: r["time_to_target_s"] for r in results["arms"]["sgd"]["per_seed"]}
        for seed, ratio in base["per_seed"].items():
            kaisa_time = next(
                r["time_to_target_s"]
                for r in results["arms"]["kaisa-sgd"]["per_seed"]
                if str(r["seed"]) == seed
            )
            if ratio:
                assert ratio == pytest.approx(kaisa_time / sgd_times[int(seed)])
    with (out / "evaluations.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert rows
    assert {r["arm"] for r in rows} == set(arms)
    for r in rows:
        assert 0.0 <= float(r["test_accuracy"]) <= 1.0
        assert float(r["train_seconds"]) >= 0.0
        int(r["step"]), int(r["seed"]), float(r["epoch"]), float(r["test_loss"])
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return results


# --- the IDX reader -------------------------------------------------------------------


def test_idx_round_trip_and_loader(tmp_path: Path) -> None:
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "x.gz", arr)
    np.testing.assert_array_equal(read_idx(tmp_path / "x.gz", ndim=3), arr)
    data = load_fashion_mnist(write_tiny(tmp_path / "d", 40, 10))
    assert data.train_x.shape == (40, 1, 28, 28) and data.test_y.shape == (10,)
    assert data.image_shape == (1, 28, 28)
    assert abs(float(data.train_x.mean())) < 2.0


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.unlink(), "file not found|missing"),
        (lambda p: p.write_bytes(b"not gzip at all"), "not a readable gzip"),
        (lambda p: p.write_bytes(p.read_bytes()[:200]), "not a readable gzip"),
        (lambda p: p.write_bytes(gzip.compress(b"\x00\x00\x08\x01" + b"\x00" * 8)), "magic"),
        (lambda p: p.write_bytes(gzip.compress(b"\x00\x00\x08\x03\x00\x00\x00\x02")), "header"),
        (
            lambda p: p.write_bytes(gzip.compress(gzip.decompress(p.read_bytes())[:-5])),
            "file holds",
        ),
    ],
)
def test_reader_rejects_bad_files(
    tmp_path: Path, damage: Callable[[Path], object], message: str
) -> None:
    d = write_tiny(tmp_path, 40, 10)
    damage(d / FILES["train_images"])
    with pytest.raises(DatasetError, match=message):
        load_fashion_mnist(d)


def test_reader_refuses_a_gzip_bomb_without_decompressing_it(tmp_path: Path) -> None:
    """A header announcing 2x28x28 bytes followed by 64 MiB of zeros (64 kB compressed)."""
    import tracemalloc
    import zlib

    path = tmp_path / "bomb.gz"
    header = b"\x00\x00\x08\x03" + (2).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip framing
    chunks = [compressor.compress(header)]
    zeros = bytes(1 << 20)
    chunks += [compressor.compress(zeros) for _ in range(64)]
    path.write_bytes(b"".join([*chunks, compressor.flush()]))
    assert path.stat().st_size < 200_000
    tracemalloc.start()
    try:
        with pytest.raises(DatasetError, match="file holds more than 1568"):
            read_idx(path, ndim=3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # never near the 64 MiB it would decompress to


def test_reader_rejects_inconsistent_labels(tmp_path: Path) -> None:
    d = write_tiny(tmp_path, 40, 10)
    write_idx(d / FILES["test_labels"], np.zeros(9, dtype=np.uint8))
    with pytest.raises(DatasetError, match="9 labels for 10 images"):
        load_fashion_mnist(d)
    write_idx(d / FILES["test_labels"], np.full(10, 12, dtype=np.uint8))
    with pytest.raises(DatasetError, match="out of range"):
        load_fashion_mnist(d)


def test_warmup_cosine_shape() -> None:
    lr = warmup_cosine(0.2, 10, 110)
    assert lr(0) == pytest.approx(0.02)
    assert lr(9) == pytest.approx(0.2)
    assert lr(60) == pytest.approx(0.1)
    assert lr(109) < 0.001
    assert all(lr(s) >= lr(s + 1) for s in range(10, 109))


def test_paired_ratios_seed_by_seed() -> None:
    sgd = [
        {"seed": 0, "time_to_target_s": 100.0},
        {"seed": 1, "time_to_target_s": 80.0},
        {"seed": 2, "time_to_target_s": None},
        {"seed": 3, "time_to_target_s": 50.0},
        {"seed": 4, "time_to_target_s": None},
    ]
    kaisa = [
        {"seed": 0, "time_to_target_s": 70.0},
        {"seed": 1, "time_to_target_s": 60.0},
        {"seed": 2, "time_to_target_s": 40.0},
        {"seed": 3, "time_to_target_s": None},
        {"seed": 4, "time_to_target_s": None},
        {"seed": 5, "time_to_target_s": 10.0},
    ]
    paired = _paired_ratios(sgd, kaisa)
    # Seed 4 (neither reached) and seed 5 (no SGD run) are left out.
    assert paired == {"0": pytest.approx(0.7), "1": pytest.approx(0.75), "2": 0.0, "3": None}


def test_verdict_gives_the_median_and_the_seed_by_seed_ratios() -> None:
    vs_sgd = {
        "arm": "sgd",
        "time_ratio": 0.65,
        "per_seed": {"0": 0.74, "1": 0.65, "2": None},
        "per_seed_median": 0.74,
    }
    results = {
        "target_accuracy": 0.91,
        "arms": {"sgd": {"time_to_target_s": 100.0}, "kaisa-sgd": {"time_to_target_s": 65.0}},
        "comparisons": {"kaisa-sgd": {"vs_best": vs_sgd, "vs_base": vs_sgd}},
    }
    text = verdict(results)
    assert text.startswith("SGD + KAISA reached 91.0% in 0.65x SGD's time (65.0 s vs 100.0 s")
    assert "Seed by seed: 0.74x (seed 0), 0.65x (seed 1), never (seed 2); median 0.74x." in text
    assert len(text.splitlines()) == 1  # the best other arm is the base: one sentence


def test_stop_at_target_ends_at_the_first_hit(tiny: Path) -> None:
    """A sweep run that stops at the target has the full run's points up to the first hit."""
    import torch

    from kaisa.demo.config import ArmConfig, DemoConfig
    from kaisa.demo.train import train_arm

    torch.set_num_threads(1)
    data = load_fashion_mnist(str(tiny))
    arm = ArmConfig("sgd", 0.05)
    config = DemoConfig(
        data_dir=str(tiny), out_dir="", arms=(arm,), epochs=3, batch_size=32,
        eval_every=2, target=0.3, progress=False,
    )  # fmt: skip
    full = train_arm(data, config, arm, seed=0)
    stopped = train_arm(data, config, arm, seed=0, stop_at_target=True)
    hit = full.first_reaching(0.3)
    assert hit is not None and hit.step < full.steps
    assert stopped.steps == hit.step
    assert [p.step for p in stopped.points] == [p.step for p in full.points if p.step <= hit.step]
    assert stopped.first_reaching(0.3) is not None
    assert stopped.first_reaching(0.3).test_accuracy == hit.test_accuracy  # type: ignore[union-attr]


@pytest.mark.parametrize("turn", [1, 4])
def test_lockstep_arms_compute_what_each_arm_computes_alone(tiny: Path, turn: int) -> None:
    """Taking turns (every step or every ``turn`` steps) changes when steps run, not results.

    Both arms (SGD and SGD + K-FAC) trained in lockstep give bit for bit the
    evaluation points (steps, accuracies, losses) of each arm trained alone,
    including an arm that stops at the target while the other goes on.
    """
    import torch

    from kaisa.demo.config import ArmConfig, DemoConfig, KfacConfig
    from kaisa.demo.train import train_arm, train_arms_in_lockstep

    torch.set_num_threads(1)
    data = load_fashion_mnist(str(tiny))
    sgd = ArmConfig("sgd", 0.05)
    # (Without the clock calibration: its choice follows the measured time.)
    kfac = ArmConfig(
        "kaisa",
        0.05,
        kfac=KfacConfig(factor_update_steps=2, inv_update_steps=4, calibrate_budget=False),
    )
    config = DemoConfig(
        data_dir=str(tiny), out_dir="", arms=(sgd, kfac), epochs=2, batch_size=32,
        eval_every=3, target=0.3, progress=False,
    )  # fmt: skip

    def points(run: object) -> list[tuple[int, float, float, float]]:
        return [
            (p.step, p.test_accuracy, p.test_loss, p.train_loss)
            for p in run.points  # type: ignore[attr-defined]
        ]

    for stop in (False, True):
        together = train_arms_in_lockstep(
            data, config, [sgd, kfac], 0, stop_at_target=stop, turn=turn
        )
        alone = [train_arm(data, config, arm, 0, stop_at_target=stop) for arm in (sgd, kfac)]
        assert [r.arm for r in together] == ["sgd", "kaisa"]
        for t, a in zip(together, alone, strict=True):
            assert t.steps == a.steps and len(t.points) > 1
            assert points(t) == points(a), (t.arm, stop)
            assert t.train_seconds > 0


@pytest.mark.parametrize("turn", [0, -1, 1.5, True])
def test_lockstep_rejects_a_bad_turn(tiny: Path, turn: object) -> None:
    from kaisa.demo.config import ArmConfig, DemoConfig
    from kaisa.demo.train import train_arms_in_lockstep

    arm = ArmConfig("sgd", 0.05)
    config = DemoConfig(data_dir=str(tiny), out_dir="", arms=(arm,), progress=False)
    with pytest.raises(ValueError, match="turn must be a positive integer"):
        train_arms_in_lockstep(load_fashion_mnist(str(tiny)), config, [arm], 0, turn=turn)  # type: ignore[arg-type]


# --- the whole demo --------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sequential", [False, True], ids=["lockstep", "sequential"])
def test_demo_both_arms(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], sequential: bool
) -> None:
    out = tmp_path / "out"
    extra = ["--sequential"] if sequential else []
    code = main(["--data-dir", str(tiny), "--out", str(out), *TINY_ARGS, *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "SGD + KAISA" in captured.out and "time to 30.0%" in captured.out
    assert "Summary over workloads" in captured.out
    results = _check_outputs(out)
    arms = results["arms"]
    assert isinstance(arms, dict)
    for name in ("sgd", "kaisa-sgd"):
        assert arms[name]["seeds"] == 2
        assert len(arms[name]["per_seed"]) == 2
    assert (
        arms["sgd"]["hyperparameters"]["weight_decay"]
        == (arms["kaisa-sgd"]["hyperparameters"]["weight_decay"])
    )
    assert arms["kaisa-sgd"]["kfac_seconds_per_step"] > 0
    assert results["shared"]["lockstep"] is not sequential  # type: ignore[index]
    assert results["shared"]["device"] == "cpu"  # type: ignore[index]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("columns", [120, 0], ids=["sized", "unsized"])
def test_demo_progress_on_a_terminal(tiny: Path, tmp_path: Path, columns: int) -> None:
    """On a terminal each arm of a seed has its own tqdm bar, the two in lockstep.

    A pseudo-terminal that reports no width gets the one-line epoch summaries
    instead (tqdm would draw nothing there).
    """
    import fcntl
    import pty
    import select
    import struct
    import termios

    out = tmp_path / "out"
    args = [a for a in TINY_ARGS if a != "--no-progress"]
    args[args.index("--seeds") + 1] = "0"
    cmd = [*KAISA, "demo", "--data-dir", str(tiny), "--out", str(out)]
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(
        [*cmd, *args], stdout=slave, stderr=subprocess.PIPE, env=_env(), cwd=tmp_path
    )
    os.close(slave)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 90)
            if not ready:
                break
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closes (EIO) when the demo exits
                break
            if not chunk:
                break
            chunks.append(chunk)
        code = proc.wait(timeout=30)
        err = proc.stderr.read().decode() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    screen = b"".join(chunks).decode(errors="replace")
    assert code == 0, err + screen
    assert "Traceback" not in err
    for arm in ("sgd", "kaisa-sgd"):
        for epoch in (1, 2):
            assert f"{arm} seed 0 epoch {epoch}/2" in screen, screen
    bars = re.search(r"\| \d+/\d+ \[", screen) is not None  # tqdm's "| 8/8 [00:01<..."
    summaries = screen.count("(training ")  # one line per arm and epoch
    if columns:
        assert bars and summaries == 0, screen
    else:
        assert not bars and summaries == 4, screen
    _check_outputs(out)


@pytest.mark.timeout(60)
def test_demo_progress_lines_when_the_output_is_not_a_terminal(tiny: Path, tmp_path: Path) -> None:
    """Output to a pipe (``make demo > log``, CI) gets plain progress lines, not tqdm bars.

    With ``--progress-every 0`` every arm prints one line after each step: the
    workload, arm, seed, step, elapsed time, training clock and last test accuracy.
    """
    out = tmp_path / "out"
    args = [a for a in TINY_ARGS if a != "--no-progress"]
    args[args.index("--seeds") + 1] = "0"
    cmd = [*KAISA, "demo", "--data-dir", str(tiny), "--out", str(out)]
    proc = subprocess.run(
        [*cmd, *args, "--progress-every", "0"],
        capture_output=True,
        text=True,
        timeout=50,
        env=_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stdout and "\x1b" not in proc.stdout  # no bar redrawn in place
    line = re.compile(
        r"^\[progress\] workload gap_cnn, arm (\S+), seed 0: step (\d+)/16 \(epoch ([12])/2\), "
        r"elapsed \d+\.\d s, train clock \d+\.\d s, last test acc (none yet|[01]\.\d{4})$"
    )
    seen: dict[str, list[tuple[int, int, str]]] = {"sgd": [], "kaisa-sgd": []}
    for text in proc.stdout.splitlines():
        if text.startswith("[progress]"):
            match = line.match(text)
            assert match, text
            arm, step, epoch, acc = match.groups()
            seen[arm].append((int(step), int(epoch), acc))
    for arm, points in seen.items():
        assert [p[0] for p in points] == list(range(1, 17)), (arm, proc.stdout)
        assert all(epoch == (step - 1) // 8 + 1 for step, epoch, _ in points), points
        # Evaluated every 4 steps: no accuracy before step 4, then the last one.
        assert [acc == "none yet" for _, _, acc in points] == [True] * 3 + [False] * 13
    # The end-of-epoch lines are still there, one per arm and epoch.
    assert proc.stdout.count("(training ") == 4, proc.stdout
    _check_outputs(out)


def test_help_ends_every_option_with_its_default_in_one_style() -> None:
    """Each option's help says "(default: ...)" once, at its end; no other style."""
    from kaisa.demo.cli import _parser

    parser = _parser()
    options = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert len(options) > 30
    for action in options:
        text = action.help or ""
        assert text.count("(default: ") == 1 and text.endswith(")"), action.option_strings
        assert not re.search(r"\[[^\]]*\]", text), action.option_strings  # the old "[x]"
    shown = " ".join(parser.format_help().split())
    for expected in (
        "epoch budget for every workload (default: the workload's)",
        "(default: the workload's)",
        "global batch: images, or gpt's windows of 64 bytes (default: the workload's: 128, gpt 16)",
        "(default: 0,1,2)",
        "(default: gap_cnn,small_cnn,vit,gpt)",
        "Tikhonov damping (default: the library's, ",
        "(default: runs/demo-<timestamp>)",
        "--no-progress no progress bars on a terminal, no progress lines otherwise (default: off)",
    ):
        assert expected in shown, expected
    assert shown.count("(default: ") == len(options)


@pytest.mark.timeout(120)
def test_demo_two_processes(tiny: Path, tmp_path: Path) -> None:
    """Every arm runs under torchrun with DDP (one epoch, one seed)."""
    out = tmp_path / "out"
    arms = tuple(a for a in ARM_NAMES if a != "soap" or importlib.util.find_spec("heavyball"))
    args = list(TINY_ARGS)
    args[args.index("--seeds") + 1] = "0"
    args[args.index("--threads") + 1] = "2"
    args[args.index("--epochs") + 1] = "1"
    args[args.index("--arms") + 1] = ",".join(arms)
    cmd = [*KAISA, "demo", "--data-dir", str(tiny), "--out", str(out)]
    proc = subprocess.run(
        [*cmd, *args, "--nproc", "2", "--grad-worker-fraction", "0.5"],
        capture_output=True,
        text=True,
        timeout=100,
        env=_env(),
        cwd=tmp_path,
    )
    log = out / "torchrun.log"
    assert proc.returncode == 0, proc.stderr + (log.read_text() if log.exists() else "")
    assert "2 process(es) x 1 thread(s)" in proc.stdout
    results = _check_outputs(out, arms, kfac={"grad_worker_fraction": 0.5})
    assert results["shared"]["nproc"] == 2  # type: ignore[index]
    options = results["arms"]["kaisa-sgd"]["kfac_options"]  # type: ignore[index]
    assert options["grad_worker_fraction"] == 0.5


# --- bad input: one line, exit code 2, no traceback -------------------------------------


def _corrupt(d: Path) -> Path:
    (d / FILES["test_images"]).write_bytes(b"\x1f\x8b garbage")
    return d


@pytest.mark.parametrize(
    ("make_args", "expected"),
    [
        (lambda d, t: ["--data-dir", str(t / "nowhere")], "dataset directory not found"),
        (lambda d, t: ["--data-dir", str(_corrupt(write_tiny(t / "c", 40, 10)))], "gzip"),
        (lambda d, t: ["--data-dir", str(d), "--target", "1.5"], "impossible target"),
        (lambda d, t: ["--data-dir", str(d), "--target", "91"], "did you mean 0.91"),
        (lambda d, t: ["--data-dir", str(d), "--target", "0"], "impossible target"),
        (lambda d, t: ["--data-dir", str(d), "--epochs", "two"], "--epochs"),
        (lambda d, t: ["--data-dir", str(d), "--nproc", "0"], "--nproc"),
        (lambda d, t: ["--data-dir", str(d), "--model", "vgg"], "--model"),
        (lambda d, t: ["--data-dir", str(d), "--seeds", "a,b"], "--seeds"),
        (lambda d, t: ["--data-dir", str(d), "--sgd-lr", "-1"], "--sgd-lr"),
        (lambda d, t: ["--data-dir", str(d), "--kl-clip", "nan"], "--kl-clip"),
        (lambda d, t: ["--data-dir", str(d), "--batch-size", "33", "--nproc", "2"], "divisible"),
        (lambda d, t: ["--data-dir", str(d), "--batch-size", "4096"], "larger than the training"),
        (
            lambda d, t: ["--data-dir", str(d), "--nproc", "4", "--grad-worker-fraction", "0.75"],
            "gradient workers",
        ),
        (lambda d, t: ["--data-dir", str(d), "--curvature", "dense"], "'exact', 'lowrank:K'"),
        (lambda d, t: ["--data-dir", str(d), "--eigenvalue-correction", "on"], "'ekfac'"),
        (lambda d, t: ["--data-dir", str(d), "--eigenbasis-tolerance", "1"], "in [0, 1)"),
        (lambda d, t: ["--data-dir", str(d), "--factor-sample", "0"], "in (0, 1]"),
        (lambda d, t: ["--data-dir", str(d), "--time-budget", "0"], "--time-budget"),
        (
            lambda d, t: ["--data-dir", str(d), "--adaptive-intervals", "yes"],
            "--adaptive-intervals",
        ),
        (
            lambda d, t: ["--data-dir", str(d), "--adaptive-intervals", "on"],
            "give eigenbasis_tolerance too",
        ),
        (lambda d, t: ["--data-dir", str(d), "--device", "tpu"], "expected cpu, cuda or cuda:K"),
        # No such device here: CUDA missing (a CPU machine) or too few GPUs.
        (lambda d, t: ["--data-dir", str(d), "--device", "cuda:99"], "--device: cuda:99"),
        (lambda d, t: ["--data-dir", str(d), "--no-such-option"], "unrecognized"),
    ],
)
def test_bad_input_is_one_clear_line(
    tiny: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make_args: Callable[[Path, Path], list[str]],
    expected: str,
) -> None:
    code = main([*make_args(tiny, tmp_path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kaisa demo: error: ")
    assert expected in lines[0]


@pytest.mark.timeout(60)
def test_bad_input_from_the_command_line(tmp_path: Path) -> None:
    d = _corrupt(write_tiny(tmp_path / "d", 40, 10))
    for args in (["--data-dir", str(d)], ["--data-dir", str(d), "--target", "2"]):
        proc = subprocess.run(
            [*KAISA, "demo", *args, "--out", str(tmp_path / "o")],
            capture_output=True,
            text=True,
            timeout=50,
            env=_env(),
        )
        assert proc.returncode == 2
        assert "Traceback" not in proc.stderr
        assert proc.stderr.startswith("kaisa demo: error: ")
        assert len(proc.stderr.strip().splitlines()) == 1


# --- the suite: configuration, arms, optimizers, learning rates, summary ---------------


def _suite(*args: str) -> SuiteConfig:
    return build_config(parse_args(["--out", "unused", *args]))


def test_config_round_trip_with_every_arm() -> None:
    suite = _suite(
        "--workload", "gap_cnn,resnet20", "--arms", "kaisa,soap,muon,adamw,sgd,kaisa-adamw",
        "--lr", "muon=0.03,adamw=0.004", "--damping", "0.01", "--kl-clip", "none", "--seeds",
        "3,4", "--epochs", "2",
    )  # fmt: skip
    assert [w.name for w in suite.workloads] == ["gap_cnn", "resnet20"]
    arms = suite.workloads[0].arms
    assert [a.name for a in arms] == list(ARM_NAMES)  # canonical order, alias resolved
    assert [a.optimizer for a in arms] == ["sgd", "adamw", "muon", "soap", "sgd", "adamw"]
    by_name = {a.name: a for a in arms}
    assert by_name["muon"].lr == 0.03 and by_name["muon"].lr_source == "command line"
    assert by_name["muon"].hyperparameters()["adamw_lr"] == pytest.approx(0.003)
    for name in ("kaisa-sgd", "kaisa-adamw"):
        kfac = by_name[name].kfac
        assert kfac is not None
        assert kfac.overrides() == {"damping": 0.01, "kl_clip": None}
        assert kfac.as_record() == {"damping": 0.01, "kl_clip": "off"}
    assert all(by_name[n].kfac is None for n in ("sgd", "adamw", "muon", "soap"))
    assert suite.workloads[1].out_dir == os.path.join("unused", "resnet20")
    again = SuiteConfig.from_json(json.loads(json.dumps(suite.to_json())))
    assert again == suite


def test_curvature_and_the_eigenvalue_correction_reach_both_kaisa_arms() -> None:
    suite = _suite(
        "--workload", "gpt", "--arms", "adamw,kaisa-sgd,kaisa-adamw", "--curvature", "Exact",
        "--eigenvalue-correction", "ekfac", "--factor-update-steps", "5",
        "--eigenbasis-tolerance", "0.05", "--time-budget", "2", "--adaptive-intervals", "on",
        "--factor-sample", "0.25", "--fresh-start-steps", "200",
    )  # fmt: skip
    for arm in suite.workloads[0].arms:
        if arm.name == "adamw":
            assert arm.kfac is None
            continue
        assert arm.kfac is not None
        assert arm.kfac.overrides() == {
            "factor_update_steps": 5,
            "curvature": "exact",
            "eigenvalue_correction": "ekfac",
            "eigenbasis_tolerance": 0.05,
            "adaptive_intervals": True,
            "time_budget": 2.0,
            "factor_sample": 0.25,
            "fresh_start_steps": 200,
        }
    assert _suite("--curvature", "lowrank:16").workloads[0].arms[4].kfac.overrides() == {
        "curvature": "lowrank:16"
    }


def test_kaisa_arms_pass_nothing_but_the_lr_by_default() -> None:
    suite = _suite("--workload", "gap_cnn", "--arms", "kaisa-sgd,kaisa-adamw")
    for arm in suite.workloads[0].arms:
        assert arm.kfac is not None and arm.kfac.overrides() == {}
        assert arm.hyperparameters()["kfac"] == {}


def test_quick_preset_and_explicit_options() -> None:
    quick = _suite("--quick")
    assert [w.name for w in quick.workloads] == ["gap_cnn"]
    w = quick.workloads[0]
    assert [a.name for a in w.arms] == ["sgd", "adamw", "muon", "kaisa-sgd"]
    assert (w.epochs, w.seeds, w.target, w.stop_at_target) == (1, (0,), 0.85, True)
    mine = _suite("--quick", "--arms", "sgd", "--target", "0.8", "--workload", "small_cnn")
    w = mine.workloads[0]
    assert [a.name for a in w.arms] == ["sgd"] and w.target == 0.8
    assert w.model == "small_cnn" and w.epochs == 1
    full = _suite()
    assert [c.name for c in full.workloads] == ["gap_cnn", "small_cnn", "vit", "gpt"]
    assert all(len(c.arms) == len(ARM_NAMES) and c.seeds == (0, 1, 2) for c in full.workloads)


def test_model_is_a_deprecated_alias_of_one_workload(capsys: pytest.CaptureFixture[str]) -> None:
    suite = _suite("--model", "small_cnn")
    assert [w.name for w in suite.workloads] == ["small_cnn"]
    assert suite.workloads[0].model == "small_cnn"
    assert _suite("--model", "resnet32").workloads[0].model == "resnet32"


def test_learning_rates_command_line_then_sweep_file_then_fallback(tmp_path: Path) -> None:
    lrs = tmp_path / "lrs.json"
    lrs.write_text(json.dumps({"lrs": {"gap_cnn": {
        "sgd": {"lr": 0.2, "settings": {"epochs": 3, "target_accuracy": 0.91}},
        "kaisa": {"lr": 0.07},
    }}}))  # fmt: skip
    suite = _suite("--workload", "gap_cnn,small_cnn", "--arms", "sgd,adamw,kaisa-sgd",
                   "--lr-file", str(lrs), "--lr", "adamw=0.003")  # fmt: skip
    gap, small = ({a.name: a for a in w.arms} for w in suite.workloads)
    assert gap["sgd"].lr == 0.2 and gap["sgd"].lr_source.endswith("(3 epoch(s), target 91.0%)")
    assert "sweep file" in gap["sgd"].lr_source
    assert gap["kaisa-sgd"].lr == 0.07  # written under the old name
    assert gap["adamw"].lr == 0.003 and gap["adamw"].lr_source == "command line"
    assert small["sgd"].lr == FALLBACK_LRS["sgd"]
    assert small["sgd"].lr_source.startswith("fallback")
    assert _suite("--sgd-lr", "0.3", "--kaisa-lr", "0.02").workloads[0].arms[4].lr == 0.02


def test_each_arm_builds_and_trains(tiny: Path) -> None:
    """Every arm takes its steps on the tiny data (SOAP when heavyball is installed)."""
    import torch

    torch.set_num_threads(1)
    data = load_fashion_mnist(str(tiny))
    names = [a for a in ARM_NAMES if a != "soap" or importlib.util.find_spec("heavyball")]
    arms = tuple(make_arm(name, FALLBACK_LRS[name]) for name in names)
    config = DemoConfig(data_dir=str(tiny), out_dir="", arms=arms, epochs=1, batch_size=64,
                        eval_every=2, target=0.99, progress=False)  # fmt: skip
    runs = train_arms_in_lockstep(data, config, arms, 0)
    assert [r.arm for r in runs] == names
    for run in runs:
        assert run.steps == 4 and not run.diverged, run.arm
        assert all(math.isfinite(p.train_loss) for p in run.points)
        assert (run.kfac_seconds > 0) == run.arm.startswith("kaisa"), run.arm
    by_name = {r.arm: r for r in runs}
    assert by_name["muon"].optimizer_info["muon_conv_filters"]
    assert by_name["kaisa-adamw"].kfac_options["lr"] == "callable"


@pytest.mark.parametrize("native", [True, False])
def test_schedule_reaches_every_param_group(
    tiny: Path, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Muon's AdamW group follows the schedule at its fixed ratio of the Muon LR.

    The hidden matrices go to torch.optim.Muon (bfloat16 iteration) where the
    device multiplies bfloat16 natively, to ConvMuon (float32) where it does not.
    """
    import torch

    from kaisa.demo import optimizers
    from kaisa.models import build_model

    monkeypatch.setattr(optimizers, "native_bfloat16", lambda device: native)
    arm = make_arm("muon", 0.02)
    opt, info = optimizers.build_optimizer(build_model("small_cnn", in_channels=1), arm)
    scales = sorted(g["lr_scale"] for g in opt.param_groups)
    assert scales == [MUON_ADAMW_LR_RATIO, 1.0, 1.0]  # AdamW, Muon (2-D), ConvMuon (4-D)
    kinds = [type(o).__name__ for o in opt.optimizers]  # type: ignore[attr-defined]
    assert kinds == ["Muon" if native else "ConvMuon", "ConvMuon", "AdamW"]
    assert isinstance(opt.optimizers[0], torch.optim.Muon) == native  # type: ignore[attr-defined]
    assert ("bfloat16 iteration" in info["matrices"]) == native
    assert ("float32 iteration (cpu has no native bfloat16" in info["matrices"]) != native


def test_native_bfloat16_is_a_property_of_the_device() -> None:
    """A bool, the same on every call; an unknown device type is left to itself."""
    import torch

    from kaisa.demo.optimizers import native_bfloat16

    cpu = native_bfloat16(torch.device("cpu"))
    assert isinstance(cpu, bool) and native_bfloat16(torch.device("cpu")) == cpu
    assert native_bfloat16(torch.device("meta")) is True


@pytest.mark.parametrize(
    ("model", "matrices", "filters", "adamw_weights"),
    [
        ("small_cnn", ["classifier.1.weight"], ["features.3.weight"],
         ["features.0.weight", "classifier.3.weight"]),
        ("gap_cnn", [], [f"features.{i}.weight" for i in (3, 7, 10, 14, 17)],
         ["features.0.weight", "classifier.1.weight"]),
        ("resnet20", [], [f"layer{s}.{b}.conv{c}.weight" for s in (1, 2, 3) for b in range(3)
                          for c in (1, 2)],
         ["conv1.weight", "fc.weight"]),
        ("vit", [f"encoder.layers.{i}.{w}" for i in (0, 1)
                 for w in ("self_attn.in_proj_weight", "self_attn.out_proj.weight",
                           "linear1.weight", "linear2.weight")],
         [], ["cls_token", "pos_embed", "patch_embed.weight", "head.weight"]),
    ],
)  # fmt: skip
def test_muon_param_split(
    model: str, matrices: list[str], filters: list[str], adamw_weights: list[str]
) -> None:
    """Hidden weights to Muon (2-D: torch's; conv filters: ConvMuon); the rest to AdamW."""
    from torch import nn

    from kaisa.demo.optimizers import muon_param_split
    from kaisa.models import build_model

    net = build_model(model, in_channels=1)
    split = muon_param_split(net)
    assert list(split.matrices) == matrices
    assert sorted(split.filters) == sorted(filters)
    names = dict(net.named_parameters())
    assert {n for n in split.adamw if names[n].ndim >= 2} == set(adamw_weights)
    # Biases and norm parameters all go to AdamW; nothing is lost or doubled.
    assert all(names[n].ndim == 1 for n in split.adamw if n not in adamw_weights)
    assert sorted([*split.matrices, *split.filters, *split.adamw]) == sorted(names)
    norms = [n for n, m in net.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(f"{n}.weight" in split.adamw for n in norms)


def test_muon_param_split_sees_huggingface_conv1d_as_hidden_matrices() -> None:
    """GPT-2's projections are HF ``Conv1D`` (a transposed Linear): Muon's; the
    embeddings and the tied head stay AdamW's."""
    transformers = pytest.importorskip("transformers")
    from kaisa.demo.optimizers import muon_param_split

    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    net = transformers.GPT2LMHeadModel(config)
    split = muon_param_split(net)
    assert list(split.matrices) == [
        f"transformer.h.{i}.{w}.weight"
        for i in (0, 1)
        for w in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    weights = {n for n, p in net.named_parameters() if p.ndim >= 2 and n in split.adamw}
    assert weights == {"transformer.wte.weight", "transformer.wpe.weight"}  # lm_head is wte


def test_conv_muon_is_torch_muon_on_a_matrix_and_orthogonalises() -> None:
    """On a 2-D parameter ConvMuon takes torch.optim.Muon's step (up to bf16 vs fp32)."""
    import torch

    from kaisa.demo.optimizers import ConvMuon, newton_schulz

    torch.manual_seed(0)
    w0 = torch.randn(16, 24)
    grads = [torch.randn(16, 24) for _ in range(3)]
    mine, ref = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    opt_a = ConvMuon([mine], lr=0.02, weight_decay=0.01)
    opt_b = torch.optim.Muon([ref], lr=0.02, weight_decay=0.01)
    for g in grads:
        mine.grad, ref.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    step_a, step_b = mine.detach() - w0, ref.detach() - w0
    assert torch.linalg.norm(step_a - step_b) < 0.05 * torch.linalg.norm(step_b)
    # Singular values of the orthogonalised matrix near 1 (Muon's iteration: about 0.7-1.2).
    s = torch.linalg.svdvals(newton_schulz(torch.randn(40, 12)))
    assert float(s.min()) > 0.5 and float(s.max()) < 1.3
    # A conv filter bank is handled as its (out, in*kh*kw) matrix.
    filt = torch.randn(8, 4, 3, 3, requires_grad=True)
    filt.grad = torch.randn(8, 4, 3, 3)
    before = filt.detach().clone()
    ConvMuon([filt], lr=0.1).step()
    update = (before - filt.detach()).reshape(8, -1) / 0.1
    assert torch.allclose(update, newton_schulz(filt.grad.reshape(8, -1) * 0.05), atol=1e-5)


def _arm_result(time: float | None, by_seed: dict[int, float | None], **extra: object) -> dict:
    per_seed = [{"seed": s, "time_to_target_s": t} for s, t in by_seed.items()]
    return {"time_to_target_s": time, "per_seed": per_seed, **extra}


def test_compare_arms_against_the_best_other_arm() -> None:
    arms = {
        "sgd": _arm_result(100.0, {0: 100.0, 1: 90.0}),
        "adamw": _arm_result(80.0, {0: 80.0, 1: 85.0}),
        "muon": _arm_result(None, {0: None, 1: 70.0}),
        "kaisa-sgd": _arm_result(60.0, {0: 60.0, 1: 68.0}),
        "kaisa-adamw": _arm_result(90.0, {0: 90.0, 1: None}),
    }
    comp = compare_arms(arms)
    # kaisa arms: the best arm without K-FAC (AdamW), not the faster kaisa-sgd.
    assert comp["kaisa-sgd"]["vs_best"]["arm"] == "adamw"
    assert comp["kaisa-sgd"]["vs_best"]["time_ratio"] == pytest.approx(0.75)
    assert comp["kaisa-sgd"]["vs_best"]["per_seed"] == {
        "0": pytest.approx(0.75), "1": pytest.approx(0.8)}  # fmt: skip
    assert comp["kaisa-sgd"]["vs_base"]["arm"] == "sgd"
    assert comp["kaisa-sgd"]["vs_base"]["time_ratio"] == pytest.approx(0.6)
    assert comp["kaisa-adamw"]["vs_best"]["arm"] == "adamw"
    assert comp["kaisa-adamw"]["vs_best"]["time_ratio"] == pytest.approx(90 / 80)
    assert comp["kaisa-adamw"]["vs_best"]["per_seed"] == {"0": pytest.approx(90 / 80), "1": None}
    # Other arms: the best arm but themselves, kaisa arms included.
    assert comp["sgd"]["vs_best"]["arm"] == "kaisa-sgd"
    assert comp["sgd"]["vs_best"]["time_ratio"] == pytest.approx(100 / 60)
    assert comp["adamw"]["vs_best"]["arm"] == "kaisa-sgd"
    muon = comp["muon"]["vs_best"]
    assert muon["arm"] == "kaisa-sgd" and muon["time_ratio"] is None
    assert muon["per_seed"] == {"0": None, "1": pytest.approx(70 / 68)}
    assert "vs_base" not in comp["sgd"]
    # Nobody else reached the target: no arm to compare with.
    alone = compare_arms({"sgd": _arm_result(50.0, {0: 50.0}), "adamw": _arm_result(None, {})})
    assert alone["sgd"]["vs_best"]["arm"] is None and alone["adamw"]["vs_best"]["arm"] == "sgd"


def test_compare_arms_steps_against_the_fewest_other() -> None:
    # Muon is the fastest arm without K-FAC, SOAP takes the fewest steps: the
    # time compares with Muon, the steps with SOAP (the same candidates).
    arms = {
        "adamw": _arm_result(60.0, {0: 60.0}, steps_to_target=950),
        "muon": _arm_result(35.0, {0: 35.0}, steps_to_target=522),
        "soap": _arm_result(90.0, {0: 90.0}, steps_to_target=484),
        "sgd": _arm_result(None, {0: None}, steps_to_target=None),
        "kaisa-adamw": _arm_result(38.0, {0: 38.0}, steps_to_target=436),
    }
    comp = compare_arms(arms)
    assert comp["kaisa-adamw"]["vs_best"]["arm"] == "muon"
    assert comp["kaisa-adamw"]["vs_fewest_steps"] == {
        "arm": "soap", "steps_ratio": pytest.approx(436 / 484)}  # fmt: skip
    # Other arms: every arm but themselves, kaisa's included.
    assert comp["muon"]["vs_fewest_steps"] == {
        "arm": "kaisa-adamw", "steps_ratio": pytest.approx(522 / 436)}  # fmt: skip
    # An arm that never reached the target has no ratio, but still names the fewest.
    assert comp["sgd"]["vs_fewest_steps"] == {"arm": "kaisa-adamw", "steps_ratio": None}
    # Nobody else reached it (or no steps on record): nothing to compare with.
    alone = compare_arms({"kaisa-sgd": _arm_result(5.0, {0: 5.0}, steps_to_target=50),
                          "sgd": _arm_result(None, {0: None}, steps_to_target=None)})  # fmt: skip
    assert alone["kaisa-sgd"]["vs_fewest_steps"] == {"arm": None, "steps_ratio": None}
    no_steps = compare_arms({"sgd": _arm_result(5.0, {0: 5.0}), "adamw": _arm_result(6.0, {})})
    assert no_steps["sgd"]["vs_fewest_steps"] == {"arm": None, "steps_ratio": None}


def test_summary_rows_over_workloads() -> None:
    def results(workload: str, times: dict[str, float | None]) -> dict:
        arms = {}
        for name, t in times.items():
            arm = _arm_result(t, {0: t}, seeds=1, seeds_reaching_target=int(t is not None),
                              steps_to_target=None if t is None else 10 * t,
                              seconds_per_step=0.05, hyperparameters={"lr": 0.1})  # fmt: skip
            if name.startswith("kaisa"):
                arm.update(kfac_share=0.2, kfac_phase_seconds={"precondition": 1.5})
            arms[name] = arm
        return {"workload": workload, "target_accuracy": 0.9, "arm_order": list(times),
                "arms": arms, "comparisons": compare_arms(arms), "provisional": True,
                "shared": {"epochs": 3, "seeds": [0], "stop_at_target": True}}  # fmt: skip

    docs = [results("gap_cnn", {"sgd": 100.0, "kaisa-sgd": 50.0}),
            results("resnet20", {"sgd": None, "kaisa-sgd": 40.0})]  # fmt: skip
    summary = summarize_suite(docs)
    rows = {(r["workload"], r["arm"]): r for r in summary["rows"]}
    assert list(rows) == [("gap_cnn", "sgd"), ("gap_cnn", "kaisa-sgd"),
                          ("resnet20", "sgd"), ("resnet20", "kaisa-sgd")]  # fmt: skip
    assert rows["gap_cnn", "kaisa-sgd"]["ratio"] == pytest.approx(0.5)
    assert rows["gap_cnn", "kaisa-sgd"]["vs"] == "sgd"
    assert rows["gap_cnn", "sgd"]["ratio"] == pytest.approx(2.0)
    assert rows["gap_cnn", "kaisa-sgd"]["kfac_share"] == 0.2
    assert rows["gap_cnn", "kaisa-sgd"]["ms_per_step"] == pytest.approx(50.0)
    assert rows["resnet20", "kaisa-sgd"]["vs"] is None  # SGD never reached it
    assert rows["resnet20", "sgd"]["ratio"] is None and rows["resnet20", "sgd"]["vs"] == "kaisa-sgd"
    text = format_summary(summary)
    assert "0.50x sgd" in text and "never" in text and "(none)" in text
    assert "precondition 1.50 s" in text
    markdown = summary_markdown(summary)
    row = "| resnet20 | SGD + KAISA | 1/1 | 400 | (none) | 50.0 | 40.0 s | (none) | 20% |"
    assert row in markdown
    # Steps against the fewest of the same arms: 500 against SGD's 1000.
    assert rows["gap_cnn", "kaisa-sgd"]["steps_ratio"] == pytest.approx(0.5)
    assert rows["gap_cnn", "kaisa-sgd"]["steps_vs"] == "sgd"
    row = "| gap_cnn | SGD + KAISA | 1/1 | 500 | 0.50x sgd | 50.0 | 50.0 s | 0.50x sgd |"
    assert row in markdown
    assert "'steps vs fewest other'" in markdown
    # A record made before the steps comparison existed gets the same rows from its arms.
    old_docs = [
        {**doc, "comparisons": {name: {k: v for k, v in comp.items() if k != "vs_fewest_steps"}
                                for name, comp in doc["comparisons"].items()}}
        for doc in docs
    ]  # fmt: skip
    assert all("vs_fewest_steps" not in c for d in old_docs for c in d["comparisons"].values())
    assert summarize_suite(old_docs)["rows"] == summary["rows"]
    # The CPU's capability is on record: the same model name can be AVX2 or AVX-512 + BF16.
    import torch

    from kaisa.demo.compare import machine_info

    machine = machine_info()
    assert machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    for native, word in ((True, "native"), (False, "emulated")):
        on_record = summarize_suite(
            docs, machine_before={**machine, "cpu": "Some CPU", "cpu_native_bfloat16": native}
        )
        line = f"CPU: Some CPU, {machine['cpu_count']} CPUs, {machine['cpu_capability']}, "
        assert f"{line}bfloat16 {word}." in summary_markdown(on_record)


def test_summary_names_the_seed_whose_choice_it_shows() -> None:
    # The choice shown is the first seed's run: with seeds 3-5 that is seed 3, not 0.
    arms = {
        "adamw": _arm_result(80.0, {3: 80.0}, seeds=1, seeds_reaching_target=1,
                             steps_to_target=800, seconds_per_step=0.1,
                             hyperparameters={"lr": 0.004}),
        "kaisa-adamw": _arm_result(60.0, {3: 60.0}, seeds=1, seeds_reaching_target=1,
                                   steps_to_target=500, seconds_per_step=0.12,
                                   hyperparameters={"lr": 0.004}, kfac_share=0.3,
                                   kfac_phase_seconds={"precondition": 2.0},
                                   interval_stretch={"factor": 2, "changes": 3}),
    }  # fmt: skip
    doc = {"workload": "gap_cnn", "target_accuracy": 0.9, "arm_order": list(arms), "arms": arms,
           "comparisons": compare_arms(arms), "provisional": False,
           "shared": {"epochs": 3, "seeds": [3, 4, 5], "stop_at_target": True}}  # fmt: skip
    text = summary_markdown(summarize_suite([doc]))
    assert "kaisa's automatic curvature choice (seed 3):" in text
    assert "(seed 0)" not in text
    assert "intervals as given (adaptive_intervals: x2 at the end, 3 change(s))" in text


# --- bad arms and workloads, SOAP without heavyball ------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--arms", "sgd,lion"], "argument --arms: unknown arm 'lion'; allowed: sgd, adamw, muon,"),
        (["--arms", ","], "argument --arms: expected a comma-separated list"),
        (["--workload", "vgg"], "argument --workload: unknown workload 'vgg'; allowed: gap_cnn,"),
        (["--lr", "lion=0.1"], "argument --lr: unknown arm 'lion'"),
        (["--lr", "sgd"], "argument --lr: expected ARM=LR pairs"),
        (["--lr", "sgd=-1"], "argument --lr: expected a positive number"),
        (["--model", "gap_cnn", "--workload", "gap_cnn"], "give only --workload"),
        (["--lr-file", "/nonexistent/lrs.json"], "argument --lr-file: /nonexistent/lrs.json"),
    ],
)
def test_bad_arm_workload_or_lr_is_one_clear_line(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    code = main(["--data-dir", str(tiny), "--out", str(tmp_path / "out"), *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("kaisa demo: error: ") and expected in lines[0], lines[0]


def test_bad_lr_file_is_one_clear_line(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "lrs.json"
    bad.write_text(json.dumps({"lrs": {"gap_cnn": {"sgd": {"lr": "fast"}}}}))
    code = main(["--data-dir", str(tiny), "--out", str(tmp_path / "o"), "--lr-file", str(bad)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "'lrs.gap_cnn.sgd.lr' must be a positive number" in err


def test_soap_without_heavyball(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kaisa.demo.optimizers import MissingDependencyError, build_optimizer
    from kaisa.models import build_model

    monkeypatch.setitem(sys.modules, "heavyball", None)  # `import heavyball` raises ImportError
    code = main(["--data-dir", str(tiny), "--out", str(tmp_path / "o"), "--arms", "sgd,soap"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "arm 'soap' needs heavyball" in lines[0]
    assert "pip install -c constraints.txt heavyball" in lines[0]
    with pytest.raises(MissingDependencyError, match=r"pip install -c constraints\.txt heavyball"):
        build_optimizer(build_model("gap_cnn", in_channels=1), make_arm("soap", 1e-3))
    # Without soap among the arms heavyball is not needed.
    assert _suite("--arms", "sgd,muon").workloads[0].arms[1].name == "muon"


def test_the_summary_names_kaisas_automatic_choice() -> None:
    from kaisa.demo.report import _choice_text

    row = {
        "curvature_choice": {
            "specs": {"conv": ["exact", "exact"], "fc1": ["kvec", "lowrank:8"]},
            "factor_update_steps": 80,
            "inv_update_steps": 100,
            "kfac_work": 9.0,
            "training_work": 100.0,
        }
    }
    assert _choice_text(row) == (
        "factors/inverses every 80/100 steps, modelled share 0.090; A/G held as: fc1 kvec/lowrank:8"
    )
    row["curvature_choice"].update(time_scale=2**1.5, calibrated=True)
    assert _choice_text(row) == (
        "factors/inverses every 80/100 steps, modelled share 0.090, budget scaled by the clock "
        "2.83x; A/G held as: fc1 kvec/lowrank:8"
    )
    row["curvature_choice"].update(calibrated=False)
    row["interval_stretch"] = {"factor": 4, "changes": 7}
    assert _choice_text(row) == (
        "factors/inverses every 80/100 steps (adaptive_intervals: x4 at the end, 7 change(s)), "
        "modelled share 0.090; A/G held as: fc1 kvec/lowrank:8"
    )
    assert _choice_text({"interval_stretch": {"factor": 2, "changes": 1}}) == (
        "no automatic choice, intervals as given (adaptive_intervals: x2 at the end, 1 change(s))"
    )
    assert _choice_text({}) == ""
    # The profile the options left 'auto' took, first.
    row["profile"] = "language-model"
    assert _choice_text(row).startswith("profile language-model: factors/inverses every 80/100")
    assert _choice_text({"profile": "general"}) == ""
