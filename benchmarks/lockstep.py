"""Does training the demo's arms in lockstep slow either of them?

``make demo`` trains the arms of a seed in one process, one step of each in
turn (``train_arms_in_lockstep``), so that the shared machine's load falls on
all alike. Alternating every step could cost time of its own: each arm's step
may evict the other arm's model, optimizer and K-FAC state from the caches,
and an arm with a larger working set may slow its partner more than it is
slowed. This measures it for two of the demo's arms of one workload (by
default GapCNN's SGD and SGD + KAISA with the demo's defaults; ``--workload``,
``--arms`` and ``--demo-args``, any other ``kaisa demo`` options such as a
kaisa configuration, choose others) on the first ``--steps`` steps of the
workload's run (the image workloads: one epoch of that many steps on the
first training images, so the learning-rate schedule is compressed; the
language model: its own schedule, stopped after ``--steps``; neither matters
for the time per step), trained

- ``step``: in lockstep, one step of each in turn (the demo's way),
- ``turnN``: in lockstep, ``N`` steps of each in turn (``--turn``),
- ``alone``: one arm after the other,

each schedule once per round, the order of the schedules reversed every other
round (and in ``alone`` the order of the arms), for ``--rounds`` rounds.
Reported per schedule: the median over rounds of each arm's training time per
step (the demo's clock: evaluation excluded) and of the second arm's step
over the first's in the same round, with the load average before and after.
Nothing is asserted.

    python benchmarks/lockstep.py --threads 2 --steps 250 --rounds 2
    python benchmarks/lockstep.py --workload gpt --arms muon,kaisa-adamw \\
        --demo-args "--factor-update-steps 5 --eigenvalue-correction ekfac"
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
from pathlib import Path
from typing import Any

from common import LoadRecord, format_table, machine_info, set_threads, write_json

from kaisa.demo.cli import build_config, parse_args
from kaisa.demo.config import DemoConfig
from kaisa.demo.data import FashionMNIST
from kaisa.demo.datasets import load_dataset
from kaisa.demo.train import RunResult, train_arm, train_arms_in_lockstep


def _run(schedule: str, data: Any, config: DemoConfig, turn: int, rnd: int) -> list[RunResult]:
    if schedule == "alone":
        arms = config.arms if rnd % 2 == 0 else tuple(reversed(config.arms))
        return [train_arm(data, config, arm, seed=0) for arm in arms]
    return train_arms_in_lockstep(
        data, config, config.arms, 0, turn=1 if schedule == "step" else turn
    )


def _config_and_data(
    args: argparse.Namespace, p: argparse.ArgumentParser
) -> tuple[DemoConfig, Any]:
    """The workload's demo configuration for these arms and options, cut to ``--steps``."""
    argv = ["--threads", str(args.threads), "--workload", args.workload, "--arms", args.arms]
    if args.data_dir:
        argv += ["--data-dir", args.data_dir]
    config = build_config(parse_args(argv + shlex.split(args.demo_args))).workloads[0]
    if len(config.arms) != 2:
        p.error(f"--arms names two arms; got {len(config.arms)} ({args.arms!r})")
    full = load_dataset(config.dataset, config.data_dir)
    config = dataclasses.replace(config, eval_every=10**9, progress=False, stop_at_target=False)
    if not isinstance(full, FashionMNIST):  # its own schedule, stopped after --steps
        return dataclasses.replace(config, step_limit=args.steps), full
    n = args.steps * config.batch_size
    if n > full.train_x.shape[0]:
        p.error(
            f"--steps {args.steps} needs {n} training images, the set has {full.train_x.shape[0]}"
        )
    # One epoch of --steps steps; a small test set (evaluated once, off the clock).
    data = FashionMNIST(full.train_x[:n], full.train_y[:n], full.test_x[:1000], full.test_y[:1000],
                        full.directory)  # fmt: skip
    return dataclasses.replace(config, epochs=1), data


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=250, help="training steps per arm and run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--turn", type=int, default=25, help="steps per turn of the 'turnN' schedule")
    p.add_argument("--workload", default="gap_cnn", help="one of the demo's workloads")
    p.add_argument("--arms", default="sgd,kaisa-sgd", help="two of the demo's arms, A,B")
    p.add_argument(
        "--demo-args", default="", help="more kaisa demo options, one string (kaisa's options)"
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="Fashion-MNIST's directory (default: the demo's); the language model's text: "
        "--demo-args '--text-dir DIR'",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.turn < 1:
        p.error("--steps, --rounds and --turn must be positive")
    set_threads(args.threads)
    config, data = _config_and_data(args, p)
    first, second = (arm.name for arm in config.arms)

    schedules = ["step", f"turn{args.turn}", "alone"]
    per_step: dict[str, dict[str, list[float]]] = {s: {first: [], second: []} for s in schedules}
    steps: dict[str, dict[str, list[int]]] = {s: {first: [], second: []} for s in schedules}
    ratios: dict[str, list[float]] = {s: [] for s in schedules}
    with LoadRecord() as load:
        for rnd in range(args.rounds):
            for schedule in schedules if rnd % 2 == 0 else list(reversed(schedules)):
                runs = {r.arm: r for r in _run(schedule, data, config, args.turn, rnd)}
                for arm, run in runs.items():
                    per_step[schedule][arm].append(1000 * run.seconds_per_step)
                    steps[schedule][arm].append(run.steps)
                ratios[schedule].append(
                    runs[second].seconds_per_step / runs[first].seconds_per_step
                )
                print(f"round {rnd} {schedule:>7}: {first} {per_step[schedule][first][-1]:.2f} "
                      f"ms/step, {second} {per_step[schedule][second][-1]:.2f}",
                      flush=True)  # fmt: skip

    rows = [
        [
            s,
            f"{statistics.median(per_step[s][first]):.2f}",
            f"{statistics.median(per_step[s][second]):.2f}",
            f"{statistics.median(ratios[s]):.3f}",
            " ".join(f"{r:.3f}" for r in ratios[s]),
        ]
        for s in schedules
    ]
    print(
        f"\n{args.workload}, {first} and {second}, {args.steps} steps each per run, "
        f"{args.threads} thread(s), median of {args.rounds} rounds, {load.describe()}:"
    )
    print(
        format_table(
            ["schedule", f"{first} ms/step", f"{second} ms/step", f"{second}/{first}", "per round"],
            rows,
        )
    )
    result = {
        "benchmark": "lockstep",
        "settings": vars(args),
        "arms": [first, second],
        "hyperparameters": {arm.name: arm.hyperparameters() for arm in config.arms},
        "ms_per_step": per_step,
        "steps": steps,  # each measured run's training steps
        "second_over_first": ratios,
        "load": load.as_dict(),
        "machine": machine_info(),
    }
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
