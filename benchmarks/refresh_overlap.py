"""Would refreshing the eigenbases on a second thread, beside the training step, save time?

On `gpt` (the suite's configuration of kaisa, its automatic choice made by
``--warmup`` training steps on one fixed batch of random bytes), one
*refresh* is every registered side's decomposition as an inverse update
makes it (``layer.decompose``). The factors do not change between refreshes
here, so exact sides under ``eigenbasis_tolerance`` keep their bases and the
low-rank sides' subspace iterations are most of it. One *step* is the
model's forward, backward and AdamW on that batch (no K-FAC work). Two
arms, alternating every round:

* ``sequential``: the step, then the refresh (what ``step()`` does today);
* ``overlapped``: the refresh on a second Python thread (``torch.linalg``
  releases the GIL) while the step runs; the round ends when both have.

Each arm's time per round is the median of ``--steps`` calls; the table
gives each arm's median over ``--rounds`` rounds and the ratio
overlapped / sequential, with the step and the refresh alone for scale and
the machine's load before and after. Nothing else should run. Nothing is
asserted: this answers whether the CPU has idle capacity during a training
step that a concurrent refresh could use.

    python benchmarks/refresh_overlap.py --threads 2 --rounds 6 --steps 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import load_average, time_repeated

import kaisa
from kaisa.models import GPT

#: The suite's one configuration (benchmarks/README.md, session 33).
SUITE_KFAC = {
    "factor_update_steps": 5,
    "inv_update_steps": 5,
    "eigenvalue_correction": "ekfac",
    "eigenbasis_tolerance": 0.05,
    "time_budget": 1.25,
    "adaptive_intervals": True,
}


def _median_ms(fn: Callable[[], None], calls: int) -> float:
    return statistics.median(time_repeated(fn, calls, warmup=0)) * 1e3


def build(warmup: int) -> tuple[Callable[[], None], Callable[[], None], kaisa.KFACPreconditioner]:
    """The step and the refresh of a `gpt` trained ``warmup`` steps with kaisa, and kaisa."""
    torch.manual_seed(0)
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = kaisa.KFACPreconditioner(model, lr=4e-3, **SUITE_KFAC)  # type: ignore[arg-type]
    data = torch.randint(0, 256, (16, 65), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1], data[:, 1:].reshape(-1)

    def train(with_kfac: bool) -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).reshape(-1, 256), y).backward()
        if with_kfac:
            pre.step()
        optimizer.step()

    for _ in range(warmup):
        train(True)
    pre.remove_hooks()  # from here on the step is the model's and AdamW's alone
    damping = float(pre.hyperparameters().damping)
    layers = [layer for layer in pre._roster if layer.active]

    def refresh() -> None:
        for layer in layers:
            for which in ("a", "g"):
                layer.decompose(which, damping)

    return lambda: train(False), refresh, pre


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=30, help="training steps with kaisa first")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=15, help="timed calls per arm and round")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    step, refresh, _ = build(args.warmup)

    def sequential() -> None:
        step()
        refresh()

    def overlapped() -> None:
        worker = threading.Thread(target=refresh)
        worker.start()
        step()
        worker.join()

    arms = {"step": step, "refresh": refresh, "sequential": sequential, "overlapped": overlapped}
    for fn in arms.values():  # warm caches and thread pools
        fn()
    load_before = load_average()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, fn in arms.items():
            times[name].append(_median_ms(fn, args.steps))
    load_after = load_average()
    result = {
        "threads": args.threads,
        "rounds": args.rounds,
        "steps": args.steps,
        "ms": {name: statistics.median(ts) for name, ts in times.items()},
        "rounds_ms": times,
        "overlapped_over_sequential": statistics.median(
            o / s for o, s in zip(times["overlapped"], times["sequential"], strict=True)
        ),
        "load_before": load_before,
        "load_after": load_after,
    }
    for name, ms in result["ms"].items():
        print(f"{name:>11}: {ms:7.1f} ms (rounds {', '.join(f'{t:.1f}' for t in times[name])})")
    print(f"overlapped / sequential: {result['overlapped_over_sequential']:.3f}")
    print(f"load average {load_before} -> {load_after}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
