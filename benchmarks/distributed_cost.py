"""KAISA's cost model at simulated world sizes: memory per rank and traffic per step.

For a ResNet (ResNet-20 from ``kaisa.models``, ResNet-50 shapes) and a
Transformer (the small ``kaisa.models`` transformer, BERT-Large shapes), at
world sizes 2, 4, 8, ..., 1024, for MEM-OPT (``f = 1/N``), HYBRID-OPT
(``f = 1/2``) and COMM-OPT (``f = 1``), the cost model of spec §5
(``kaisa.distributed.cost``) gives per rank:

* memory in MB of float32 (10⁶ bytes): the Kronecker factors (the same on
  every rank) and the second-order state (max over the ranks), and their sum;
* elements sent: factor all-reduce per factor update, inverse broadcast per
  inverse update (max over the ranks), gradient broadcast per step, and the
  average per step given the update intervals (max over the ranks);
* the load imbalance, the largest rank's decomposition cost (``n³``) over the
  mean.

Nothing runs distributed here: the plan is a pure function of the layer shapes,
so these are the model's predictions, not measurements (those come from gloo
processes and ``kaisa.Telemetry``). The time to compute each plan and its
summary is recorded too.

Examples::

    python benchmarks/distributed_cost.py
    python benchmarks/distributed_cost.py --models resnet50,bert-large --max-world-size 4096
    python benchmarks/distributed_cost.py --json        # benchmarks/results/distributed_cost.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common import add_json_option, format_table, write_json

from kaisa.choices import ComputeMethod
from kaisa.cli.shapes import module_layer_shapes
from kaisa.distributed.cost import summarize
from kaisa.distributed.layer_shapes import bert_large_shapes, resnet50_shapes
from kaisa.distributed.plan import LayerShape, make_plan

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "distributed_cost.json"
FRACTIONS = (("mem-opt", "mem-opt"), ("hybrid-opt", 0.5), ("comm-opt", 1.0))
MB = 4 / 1e6  # float32


def _kaisa_model(name: str) -> Callable[[], list[LayerShape]]:
    def build() -> list[LayerShape]:
        from kaisa.models import build_model

        return module_layer_shapes(build_model(name))

    return build


MODELS: dict[str, tuple[str, Callable[[], list[LayerShape]]]] = {
    "resnet20": ("ResNet-20 (kaisa.models, CIFAR)", _kaisa_model("resnet20")),
    "resnet50": ("ResNet-50 (ImageNet shapes)", resnet50_shapes),
    "transformer": ("small transformer (kaisa.models)", _kaisa_model("transformer")),
    "bert-large": ("BERT-Large (shapes, with pooler)", bert_large_shapes),
}


def _elements(x: float) -> str:
    """Millions of elements, 4 significant digits."""
    return f"{x / 1e6:.4g}"


def run_model(
    name: str,
    layers: Sequence[LayerShape],
    world_sizes: Sequence[int],
    factor_update_steps: int,
    inv_update_steps: int,
    compute_method: ComputeMethod,
    symmetry_aware: bool,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n in world_sizes:
        for label, fraction in FRACTIONS:
            start = time.perf_counter()
            plan = make_plan(layers, n, fraction)
            summary = summarize(
                plan,
                compute_method=compute_method,
                symmetry_aware=symmetry_aware,
                factor_update_steps=factor_update_steps,
                inv_update_steps=inv_update_steps,
            )
            seconds = time.perf_counter() - start
            rows.append(
                {
                    "model": name,
                    "world_size": n,
                    "fraction_name": label,
                    "plan_seconds": seconds,
                    **summary.to_dict(),
                }
            )
    return rows


def _table(title: str, rows: Sequence[dict[str, Any]]) -> str:
    headers = [
        "N",
        "fraction",
        "m",
        "factors MB",
        "2nd max MB",
        "total max MB",
        "AR/fu Mel",
        "inv bc max Mel",
        "grad bc Mel",
        "avg/step max Mel",
        "imbalance",
        "plan ms",
    ]
    body = []
    for r in rows:
        mem, sent = r["memory_elements"], r["elements_sent"]
        body.append(
            [
                r["world_size"],
                r["fraction_name"],
                r["grad_workers"],
                f"{mem['factors']['max'] * MB:.1f}",
                f"{mem['second_order']['max'] * MB:.1f}",
                f"{mem['total']['max'] * MB:.1f}",
                _elements(sent["factor_allreduce_per_factor_update"]["max"]),
                _elements(sent["inverse_broadcast_per_inverse_update"]["max"]),
                _elements(sent["grad_broadcast_per_step"]["max"]),
                _elements(sent["average_per_step"]["max"]),
                f"{r['imbalance']:.2f}",
                f"{r['plan_seconds'] * 1e3:.1f}",
            ]
        )
    return format_table(headers, body, title=title)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated, from {', '.join(MODELS)} (default: all)",
    )
    p.add_argument("--max-world-size", type=int, default=1024, help="largest power of two")
    p.add_argument("--factor-update-steps", type=int, default=10)
    p.add_argument("--inv-update-steps", type=int, default=100)
    p.add_argument("--compute-method", choices=("eigen", "inverse"), default="eigen")
    p.add_argument("--symmetry-aware", action="store_true")
    add_json_option(p, DEFAULT_JSON)
    args = p.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if args.max_world_size < 2:
        p.error("--max-world-size must be at least 2")
    world_sizes = [
        2**k for k in range(1, args.max_world_size.bit_length()) if 2**k <= args.max_world_size
    ]

    print(
        f"cost model per rank; factor_update_steps={args.factor_update_steps}, "
        f"inv_update_steps={args.inv_update_steps}, compute_method={args.compute_method!r}, "
        f"symmetry_aware={args.symmetry_aware}; MB of float32 (10^6 bytes); "
        "Mel = 10^6 elements; AR/fu = factor all-reduce per factor update; inv bc = inverse "
        "broadcast per inverse update; grad bc = gradient broadcast per step"
    )
    results: dict[str, Any] = {
        "settings": {
            "factor_update_steps": args.factor_update_steps,
            "inv_update_steps": args.inv_update_steps,
            "compute_method": args.compute_method,
            "symmetry_aware": args.symmetry_aware,
            "assignment_strategy": "compute",
            "colocate_factors": True,
            "bytes_per_element": 4,
        },
        "models": {},
    }
    for name in names:
        title, build = MODELS[name]
        try:
            layers = build()
        except ImportError as exc:  # kaisa.models missing
            print(f"\n{title}: skipped ({exc})")
            continue
        rows = run_model(
            name,
            layers,
            world_sizes,
            args.factor_update_steps,
            args.inv_update_steps,
            args.compute_method,
            args.symmetry_aware,
        )
        print()
        print(_table(f"{title}: {len(layers)} K-FAC layers", rows))
        results["models"][name] = {"title": title, "num_layers": len(layers), "rows": rows}
    if args.json:
        write_json(args.json, results)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
