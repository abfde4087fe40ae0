"""``kaisa plan``: the KAISA work plan and cost model for a model and a world size.

For each gradient-worker fraction it prints the memory each rank holds
(Kronecker factors and second-order state, max and mean over the ranks), the
elements each rank sends by kind, their average per step, and the load
imbalance (the largest rank's decomposition cost over the mean). Nothing is
started: the plan is a pure function of the layer shapes, so any world size
can be examined before renting machines. ResNet-50 and BERT shapes are
written down (no torch import); the networks of ``kaisa.models`` are built
on the CPU to read their shapes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from fractions import Fraction
from typing import NoReturn, cast

from kaisa.choices import (
    ASSIGNMENT_STRATEGIES,
    COMPUTE_METHODS,
    NAMED_FRACTIONS,
    AssignmentStrategy,
    ComputeMethod,
)
from kaisa.cli.shapes import module_layer_shapes
from kaisa.curvature.costs import SideSpec
from kaisa.distributed.cost import CostSummary, summarize
from kaisa.distributed.fraction import (
    DEFAULT_LINK,
    FractionChoice,
    FractionCost,
    FractionModel,
    Link,
    choose_stable,
    format_bytes,
    parse_bytes,
)
from kaisa.distributed.layer_shapes import SHAPE_MODELS
from kaisa.distributed.plan import (
    FractionSpec,
    LayerShape,
    WorkPlan,
    make_plan,
    resolve_grad_workers,
)
from kaisa.validation import check_count

__all__ = ["default_grad_workers", "main", "model_shapes", "parse_fraction"]

_PROG = "kaisa plan"
_BYTES_PER_ELEMENT = 4  # float32
_MAX_DEFAULT_ROWS = 12
#: The largest ``--world-size``: the plan places every layer on a rank and the
#: cost model sums each rank's share, so the work grows with the world size
#: (2^16 ranks take about 15 s for ResNet-50; 10^9 would exhaust the memory).
MAX_WORLD_SIZE = 65536


class _UsageError(Exception):
    """A bad command line; reported as one line and exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def parse_fraction(text: str) -> FractionSpec:
    """A ``--fraction`` value: a name ('mem-opt', ...), a float, or ``p/q``."""
    key = text.strip().lower()
    if key in NAMED_FRACTIONS:
        return key
    try:
        value = float(Fraction(key))
    except (ValueError, ZeroDivisionError):
        raise _UsageError(
            f"argument --fraction: expected a number in [0, 1], a ratio such as 1/4, or one of "
            f"'comm-opt', 'hybrid-opt', 'mem-opt'; got {text!r}"
        ) from None
    return value


def default_grad_workers(world_size: int) -> list[int]:
    """Gradient workers per layer to show when no ``--fraction`` is given.

    Every divisor of the world size when there are at most 12; otherwise
    MEM-OPT (1), HYBRID-OPT (N/2), COMM-OPT (N) and divisors spread evenly
    on a log scale in between.
    """
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    if len(divisors) <= _MAX_DEFAULT_ROWS:
        return divisors
    chosen = {1, world_size}
    if world_size % 2 == 0:
        chosen.add(world_size // 2)
    slots = _MAX_DEFAULT_ROWS - len(chosen)
    for k in range(1, slots + 1):
        target = world_size ** (k / (slots + 1))
        chosen.add(min(divisors, key=lambda d: (abs(d / target - 1), d)))
    return sorted(chosen)


def _raised(error: BaseException) -> str:
    """``'KeyError: 'x''`` for an exception (just its type when it has no message)."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _user_model(spec: str) -> list[LayerShape]:
    """Layer shapes of the model ``factory()`` returns, for ``--model package.module:factory``."""
    import importlib

    import torch.nn as nn

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise _UsageError(f"argument --model: expected package.module:factory; got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # not found, or the module's own code failed at import
        raise _UsageError(
            f"argument --model: cannot import {module_name!r}: {_raised(error)}"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise _UsageError(f"argument --model: {module_name!r} has no callable {attr!r}")
    try:
        model = factory()
    except (Exception, SystemExit) as error:  # the user's code: report it on one line
        raise _UsageError(f"argument --model: {spec}() raised {_raised(error)}") from None
    if not isinstance(model, nn.Module):
        raise _UsageError(
            f"argument --model: {spec}() returned {type(model).__name__}, not a torch.nn.Module"
        )
    try:
        shapes = module_layer_shapes(model)
    except Exception as error:
        raise _UsageError(
            f"argument --model: reading the layers of {spec}()'s model raised {_raised(error)}"
        ) from None
    if not shapes:
        raise _UsageError(f"argument --model: {spec}() has no layer kaisa can precondition")
    return shapes


def split_stages(shapes: Sequence[LayerShape], stages: int) -> list[list[LayerShape]]:
    """``shapes`` in ``stages`` contiguous runs of nearly equal weight elements.

    How a pipeline would cut the model if it balanced parameters; each run
    is one stage's layers, planned over that stage's data-parallel group.
    """
    if stages > len(shapes):
        raise _UsageError(
            f"argument --pipeline-stages: {stages} stages but the model has {len(shapes)} "
            "K-FAC layers"
        )
    prefix = list(itertools.accumulate(s.a_size * s.g_size for s in shapes))
    runs: list[list[LayerShape]] = []
    begin = 0
    for k in range(stages - 1):
        target = prefix[-1] * (k + 1) / stages
        # The first layer at which the cut reaches its share, leaving a layer per later stage.
        end = next(i + 1 for i in range(begin, len(shapes)) if prefix[i] >= target)
        end = max(begin + 1, min(end, len(shapes) - (stages - 1 - k)))
        runs.append(list(shapes[begin:end]))
        begin = end
    runs.append(list(shapes[begin:]))
    return runs


def model_shapes(name: str) -> list[LayerShape]:
    """Layer shapes of ``name``: written down, from ``kaisa.models``, or ``module:factory``."""
    if name in SHAPE_MODELS:
        return SHAPE_MODELS[name]()
    if ":" in name:
        return _user_model(name)
    try:
        import kaisa.models as models
    except ImportError:
        model_names: tuple[str, ...] = ()
    else:
        model_names = models.MODEL_NAMES
        if name in model_names:
            return module_layer_shapes(models.build_model(name))
    allowed = ", ".join([*SHAPE_MODELS, *model_names])
    raise _UsageError(f"argument --model: unknown model {name!r}; choose from {allowed}")


def _parser() -> _Parser:
    p = _Parser(
        prog=_PROG,
        description=(
            "Print the KAISA work plan and cost model for a model and a world size: memory "
            "per rank, elements sent per step by kind, and the load imbalance, for each "
            "gradient-worker fraction. Memory is in MB (10^6 bytes) of float32; traffic is "
            "in elements per rank."
        ),
    )
    p.add_argument(
        "--model",
        default="resnet50",
        help="resnet50, bert-large, bert-base, a kaisa.models name such as resnet20, "
        "resnet32, small_cnn, gap_cnn, transformer, or your own model as "
        "package.module:factory (a function returning the nn.Module; default: resnet50)",
    )
    p.add_argument("--world-size", type=int, required=True, metavar="N", help="number of ranks")
    p.add_argument(
        "--pipeline-stages",
        type=int,
        default=1,
        metavar="S",
        help="split the layers into S contiguous pipeline stages of about equal weight "
        "elements; each stage is planned over its data-parallel group of N/S ranks "
        "(process_group=), fractions resolved against N/S (default: 1)",
    )
    p.add_argument(
        "--fraction",
        action="append",
        type=str,
        metavar="F",
        help="gradient-worker fraction: a number in [0, 1] (0 means 1/N), a ratio such as "
        "1/4, or comm-opt, hybrid-opt, mem-opt; repeatable (default: every fraction the world "
        "size allows if there are few, otherwise a spread from mem-opt to comm-opt)",
    )
    p.add_argument(
        "--assignment-strategy",
        choices=ASSIGNMENT_STRATEGIES,
        default="compute",
        help="balance decomposition time (n^3) or memory (n^2) (default: compute)",
    )
    p.add_argument(
        "--no-colocate",
        dest="colocate",
        action="store_false",
        help="let different ranks decompose a layer's A and G",
    )
    p.add_argument(
        "--symmetry-aware",
        action="store_true",
        help="all-reduce only the upper triangles of the factors",
    )
    p.add_argument("--compute-method", choices=COMPUTE_METHODS, default="eigen")
    p.add_argument(
        "--no-eigen-outer-product",
        dest="eigen_outer_product",
        action="store_false",
        help="do not keep the precomputed eigenvalue outer product (eigen method)",
    )
    p.add_argument(
        "--curvature",
        default=None,
        metavar="SPEC",
        help="how every layer's factors are held: exact, lowrank:K, kvec or diagonal, or a "
        "pair A,G such as lowrank:64,exact (a rank above a factor's side is cut to the side); "
        "a training run chooses per layer with curvature='auto' (default: exact, except a "
        "side the layer kind fixes, such as an embedding's diagonal A)",
    )
    p.add_argument("--factor-update-steps", type=int, default=10, metavar="K")
    p.add_argument("--inv-update-steps", type=int, default=100, metavar="K")
    p.add_argument(
        "--show-plan",
        nargs="?",
        const="",
        default=None,
        metavar="F",
        help="also print the per-layer placement for fraction F (default: the first listed)",
    )
    p.add_argument(
        "--memory-budget",
        default=None,
        metavar="BYTES",
        help="bytes per rank for factors and second-order state (e.g. 2GiB, 512MB, 3e9): "
        "also print which fractions fit, each one's modelled time per step, and the one "
        "grad_worker_fraction='auto' would choose (the fastest that fits)",
    )
    p.add_argument(
        "--link",
        default=None,
        metavar="SPEC",
        help="the speeds of the time model, latency=SECONDS,bandwidth=BYTES_PER_S,"
        "compute=MULTIPLY_ADDS_PER_S, rounded to powers of two as a training run rounds its "
        "probe (default: latency=2e-5,bandwidth=1e10,compute=1e13, an assumed GPU cluster; "
        "a training run measures its own)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def _fraction_label(m: int, n: int) -> str:
    f = Fraction(m, n)
    return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"


def _human(x: float) -> str:
    """Compact count: 1234567 -> '1.23M'."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}" if x != int(x) else str(int(x))


def _tables(summaries: Sequence[CostSummary]) -> str:
    mb = _BYTES_PER_ELEMENT / 1e6
    mem_head = (
        f"{'m':>6} {'fraction':>9} {'strategy':<10} | {'factors':>9} {'2nd max':>9} "
        f"{'2nd mean':>9} {'total max':>10}"
    )
    comm_head = (
        f"{'m':>6} {'fraction':>9} | {'factor AR':>9} {'inv bc max':>10} {'inv bc mean':>11} "
        f"{'grad bc':>9} | {'avg/step max':>12} {'avg/step mean':>13} | {'imbalance':>9}"
    )
    lines = ["memory per rank, MB of float32", mem_head, "-" * len(mem_head)]
    for s in summaries:
        lines.append(
            f"{s.grad_workers:>6} {_fraction_label(s.grad_workers, s.world_size):>9} "
            f"{s.strategy_name:<10} | {s.factors.max * mb:>9.2f} {s.second_order.max * mb:>9.2f} "
            f"{s.second_order.mean * mb:>9.2f} {s.memory_total.max * mb:>10.2f}"
        )
    lines += [
        "",
        "elements sent per rank: factor all-reduce per factor update, inverse broadcast per "
        "inverse update, gradient broadcast per step; average per step",
        comm_head,
        "-" * len(comm_head),
    ]
    for s in summaries:
        lines.append(
            f"{s.grad_workers:>6} {_fraction_label(s.grad_workers, s.world_size):>9} | "
            f"{_human(s.factor_allreduce.max):>9} {_human(s.inverse_broadcast.max):>10} "
            f"{_human(s.inverse_broadcast.mean):>11} {_human(s.grad_broadcast.max):>9} | "
            f"{_human(s.per_step.max):>12} {_human(s.per_step.mean):>13} | "
            f"{s.imbalance:>9.2f}"
        )
    return "\n".join(lines)


def _plan_json(plan: WorkPlan) -> dict[str, object]:
    return {
        "world_size": plan.world_size,
        "grad_workers": plan.grad_workers,
        "num_columns": plan.num_columns,
        "layers": [
            {
                "name": la.name,
                "a_size": la.a_size,
                "g_size": la.g_size,
                "a_spec": la.a_spec,
                "g_spec": la.g_spec,
                "column": la.column,
                "a_rank": la.a_rank,
                "g_rank": la.g_rank,
            }
            for la in plan.layers
        ],
    }


def _with_curvature(shapes: list[LayerShape], text: str | None) -> list[LayerShape]:
    """``shapes`` with ``--curvature``'s representations (a low rank capped at each side).

    Without ``--curvature`` the shapes keep theirs (exact, or their layer kind's).
    """
    if text is None:
        return shapes
    parts = [part.strip() for part in text.split(",")]
    if len(parts) not in (1, 2):
        raise _UsageError(f"argument --curvature: one representation or a pair A,G; got {text!r}")
    try:
        specs = [SideSpec.parse(part) for part in parts]
    except ValueError as error:
        raise _UsageError(f"argument --curvature: {error}") from None
    a_spec, g_spec = specs[0], specs[-1]

    def capped(spec: SideSpec, n: int) -> str:
        if spec.kind == "lowrank" and spec.rank is not None and spec.rank > n:
            return "exact"
        return str(spec)

    return [
        LayerShape(s.name, s.a_size, s.g_size, capped(a_spec, s.a_size), capped(g_spec, s.g_size))
        for s in shapes
    ]


def _at_least_one(flag: str, value: int) -> int:
    """``value`` if it is ``>= 1``; else the usage error ``argument FLAG: must be ...``."""
    try:
        return check_count(value, f"argument {flag}:", 1)
    except ValueError as error:
        raise _UsageError(str(error)) from None


def _budget_choice(
    run: Sequence[LayerShape], n: int, budget: int, link: Link, args: argparse.Namespace
) -> FractionChoice:
    """What ``grad_worker_fraction='auto'`` chooses for ``run`` on ``n`` ranks (float32)."""
    model = FractionModel(
        compute_method=args.compute_method,
        eigen_outer_product=args.eigen_outer_product,
        symmetry_aware=args.symmetry_aware,
        assignment_strategy=args.assignment_strategy,
        colocate_factors=args.colocate,
        factor_update_steps=args.factor_update_steps,
        inv_update_steps=args.inv_update_steps,
    )
    return choose_stable(run, n, link, budget, model)


def _budget_table(choice: FractionChoice, shown: Sequence[int]) -> str:
    """Each shown fraction (and the chosen one) with its memory, fit and modelled time."""
    budget = choice.memory_budget or 0.0
    assert choice.link is not None
    head = (
        f"{'m':>6} {'fraction':>9} {'strategy':<10} | {'memory/rank':>11} {'fits':>4} | "
        f"{'ms/step':>9} {'AR':>8} {'decomp':>8} {'inv bc':>8} {'precond':>8} {'grad bc':>8}"
    )
    lines = [
        f"memory budget {format_bytes(budget)} per rank: modelled time per step (ms; factor "
        f"all-reduce, decompositions, inverse broadcast, preconditioning, gradient broadcast) "
        f"at {choice.link.describe()}",
        head,
        "-" * len(head),
    ]
    rows = sorted(set(shown) | {1, choice.world_size, choice.grad_workers})
    for c in choice.costs:
        if c.grad_workers not in rows:
            continue
        parts = " ".join(f"{c.seconds[k] * 1e3:>8.3g}" for k in c.seconds)
        mark = "  <- chosen" if c.grad_workers == choice.grad_workers else ""
        lines.append(
            f"{c.grad_workers:>6} {_fraction_label(c.grad_workers, c.world_size):>9} "
            f"{c.strategy_name:<10} | {format_bytes(c.memory_bytes):>11} "
            f"{'yes' if c.memory_bytes <= budget else 'no':>4} | {c.time_s * 1e3:>9.4g} "
            f"{parts}{mark}"
        )
    chosen = choice.cost_of(choice.grad_workers)
    comm, mem = choice.cost_of(choice.world_size), choice.cost_of(1)
    assert chosen is not None and comm is not None and mem is not None

    def brief(cost: FractionCost) -> str:
        fits = "fits" if cost.memory_bytes <= budget else "does not fit"
        return f"{format_bytes(cost.memory_bytes)}, {cost.time_s * 1e3:.4g} ms/step ({fits})"

    lines.append(
        f"grad_worker_fraction='auto' chooses m={chosen.grad_workers} (fraction "
        f"{_fraction_label(chosen.grad_workers, chosen.world_size)}, {chosen.strategy_name}): "
        f"{brief(chosen)}; COMM-OPT: {brief(comm)}; MEM-OPT: {brief(mem)}"
        + ("; a speed lay at a rounding boundary" if choice.boundary else "")
    )
    return "\n".join(lines)


def _run(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    n = _at_least_one("--world-size", args.world_size)
    if n > MAX_WORLD_SIZE:
        raise _UsageError(
            f"argument --world-size: at most {MAX_WORLD_SIZE} ranks (the plan places work on "
            f"every rank, so its cost grows with the world size); got {n}"
        )
    for opt in ("factor_update_steps", "inv_update_steps"):
        _at_least_one("--" + opt.replace("_", "-"), getattr(args, opt))

    stages: int = args.pipeline_stages
    if stages < 1 or n % stages:
        raise _UsageError(
            f"argument --pipeline-stages: must be a positive divisor of --world-size {n}, "
            f"got {stages}"
        )
    world = n
    n //= stages  # each stage's data-parallel group
    shapes = _with_curvature(model_shapes(args.model), args.curvature)
    if args.fraction:
        ms: list[int] = []
        for text in args.fraction:
            m = resolve_grad_workers(parse_fraction(text), n)
            if m not in ms:
                ms.append(m)
    else:
        ms = default_grad_workers(n)
    show_m: int | None = None
    if args.show_plan is not None:
        show_m = (
            resolve_grad_workers(parse_fraction(args.show_plan), n) if args.show_plan else ms[0]
        )

    budget: int | None = None
    if args.memory_budget is not None:
        try:
            budget = parse_bytes(args.memory_budget, "argument --memory-budget:")
        except (TypeError, ValueError) as error:
            raise _UsageError(str(error)) from None
    try:
        link = Link.parse(args.link, "argument --link") if args.link else DEFAULT_LINK
    except ValueError as error:
        raise _UsageError(str(error)) from None
    strategy = cast(AssignmentStrategy, args.assignment_strategy)
    method = cast(ComputeMethod, args.compute_method)
    runs = split_stages(shapes, stages) if stages > 1 else [shapes]
    stage_plans: list[dict[int, WorkPlan]] = []
    stage_summaries: list[list[CostSummary]] = []
    stage_choices: list[FractionChoice | None] = []
    for run in runs:
        stage_choices.append(None if budget is None else _budget_choice(run, n, budget, link, args))
        plans: dict[int, WorkPlan] = {
            m: make_plan(run, n, m / n, strategy, args.colocate)
            for m in sorted(set(ms) | ({show_m} if show_m is not None else set()))
        }
        stage_plans.append(plans)
        stage_summaries.append(
            [
                summarize(
                    plans[m],
                    compute_method=method,
                    eigen_outer_product=args.eigen_outer_product,
                    symmetry_aware=args.symmetry_aware,
                    factor_update_steps=args.factor_update_steps,
                    inv_update_steps=args.inv_update_steps,
                )
                for m in ms
            ]
        )

    settings: dict[str, object] = {
        "model": args.model,
        "num_layers": len(shapes),
        "world_size": n,
        "assignment_strategy": strategy,
        "colocate_factors": args.colocate,
        "compute_method": method,
        "eigen_outer_product": args.eigen_outer_product,
        "symmetry_aware": args.symmetry_aware,
        "curvature": args.curvature,
        "factor_update_steps": args.factor_update_steps,
        "inv_update_steps": args.inv_update_steps,
    }
    if budget is not None:
        settings.update(memory_budget=budget, link=link.to_dict())
    if stages > 1:
        settings.update(world_size=world, pipeline_stages=stages, data_parallel_size=n)
    if args.json:
        out: dict[str, object] = dict(settings)
        parts: list[dict[str, object]] = []
        for run, plans, summaries, choice in zip(
            runs, stage_plans, stage_summaries, stage_choices, strict=True
        ):
            part: dict[str, object] = {
                "fractions": [s.to_dict(_BYTES_PER_ELEMENT) for s in summaries]
            }
            if choice is not None:
                assert choice.link is not None
                part["auto"] = {
                    "grad_workers": choice.grad_workers,
                    "link_rounded": choice.link.to_dict(),
                    "boundary": choice.boundary,
                    "fractions": [c.to_dict() for c in choice.costs],
                }
            if show_m is not None:
                part["plan"] = _plan_json(plans[show_m])
            if stages > 1:
                part["layers"] = [shape.name for shape in run]
            parts.append(part)
        if stages > 1:
            out["stages"] = parts
        else:
            out.update(parts[0])
        print(json.dumps(out, indent=2))
        return 0

    where = (
        f"world size {n}"
        if stages == 1
        else f"world size {world} = {stages} pipeline stages x {n} data-parallel ranks"
    )
    print(
        f"{args.model}: {len(shapes)} K-FAC layers, {where}, "
        f"assignment_strategy={strategy!r}, colocate_factors={args.colocate}, "
        f"compute_method={method!r}"
        + (f", eigen_outer_product={args.eigen_outer_product}" if method == "eigen" else "")
        + f", symmetry_aware={args.symmetry_aware}, curvature={args.curvature!r}"
        + ", factor_update_steps="
        f"{args.factor_update_steps}, inv_update_steps={args.inv_update_steps}"
    )
    for k, (run, plans, summaries) in enumerate(
        zip(runs, stage_plans, stage_summaries, strict=True)
    ):
        print()
        if stages > 1:
            print(
                f"stage {k}: {len(run)} layers ({run[0].name} .. {run[-1].name}), "
                f"planned over its {n} data-parallel ranks"
            )
        print(_tables(summaries))
        if stage_choices[k] is not None:
            print()
            print(_budget_table(stage_choices[k], ms))  # type: ignore[arg-type]
        if show_m is not None:
            plan = plans[show_m]
            load = plan.decomposition_cost()
            print()
            print(plan.describe())
            busiest = max(range(n), key=lambda r: (load[r], -r))
            print(
                f"busiest rank {busiest}: decomposition cost {load[busiest]:.4g} "
                f"({strategy}), imbalance {plan.imbalance():.2f}"
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kaisa plan`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    try:
        return _run(sys.argv[1:] if argv is None else argv)
    except _UsageError as err:
        message = str(err)
    except ValueError as err:  # an impossible fraction, named by make_plan
        message = str(err)
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    print(f"{_PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
