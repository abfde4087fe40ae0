"""KAISA in real gloo processes on this host: memory, traffic and time per rank.

For a ResNet (``kaisa.models.resnet20``, random 3×32×32 images, local batch
32) and a Transformer (``kaisa.models.build_model('transformer')`` at its
default small sizes: d_model 64, 2 blocks, vocabulary 1000; random token
sequences of length 64, local batch 16), at world sizes 2 and 4, for MEM-OPT
(``grad_worker_fraction='mem-opt'``), HYBRID-OPT (0.5) and COMM-OPT (1.0),
every rank trains a DDP-wrapped model with SGD and a
``kaisa.KFACPreconditioner`` holding the sides the cost model of spec §5
and ``distributed_cost.py`` assume (each layer kind's own representation, an
embedding's diagonal ``A``, every other side exact; the automatic choice's
first step all-reduces provisional exact factors, which those counts do not
model) for a few steps on a short schedule (by default
factors every 2 steps, second-order state every 4, 13 steps: steps 0, 4, 8,
12 update both, 2, 6, 10 the factors only, the odd steps neither). Reported
per rank, as max and mean over the ranks:

* memory from ``preconditioner.memory_usage()``: factors and second-order
  state, MB (10⁶ bytes);
* elements sent per collective kind, from ``preconditioner.telemetry``
  (``last_step_elements`` after every step): factor all-reduce per
  factor-update step, inverse broadcast per inverse-update step, gradient
  broadcast per step, 'layer_flags' per step (kaisa's per-step agreement on
  which layers ran, and on factor-update steps two more flags: that every
  rank steps rather than discards the iteration) and 'factor_rows' per
  factor-update step (two row counts
  per layer, sent with the factor all-reduce), both outside the cost model of
  spec §5;
* the average elements per step at ``factor_update_steps=10``,
  ``inv_update_steps=100`` (``--avg-intervals``), computed from the measured
  per-event counts (``fa/10 + ib/100 + gb``; 'layer_flags' and 'factor_rows'
  not included);
* the plan's imbalance (``plan.imbalance()``);
* median step time per kind of step (plain, factor update, inverse update),
  the average step time those medians give at the ``--avg-intervals``
  schedule, and per-phase times (``telemetry.phase_seconds``, differenced step
  by step; median over the steps where the phase happens). Step 0 is a warm-up
  and not timed.

The ✓/✗ column says whether every rank's counts at every step, and its memory,
equal exactly what ``kaisa.distributed.cost`` (``rank_traffic``,
``rank_memory``) predicts for the plan the preconditioner used; 'layer_flags'
must be the number of layers at every step (three more at factor-update steps)
and 'factor_rows' twice the layers at every factor-update step. The 'sim' column says whether the
measured max values equal the row of ``results/distributed_cost.json`` (the
simulated sizes; ``--simulated``) for the same model, world size and
fraction, if that file has one; the quantities that differ are listed.

Times are only indicative: the processes use one thread each and share the
host's cores (4 processes on a 2-core machine are oversubscribed), and the
factor all-reduce timer covers its launch in the backward hooks and the final
wait, not the transfer that overlaps the backward pass. The load average is
recorded before and after every (model, world size) group. Nothing is asserted
on time.

Examples::

    python benchmarks/distributed_real.py --json      # benchmarks/results/distributed_real.json
    python benchmarks/distributed_real.py --models transformer --world-sizes 2 --steps 5
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import (
    LoadRecord,
    add_json_option,
    format_table,
    load_average,
    machine_info,
    write_json,
)
from torch import nn

import kaisa
from kaisa.cli.shapes import module_layer_shapes
from kaisa.distributed.cost import rank_memory, rank_traffic
from kaisa.distributed.plan import WorkPlan
from kaisa.models import build_model

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent / "tests" / "distributed"))
from harness import DistributedTestError, run_distributed  # noqa: E402

DEFAULT_JSON = _HERE / "results" / "distributed_real.json"
SIMULATED_JSON = _HERE / "results" / "distributed_cost.json"
FRACTIONS: dict[str, float | str] = {"mem-opt": "mem-opt", "hybrid-opt": 0.5, "comm-opt": 1.0}
KINDS = (
    "factor_allreduce",
    "inverse_broadcast",
    "grad_broadcast",
    "layer_flags",
    "factor_rows",
)
# Kind of step a phase happens on (its per-phase time is the median over those steps).
PHASE_STEPS = {
    "capture": "factor",
    "factor_products": "factor",
    "factor_allreduce": "factor",
    "decomposition": "inverse",
    "inverse_broadcast": "inverse",
    "precondition": "any",
    "grad_broadcast": "any",
    "kl_clip": "any",
}
SEQ_LEN = 64
VOCAB = 1000
# Model name -> (local batch, description).
MODELS: dict[str, tuple[int, str]] = {
    "resnet20": (32, "ResNet-20 (kaisa.models), random 3x32x32 input"),
    "transformer": (
        16,
        f"transformer (kaisa.models defaults: d_model 64, 2 blocks, vocab {VOCAB}), "
        f"random tokens, length {SEQ_LEN}",
    ),
}
# stale_refresh off: its refreshes follow the gradients, which the cost model does not
# know (its per-step flags: tests/distributed/test_stale_refresh_distributed.py).
KFAC_OPTIONS: dict[str, Any] = {
    "lr": 0.1,
    "damping": 0.003,
    "kl_clip": 0.001,
    "stale_refresh": False,
    # The spec §5 cost model counts K-FAC's own solve: no eigenvalue correction
    # and no kept bases, which the Transformer's embedding would otherwise turn on.
    "profile": "general",
}
MB = 1e6


# --------------------------------------------------------------------------- in each rank


def _make_model(name: str) -> nn.Module:
    if name == "resnet20":
        return build_model("resnet20")
    return build_model("transformer", vocab_size=VOCAB, num_classes=2)


def _batch(name: str, local_batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "resnet20":
        x = torch.randn(local_batch, 3, 32, 32, generator=gen)
        y = torch.randint(0, 10, (local_batch,), generator=gen)
    else:
        x = torch.randint(0, VOCAB, (local_batch, SEQ_LEN), generator=gen)
        y = torch.randint(0, 2, (local_batch,), generator=gen)
    return x, y


def _step_kind(step: int, factor_every: int, inv_every: int) -> str:
    if step % inv_every == 0:
        return "inverse"  # inv_every is a multiple of factor_every: factors update too
    if step % factor_every == 0:
        return "factor"
    return "plain"


def _run_config(
    rank: int, world_size: int, model_name: str, fraction: float | str, settings: dict[str, Any]
) -> dict[str, Any]:
    torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts them anyway)
    local_batch = MODELS[model_name][0]
    model = _make_model(model_name)
    net = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    preconditioner = kaisa.KFACPreconditioner(
        net,
        factor_update_steps=settings["factor_every"],
        inv_update_steps=settings["inv_every"],
        grad_worker_fraction=fraction,
        conv_factor_estimator=settings["conv_factor_estimator"],
        # The representations the cost model assumes: each layer kind's own
        # (an embedding's diagonal A), every other side exact. (The keys are
        # searched as patterns: each matches the bare model's name, escaped, at the end
        # of the registered one, which DDP prefixes with 'module.'.)
        curvature={
            rf"(?:^|\.){re.escape(s.name)}$": (s.a_spec, s.g_spec)
            for s in module_layer_shapes(model)
        },
        **KFAC_OPTIONS,
    )
    telemetry = preconditioner.telemetry
    gen = torch.Generator().manual_seed(1000 + rank)
    steps = []
    for step in range(settings["steps"]):
        x, y = _batch(model_name, local_batch, gen)
        dist.barrier()  # start every step together; not timed
        phases_before = dict(telemetry.phase_seconds)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        preconditioner.step()
        optimizer.step()
        seconds = time.perf_counter() - start
        steps.append(
            {
                "step": step,
                "kind": _step_kind(step, settings["factor_every"], settings["inv_every"]),
                "seconds": seconds,
                "phases": {
                    k: v - phases_before.get(k, 0.0) for k, v in telemetry.phase_seconds.items()
                },
                "elements": dict(telemetry.last_step_elements),
            }
        )
    result = {
        "plan": preconditioner.plan,
        "num_layers": len(preconditioner.layers),
        "memory": preconditioner.memory_usage(),
        "factor_element_size": torch.empty((), dtype=preconditioner.factor_dtype).element_size(),
        "inv_element_size": torch.empty((), dtype=preconditioner.inv_dtype).element_size(),
        "compute_method": preconditioner.options.compute_method,
        "eigen_outer_product": preconditioner.options.compute_eigenvalue_outer_product,
        "symmetry_aware": preconditioner.options.symmetry_aware,
        "skipped_factor_updates": telemetry.skipped_factor_updates,
        "failed_decompositions": telemetry.failed_decompositions,
        "steps": steps,
    }
    preconditioner.remove_hooks()
    del preconditioner, net, model, optimizer
    gc.collect()
    return result


def _worker(
    rank: int, world_size: int, model_name: str, fractions: list[Any], settings: dict[str, Any]
) -> list[dict[str, Any]]:
    torch.set_num_threads(1)  # the harness does too; one thread per process
    return [_run_config(rank, world_size, model_name, f, settings) for f in fractions]


# --------------------------------------------------------------------------- in the parent


def _max_mean(values: Sequence[float]) -> dict[str, float]:
    return {"max": max(values), "mean": sum(values) / len(values)}


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _analyse(
    ranks: list[dict[str, Any]], settings: dict[str, Any], avg_f: int, avg_i: int
) -> dict[str, Any]:
    """Compare one configuration's per-rank measurements with the cost model."""
    plan: WorkPlan = ranks[0]["plan"]
    first = ranks[0]
    method, outer, sym = (
        first["compute_method"],
        first["eigen_outer_product"],
        first["symmetry_aware"],
    )
    problems: list[str] = []
    per_rank: list[dict[str, Any]] = []
    for rank, got in enumerate(ranks):
        if got["plan"] != plan:
            problems.append(f"rank {rank} used a different plan")
        traffic = rank_traffic(plan, rank, method, sym)
        predicted_event = {
            "factor_allreduce": traffic.factor_allreduce,
            "inverse_broadcast": traffic.inverse_broadcast,
            "grad_broadcast": traffic.grad_broadcast,
            "layer_flags": got["num_layers"],
            "factor_rows": 2 * got["num_layers"],
        }
        # Measured count per event: the value seen on the steps where the event happens.
        measured_event: dict[str, int] = {}
        for kind, on in (
            ("factor_allreduce", ("factor", "inverse")),
            ("inverse_broadcast", ("inverse",)),
            ("grad_broadcast", ("plain", "factor", "inverse")),
            ("layer_flags", ("plain",)),
            ("factor_rows", ("factor", "inverse")),
        ):
            seen = {s["elements"][kind] for s in got["steps"] if s["kind"] in on}
            if len(seen) != 1:
                problems.append(f"rank {rank}: {kind} varies between its steps: {sorted(seen)}")
            measured_event[kind] = max(seen) if seen else 0
        for s in got["steps"]:
            expected = {
                "factor_allreduce": predicted_event["factor_allreduce"]
                if s["kind"] != "plain"
                else 0,
                "inverse_broadcast": predicted_event["inverse_broadcast"]
                if s["kind"] == "inverse"
                else 0,
                "grad_broadcast": predicted_event["grad_broadcast"],
                "layer_flags": predicted_event["layer_flags"] + (3 if s["kind"] != "plain" else 0),
                "factor_rows": predicted_event["factor_rows"] if s["kind"] != "plain" else 0,
            }
            wrong = {k: (s["elements"][k], v) for k, v in expected.items() if s["elements"][k] != v}
            if wrong:
                problems.append(f"rank {rank} step {s['step']}: (measured, predicted) {wrong}")
        memory = rank_memory(plan, rank, method, outer)
        predicted_mem = {
            "factors": memory.factors * got["factor_element_size"],
            "second_order": memory.second_order * got["inv_element_size"],
        }
        for key, value in predicted_mem.items():
            if got["memory"][key] != value:
                problems.append(f"rank {rank}: {key} {got['memory'][key]} bytes, predicted {value}")
        if got["skipped_factor_updates"] or got["failed_decompositions"]:
            problems.append(
                f"rank {rank}: {got['skipped_factor_updates']} skipped factor updates, "
                f"{got['failed_decompositions']} failed decompositions"
            )
        avg = (
            measured_event["factor_allreduce"] / avg_f
            + measured_event["inverse_broadcast"] / avg_i
            + measured_event["grad_broadcast"]
        )
        timed = [s for s in got["steps"] if s["step"] > 0]
        step_median = {
            kind: _median([s["seconds"] for s in timed if s["kind"] == kind])
            for kind in ("plain", "factor", "inverse")
        }
        step_median["all"] = _median([s["seconds"] for s in timed])
        # Average step time at (avg_f, avg_i): inverse steps 1/I, factor-only 1/F - 1/I.
        w_inv, w_fac = 1 / avg_i, 1 / avg_f - 1 / avg_i
        step_median["estimated_average"] = (
            w_inv * step_median["inverse"]
            + w_fac * step_median["factor"]
            + (1 - w_inv - w_fac) * step_median["plain"]
        )
        phase_median = {}
        for phase in got["steps"][0]["phases"]:
            on = PHASE_STEPS.get(phase, "any")
            kinds = {"factor": ("factor", "inverse"), "inverse": ("inverse",)}.get(
                on, ("plain", "factor", "inverse")
            )
            phase_median[phase] = _median([s["phases"][phase] for s in timed if s["kind"] in kinds])
        per_rank.append(
            {
                "rank": rank,
                "column": plan.column_of(rank),
                "memory_bytes": {k: got["memory"][k] for k in ("factors", "second_order")},
                "predicted_memory_bytes": predicted_mem,
                "elements_per_event": measured_event,
                "predicted_elements_per_event": predicted_event,
                "average_elements_per_step": avg,
                "predicted_average_elements_per_step": traffic.per_step(avg_f, avg_i),
                "step_seconds_median": step_median,
                "phase_seconds_median": phase_median,
                "per_step": got["steps"],
            }
        )

    def mm(path: Sequence[str]) -> dict[str, float]:
        values = []
        for r in per_rank:
            v: Any = r
            for key in path:
                v = v[key]
            values.append(v)
        return _max_mean(values)

    return {
        "world_size": plan.world_size,
        "grad_workers": plan.grad_workers,
        "strategy": plan.strategy_name,
        "num_layers": first["num_layers"],
        "compute_method": method,
        "eigen_outer_product": outer,
        "symmetry_aware": sym,
        "imbalance": plan.imbalance(),
        "matches_cost_model": not problems,
        "problems": problems,
        "memory_mb": {
            k: {s: v / MB for s, v in mm(("memory_bytes", k)).items()}
            for k in ("factors", "second_order")
        },
        "elements_per_event": {k: mm(("elements_per_event", k)) for k in KINDS},
        "average_elements_per_step": mm(("average_elements_per_step",)),
        "step_seconds_median": {
            k: mm(("step_seconds_median", k))
            for k in ("plain", "factor", "inverse", "all", "estimated_average")
        },
        "phase_seconds_median": {
            k: mm(("phase_seconds_median", k)) for k in per_rank[0]["phase_seconds_median"]
        },
        "plan": plan.describe(),
        "ranks": per_rank,
    }


def _simulated_rows(path: Path) -> dict[tuple[str, int, str], dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    settings = data.get("settings", {})
    if settings.get("compute_method") != "eigen" or settings.get("symmetry_aware"):
        return {}
    rows = {}
    for name, model in data.get("models", {}).items():
        for row in model.get("rows", []):
            rows[(name, row["world_size"], row["fraction_name"])] = row
    return rows


def _compare_simulated(
    row: dict[str, Any], sim: dict[str, Any] | None, avg: tuple[int, int]
) -> tuple[str, list[str]]:
    """'✓'/'✗' (or '-' without a simulated row) and the quantities that differ."""
    if sim is None:
        return "-", []
    mem, sent = sim["memory_elements"], sim["elements_sent"]
    # MB back to bytes, then float32 elements (the simulation counts 4 bytes each).
    pairs = {
        "factors": (row["memory_mb"]["factors"]["max"] * MB / 4, mem["factors"]["max"]),
        "second_order": (
            row["memory_mb"]["second_order"]["max"] * MB / 4,
            mem["second_order"]["max"],
        ),
        "factor_allreduce": (
            row["elements_per_event"]["factor_allreduce"]["max"],
            sent["factor_allreduce_per_factor_update"]["max"],
        ),
        "inverse_broadcast": (
            row["elements_per_event"]["inverse_broadcast"]["max"],
            sent["inverse_broadcast_per_inverse_update"]["max"],
        ),
        "grad_broadcast": (
            row["elements_per_event"]["grad_broadcast"]["max"],
            sent["grad_broadcast_per_step"]["max"],
        ),
        "imbalance": (row["imbalance"], sim["imbalance"]),
    }
    if (sim["factor_update_steps"], sim["inv_update_steps"]) == avg:
        pairs["average_per_step"] = (
            row["average_elements_per_step"]["max"],
            sent["average_per_step"]["max"],
        )
    differ = [
        f"{name}: measured {a:g}, simulated {b:g}"
        for name, (a, b) in pairs.items()
        if abs(a - b) > 1e-6 * max(1.0, abs(b))
    ]
    return ("✗" if differ else "✓"), differ


def _mm_cell(x: dict[str, float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    """``max`` alone when every rank has the same value, else ``max/mean``."""
    hi, mean = x["max"] * scale, x["mean"] * scale
    if fmt.format(hi) == fmt.format(mean):
        return fmt.format(hi)
    return f"{fmt.format(hi)}/{fmt.format(mean)}"


def _tables(rows: list[dict[str, Any]], avg: tuple[int, int]) -> str:
    kel = 1e-3
    traffic_headers = [
        "model",
        "N",
        "fraction",
        "m",
        "factors MB",
        "2nd MB",
        "AR/fu kel",
        "inv bc/iu kel",
        "grad bc/st kel",
        "flags/st",
        f"avg/st@{avg[0]},{avg[1]} kel",
        "imbal",
        "=cost",
        "=sim",
    ]
    traffic_body = []
    time_body = []
    for r in rows:
        ev = r["elements_per_event"]
        traffic_body.append(
            [
                r["model"],
                r["world_size"],
                r["fraction_name"],
                r["grad_workers"],
                _mm_cell(r["memory_mb"]["factors"], fmt="{:.3g}"),
                _mm_cell(r["memory_mb"]["second_order"], fmt="{:.3g}"),
                _mm_cell(ev["factor_allreduce"], kel),
                _mm_cell(ev["inverse_broadcast"], kel),
                _mm_cell(ev["grad_broadcast"], kel),
                _mm_cell(ev["layer_flags"], fmt="{:.0f}"),
                _mm_cell(r["average_elements_per_step"], kel),
                f"{r['imbalance']:.2f}",
                "✓" if r["matches_cost_model"] else "✗",
                r["simulated_match"],
            ]
        )
        st, ph = r["step_seconds_median"], r["phase_seconds_median"]
        ms = 1e3
        time_body.append(
            [
                r["model"],
                r["world_size"],
                r["fraction_name"],
                _mm_cell(st["plain"], ms, "{:.0f}"),
                _mm_cell(st["factor"], ms, "{:.0f}"),
                _mm_cell(st["inverse"], ms, "{:.0f}"),
                _mm_cell(st["estimated_average"], ms, "{:.0f}"),
                _mm_cell(ph["factor_products"], ms, "{:.0f}"),
                _mm_cell(ph["factor_allreduce"], ms, "{:.0f}"),
                _mm_cell(ph["decomposition"], ms, "{:.0f}"),
                _mm_cell(ph["inverse_broadcast"], ms, "{:.1f}"),
                _mm_cell(ph["precondition"], ms, "{:.1f}"),
                _mm_cell(ph["grad_broadcast"], ms, "{:.1f}"),
                f"{r['load_before'][0]:.1f}->{r['load_after'][0]:.1f}",
            ]
        )
    time_headers = [
        "model",
        "N",
        "fraction",
        "plain ms",
        "fac-upd ms",
        "inv-upd ms",
        f"avg@{avg[0]},{avg[1]} ms",
        "fprod/fu",
        "AR/fu",
        "decomp/iu",
        "inv bc/iu",
        "precond/st",
        "grad bc/st",
        "load1m",
    ]
    return (
        format_table(
            traffic_headers,
            traffic_body,
            title="Memory and traffic per rank (max/mean over ranks; one value when all equal)",
        )
        + "\n\n"
        + format_table(
            time_headers,
            time_body,
            title="Median step and phase times per rank, ms (max/mean over ranks; indicative)",
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--models", default=",".join(MODELS), help=f"from {', '.join(MODELS)}")
    p.add_argument("--world-sizes", default="2,4", help="comma-separated (default 2,4)")
    p.add_argument("--fractions", default=",".join(FRACTIONS), help=f"from {', '.join(FRACTIONS)}")
    p.add_argument("--steps", type=int, default=13, help="steps per configuration (step 0 untimed)")
    p.add_argument("--factor-every", type=int, default=2, help="factor_update_steps of the run")
    p.add_argument(
        "--inv-every",
        type=int,
        default=4,
        help="inv_update_steps of the run (multiple of the above)",
    )
    p.add_argument(
        "--avg-intervals",
        default="10,100",
        help="factor_update_steps,inv_update_steps for the per-step averages (default 10,100)",
    )
    p.add_argument(
        "--simulated",
        default=str(SIMULATED_JSON),
        metavar="PATH",
        help="distributed_cost.py JSON to compare with (default: %(default)s)",
    )
    p.add_argument("--conv-factor-estimator", choices=("expand", "reduce"), default="expand")
    p.add_argument(
        "--timeout", type=float, default=240.0, help="seconds per (model, world size) group"
    )
    add_json_option(p, DEFAULT_JSON)
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    fractions = [f.strip() for f in args.fractions.split(",") if f.strip()]
    world_sizes = [int(n) for n in args.world_sizes.split(",") if n.strip()]
    avg_f, avg_i = (int(v) for v in args.avg_intervals.split(","))
    if unknown := [m for m in models if m not in MODELS] + [
        f for f in fractions if f not in FRACTIONS
    ]:
        p.error(f"unknown model(s) or fraction(s): {', '.join(unknown)}")
    if any(n < 2 for n in world_sizes):
        p.error("world sizes must be at least 2")
    if args.factor_every < 1 or args.inv_every % args.factor_every or args.inv_every < 1:
        p.error("--inv-every must be a positive multiple of --factor-every")
    if args.steps <= args.inv_every:
        p.error(
            "--steps must exceed --inv-every (step 0 is untimed; an inverse step must be timed)"
        )
    settings = {
        "steps": args.steps,
        "factor_every": args.factor_every,
        "inv_every": args.inv_every,
        "conv_factor_estimator": args.conv_factor_estimator,
    }
    print(
        f"gloo on localhost, one thread per process; DDP + SGD(momentum 0.9) + "
        f"KFACPreconditioner({', '.join(f'{k}={v}' for k, v in KFAC_OPTIONS.items())}, "
        f"conv_factor_estimator={args.conv_factor_estimator!r}); {args.steps} steps per "
        f"configuration with factor_update_steps={args.factor_every}, "
        f"inv_update_steps={args.inv_every}; averages per step for ({avg_f}, {avg_i})",
        flush=True,
    )
    simulated = _simulated_rows(Path(args.simulated))
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    started = time.perf_counter()
    with LoadRecord() as overall:
        for model_name in models:
            for n in world_sizes:
                load_before = load_average()
                t0 = time.perf_counter()
                try:
                    per_rank = run_distributed(
                        _worker,
                        n,
                        model_name,
                        [FRACTIONS[f] for f in fractions],
                        settings,
                        timeout=args.timeout,
                    )
                except DistributedTestError as exc:
                    errors.append(f"{model_name} N={n}: {exc}")
                    print(f"{model_name} N={n}: FAILED\n{exc}", file=sys.stderr, flush=True)
                    continue
                wall = time.perf_counter() - t0
                load_after = load_average()
                print(
                    f"{model_name} N={n}: {wall:.1f} s, load 1m {load_before[0]:.2f} -> "
                    f"{load_after[0]:.2f}",
                    flush=True,
                )
                for i, fraction_name in enumerate(fractions):
                    row = {
                        "model": model_name,
                        "fraction_name": fraction_name,
                        "fraction": FRACTIONS[fraction_name],
                        **_analyse([r[i] for r in per_rank], settings, avg_f, avg_i),
                        "group_wall_seconds": wall,
                        "load_before": list(load_before),
                        "load_after": list(load_after),
                    }
                    row["simulated_match"], row["simulated_differences"] = _compare_simulated(
                        row, simulated.get((model_name, n, fraction_name)), (avg_f, avg_i)
                    )
                    rows.append(row)
    total = time.perf_counter() - started
    print()
    print(_tables(rows, (avg_f, avg_i)))
    print(
        "\nMB = 10^6 bytes; kel = 10^3 elements; AR/fu = factor all-reduce per factor update; "
        "inv bc/iu = inverse broadcast per inverse update; grad bc/st = gradient broadcast per "
        "step; flags/st = 'layer_flags' per step (not in the cost model, not in avg/st); "
        "=cost: every rank's counts at every step and its memory equal kaisa.distributed.cost; "
        "=sim: max values equal results/distributed_cost.json. Times: fac-upd / inv-upd = "
        "steps updating the factors only / factors and second-order state; "
        f"avg@{avg_f},{avg_i} = medians weighted {1 - 1 / avg_f:.2f}/"
        f"{1 / avg_f - 1 / avg_i:.2f}/{1 / avg_i:.2f}; fprod and AR per factor-update step, "
        "decomp and inv bc per inverse-update step, precond and grad bc per step (AR times the "
        "launch in the hooks plus the final wait)."
    )
    for r in rows:
        for problem in r["problems"]:
            print(f"✗ {r['model']} N={r['world_size']} {r['fraction_name']}: {problem}")
        for difference in r["simulated_differences"]:
            print(f"≠ sim {r['model']} N={r['world_size']} {r['fraction_name']}: {difference}")
    if any(r["world_size"] == 2 and r["fraction_name"] == "hybrid-opt" for r in rows):
        print("note: at N=2, HYBRID-OPT (f=0.5) gives m=1 gradient worker, the MEM-OPT plan.")
    print(f"\ntotal {total:.1f} s; {overall.describe()}")
    if args.json:
        write_json(
            args.json,
            {
                "settings": {
                    **settings,
                    "average_intervals": [avg_f, avg_i],
                    "kfac_options": KFAC_OPTIONS,
                    "optimizer": "SGD(lr=0.1, momentum=0.9)",
                    "ddp": True,
                    "backend": "gloo",
                    "threads_per_process": 1,
                    "models": {
                        m: {"local_batch": MODELS[m][0], "input": MODELS[m][1]} for m in models
                    },
                    "timeout_seconds_per_group": args.timeout,
                    "simulated_json": args.simulated,
                },
                "machine": machine_info(),
                "load": overall.as_dict(),
                "total_seconds": total,
                "errors": errors,
                "rows": rows,
            },
        )
        print(f"wrote {args.json}")
    ok = not errors and all(r["matches_cost_model"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
