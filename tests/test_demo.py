"""The demo's code paths on a tiny Fashion-MNIST look-alike written by the tests.

The data set is a few hundred 28x28 images in the real IDX gzip format whose
class is a bright horizontal band at a class-dependent height, so a few
steps of training already separate the classes.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kaisa.demo.cli import main
from kaisa.demo.compare import _paired_ratios
from kaisa.demo.data import FILES, DatasetError, load_fashion_mnist, read_idx, write_idx
from kaisa.demo.report import verdict
from kaisa.demo.train import warmup_cosine

ROOT = Path(__file__).resolve().parents[1]
TINY_ARGS = [
    "--model",
    "gap_cnn",
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


def _check_outputs(out: Path, arms: tuple[str, ...] = ("sgd", "kaisa")) -> dict[str, object]:
    results = json.loads((out / "results.json").read_text())
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
    if "kaisa" in arms:
        kaisa_arm = results["arms"]["kaisa"]
        kfac = kaisa_arm["hyperparameters"]["kfac"]
        assert kfac["damping_mode"] == "relative" and kfac["factor_init"] == "first_batch"
        for run in kaisa_arm["per_seed"]:
            assert 0.0 <= run["kl_clipped_fraction"] <= 1.0
    if set(arms) == {"sgd", "kaisa"}:
        sgd_times = {r["seed"]: r["time_to_target_s"] for r in results["arms"]["sgd"]["per_seed"]}
        for seed, ratio in results["kaisa_time_ratio_per_seed"].items():
            kaisa_time = next(
                r["time_to_target_s"]
                for r in results["arms"]["kaisa"]["per_seed"]
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
    results = {
        "target_accuracy": 0.91,
        "arms": {"sgd": {"time_to_target_s": 100.0}, "kaisa": {"time_to_target_s": 65.0}},
        "kaisa_time_ratio_per_seed": {"0": 0.74, "1": 0.65, "2": None},
        "kaisa_time_ratio_per_seed_median": 0.74,
    }
    text = verdict(results)
    assert text.startswith("SGD + KAISA reached 91.0% in 0.65x SGD's time (65.0 s vs 100.0 s")
    assert "Seed by seed: 0.74x (seed 0), 0.65x (seed 1), never (seed 2); median 0.74x." in text


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
        eval_every=2, target_accuracy=0.3, progress=False,
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
    kfac = ArmConfig("kaisa", 0.05, kfac=KfacConfig(factor_update_steps=2, inv_update_steps=4))
    config = DemoConfig(
        data_dir=str(tiny), out_dir="", arms=(sgd, kfac), epochs=2, batch_size=32,
        eval_every=3, target_accuracy=0.3, progress=False,
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
    results = _check_outputs(out)
    arms = results["arms"]
    assert isinstance(arms, dict)
    for name in ("sgd", "kaisa"):
        assert arms[name]["seeds"] == 2
        assert len(arms[name]["per_seed"]) == 2
    assert (
        arms["sgd"]["hyperparameters"]["weight_decay"]
        == (arms["kaisa"]["hyperparameters"]["weight_decay"])
    )
    assert arms["kaisa"]["kfac_seconds_per_step"] > 0
    assert results["shared"]["lockstep"] is not sequential  # type: ignore[index]


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
    cmd = [sys.executable, "-m", "kaisa.cli", "demo", "--data-dir", str(tiny), "--out", str(out)]
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
    for arm in ("sgd", "kaisa"):
        for epoch in (1, 2):
            assert f"{arm} seed 0 epoch {epoch}/2" in screen, screen
    bars = re.search(r"\| \d+/\d+ \[", screen) is not None  # tqdm's "| 8/8 [00:01<..."
    summaries = screen.count("(training ")  # one line per arm and epoch
    if columns:
        assert bars and summaries == 0, screen
    else:
        assert not bars and summaries == 4, screen
    _check_outputs(out)


@pytest.mark.timeout(120)
def test_demo_two_processes(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = list(TINY_ARGS)
    args[args.index("--seeds") + 1] = "0"
    args[args.index("--threads") + 1] = "2"
    cmd = [sys.executable, "-m", "kaisa.cli", "demo", "--data-dir", str(tiny), "--out", str(out)]
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
    results = _check_outputs(out)
    assert results["shared"]["nproc"] == 2  # type: ignore[index]
    kfac = results["arms"]["kaisa"]["hyperparameters"]["kfac"]  # type: ignore[index]
    assert kfac["grad_worker_fraction"] == 0.5


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
            [sys.executable, "-m", "kaisa.cli", "demo", *args, "--out", str(tmp_path / "o")],
            capture_output=True,
            text=True,
            timeout=50,
            env=_env(),
        )
        assert proc.returncode == 2
        assert "Traceback" not in proc.stderr
        assert proc.stderr.startswith("kaisa demo: error: ")
        assert len(proc.stderr.strip().splitlines()) == 1
