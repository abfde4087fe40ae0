"""``grad_worker_fraction='auto'`` under a memory budget, measured on 4 gloo processes.

Issue 32, item 2: the paper's fixed-memory-budget case on this host. Every
rank (one thread each) holds a copy of a small MLP (by default 64 → 128 →
128 → 128 → 10, ``Tanh`` between) and:

1. builds a preconditioner with ``grad_worker_fraction='auto'`` and a
   ``memory_budget`` halfway between MEM-OPT's and COMM-OPT's modelled memory
   (factors and second-order state, float32): the speeds are probed on the
   process group (no ``KAISA_LINK``), the ranks agree, and the choice is
   recorded with every fraction's modelled memory and time;
2. trains one copy of the model per fraction (every divisor of the world
   size; those over the budget too, for reference), their steps taken in
   turn (fraction after fraction, step after step, so that the load of the
   shared host falls on all alike), each step started together
   (``dist.barrier``, not timed);
3. records per fraction the measured memory (``memory_usage()``: factors +
   second-order state, the largest rank's) against the model and the budget,
   and the step time (the slowest rank's, per step): the whole iteration
   and ``preconditioner.step()`` alone (what the model models), mean and
   median over the steps after the first.

The host is shared with other work: the load average is recorded before and
after, and times are indicative only (4 single-thread processes on however
many cores the host lends). Nothing is asserted on time; the report says
whether the chosen fraction's measured time was the lowest of those that fit.

Examples::

    python benchmarks/fraction_auto.py --json   # benchmarks/results/fraction_auto.json
    python benchmarks/fraction_auto.py --steps 60 --width 192
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import LoadRecord, add_json_option, format_table, machine_info, write_json
from torch import nn

import kaisa
from kaisa.cli.shapes import module_layer_shapes
from kaisa.distributed.fraction import DEFAULT_LINK, FractionModel, format_bytes

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent / "tests" / "distributed"))
from harness import run_distributed  # noqa: E402

DEFAULT_JSON = _HERE / "results" / "fraction_auto.json"
WORLD = 4
OPTIONS: dict[str, Any] = {"curvature": "exact", "lr": 0.1, "damping": 0.003, "kl_clip": 0.001}


def _model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, 10),
    )


def _budget(width: int, settings: dict[str, Any]) -> tuple[int, dict[int, int]]:
    """Halfway between MEM-OPT's and COMM-OPT's modelled memory, and every fraction's."""
    model = FractionModel(
        factor_update_steps=settings["factor_every"], inv_update_steps=settings["inv_every"]
    )
    shapes = module_layer_shapes(_model(width))
    memory = {
        p.grad_workers: model.cost(p, DEFAULT_LINK).memory_bytes for p in model.plans(shapes, WORLD)
    }
    return (memory[1] + memory[WORLD]) // 2, memory


def _worker(rank: int, world_size: int, settings: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    width, budget = settings["width"], settings["budget"]
    schedule = {
        "factor_update_steps": settings["factor_every"],
        "inv_update_steps": settings["inv_every"],
    }
    probe_model = _model(width)
    auto = kaisa.KFACPreconditioner(
        probe_model, grad_worker_fraction="auto", memory_budget=budget, **schedule, **OPTIONS
    )
    choice = auto.grad_worker_choice
    auto.remove_hooks()
    runs = []
    for cost in choice.costs:
        model = copy.deepcopy(probe_model)
        pre = kaisa.KFACPreconditioner(
            model, grad_worker_fraction=cost.grad_workers / world_size, **schedule, **OPTIONS
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        runs.append({"m": cost.grad_workers, "model": model, "pre": pre, "opt": optimizer})
    gen = torch.Generator().manual_seed(1000 + rank)
    times: dict[int, list[tuple[float, float]]] = {r["m"]: [] for r in runs}
    for _ in range(settings["steps"]):
        x = torch.randn(settings["batch"], 64, generator=gen)
        y = torch.randint(0, 10, (settings["batch"],), generator=gen)
        for run in runs:
            dist.barrier()
            start = time.perf_counter()
            run["opt"].zero_grad(set_to_none=True)
            nn.functional.cross_entropy(run["model"](x), y).backward()
            for p in run["model"].parameters():  # DDP's averaging, by hand
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)
            before_step = time.perf_counter()
            run["pre"].step()
            after_step = time.perf_counter()
            run["opt"].step()
            times[run["m"]].append((time.perf_counter() - start, after_step - before_step))
    memory = {}
    for run in runs:
        usage = run["pre"].memory_usage()
        memory[run["m"]] = usage["factors"] + usage["second_order"]
        run["pre"].remove_hooks()
    assert choice.link is not None
    return {
        "chosen": choice.grad_workers,
        "boundary": choice.boundary,
        "link": choice.link.to_dict(),
        "budget": choice.memory_budget,
        "costs": [c.to_dict() for c in choice.costs],
        "times": times,
        "memory": memory,
    }


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "median": statistics.median(values)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--width", type=int, default=128, help="hidden width of the MLP")
    p.add_argument("--batch", type=int, default=32, help="local batch per rank")
    p.add_argument("--steps", type=int, default=41, help="steps per fraction (the first untimed)")
    p.add_argument("--factor-every", type=int, default=2, help="factor_update_steps")
    p.add_argument("--inv-every", type=int, default=10, help="inv_update_steps")
    p.add_argument("--timeout", type=float, default=480.0, help="seconds for the whole run")
    add_json_option(p, DEFAULT_JSON)
    args = p.parse_args(argv)
    settings: dict[str, Any] = {
        "width": args.width,
        "batch": args.batch,
        "steps": args.steps,
        "factor_every": args.factor_every,
        "inv_every": args.inv_every,
    }
    budget, modelled_memory = _budget(args.width, settings)
    settings["budget"] = budget
    print(
        f"{WORLD} gloo processes, one thread each; MLP width {args.width}, local batch "
        f"{args.batch}; factors every {args.factor_every}, inverses every {args.inv_every} "
        f"steps; memory_budget {budget} bytes ({format_bytes(budget)}), halfway between "
        f"MEM-OPT's {modelled_memory[1]} and COMM-OPT's {modelled_memory[WORLD]}",
        flush=True,
    )
    with LoadRecord() as load:
        results = run_distributed(_worker, WORLD, settings, timeout=args.timeout)
    first = results[0]
    assert all(r["chosen"] == first["chosen"] and r["link"] == first["link"] for r in results)
    rows, fractions = [], []
    for cost in first["costs"]:
        m = cost["grad_workers"]
        steps = [
            tuple(max(r["times"][m][i][k] for r in results) for k in (0, 1))
            for i in range(1, args.steps)
        ]
        measured_memory = max(r["memory"][m] for r in results)
        entry = {
            "grad_workers": m,
            "strategy": cost["strategy"],
            "fits": cost["memory_bytes"] <= budget,
            "chosen": m == first["chosen"],
            "modelled_memory_bytes": cost["memory_bytes"],
            "measured_memory_bytes": measured_memory,
            "modelled_seconds_per_step": cost["time_s"],
            "modelled_seconds": cost["seconds"],
            "iteration_seconds": _stats([s[0] for s in steps]),
            "preconditioner_step_seconds": _stats([s[1] for s in steps]),
        }
        fractions.append(entry)
        rows.append(
            [
                m,
                cost["strategy"],
                "yes" if entry["fits"] else "no",
                "<-" if entry["chosen"] else "",
                measured_memory,
                cost["memory_bytes"],
                f"{cost['time_s'] * 1e3:.3g}",
                f"{entry['preconditioner_step_seconds']['mean'] * 1e3:.3g}",
                f"{entry['iteration_seconds']['mean'] * 1e3:.3g}",
                f"{entry['iteration_seconds']['median'] * 1e3:.3g}",
            ]
        )
    print(
        format_table(
            [
                "m",
                "strategy",
                "fits",
                "auto",
                "memory B",
                "model B",
                "model ms",
                "step() ms",
                "iter ms mean",
                "iter ms median",
            ],
            rows,
            title=f"probed (rounded): latency {first['link']['latency_s'] * 1e6:.3g} us, "
            f"bandwidth {first['link']['bandwidth'] / 1e9:.3g} GB/s, compute "
            f"{first['link']['compute_rate']:.3g} multiply-adds/s",
        )
    )
    fitting = [f for f in fractions if f["fits"]]
    chosen = next(f for f in fractions if f["chosen"])
    fastest = min(fitting, key=lambda f: f["iteration_seconds"]["mean"])
    within = chosen["measured_memory_bytes"] <= budget
    print(
        f"chosen m={chosen['grad_workers']}: measured memory {chosen['measured_memory_bytes']} "
        f"bytes, {'within' if within else 'OVER'} the budget {budget}; the fastest measured of "
        f"the fractions that fit is m={fastest['grad_workers']} "
        f"({'the chosen one' if fastest is chosen else 'not the chosen one'}); {load.describe()}"
    )
    if args.json:
        write_json(
            args.json,
            {
                "command": "python benchmarks/fraction_auto.py " + " ".join(argv or sys.argv[1:]),
                "machine": machine_info(),
                "load": load.as_dict(),
                "settings": settings,
                "world_size": WORLD,
                "link_rounded": first["link"],
                "boundary": first["boundary"],
                "chosen_grad_workers": first["chosen"],
                "chosen_within_budget": within,
                "fastest_fitting_grad_workers": fastest["grad_workers"],
                "fractions": fractions,
            },
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
