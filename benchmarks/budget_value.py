"""What does a larger ``time_budget`` buy on a model whose step is cheap?

Issue 31 (item 2) says the automatic choice caps K-FAC's work at 10% of the
step "whatever the curvature is worth", so on a cheap-step model (a small
MLP) it keeps little curvature, while spending more per step to save steps
might win. This measures it on such a model: a 784-256-256-10 ReLU MLP on
Fashion-MNIST (batch 128, SGD with momentum 0.9, weight decay 5e-4, constant
learning rate), trained to ``--target`` test accuracy (the full 10 000 test
images, evaluated every ``--eval-every`` steps, off the clock), by

- ``sgd``: SGD alone,
- ``budget-B``: SGD + kaisa with ``time_budget=B`` and every other option at
  its default (``--budgets``; 0.1 is the default),
- ``exact-F/I``: SGD + kaisa with every side exact and factors every ``F``,
  inverses every ``I`` steps (``--exact``; fixed, no budget),
- ``first-input-side``: SGD + kaisa with only the first layer's input side
  held in rank 64 and every other side diagonal, factors every 10, inverses
  every 20 steps (:data:`FIRST_INPUT_SIDE`; chosen by hand after the first
  run showed which side buys the steps: an illustration of what a choice
  judged by value would keep, not a default),
- with ``--first-input-ranks``, ``first-input-rK-F/I``: the same side in
  rank ``K``, every other side diagonal, factors every ``F`` and inverses
  every ``I`` steps (each pair of ``--first-input-intervals``): how little
  of that side buys its steps,
- with ``--per-side``, ``all-diagonal`` (every side diagonal) and, for each
  layer and side, ``only-<layer><A|G>``: that side exact and every other
  diagonal (both at 10/20): what each side buys in steps on its own,
  and with ``--side-gains`` a candidate measure of it computed from the
  factors (:func:`side_gains`),

each at every learning rate of its list, all of a seed's (arm, learning
rate) runs in lockstep (one step of each in turn, so the machine's load
falls on all alike). Per arm and seed the best learning rate is the one with
the least time to target (ties: fewer steps); reported per arm: the median
over seeds of its best steps, ms per step and time to target, and of its
time over SGD's in the same seed. Nothing is asserted. ::

    python benchmarks/budget_value.py --threads 2 --seeds 0,1,2 \\
        --json benchmarks/results/budget_value.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from common import (
    ARM_SUMMARY_HEADERS,
    LoadRecord,
    arm_summaries,
    arm_summary_table,
    best_rate,
    floats,
    format_table,
    machine_info,
    set_threads,
    write_json,
)

import kaisa
from kaisa.demo.data import DEFAULT_DATA_DIR, load_fashion_mnist

SGD_LRS = (0.01, 0.02, 0.05, 0.1)
KAISA_LRS = (0.05, 0.1, 0.2, 0.4)
#: The MLP's registered layers, as kaisa names them (indices in the Sequential).
LAYERS = ("0", "2", "4")
#: The fixed intervals of every arm whose sides are named (not chosen by a budget).
INTERVALS_10_20 = {"factor_update_steps": 10, "inv_update_steps": 20}
#: The one side that buys the steps on this model, found by hand (benchmarks/README.md):
#: the first layer's input side (784 pixels) in rank 64, every other side diagonal.
FIRST_INPUT_SIDE = {
    "curvature": {"^0$": ["lowrank:64", "diagonal"], ".*": "diagonal"},
    **INTERVALS_10_20,
}


@dataclasses.dataclass
class Run:
    """One (arm, learning rate) of a seed, trained step by step in lockstep."""

    arm: str
    lr: float
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    preconditioner: kaisa.KFACPreconditioner | None
    generator: torch.Generator
    seconds: float = 0.0
    steps: int = 0
    hit: int | None = None
    last_accuracy: float = 0.0

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "arm": self.arm,
            "lr": self.lr,
            "steps": self.hit,
            "ran": self.steps,
            "ms_per_step": 1000 * self.seconds / max(self.steps, 1),
            "time": None if self.hit is None else self.seconds,
            "last_accuracy": self.last_accuracy,
        }
        choice = self.preconditioner.curvature_choice if self.preconditioner else None
        if choice is not None:
            out["specs"] = {k: list(v) for k, v in choice.specs.items()}
            out["intervals"] = [choice.factor_update_steps, choice.inv_update_steps]
            out["time_scale"] = choice.time_scale
        return out


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(784, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


def _make_run(arm: str, lr: float, seed: int, kfac: dict[str, Any] | None) -> Run:
    torch.manual_seed(seed)  # the same initial weights for every arm of a seed
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    pre = None if kfac is None else kaisa.KFACPreconditioner(model, optimizer=optimizer, **kfac)
    # The same batches for every arm of a seed.
    return Run(arm, lr, model, optimizer, pre, torch.Generator().manual_seed(seed))


def _first_input(rank: int, factor_steps: int, inv_steps: int) -> dict[str, Any]:
    """The first layer's input side in rank ``rank``, every other side diagonal."""
    return {
        "curvature": {"^0$": [f"lowrank:{rank}", "diagonal"], ".*": "diagonal"},
        "factor_update_steps": factor_steps,
        "inv_update_steps": inv_steps,
    }


def _one_side(layer: str, side: str) -> dict[str, Any]:
    """Every side diagonal but ``side`` ('A' or 'G') of ``layer``, exact; 10/20."""
    pair = ["exact", "diagonal"] if side == "A" else ["diagonal", "exact"]
    return {"curvature": {f"^{layer}$": pair, ".*": "diagonal"}, **INTERVALS_10_20}


def _arms(args: argparse.Namespace) -> list[tuple[str, Any]]:
    arms: list[tuple[str, Any]] = [("sgd", None)]
    arms += [(f"budget-{b:g}", {"time_budget": b}) for b in args.budgets]
    arms += [
        (
            f"exact-{f}/{i}",
            {"curvature": "exact", "factor_update_steps": f, "inv_update_steps": i},
        )
        for f, i in args.exact
    ]
    if args.first_input_side:
        arms.append(("first-input-side", FIRST_INPUT_SIDE))
    arms += [
        (f"first-input-r{k}-{f}/{i}", _first_input(k, f, i))
        for k in args.first_input_ranks
        for f, i in args.first_input_intervals
    ]
    if args.per_side:
        arms.append(("all-diagonal", {"curvature": "diagonal", **INTERVALS_10_20}))
        arms += [(f"only-{la}{side}", _one_side(la, side)) for la in LAYERS for side in "AG"]
    return arms


def _relative(factor: torch.Tensor) -> torch.Tensor:
    return factor / (factor.trace() / factor.shape[0])


def _held(factor: torch.Tensor, kind: str, damping: float) -> torch.Tensor:
    eye = torch.eye(factor.shape[0], dtype=factor.dtype)
    return factor + damping * eye if kind == "exact" else torch.diag(factor.diagonal() + damping)


def _one_step_reduction(
    a: torch.Tensor, g: torch.Tensor, grad: torch.Tensor, kinds: tuple[str, str], damping: float
) -> float:
    """The loss reduction ``(∇·d)² / (2 dᵀ C d)`` of ``d`` at its best scale under ``C = G ⊗ A``.

    ``d`` is the gradient solved with ``A`` and ``G`` held as ``kinds``
    (``'exact'`` or ``'diagonal'``); ``C`` is the exact (damped) Kronecker
    curvature. Float64, each factor divided by its mean eigenvalue.
    """
    a, g = _relative(a), _relative(g)
    held_a, held_g = (_held(f, k, damping) for f, k in zip((a, g), kinds, strict=True))
    d = torch.linalg.solve(held_g, torch.linalg.solve(held_a, grad.t()).t())
    curved = _held(g, "exact", damping) @ d @ _held(a, "exact", damping)
    return float((grad * d).sum() ** 2 / (2 * (d * curved).sum()))


def side_gains(
    data: Any, seed: int, steps: int = 300, damping: float = 0.1, batch_size: int = 128
) -> dict[str, float]:
    """Per side, the one-step reduction with that side exact over that with both diagonal.

    SGD (lr 0.05, momentum 0.9) trains the MLP for ``steps`` steps on the
    seed's batches while each layer's factors are averaged (decay 0.95,
    float64: ``A`` of the inputs with a bias column, ``G`` of the output
    gradients per example); the last batch's gradient is then solved each
    way (:func:`_one_step_reduction`). A candidate for what a side buys,
    computed from the factors and one gradient, to set against the steps the
    ``only-`` arms take.
    """
    torch.manual_seed(seed)
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    layers = {name: model[int(name)] for name in LAYERS}
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture(name: str) -> Any:
        def hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
            ones = torch.ones(inputs[0].shape[0], 1)
            row = torch.cat([inputs[0].detach(), ones], 1).double()
            output.register_hook(lambda grad: seen.__setitem__(name, (row, grad.double())))

        return hook

    for name, layer in layers.items():
        layer.register_forward_hook(capture(name))
    factors: dict[tuple[str, str], torch.Tensor] = {}
    xtr = data.train_x.reshape(data.train_x.shape[0], -1)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, xtr.shape[0], (batch_size,), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(xtr[idx]), data.train_y[idx]).backward()
        for name, (row, out) in seen.items():
            out = out * row.shape[0]  # per example (the loss is a batch mean)
            for side, m in (("A", row), ("G", out)):
                new = m.t() @ m / m.shape[0]
                old = factors.get((name, side))
                factors[name, side] = new if old is None else 0.95 * old + 0.05 * new
        optimizer.step()
    gains = {}
    for name, layer in layers.items():
        assert layer.weight.grad is not None and layer.bias.grad is not None
        grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1).double()
        a, g = factors[name, "A"], factors[name, "G"]
        both = _one_step_reduction(a, g, grad, ("diagonal", "diagonal"), damping)
        for side, kinds in (("A", ("exact", "diagonal")), ("G", ("diagonal", "exact"))):
            gains[f"{name}{side}"] = _one_step_reduction(a, g, grad, kinds, damping) / both
    return gains


def run_seed(args: argparse.Namespace, data: Any, seed: int) -> list[dict[str, Any]]:
    xtr = data.train_x.reshape(data.train_x.shape[0], -1)
    xte = data.test_x.reshape(data.test_x.shape[0], -1)
    runs = [
        _make_run(name, lr, seed, kfac)
        for name, kfac in _arms(args)
        for lr in (SGD_LRS if kfac is None else KAISA_LRS)
    ]
    for step in range(1, args.max_steps + 1):
        live = [r for r in runs if r.hit is None]
        if not live:
            break
        for r in live:
            idx = torch.randint(0, xtr.shape[0], (args.batch_size,), generator=r.generator)
            x, y = xtr[idx], data.train_y[idx]
            start = time.perf_counter()
            r.optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(r.model(x), y).backward()
            if r.preconditioner is not None:
                r.preconditioner.step()
            r.optimizer.step()
            r.seconds += time.perf_counter() - start
            r.steps = step
            if step % args.eval_every == 0:
                with torch.no_grad():
                    pred = r.model(xte).argmax(1)
                r.last_accuracy = (pred == data.test_y).float().mean().item()
                if r.last_accuracy >= args.target:
                    r.hit = step
    return [dict(seed=seed, **r.result()) for r in runs]


def _ranks(text: str) -> list[int]:
    ranks = [int(v) for v in text.split(",") if v]
    # The ranks the first layer's 785-wide input side allows (SideSpec.check_size).
    bad = [k for k in ranks if not 1 <= k <= 785]
    if bad:
        raise argparse.ArgumentTypeError(f"ranks must be in [1, 785]; got {bad}")
    return ranks


def _intervals(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in filter(None, text.split(",")):
        f, _, i = item.partition("/")
        pairs.append((int(f), int(i)))
    return pairs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--budgets", type=floats, default=[0.1, 0.3, 1.0, 3.0])
    p.add_argument("--exact", type=_intervals, default=[(10, 20)], help="F/I,F/I,...")
    p.add_argument(
        "--no-first-input-side",
        dest="first_input_side",
        action="store_false",
        help="leave out the hand-picked arm (FIRST_INPUT_SIDE)",
    )
    p.add_argument(
        "--first-input-ranks",
        type=_ranks,
        default=[],
        help="K,K,...: arms with the first layer's input side in rank K, every other side diagonal",
    )
    p.add_argument(
        "--first-input-intervals",
        type=_intervals,
        default=[(10, 20)],
        help="F/I,F/I,...: the intervals of the --first-input-ranks arms",
    )
    p.add_argument(
        "--per-side",
        action="store_true",
        help="add 'all-diagonal' and, per layer and side, 'only-<layer><A|G>': that side "
        "exact, every other diagonal (10/20): what each side buys in steps",
    )
    p.add_argument(
        "--side-gains",
        action="store_true",
        help="also print side_gains() per seed (a candidate measure of what each side buys)",
    )
    p.add_argument("--target", type=float, default=0.86)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    set_threads(args.threads)
    data = load_fashion_mnist(args.data_dir)

    rows: list[dict[str, Any]] = []
    with LoadRecord() as load:
        for seed in seeds:
            seed_rows = run_seed(args, data, seed)
            rows += seed_rows
            print(f"seed {seed} done ({len(seed_rows)} runs)", flush=True)

    names = [name for name, _ in _arms(args)]
    # Each arm at its fastest rate per seed; time over SGD's (its fastest) seed by seed.
    summary = arm_summaries(names, rows, seeds, by="time")
    best = {
        (n, s): best_rate([r for r in rows if r["arm"] == n and r["seed"] == s], by="time")
        for n in names
        for s in seeds
    }
    table = arm_summary_table(summary, decimals=2)
    for n, line in zip(names, table, strict=True):
        ratios = [
            b["time"] / sgd["time"]
            for b, sgd in ((best[n, s], best["sgd", s]) for s in seeds)
            if b is not None and sgd is not None
        ]
        summary[n]["median_time_over_sgd"] = statistics.median(ratios) if ratios else None
        line.append("-" if not ratios else f"{statistics.median(ratios):.2f}")
    print(
        f"\nMLP 784-256-256-10 on Fashion-MNIST to {args.target:.0%} test accuracy, "
        f"{args.threads} thread(s), seeds {args.seeds}, lockstep, {load.describe()}:"
    )
    print(format_table([*ARM_SUMMARY_HEADERS, "time/SGD"], table))
    gains = {}
    if args.side_gains:
        gains = {seed: side_gains(data, seed) for seed in seeds}
        print("\nOne-step reduction with the side exact over both diagonal (side_gains):")
        print(
            format_table(
                ["side", *(f"seed {s}" for s in seeds)],
                [[k, *(f"{gains[s][k]:.1f}" for s in seeds)] for k in gains[seeds[0]]],
            )
        )
    result = {
        "benchmark": "budget_value",
        "side_gains": gains,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "runs": rows,
        "summary": summary,
        "load": load.as_dict(),
        "machine": machine_info(),
    }
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
