"""Does training the demo's two arms in lockstep slow either of them?

``make demo`` trains SGD and SGD + KAISA of a seed in one process, one step of
each in turn (``train_arms_in_lockstep``), so that the shared machine's load
falls on both alike. Alternating every step could cost time of its own: each
arm's step may evict the other arm's model, optimizer and K-FAC state from the
caches. This measures it: the demo's SGD and SGD + KAISA arms (``kaisa demo
--workload gap_cnn --arms sgd,kaisa-sgd`` with its defaults) on
the first ``--steps`` batches of Fashion-MNIST (one epoch of that many steps,
so the learning-rate schedule is compressed, which does not matter for the
time per step), trained

- ``step``: in lockstep, one step of each in turn (the demo's way),
- ``turnN``: in lockstep, ``N`` steps of each in turn (``--turn``),
- ``alone``: one arm after the other,

each schedule once per round, the order of the schedules reversed every other
round (and in ``alone`` the order of the arms), for ``--rounds`` rounds.
Reported per schedule: the median over rounds of each arm's training time per
step (the demo's clock: evaluation excluded) and of KAISA's step over SGD's
in the same round, with the load average before and after. Nothing is
asserted.

    python benchmarks/lockstep.py --threads 2 --steps 250 --rounds 2
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import Any

from common import LoadRecord, format_table, machine_info, set_threads, write_json

from kaisa.demo.cli import build_config, parse_args
from kaisa.demo.config import DemoConfig
from kaisa.demo.data import DEFAULT_DATA_DIR, FashionMNIST, load_fashion_mnist
from kaisa.demo.train import RunResult, train_arm, train_arms_in_lockstep


def _run(
    schedule: str, data: FashionMNIST, config: DemoConfig, turn: int, rnd: int
) -> list[RunResult]:
    if schedule == "alone":
        arms = config.arms if rnd % 2 == 0 else tuple(reversed(config.arms))
        return [train_arm(data, config, arm, seed=0) for arm in arms]
    return train_arms_in_lockstep(
        data, config, config.arms, 0, turn=1 if schedule == "step" else turn
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=250, help="training steps per arm and run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--turn", type=int, default=25, help="steps per turn of the 'turnN' schedule")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.turn < 1:
        p.error("--steps, --rounds and --turn must be positive")
    set_threads(args.threads)

    full = load_fashion_mnist(args.data_dir)
    config = build_config(
        parse_args(["--data-dir", args.data_dir, "--threads", str(args.threads),
                    "--workload", "gap_cnn", "--arms", "sgd,kaisa-sgd"])
    ).workloads[0]  # fmt: skip
    n = args.steps * config.batch_size
    if n > full.train_x.shape[0]:
        p.error(
            f"--steps {args.steps} needs {n} training images, the set has {full.train_x.shape[0]}"
        )
    # One epoch of --steps steps; a small test set (evaluated once, off the clock).
    data = FashionMNIST(full.train_x[:n], full.train_y[:n], full.test_x[:1000], full.test_y[:1000],
                        full.directory)  # fmt: skip
    config = dataclasses.replace(
        config, epochs=1, eval_every=10**9, progress=False, stop_at_target=False
    )

    schedules = ["step", f"turn{args.turn}", "alone"]
    per_step: dict[str, dict[str, list[float]]] = {s: {"sgd": [], "kaisa": []} for s in schedules}
    ratios: dict[str, list[float]] = {s: [] for s in schedules}
    with LoadRecord() as load:
        for rnd in range(args.rounds):
            for schedule in schedules if rnd % 2 == 0 else list(reversed(schedules)):
                runs = {
                    "kaisa" if r.arm == "kaisa-sgd" else r.arm: r
                    for r in _run(schedule, data, config, args.turn, rnd)
                }
                for arm, run in runs.items():
                    per_step[schedule][arm].append(1000 * run.seconds_per_step)
                ratios[schedule].append(
                    runs["kaisa"].seconds_per_step / runs["sgd"].seconds_per_step
                )
                sgd_ms, kaisa_ms = per_step[schedule]["sgd"][-1], per_step[schedule]["kaisa"][-1]
                print(f"round {rnd} {schedule:>7}: SGD {sgd_ms:.2f} ms/step, KAISA {kaisa_ms:.2f}",
                      flush=True)  # fmt: skip

    rows = [
        [
            s,
            f"{statistics.median(per_step[s]['sgd']):.2f}",
            f"{statistics.median(per_step[s]['kaisa']):.2f}",
            f"{statistics.median(ratios[s]):.3f}",
            " ".join(f"{r:.3f}" for r in ratios[s]),
        ]
        for s in schedules
    ]
    print(f"\nThe demo's arms, {args.steps} steps each per run, {args.threads} thread(s), "
          f"median of {args.rounds} rounds, {load.describe()}:")  # fmt: skip
    print(
        format_table(["schedule", "SGD ms/step", "KAISA ms/step", "KAISA/SGD", "per round"], rows)
    )
    result = {
        "benchmark": "lockstep",
        "settings": vars(args),
        "kaisa_arm": config.arms[1].hyperparameters(),
        "ms_per_step": per_step,
        "kaisa_over_sgd": ratios,
        "load": load.as_dict(),
        "machine": machine_info(),
    }
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
