"""Measure the automatic choice's cost weights (:class:`kaisa.curvature.costs.CostModel`) here.

The automatic curvature choice counts K-FAC's work in multiply-adds and
weighs each kind of it against a multiply-add of the registered layers'
forward and backward passes (a *training* multiply-add): a weight is how
much slower that kind of work runs per multiply-add than training does on
this machine. This script measures the speeds on the suite's GapCNN
(``kaisa.models.build_model('gap_cnn')``, batch 128 of Fashion-MNIST's shape,
random data, channels_last as the suite trains unless ``--contiguous``,
kaisa's default layer handlers), each the median of ``--repeats`` timed calls
after ``--warmup`` untimed ones:

* ``training``: one forward and backward pass of the whole model, counted as
  the registered layers' modelled training work
  (``LayerHandler.training_work``); the unit of every weight;
* ``capture``: every layer's factor products on its own input and output
  gradient (``a_sum`` and ``g_sum``), counted as
  ``LayerHandler.capture_work``;
* ``eigh``: the eigendecomposition of every factor side
  (:func:`kaisa.curvature.linalg.symmetric_eigen`, the captured factors
  themselves), counted as ``n³`` per side; also printed per side size;
* ``cholesky_inverse``: the damped inverse of every factor side
  (:func:`kaisa.curvature.linalg.damped_inverse`), counted as ``n³`` per side;
* ``apply``: the exact solve of every layer's ``(g, a)`` gradient from its
  eigenbases (:func:`kaisa.curvature.linalg.precondition_eigen`, the divisor
  precomputed as the blocks hold it), counted as
  :func:`kaisa.curvature.costs.side_cost` counts it (``2n²`` per column on
  each side).

Each weight is training multiply-adds per ms over that kind's multiply-adds
(or ``n³``) per ms. The script prints the table, the implied
:class:`~kaisa.curvature.costs.CostModel` next to
:data:`~kaisa.curvature.costs.DEFAULT_COST_MODEL`, and with ``--json`` writes
them (``"weights"`` holds the fields it measures; ``operator``, the weight
of a model's operator calls, is fitted to the suite's clock instead and
stays at its default). Pass the result to the choice::

    import json
    from kaisa.curvature.budget import choose_curvature
    from kaisa.curvature.costs import CostModel

    weights = json.load(open("benchmarks/results/cost_weights.json"))["weights"]
    choice = choose_curvature(layers, 0.1, cost_model=CostModel(**weights))

(``KFACPreconditioner`` will take ``cost_model=`` too; until then the
preconditioner uses the default weights.) The weights describe the machine,
its thread count and its libraries, not the model: measure with the threads
(or the GPU, ``--device cuda``) you train with. Where the defaults came
from: ``benchmarks/README.md``, "Cost weights".

The machine's load is printed before and after; nothing else should run.
Nothing is asserted.

    python benchmarks/cost_weights.py --threads 2
    python benchmarks/cost_weights.py --device cuda --json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import add_json_option, load_average, machine_info, set_threads, write_json
from torch import nn

from kaisa.curvature.costs import DEFAULT_COST_MODEL, CostModel, SideSpec, side_cost
from kaisa.curvature.linalg import (
    damped_inverse,
    eigen_outer_inverse,
    precondition_eigen,
    symmetric_eigen,
)
from kaisa.layers.base import LayerHandler
from kaisa.layers.registry import find_layers
from kaisa.models import build_model

RESULTS = Path(__file__).resolve().parent / "results" / "cost_weights.json"
#: Damping added for the Cholesky inverses and the solves (relative to a unit factor).
DAMPING = 0.03


@dataclasses.dataclass
class Layer:
    """One registered layer with what it saw on the measured batch."""

    name: str
    handler: LayerHandler
    x: torch.Tensor | None = None
    grad_output: torch.Tensor | None = None
    a: torch.Tensor | None = None
    g: torch.Tensor | None = None
    rows: int = 0


def median_ms(
    fn: Callable[[], object], sync: Callable[[], None], warmup: int, repeats: int
) -> float:
    """Median wall-clock milliseconds of ``fn`` over ``repeats`` calls (after ``warmup``)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def capture_inputs(model: nn.Module, layers: list[Layer], x: torch.Tensor, y: torch.Tensor) -> None:
    """One forward and backward pass that keeps each layer's input and output gradient."""
    removers = []
    for layer in layers:

        def capture(
            inp: torch.Tensor, output: torch.Tensor, _: object, layer: Layer = layer
        ) -> None:
            layer.x = inp.detach()

            def keep(grad: torch.Tensor) -> None:
                layer.grad_output = grad.detach()

            output.register_hook(keep)

        removers.append(layer.handler.attach(capture))  # type: ignore[arg-type]
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    for remover in removers:
        remover.remove()
    for layer in layers:
        assert layer.x is not None and layer.grad_output is not None, layer.name
        a_sum, rows = layer.handler.a_sum(layer.x)
        g_sum, _ = layer.handler.g_sum(layer.grad_output)
        layer.rows = rows
        # The factors as the running averages hold them, on a unit scale.
        layer.a = a_sum / rows
        layer.g = g_sum / rows


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.manual_seed(0)
    model = build_model("gap_cnn").to(device)
    fmt = torch.contiguous_format if args.contiguous else torch.channels_last
    model = model.to(memory_format=fmt)
    x = torch.randn(args.batch_size, 1, 28, 28, device=device).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (args.batch_size,), device=device)
    layers = [Layer(name, handler) for name, handler in find_layers(model)]
    capture_inputs(model, layers, x, y)
    warmup, repeats = args.warmup, args.repeats

    def train() -> None:
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()

    def captures() -> None:
        for layer in layers:
            assert layer.x is not None and layer.grad_output is not None
            layer.handler.a_sum(layer.x)
            layer.handler.g_sum(layer.grad_output)

    sides = [f for layer in layers for f in (layer.a, layer.g) if f is not None]

    def eighs() -> None:
        for factor in sides:
            symmetric_eigen(factor, factor.dtype)

    def inverses() -> None:
        for factor in sides:
            damped_inverse(factor, DAMPING, factor.dtype)

    solves = []
    for layer in layers:
        assert layer.a is not None and layer.g is not None
        qa, da = symmetric_eigen(layer.a, layer.a.dtype)
        qg, dg = symmetric_eigen(layer.g, layer.g.dtype)
        grad = torch.randn(layer.g.shape[0], layer.a.shape[0], device=device)
        solves.append((grad, qa, qg, eigen_outer_inverse(dg, da, DAMPING)))

    def applies() -> None:
        for grad, qa, qg, outer in solves:
            precondition_eigen(grad, qa, qg, outer_inverse=outer)

    exact = SideSpec("exact")
    work: dict[str, float] = {
        "training": sum(layer.handler.training_work(layer.rows) for layer in layers),
        "capture": sum(
            layer.handler.capture_work("a", "gram", layer.rows)
            + layer.handler.capture_work("g", "gram", layer.rows)
            for layer in layers
        ),
        "eigh": float(sum(f.shape[0] ** 3 for f in sides)),
        "cholesky_inverse": float(sum(f.shape[0] ** 3 for f in sides)),
        "apply": sum(
            side_cost(exact, h.a_size).apply_per_column * h.g_size
            + side_cost(exact, h.g_size).apply_per_column * h.a_size
            for h in (layer.handler for layer in layers)
        ),
    }
    calls: dict[str, Callable[[], object]] = {
        "training": train,
        "capture": captures,
        "eigh": eighs,
        "cholesky_inverse": inverses,
        "apply": applies,
    }
    ms = {kind: median_ms(fn, sync, warmup, repeats) for kind, fn in calls.items()}
    speed = {kind: work[kind] / ms[kind] for kind in work}  # per ms
    # The weights of the kinds timed here; the others (``operator``: a model's operator
    # calls, fitted to the suite's clock) are not speeds this script can measure.
    timed = [f.name for f in dataclasses.fields(CostModel) if f.name in speed]
    weights = {name: speed["training"] / speed[name] for name in timed}
    # The eigendecomposition per side size (equal sizes timed once).
    by_size = {}
    for factor in sides:
        n = factor.shape[0]
        if n not in by_size:
            t = median_ms(lambda f=factor: symmetric_eigen(f, f.dtype), sync, warmup, repeats)
            by_size[n] = {"ms": t, "n3_per_ms": n**3 / t, "weight": speed["training"] * t / n**3}
    return {
        "layers": [
            {
                "name": layer.name,
                "a": layer.handler.a_size,
                "g": layer.handler.g_size,
                "rows": layer.rows,
            }
            for layer in layers
        ],
        "work": work,
        "ms": ms,
        "per_ms": speed,
        "eigh_by_size": by_size,
        "weights": weights,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:k]")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per median")
    parser.add_argument("--contiguous", action="store_true", help="not channels_last")
    add_json_option(parser, RESULTS)
    args = parser.parse_args()
    set_threads(args.threads)
    before = load_average()
    print(f"load before {before}")
    result = measure(args)
    after = load_average()
    print(f"load after  {after}")
    layers = ", ".join(f"{r['name']} ({r['a']}, {r['g']})" for r in result["layers"])
    print(f"GapCNN, batch {args.batch_size}, {args.device}; layers (A, G): {layers}")
    print(f"{'kind':<17} {'work (M)':>10} {'ms':>9} {'M per ms':>9} {'weight':>7} {'default':>8}")
    default = dataclasses.asdict(DEFAULT_COST_MODEL)
    for kind in ("training", "capture", "eigh", "cholesky_inverse", "apply"):
        unit = " n³" if kind in ("eigh", "cholesky_inverse") else ""
        weight = f"{result['weights'][kind]:.3g}" if kind != "training" else "1"
        print(
            f"{kind:<17} {result['work'][kind] / 1e6:>10.1f} {result['ms'][kind]:>9.2f} "
            f"{result['per_ms'][kind] / 1e6:>9.1f} {weight:>7} "
            f"{default.get(kind, 1.0):>8g}{unit}"
        )
    print(
        "eigh per side size: "
        + ", ".join(
            f"{n}: {r['ms']:.3f} ms ({r['weight']:.3g})"
            for n, r in sorted(result["eigh_by_size"].items())
        )
    )
    model = CostModel(**result["weights"])  # the weights not measured here: the defaults
    untimed = [name for name in dataclasses.asdict(model) if name not in result["weights"]]
    print(
        "CostModel("
        + ", ".join(f"{k}={v:.3g}" for k, v in dataclasses.asdict(model).items())
        + ")"
        + (f"; {', '.join(untimed)}: the default, not measured here" if untimed else "")
    )
    if args.json:
        write_json(
            args.json,
            {
                "command": "python benchmarks/cost_weights.py",
                "args": vars(args),
                "machine": machine_info(),
                "load_before": before,
                "load_after": after,
                **result,
                "default_weights": default,
            },
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
