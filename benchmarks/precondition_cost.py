"""What ``preconditioner.step()`` costs per step on the suite's models, phase by phase.

For each model (the suite's image workloads by default; ``gpt`` too) the
script builds it with kaisa (its defaults, or ``--kfac``'s options) in front
of AdamW, trains ``--warmup`` steps on one fixed random batch of
Fashion-MNIST's shape (``gpt``: 16 windows of 64 bytes), so that the
automatic choice is made and the blocks hold real curvature, then, on one
set of gradients:

* ``precondition``: the preconditioning of every registered layer alone
  (the gradients restored before each call), median of ``--repeats`` calls;
* ``train``: the median of a full training step (forward, backward,
  ``step()``, AdamW) with and without kaisa, the two arms alternating, and
  their ratio.

With ``--profile``, also the operator calls one preconditioning makes
(``torch.profiler``, averaged over 50 calls; the gradient restore excluded)
and the five most frequent. With ``--flops``, the floating-point work of
its matrix products (``torch.profiler``'s count, averaged over 10 calls),
the time the profiler gives them and the rate that is, against this
machine's rate on one large product (``1024 × 1024 × 1024``, float32, the
same threads, the fastest of 20): ``floor`` is the products' work at that
rate, what the pass would cost if nothing but its products ran, as fast
as this machine runs a product.

The machine's load is printed before and after; nothing else should run.
Nothing is asserted.

    python benchmarks/precondition_cost.py
    python benchmarks/precondition_cost.py --models vit --repeats 400 --profile
    python benchmarks/precondition_cost.py --kfac '{"eigenvalue_correction": "ekfac"}'
    python benchmarks/precondition_cost.py --models gpt --flops --kfac '<options>'
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from common import kfac_json, load_average

import kaisa
from kaisa.models import build_model

BATCH = 128


def _median_ms(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _operator_calls(fn: Callable[[], None], restore: Callable[[], None]) -> list[tuple[str, float]]:
    """Operator calls per call of ``fn`` (minus ``restore``'s), most frequent first."""
    from torch.profiler import ProfilerActivity, profile

    counts: dict[str, float] = {}
    for sign, target in ((1.0, fn), (-1.0, restore)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(50):
                target()
        for event in prof.key_averages():
            if event.key.startswith("aten::"):
                counts[event.key] = counts.get(event.key, 0.0) + sign * event.count / 50
    return sorted(((k, v) for k, v in counts.items() if v > 0), key=lambda kv: -kv[1])


#: The aten operators whose floating-point work ``--flops`` counts (the matrix products).
PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _product_work(fn: Callable[[], None], calls: int = 10) -> tuple[float, float]:
    """``(GFLOP, ms)`` of the matrix products per call of ``fn`` (the profiler's count and
    self time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        for _ in range(calls):
            fn()
    flops = ms = 0.0
    for event in prof.key_averages():
        if event.key in PRODUCTS:
            flops += event.flops
            ms += event.self_cpu_time_total / 1e3
    return flops / calls / 1e9, ms / calls


def product_rate(size: int = 1024, repeats: int = 20) -> float:
    """This machine's float32 rate on one ``size³`` product, GFLOP/s: the fastest of
    ``repeats`` (a peak, not a typical rate), after three untimed."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / (best * 1e9)


def measure(
    name: str,
    warmup: int,
    repeats: int,
    profile: bool = False,
    kfac: dict[str, Any] | None = None,
    flops: bool = False,
) -> dict[str, Any]:
    torch.manual_seed(0)
    if name == "gpt":  # the suite's batch: 16 windows of 64 bytes, a byte predicted per position
        x, y = torch.randint(0, 256, (16, 64)), torch.randint(0, 256, (16, 64))
    else:
        x, y = torch.randn(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))

    def loss(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    models = {arm: build_model(name) for arm in ("adamw", "kaisa")}
    models["kaisa"].load_state_dict(models["adamw"].state_dict())
    optimizers = {arm: torch.optim.AdamW(m.parameters(), lr=1e-3) for arm, m in models.items()}
    pre = kaisa.KFACPreconditioner(models["kaisa"], lr=1e-3, **(kfac or {}))

    def train(arm: str) -> Callable[[], None]:
        def one() -> None:
            optimizers[arm].zero_grad()
            loss(models[arm](x)).backward()
            if arm == "kaisa":
                pre.step()
            optimizers[arm].step()

        return one

    for _ in range(warmup):
        train("kaisa")()
    # Alternating arms: whatever else the machine does slows both alike.
    times: dict[str, list[float]] = {"adamw": [], "kaisa": []}
    for _ in range(repeats):
        for arm in times:
            start = time.perf_counter()
            train(arm)()
            times[arm].append(time.perf_counter() - start)
    adamw, with_kaisa = (statistics.median(times[a]) * 1e3 for a in ("adamw", "kaisa"))

    model = models["kaisa"]
    optimizers["kaisa"].zero_grad()
    loss(model(x)).backward()
    saved = {p: p.grad.clone() for p in model.parameters() if p.grad is not None}

    def restore() -> None:
        for p, g in saved.items():
            assert p.grad is not None
            p.grad.copy_(g)

    def precondition_only() -> None:
        restore()
        for layer in pre._roster:  # as if every layer ran this step
            layer.captures.called = True
        pre._precondition(pre.hyperparameters())

    def restore_only() -> None:
        restore()

    precondition = _median_ms(precondition_only, repeats) - _median_ms(restore_only, repeats)
    calls = _operator_calls(precondition_only, restore_only) if profile else []
    work = _product_work(precondition_only) if flops else None
    return {
        "product_gflop": None if work is None else work[0],
        "product_ms": None if work is None else work[1],
        "operator_calls": calls,
        "layers": float(len(pre.layers)),
        "precondition_ms": precondition,
        "adamw_step_ms": adamw,
        "kaisa_step_ms": with_kaisa,
        "ratio": with_kaisa / adamw,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gap_cnn,small_cnn,vit")
    parser.add_argument("--warmup", type=int, default=100, help="training steps first")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per median")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="count operator calls")
    parser.add_argument("--flops", action="store_true", help="the products' work and rate")
    parser.add_argument(
        "--kfac", type=kfac_json, default=None, help="KFACPreconditioner options, as JSON"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load before {load_average()}")
    rate = product_rate() if args.flops else None
    if rate is not None:
        print(f"one 1024^3 float32 product: {rate:.0f} GFLOP/s at {args.threads} threads")
    print(
        f"{'model':<10} {'layers':>6} {'precondition':>13} {'AdamW step':>11} "
        f"{'+ kaisa step':>13} {'ratio':>6}"
    )
    for name in args.models.split(","):
        r = measure(name, args.warmup, args.repeats, args.profile, args.kfac, args.flops)
        print(
            f"{name:<10} {r['layers']:>6.0f} {r['precondition_ms']:>10.2f} ms "
            f"{r['adamw_step_ms']:>8.2f} ms {r['kaisa_step_ms']:>10.2f} ms {r['ratio']:>6.3f}"
        )
        if r["operator_calls"]:
            total = sum(count for _, count in r["operator_calls"])
            top = ", ".join(f"{k} {v:.0f}" for k, v in r["operator_calls"][:5])
            print(f"{'':<10} operator calls per preconditioning: {total:.0f} ({top})")
        if rate is not None:
            gflop, ms = r["product_gflop"], r["product_ms"]
            print(
                f"{'':<10} products: {gflop:.3f} GFLOP a pass, {ms:.2f} ms in the profiler "
                f"({gflop / max(ms, 1e-9) * 1e3:.0f} GFLOP/s); floor {gflop / rate * 1e3:.2f} ms"
            )
    print(f"load after {load_average()}")


if __name__ == "__main__":
    main()
