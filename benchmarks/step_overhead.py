"""Per-step cost of K-FAC preconditioning over plain SGD on one CPU process.

A CIFAR-style ResNet-20 (by default) trains on one fixed random batch
(3x32x32 images, random labels, cross-entropy) with SGD + momentum, with and
without ``kaisa.KFACPreconditioner``. Each arm runs in its own fresh
subprocess so that its peak resident memory can be read from the OS and
compared with the SGD arm's. Reported:

* median step time of every arm and its ratio to SGD, with medians per kind of
  step (plain, factor update, inverse update);
* the factor-update step's extra time over SGD (median of the steps that
  update factors but not the inverses, minus the SGD median) and its ratio to
  the *floor*: the time the factor products ``Pᵀ P`` (input patches, with a
  ones column for a bias) and ``δᵀ δ`` (output gradients) of every Conv2d and
  Linear take on this machine when run bare on precomputed tensors of the real
  sizes — what any K-FAC implementation must spend to update the factors;
* the K-FAC time split by phase (``preconditioner.telemetry``) per step;
* peak RSS over the SGD arm and the preconditioner's own ``memory_usage()``
  (read after the backward pass of a factor-update step, so captures count).

The load average is recorded before and after every arm; a busy machine makes
every number here unreliable, so read them together. Nothing is asserted.

Examples::

    python benchmarks/step_overhead.py                       # a few minutes on 2 idle cores
    python benchmarks/step_overhead.py --configs sgd,kfac-1-10 --steps 10
    python benchmarks/step_overhead.py --extra compute_method="'inverse'" --json out.json

Arms (``--configs``): ``sgd``; ``kfac-F-I`` (factors every F steps, inverses
every I steps, any positive integers); ``floor`` (the bare factor products).
``sgd`` is always run, as every ratio refers to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common import (
    LoadRecord,
    format_bytes,
    format_table,
    machine_info,
    parse_key_values,
    peak_rss_bytes,
    run_child,
    set_threads,
    summarize,
    write_json,
)

DEFAULT_CONFIGS = "sgd,kfac-1-10,kfac-10-100,floor"
# Inputs per model: (channels, height, width); all are 10-class image models.
IMAGE_MODELS: dict[str, tuple[int, int, int]] = {
    "resnet20": (3, 32, 32),
    "resnet32": (3, 32, 32),
    "small_cnn": (1, 28, 28),
    "gap_cnn": (1, 28, 28),
}
# Constructor values of the issue (the published KAISA ResNet recipe).
KFAC_DEFAULTS: dict[str, Any] = {"lr": 0.1, "damping": 0.003, "kl_clip": 0.001}
# Phases in the order they happen in a step (kaisa.telemetry.PHASES); phases the
# telemetry reports beyond these follow. Distributed-only phases that stayed at
# zero are left out of the table; the core single-process ones always show.
PHASE_ORDER = (
    "capture",
    "factor_products",
    "factor_allreduce",
    "decomposition",
    "inverse_broadcast",
    "precondition",
    "grad_broadcast",
    "kl_clip",
)
ALWAYS_SHOWN_PHASES = ("capture", "factor_products", "decomposition", "precondition", "kl_clip")
MIN_TIMED_STEPS = 20


@dataclasses.dataclass(frozen=True)
class Arm:
    """One measured configuration: ``sgd``, ``floor`` or ``kfac-F-I``."""

    name: str
    kind: str  # "sgd" | "kfac" | "floor"
    factor_every: int = 0
    inverse_every: int = 0

    @staticmethod
    def parse(name: str) -> Arm:
        name = name.strip()
        if name in ("sgd", "floor"):
            return Arm(name, name)
        parts = name.split("-")
        if len(parts) == 3 and parts[0] == "kfac" and all(p.isdigit() for p in parts[1:]):
            f, i = int(parts[1]), int(parts[2])
            if f >= 1 and i >= 1:
                return Arm(name, "kfac", f, i)
        raise ValueError(
            f"--configs: unknown arm {name!r}; use sgd, floor or kfac-F-I (e.g. kfac-1-10)"
        )

    def timed_steps(self, requested: int | None) -> int:
        """Steps to time: ``requested``, else enough for whole inverse-update cycles."""
        if requested is not None:
            return requested
        if self.kind == "kfac":
            cycles = math.ceil(MIN_TIMED_STEPS / self.inverse_every)
            return cycles * self.inverse_every
        return MIN_TIMED_STEPS


def step_kind(step: int, factor_every: int, inverse_every: int) -> str:
    """What the preconditioner does at ``step`` (completed ``step()`` calls before it)."""
    factor = step % factor_every == 0
    inverse = step % inverse_every == 0
    if factor and inverse:
        return "factor+inverse"
    if inverse:
        return "inverse"
    return "factor" if factor else "plain"


# --------------------------------------------------------------------------- children


def _make_model_and_batch(model_name: str, batch_size: int, seed: int) -> tuple[Any, Any, Any]:
    import torch

    from kaisa.models import build_model

    torch.manual_seed(seed)
    model = build_model(model_name, num_classes=10, in_channels=IMAGE_MODELS[model_name][0])
    model.train()
    x = torch.randn(batch_size, *IMAGE_MODELS[model_name])
    y = torch.randint(0, 10, (batch_size,))
    return model, x, y


def child_train(arm: Arm, args: argparse.Namespace, extra: dict[str, Any]) -> dict[str, Any]:
    """Time ``warmup + steps`` training steps of one arm in this process."""
    import torch
    import torch.nn.functional as F

    set_threads(args.threads)
    model, x, y = _make_model_and_batch(args.model, args.batch_size, args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    pre: Any = None
    if arm.kind == "kfac":
        import kaisa

        options = {**KFAC_DEFAULTS, **extra}
        pre = kaisa.KFACPreconditioner(
            model,
            factor_update_steps=arm.factor_every,
            inv_update_steps=arm.inverse_every,
            **options,
        )

    def one_step(after_backward: Callable[[], None] | None = None) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if after_backward is not None:
            after_backward()
        if pre is not None:
            pre.step()
        optimizer.step()
        return float(loss.detach())

    steps = arm.timed_steps(args.steps)
    print(f"[{arm.name}] {args.warmup} warm-up + {steps} timed steps", file=sys.stderr, flush=True)
    with LoadRecord() as load:
        for _ in range(args.warmup):
            one_step()
        telemetry = getattr(pre, "telemetry", None)
        if telemetry is not None:
            telemetry.reset()
        times: list[float] = []
        kinds: list[str] = []
        loss = math.nan
        for k in range(args.warmup, args.warmup + steps):
            start = time.perf_counter()
            loss = one_step()
            times.append(time.perf_counter() - start)
            kinds.append(
                step_kind(k, arm.factor_every, arm.inverse_every) if pre is not None else "plain"
            )
    result: dict[str, Any] = {
        "arm": arm.name,
        "kind": arm.kind,
        "factor_update_steps": arm.factor_every or None,
        "inv_update_steps": arm.inverse_every or None,
        "extra": extra if pre is not None else {},
        "warmup": args.warmup,
        "times": times,
        "kinds": kinds,
        "final_loss": loss,
        "load": load.as_dict(),
        "peak_rss_bytes": peak_rss_bytes(),
        "machine": machine_info(),
    }
    if telemetry is not None:
        result["phase_seconds"] = {k: float(v) for k, v in telemetry.phase_seconds.items()}
        if hasattr(telemetry, "summary"):
            result["telemetry"] = telemetry.summary()
    if pre is not None and hasattr(pre, "memory_usage"):
        # Captures live only between the forward pass and step(): read the
        # usage after the backward pass of a factor-update step (untimed; at
        # most factor_every - 1 extra steps to reach one).
        usage: dict[str, int] = {}

        def read_usage() -> None:
            usage.update({k: int(v) for k, v in pre.memory_usage().items()})

        k = args.warmup + steps
        while k % arm.factor_every:
            one_step()
            k += 1
        one_step(read_usage)
        result["memory_usage"] = usage
    return result


def _factor_operands(model: Any, x: Any) -> list[dict[str, Any]]:
    """For each Conv2d/Linear: the patch matrix P (with ones for a bias) and δ's shape.

    One forward pass records every layer's real input; P is built exactly as a
    K-FAC capture would (``F.unfold`` rows for a convolution).
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    records: list[dict[str, Any]] = []
    handles = []

    def hook(name: str) -> Callable[..., None]:
        def fn(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            a = inputs[0].detach()
            start = time.perf_counter()
            if isinstance(module, nn.Conv2d):
                if isinstance(module.padding, str) or module.padding_mode != "zeros":
                    raise NotImplementedError(f"{name}: only explicit zero padding is supported")
                patches = F.unfold(
                    a, module.kernel_size, module.dilation, module.padding, module.stride
                )  # (N, C*kh*kw, T)
                p = patches.transpose(1, 2).reshape(-1, patches.shape[1])
                d_cols = module.out_channels
            elif isinstance(module, nn.Linear):
                p = a.reshape(-1, a.shape[-1])
                d_cols = module.out_features
            else:
                raise TypeError(f"{name}: unexpected {type(module).__name__}")
            p = p.contiguous()
            patch_seconds = time.perf_counter() - start
            if module.bias is not None:
                p = torch.cat([p, p.new_ones(p.shape[0], 1)], dim=1)
            records.append(
                {
                    "name": name,
                    "type": type(module).__name__,
                    "p": p,
                    "g_cols": d_cols,
                    "patch_seconds": patch_seconds,
                }
            )

        return fn

    for name, module in model.named_modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            handles.append(module.register_forward_hook(hook(name)))
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return records


def child_floor(args: argparse.Namespace) -> dict[str, Any]:
    """Time the bare factor products Pᵀ P and δᵀ δ of every layer."""
    import torch

    set_threads(args.threads)
    model, x, _ = _make_model_and_batch(args.model, args.batch_size, args.seed)
    records = _factor_operands(model, x)
    # Layers with equal shapes share one operand (values do not change the time,
    # and the operands are far larger than the caches), which keeps memory low.
    a_by_shape: dict[tuple[int, int], Any] = {}
    g_by_shape: dict[tuple[int, int], Any] = {}
    for r in records:
        a_by_shape.setdefault(tuple(r["p"].shape), r["p"])
        r["a_shape"] = tuple(r.pop("p").shape)
        r["g_shape"] = (r["a_shape"][0], r.pop("g_cols"))
        g_by_shape.setdefault(r["g_shape"], torch.randn(r["g_shape"]))

    def a_product(shape: tuple[int, int]) -> Any:
        p = a_by_shape[shape]
        return p.t() @ p

    def g_product(shape: tuple[int, int]) -> Any:
        d = g_by_shape[shape]
        return d.t() @ d

    def all_products() -> None:
        for r in records:
            a_product(r["a_shape"])
            g_product(r["g_shape"])

    repeat = args.floor_repeat
    print(f"[floor] {len(records)} layers, {repeat} repeats", file=sys.stderr, flush=True)
    with LoadRecord() as load:
        for _ in range(2):  # warm-up: thread pool, allocator
            all_products()
        totals: list[float] = []
        a_times: dict[str, list[float]] = {r["name"]: [] for r in records}
        g_times: dict[str, list[float]] = {r["name"]: [] for r in records}
        for _ in range(repeat):
            start = time.perf_counter()
            for r in records:
                t0 = time.perf_counter()
                a_product(r["a_shape"])
                t1 = time.perf_counter()
                g_product(r["g_shape"])
                t2 = time.perf_counter()
                a_times[r["name"]].append(t1 - t0)
                g_times[r["name"]].append(t2 - t1)
            totals.append(time.perf_counter() - start)
    flops = sum(2 * s[0] * s[1] ** 2 for r in records for s in (r["a_shape"], r["g_shape"]))
    layers = [
        {
            "name": r["name"],
            "type": r["type"],
            "a_shape": list(r["a_shape"]),
            "g_shape": list(r["g_shape"]),
            "a_seconds": statistics.median(a_times[r["name"]]),
            "g_seconds": statistics.median(g_times[r["name"]]),
            "patch_seconds": r["patch_seconds"],
        }
        for r in records
    ]
    return {
        "arm": "floor",
        "kind": "floor",
        "totals": totals,
        "seconds": statistics.median(totals),
        "a_seconds": sum(layer["a_seconds"] for layer in layers),
        "g_seconds": sum(layer["g_seconds"] for layer in layers),
        "patch_seconds": sum(layer["patch_seconds"] for layer in layers),
        "flops": flops,
        "layers": layers,
        "load": load.as_dict(),
        "peak_rss_bytes": peak_rss_bytes(),
        "machine": machine_info(),
    }


# --------------------------------------------------------------------------- report


def _ms(seconds: float) -> str:
    return "n/a" if seconds is None or math.isnan(seconds) else f"{1e3 * seconds:.1f}"


def _ratio(a: float, b: float) -> str:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return "n/a"
    return f"{a / b:.2f}x"


def _median_of(result: dict[str, Any], *kinds: str) -> tuple[float, int]:
    times = [t for t, k in zip(result["times"], result["kinds"], strict=True) if k in kinds]
    return (statistics.median(times) if times else math.nan), len(times)


def summarize_arms(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Derived numbers of the report (also written to JSON)."""
    sgd = arms.get("sgd")
    sgd_median = statistics.median(sgd["times"]) if sgd else math.nan
    sgd_mean = statistics.fmean(sgd["times"]) if sgd else math.nan
    sgd_rss = sgd["peak_rss_bytes"] if sgd else math.nan
    floor = arms.get("floor")
    floor_s = floor["seconds"] if floor else math.nan
    out: dict[str, Any] = {"sgd_median_seconds": sgd_median, "floor_seconds": floor_s}
    for name, r in arms.items():
        if r.get("kind") not in ("sgd", "kfac"):
            continue
        stats = summarize(r["times"])
        factor_median, n_factor = _median_of(r, "factor")
        extra = factor_median - sgd_median
        mean_overhead = stats["mean"] - sgd_mean
        phases = r.get("phase_seconds") or {}
        steps = len(r["times"])
        out[name] = {
            "step": stats,
            "ratio_to_sgd": stats["median"] / sgd_median,
            "median_by_kind": {
                kind: _median_of(r, kind)[0]
                for kind in ("plain", "factor", "inverse", "factor+inverse")
                if _median_of(r, kind)[1]
            },
            "count_by_kind": {k: r["kinds"].count(k) for k in sorted(set(r["kinds"]))},
            "factor_step_median": factor_median,
            "factor_steps": n_factor,
            "factor_step_extra_over_sgd": extra,
            "factor_step_extra_over_floor": extra / floor_s if floor_s else math.nan,
            "mean_overhead_over_sgd": mean_overhead,
            "phase_seconds_per_step": {k: v / steps for k, v in phases.items()},
            "peak_rss_over_sgd_bytes": r["peak_rss_bytes"] - sgd_rss,
        }
    return out


def render(
    arms: dict[str, dict[str, Any]], summary: dict[str, Any], args: argparse.Namespace
) -> str:
    sgd_median = summary["sgd_median_seconds"]
    floor_s = summary["floor_seconds"]
    trained = [n for n in arms if arms[n].get("kind") in ("sgd", "kfac")]
    kfac = [n for n in trained if arms[n]["kind"] == "kfac"]
    blocks: list[str] = []

    rows: list[Sequence[object]] = []
    for n in trained:
        s = summary[n]
        by_kind = s["median_by_kind"]
        load = arms[n]["load"]
        rows.append(
            [
                n,
                len(arms[n]["times"]),
                _ms(s["step"]["median"]),
                _ratio(s["step"]["median"], sgd_median),
                f"{_ms(s['step']['p10'])}-{_ms(s['step']['p90'])}",
                _ms(by_kind.get("plain", math.nan)),
                _ms(by_kind.get("factor", math.nan)),
                _ms(by_kind.get("factor+inverse", by_kind.get("inverse", math.nan))),
                f"{load['before'][0]:.2f}->{load['after'][0]:.2f}",
            ]
        )
    blocks.append(
        format_table(
            [
                "arm",
                "steps",
                "median ms",
                "x SGD",
                "p10-p90 ms",
                "plain ms",
                "factor ms",
                "inverse ms",
                "load 1m",
            ],
            rows,
            title="Step time (median per kind of step; 'factor' = factor update without inverse)",
        )
    )

    if kfac:
        rows = []
        for n in kfac:
            s = summary[n]
            rows.append(
                [
                    n,
                    s["factor_steps"],
                    _ms(s["factor_step_median"]),
                    _ms(s["factor_step_extra_over_sgd"]),
                    _ms(floor_s),
                    _ratio(s["factor_step_extra_over_sgd"], floor_s),
                ]
            )
        blocks.append(
            format_table(
                ["arm", "n", "factor step ms", "extra over SGD ms", "floor ms", "extra / floor"],
                rows,
                title="Factor-update step versus the floor (bare factor products)",
            )
        )

        reported: dict[str, float] = {}
        for n in kfac:
            for p, v in (arms[n].get("phase_seconds") or {}).items():
                reported[p] = reported.get(p, 0.0) + v
        ordered = [p for p in PHASE_ORDER if p in reported]
        ordered += [p for p in reported if p not in PHASE_ORDER]
        phase_names = [p for p in ordered if reported[p] > 0 or p in ALWAYS_SHOWN_PHASES]
        rows = []
        for p in phase_names:
            rows.append(
                [p] + [_ms(summary[n]["phase_seconds_per_step"].get(p, math.nan)) for n in kfac]
            )
        phase_sums = [sum(summary[n]["phase_seconds_per_step"].values()) for n in kfac]
        overheads = [summary[n]["mean_overhead_over_sgd"] for n in kfac]
        rows.append(["sum of phases"] + [_ms(v) for v in phase_sums])
        rows.append(["mean step - mean SGD step"] + [_ms(v) for v in overheads])
        rows.append(
            ["unattributed"] + [_ms(o - s) for o, s in zip(overheads, phase_sums, strict=True)]
        )
        if not phase_names:
            rows.insert(0, ["(no telemetry)"] + ["n/a"] * len(kfac))
        blocks.append(
            format_table(
                ["phase (ms per timed step)", *kfac],
                rows,
                title="K-FAC time by phase, averaged over all timed steps",
            )
        )

    rows = []
    for n in trained:
        mem = arms[n].get("memory_usage") or {}
        rows.append(
            [
                n,
                format_bytes(arms[n]["peak_rss_bytes"]),
                format_bytes(summary[n]["peak_rss_over_sgd_bytes"]) if n != "sgd" else "-",
                *(
                    format_bytes(mem[k]) if k in mem else "-"
                    for k in ("factors", "second_order", "captures", "total")
                ),
            ]
        )
    blocks.append(
        format_table(
            ["arm", "peak RSS", "over SGD", "factors", "second order", "captures", "K-FAC total"],
            rows,
            title="Memory (peak RSS of each arm's process; K-FAC columns: memory_usage() "
            "after the backward pass of a factor-update step)",
        )
    )

    floor = arms.get("floor")
    if floor:
        gflops = floor["flops"] / floor["seconds"] / 1e9 if floor["seconds"] else math.nan
        blocks.append(
            f"Floor: {len(floor['layers'])} layers, A products {_ms(floor['a_seconds'])} ms + "
            f"G products {_ms(floor['g_seconds'])} ms; median total {_ms(floor['seconds'])} ms "
            f"({floor['flops'] / 1e9:.1f} GFLOP as full matrix products, {gflops:.0f} GFLOP/s; "
            f"load 1m {floor['load']['before'][0]:.2f}->{floor['load']['after'][0]:.2f})\n"
            f"Not in the floor: building the patch matrices with F.unfold took "
            f"{_ms(floor['patch_seconds'])} ms (one pass, for reference)"
        )
    return "\n\n".join(blocks)


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Step-time and memory overhead of K-FAC over SGD (one CPU process).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"timed steps per arm (default: {MIN_TIMED_STEPS}, rounded up for K-FAC arms "
        "to whole inverse-update cycles, e.g. 100 for kfac-10-100)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--model", choices=sorted(IMAGE_MODELS), default="resnet20")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help="comma-separated arms: sgd, floor, kfac-F-I (factors every F, inverses every I)",
    )
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra KFACPreconditioner argument for every K-FAC arm (value: a Python "
        "literal, else a string); repeatable",
    )
    parser.add_argument("--floor-repeat", type=int, default=5, help="timed repeats of the floor")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per arm")
    parser.add_argument("--json", metavar="PATH", help="also write all results as JSON")
    parser.add_argument("--child", metavar="ARM", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    return parser


def _validate(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[Arm], dict[str, Any]]:
    for name in ("threads", "batch_size", "floor_repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    try:
        arms = [Arm.parse(n) for n in args.configs.split(",") if n.strip()]
        extra = parse_key_values(args.extra)
    except ValueError as exc:
        parser.error(str(exc))
    clash = sorted(set(extra) & {"factor_update_steps", "inv_update_steps"})
    if clash:
        parser.error(f"--extra may not set {', '.join(clash)}; choose them with --configs")
    if not any(a.kind == "sgd" for a in arms):
        print("note: adding the sgd arm, every ratio refers to it", file=sys.stderr)
        arms.insert(0, Arm("sgd", "sgd"))
    unique: dict[str, Arm] = {}
    for arm in arms:
        unique.setdefault(arm.name, arm)
    return list(unique.values()), extra


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    arms, extra = _validate(parser, args)

    if args.child:
        arm = Arm.parse(args.child)
        result = child_floor(args) if arm.kind == "floor" else child_train(arm, args, extra)
        write_json(args.result_file, result)
        return 0

    script = str(Path(__file__).resolve())
    common = [
        "--threads", str(args.threads),
        "--warmup", str(args.warmup),
        "--batch-size", str(args.batch_size),
        "--model", args.model,
        "--seed", str(args.seed),
        "--floor-repeat", str(args.floor_repeat),
    ]  # fmt: skip
    if args.steps is not None:
        common += ["--steps", str(args.steps)]
    for item in args.extra:
        common += ["--extra", item]

    results: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    started = time.perf_counter()
    with LoadRecord() as load:
        for arm in arms:
            outcome, error = run_child(
                [script, "--child", arm.name, *common], args.threads, args.timeout
            )
            if outcome is None:
                failures[arm.name] = error
                print(f"[{arm.name}] FAILED: {error}", file=sys.stderr)
            else:
                results[arm.name] = outcome
    elapsed = time.perf_counter() - started

    header = (
        f"step_overhead: {args.model}, batch {args.batch_size}, {args.threads} threads, "
        f"warm-up {args.warmup}; K-FAC {KFAC_DEFAULTS | extra}\n"
        f"{load.describe()}; {elapsed:.0f} s in total"
    )
    print(header)
    if "sgd" not in results:
        print("the sgd arm failed; nothing to compare", file=sys.stderr)
        summary: dict[str, Any] = {}
    else:
        summary = summarize_arms(results)
        print()
        print(render(results, summary, args))
    if extra.get("conv_factor_estimator", "expand") != "expand" and "floor" in results:
        print(
            "\nnote: the floor is the cost of the 'expand' factors (spec §3, one row per "
            "output position); a cheaper estimator can go below it"
        )
    # Only the load *before* the run says something about other work: the arms
    # themselves raise the load average while they run.
    if load.before[0] > 0.5 * machine_info()["cpus"]:
        print("\nwarning: the machine was busy before the run (1-minute load above half the CPUs)")
    for name, error in failures.items():
        print(f"\narm {name} failed: {error} (its output is above, on stderr)")

    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "step_overhead",
                "args": vars(args),
                "kfac_options": KFAC_DEFAULTS | extra,
                "machine": machine_info(),
                "load": load.as_dict(),
                "elapsed_seconds": elapsed,
                "summary": summary,
                "arms": results,
                "failures": failures,
            },
        )
        print(f"\nwrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
