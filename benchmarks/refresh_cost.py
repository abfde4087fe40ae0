"""What a refresh costs, with session 26's finiteness checks and with session 25's, side by side.

Every refresh of K-FAC's second-order state checks its factor (and an
eigendecomposition its eigenvectors, an inverse its result) for NaN and
Inf. Until session 26 that was ``torch.isfinite(t).all()``, which on the
CPU takes 25–44 ms for a ``3137 × 3137`` float32 factor at 2 threads.
:func:`kaisa.curvature.linalg.all_finite` sums instead (a finite sum has
only finite terms) and checks entry by entry only when the sum is not
finite: the same answer.

``--part sides`` times, per side width, the check both ways and one warm
low-rank refresh (``LowRankSide.refresh``) with either check, on the CPU
or, with ``--device cuda``, on a GPU (synchronised around each call).
``--part steps`` trains a workload's model twice from the same weights on
the same batches, in lockstep (blocks of ``--steps`` steps, the order
alternating every round): arm ``library``, and arm ``previous`` with the
entrywise checks patched in while it steps. The curvature is given
explicitly (session 24's choice for the workload, or ``--kfac``'s
options), so both arms hold the same sides. Reported: the median over
rounds of each arm's ms per step, of its refresh (``decomposition``) ms
per step, and their ratios, with the load before and after. Nothing is
asserted.

Session 26 also tried a low-rank refresh with one product with the factor
instead of three (the Ritz step on the previous refresh's columns). That
script, at d2f81c3, timed it too (3137 wide in rank 128: 25 ms against
107); it cost SmallCNN steps on seeds no choice was made on and was
reverted (benchmarks/README.md, "What a refresh costs"). ::

    python benchmarks/refresh_cost.py --threads 2 --part sides [--device cuda]
    python benchmarks/refresh_cost.py --threads 2 --part steps --workload small_cnn
    python benchmarks/refresh_cost.py --threads 2 --part steps --workload gpt
    python benchmarks/refresh_cost.py --threads 2 --part steps --workload gpt --kfac JSON
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from common import (
    LoadRecord,
    add_json_option,
    format_table,
    kfac_json,
    machine_info,
    set_threads,
    time_repeated,
    write_json,
)

import kaisa
import kaisa.curvature.linalg as linalg
import kaisa.curvature.representations as representations
import kaisa.curvature.shared as shared
from kaisa.curvature.costs import SideSpec
from kaisa.curvature.linalg import all_finite
from kaisa.curvature.representations import LowRankSide, make_side

#: Each workload's configuration for ``--part steps``: session 24's one
#: configuration with the representations its automatic choice held then.
CONFIGS: dict[str, dict[str, Any]] = {
    "small_cnn": {
        "curvature": {r"classifier\.1$": ["lowrank:128", "exact"], ".*": "exact"},
        "factor_update_steps": 5,
        "inv_update_steps": 5,
        "eigenvalue_correction": "ekfac",
        "eigenbasis_tolerance": 0.05,
    },
    "gpt": {
        "curvature": {r"mlp\.proj$": ["lowrank:128", "exact"], ".*": "exact"},
        "factor_update_steps": 5,
        "inv_update_steps": 5,
        "eigenvalue_correction": "ekfac",
        "eigenbasis_tolerance": 0.05,
    },
}


def entrywise_finite(*tensors: torch.Tensor) -> bool:
    """Session 25's check: ``torch.isfinite(t).all()`` of every tensor."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@contextlib.contextmanager
def entrywise_checks() -> Iterator[None]:
    """Session 25's entrywise checks (``torch.isfinite(t).all()``) in force inside the block."""
    modules = (linalg, representations, shared)
    saved = [m.all_finite for m in modules]
    for m in modules:
        m.all_finite = entrywise_finite  # type: ignore[assignment]
    try:
        yield
    finally:
        for m, check in zip(modules, saved, strict=True):
            m.all_finite = check  # type: ignore[assignment]


def _median_ms(
    f: Callable[[], object], repeats: int, warmup: int, device: torch.device | None = None
) -> float:
    """Median wall milliseconds of ``f()`` (on CUDA, synchronised before and after)."""
    call = f
    if device is not None and device.type == "cuda":

        def call() -> None:
            torch.cuda.synchronize(device)
            f()
            torch.cuda.synchronize(device)

    return 1e3 * statistics.median(time_repeated(call, repeats, warmup))


def _factor(n: int) -> torch.Tensor:
    """A Gram matrix of ``4n`` rows with a decaying spectrum (float32, as kaisa's factors)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(4 * n, n, generator=g) * torch.linspace(3.0, 0.01, n)
    return x.t() @ x / (4 * n)


def part_sides(
    sides: list[tuple[int, int]], repeats: int, warmup: int, device: torch.device | None = None
) -> list[dict[str, Any]]:
    """Per ``(n, rank)``: both checks of an ``n``-wide factor, one warm refresh with each."""
    device = device or torch.device("cpu")
    rows = []
    for n, k in sides:
        factor = _factor(n).to(device)
        row: dict[str, Any] = {"n": n, "rank": k, "device": str(device)}
        row["check_sum_ms"] = _median_ms(lambda f=factor: all_finite(f), repeats, warmup, device)
        row["check_entrywise_ms"] = _median_ms(
            lambda f=factor: entrywise_finite(f), repeats, warmup, device
        )
        for key, previous in (("refresh_library_ms", False), ("refresh_previous_ms", True)):
            side = make_side(
                SideSpec("lowrank", k),
                "bench.a",
                n,
                method="eigen",
                device=device,
                factor_dtype=torch.float32,
                inv_dtype=torch.float32,
                relative=True,
            )
            assert isinstance(side, LowRankSide)
            side.factor.copy_(factor)
            checks = entrywise_checks() if previous else contextlib.nullcontext()
            with checks:
                side.refresh(0.1)  # the cold refresh: every timed one is warm
                row[key] = _median_ms(lambda s=side: s.refresh(0.1), repeats, warmup, device)
        row["refresh_ratio"] = row["refresh_library_ms"] / row["refresh_previous_ms"]
        rows.append(row)
    return rows


class StepArm:
    """One copy of the workload's model with AdamW and kaisa; ``previous``: session 25's checks."""

    def __init__(self, name: str, workload: str, kfac: dict[str, Any], previous: bool) -> None:
        from kaisa.demo.train import build_demo_model

        torch.manual_seed(0)
        self.name, self.previous = name, previous
        if workload == "gpt":
            self.model = build_demo_model("gpt", context=64)
        else:
            self.model = build_demo_model(workload, image_shape=(1, 28, 28))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=4e-3)
        with self.patched():
            self.pre = kaisa.KFACPreconditioner(self.model, optimizer=self.optimizer, **kfac)
        self.ms: list[float] = []
        self.refresh_ms: list[float] = []

    def patched(self) -> contextlib.AbstractContextManager[None]:
        return entrywise_checks() if self.previous else contextlib.nullcontext()

    def steps(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """Train on ``batches``: ms per step, and the refresh's ms per step."""
        before = self.pre.telemetry.phase_seconds.get("decomposition", 0.0)
        with self.patched():
            start = time.perf_counter()
            for x, y in batches:
                logits = self.model(x)
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
                )
                loss.backward()
                self.pre.step()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            total = time.perf_counter() - start
        refresh = self.pre.telemetry.phase_seconds.get("decomposition", 0.0) - before
        return 1e3 * total / len(batches), 1e3 * refresh / len(batches)


def part_steps(
    workload: str, rounds: int, steps: int, warmup: int, kfac: dict[str, Any] | None = None
) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    if workload == "gpt":
        from kaisa.demo.text import load_text_corpus

        corpus = load_text_corpus()

        def batch() -> tuple[torch.Tensor, torch.Tensor]:
            return corpus.sample_batch(16, 64, generator)
    else:
        from kaisa.demo.data import load_fashion_mnist

        data = load_fashion_mnist()

        def batch() -> tuple[torch.Tensor, torch.Tensor]:
            index = torch.randint(0, data.train_x.shape[0], (128,), generator=generator)
            return data.train_x[index], data.train_y[index]

    kfac = CONFIGS[workload] if kfac is None else kfac
    arms = [StepArm("library", workload, kfac, False), StepArm("previous", workload, kfac, True)]
    warm = [batch() for _ in range(warmup)]
    for arm in arms:
        arm.steps(warm)
    with LoadRecord() as load:
        for r in range(rounds):
            block = [batch() for _ in range(steps)]
            for arm in arms[r % 2 :] + arms[: r % 2]:
                ms, refresh = arm.steps(block)
                arm.ms.append(ms)
                arm.refresh_ms.append(refresh)
    library, previous = arms
    return {
        "workload": workload,
        "kfac": kfac,
        "rounds": rounds,
        "steps": steps,
        "arms": {
            arm.name: {
                "ms_per_step": statistics.median(arm.ms),
                "refresh_ms_per_step": statistics.median(arm.refresh_ms),
                "rounds_ms": arm.ms,
                "rounds_refresh_ms": arm.refresh_ms,
            }
            for arm in arms
        },
        "step_ratio": statistics.median(
            a / b for a, b in zip(library.ms, previous.ms, strict=True)
        ),
        "load": load.as_dict(),
        "load_text": load.describe(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("sides", "steps"), default="sides")
    p.add_argument(
        "--sides",
        default="3137:128,3137:256,3137:8,513:128",
        help="--part sides: n:rank pairs, comma-separated",
    )
    p.add_argument("--workload", choices=sorted(CONFIGS), default="small_cnn")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="--part sides: cpu, cuda or cuda:K")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument(
        "--kfac",
        type=kfac_json,
        default=None,
        help="--part steps: KFACPreconditioner options (JSON) instead of the workload's "
        "session-24 configuration (CONFIGS)",
    )
    add_json_option(p, Path(__file__).parent / "results" / "refresh_cost.json")
    args = p.parse_args()
    set_threads(args.threads)
    result: dict[str, Any] = {"part": args.part, "threads": args.threads}
    if args.part == "sides":
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            p.error(f"--device {args.device}: this machine has no CUDA device")
        pairs = [(int(a), int(b)) for a, b in (s.split(":") for s in args.sides.split(","))]
        with LoadRecord() as load:
            rows = part_sides(pairs, args.repeats, min(args.warmup, 3), device)
        print(
            format_table(
                [
                    "side",
                    "rank",
                    "check: sum",
                    "entrywise",
                    "refresh: library",
                    "previous",
                    "ratio",
                ],
                [
                    [
                        r["n"],
                        r["rank"],
                        f"{r['check_sum_ms']:.2f}",
                        f"{r['check_entrywise_ms']:.2f}",
                        f"{r['refresh_library_ms']:.1f}",
                        f"{r['refresh_previous_ms']:.1f}",
                        f"{r['refresh_ratio']:.2f}",
                    ]
                    for r in rows
                ],
                title=f"ms, medians of {args.repeats}, on {device} ({args.threads} CPU threads)",
            )
        )
        result.update(rows=rows, load=load.as_dict())
        print(load.describe())
    else:
        result.update(part_steps(args.workload, args.rounds, args.steps, args.warmup, args.kfac))
        print(
            format_table(
                ["arm", "ms per step", "refresh ms per step"],
                [
                    [name, f"{a['ms_per_step']:.1f}", f"{a['refresh_ms_per_step']:.2f}"]
                    for name, a in result["arms"].items()
                ],
                title=f"{args.workload}: medians of {args.rounds} rounds of {args.steps} steps",
            )
        )
        print(f"library / previous step: {result['step_ratio']:.3f}; {result['load_text']}")
    result["machine"] = machine_info()
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
