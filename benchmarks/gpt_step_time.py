"""Milliseconds per training step of the language-model workload's arms, side by side.

``benchmarks/steps_probe.py`` counts the steps an arm (or a kaisa configuration)
needs to reach the ``gpt`` workload's target; steps do not depend on the
machine. This measures the other half of time to target: the wall time of one
training step (forward, backward, ``step()`` of kaisa where there is one, the
optimizer's step) of each arm on the workload's model (``kaisa.models.GPT`` as
the suite builds it) and batch (16 × 64 bytes; random bytes: the step's cost
does not depend on the text, except with ``eigenbasis_tolerance``, whose
bases are refreshed when the factors have moved: ``--text`` trains on the
workload's own corpus instead). Arms are the suite's (``--arms``, with the
suite's optimizers and learning rates from ``make_arm``) and named kaisa
configurations in front of AdamW (``--kaisa NAME=JSON``, repeatable; the JSON
is passed to ``KFACPreconditioner``).

Every arm trains ``--warmup`` steps first (the automatic choice, the first
decompositions), then, for ``--rounds`` rounds, ``--steps`` steps each in
turn, the order rotated every round, so the load falls on all arms alike; a
round's steps cover whole factor and inverse intervals for intervals that
divide ``--steps``. Reported per arm: the median over rounds of its mean ms per
step, its ratio to AdamW's in the same round (median), K-FAC's ms per step by
phase over the measured rounds (``phase_ms``: the phase an option changes,
apart from how many decompositions fell in the window), and the load average
before and after. Nothing is asserted. ::

    python benchmarks/gpt_step_time.py --threads 2 --rounds 3 --steps 80 \\
        --kaisa 'exact-corr-80={"curvature":"exact","factor_update_steps":80,\\
"inv_update_steps":80,"eigenvalue_correction":"adam"}'
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from common import LoadRecord, format_table, kfac_json, machine_info, set_threads, write_json

import kaisa
from kaisa.demo.config import WORKLOAD_FALLBACK_LRS, WORKLOADS, make_arm
from kaisa.demo.optimizers import build_optimizer
from kaisa.demo.text import DEFAULT_TEXT_DIR, VOCAB_SIZE, load_text_corpus
from kaisa.demo.train import build_demo_model


class Arm:
    """One arm: its model (same initial weights as every other), optimizer and kaisa."""

    def __init__(self, name: str, base: str, kfac: dict[str, Any] | None, context: int) -> None:
        torch.manual_seed(0)
        self.name = name
        self.model = build_demo_model("gpt", context=context)
        workload = WORKLOADS["gpt"]
        arm = make_arm(
            base,
            WORKLOAD_FALLBACK_LRS["gpt"][base],
            adamw_lr_ratio=workload.muon_adamw_lr_ratio or 0.1,
        )
        self.optimizer, _ = build_optimizer(self.model, arm)
        self.pre = (
            kaisa.KFACPreconditioner(self.model, optimizer=self.optimizer, **kfac)
            if kfac is not None
            else None
        )
        self.ms: list[float] = []

    def phase_seconds(self) -> dict[str, float]:
        """K-FAC's seconds so far per phase (its telemetry); empty without kaisa."""
        return {} if self.pre is None else dict(self.pre.telemetry.phase_seconds)

    def steps(self, batches: list[torch.Tensor]) -> float:
        """Train on ``batches``; the mean wall milliseconds per step."""
        start = time.perf_counter()
        for batch in batches:
            logits = self.model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
            )
            loss.backward()
            if self.pre is not None:
                self.pre.step()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return 1000.0 * (time.perf_counter() - start) / len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default="adamw,muon,soap,kaisa-adamw")
    parser.add_argument("--kaisa", action="append", default=[], metavar="NAME=JSON")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json", default="")
    parser.add_argument(
        "--text",
        nargs="?",
        const=DEFAULT_TEXT_DIR,
        default=None,
        metavar="DIR",
        help="batches from the workload's corpus (default directory: %(const)s), not random bytes",
    )
    args = parser.parse_args()
    set_threads(args.threads)
    workload = WORKLOADS["gpt"]
    context = workload.context or 64
    batch_size = workload.batch_size or 16
    specs: list[tuple[str, str, dict[str, Any] | None]] = []
    for name in filter(None, args.arms.split(",")):
        specs.append(
            (name, "adamw" if name == "kaisa-adamw" else name, {} if "kaisa" in name else None)
        )
    for entry in args.kaisa:
        name, _, text = entry.partition("=")
        specs.append((name, "adamw", kfac_json(text)))
    arms = [Arm(name, base, kfac, context) for name, base, kfac in specs]
    generator = torch.Generator().manual_seed(0)
    corpus = load_text_corpus(args.text) if args.text is not None else None

    def batch() -> torch.Tensor:
        if corpus is None:
            return torch.randint(0, VOCAB_SIZE, (batch_size, context + 1), generator=generator)
        x, y = corpus.sample_batch(batch_size, context, generator)
        return torch.cat([x, y[:, -1:]], dim=1)

    def batches(n: int) -> list[torch.Tensor]:
        return [batch() for _ in range(n)]

    warm = batches(args.warmup)
    for arm in arms:
        arm.steps(warm)
    # K-FAC's seconds per phase over the measured rounds only (not the warm-up).
    before = {arm.name: arm.phase_seconds() for arm in arms}
    ratios: dict[str, list[float]] = {arm.name: [] for arm in arms}
    with LoadRecord() as load:
        for r in range(args.rounds):
            data = batches(args.steps)
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            this_round = {arm.name: arm.steps(data) for arm in order}
            for arm in arms:
                arm.ms.append(this_round[arm.name])
                if "adamw" in this_round:
                    ratios[arm.name].append(this_round[arm.name] / this_round["adamw"])
    measured = args.rounds * args.steps
    rows = []
    for arm in arms:
        after = arm.phase_seconds()
        phase_ms = {
            phase: round(1000.0 * (seconds - before[arm.name].get(phase, 0.0)) / measured, 2)
            for phase, seconds in sorted(after.items())
        }
        rows.append(
            {
                "arm": arm.name,
                "ms_per_step": round(statistics.median(arm.ms), 1),
                "vs_adamw": round(statistics.median(ratios[arm.name]), 3)
                if ratios[arm.name]
                else None,
                "kfac": specs[arms.index(arm)][2],
                # K-FAC's ms per step by phase (its telemetry) in the measured rounds.
                "phase_ms": phase_ms or None,
                "intervals": None
                if arm.pre is None
                else [
                    arm.pre.hyperparameters().factor_update_steps,
                    arm.pre.hyperparameters().inv_update_steps,
                ],
                # Of the side refreshes (warm-up included), those that decomposed.
                "decomposed": None
                if arm.pre is None or not arm.pre.telemetry.side_refreshes
                else round(
                    1 - arm.pre.telemetry.kept_eigenbases / arm.pre.telemetry.side_refreshes, 3
                ),
            }
        )
    columns = ["arm", "ms_per_step", "vs_adamw", "intervals", "decomposed"]
    print(format_table(columns, [[row[c] for c in columns] for row in rows]))
    for row in rows:
        if row["phase_ms"]:
            phases = ", ".join(f"{k} {v:g}" for k, v in row["phase_ms"].items() if v)
            print(f"{row['arm']}: K-FAC ms per step by phase: {phases}")
    print("load:", load.as_dict())
    if args.json:
        write_json(
            args.json,
            {
                "settings": vars(args),
                "machine": machine_info(),
                "load": load.as_dict(),
                "rows": rows,
            },
        )


if __name__ == "__main__":
    main()
