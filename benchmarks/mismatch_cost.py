"""What the protected side's measure costs: Lanczos (the library) against a power iteration.

At the first factor update the automatic choice measures, for every free
side, what holding it diagonal would leave
(:func:`kaisa.autochoice.diagonal_mismatch`: the largest eigenvalue of the
diagonally scaled factor, from products with the factor). Session 40 found
it by power iteration (at most 100 products, relative tolerance 1e-6);
session 41 by Lanczos with full reorthogonalisation (at most
:data:`kaisa.autochoice.MISMATCH_ITERATIONS` products). Each product reads
the whole ``n × n`` factor, so the measure is bound by memory where the
gram product that made the factor (``rows × n²`` multiply-adds) is bound by
arithmetic.

For each width and kind of factor (a gram of ``--rows`` rows: ``wishart``,
independent Gaussian rows, whose top eigenvalues cluster; ``mean``, the
same with a dominant mean, as a layer's raw inputs; ``lowrank``, rows near
a 64-dimensional subspace) this times, in lockstep (the arms alternate
within every repeat), the gram product, the library's measure and the power
iteration, counts each one's products with the factor (untimed), and, up to
``--dense-up-to``, compares both values with a dense float64 eigenvalue.
Reported: medians over repeats, products, relative errors, the load before
and after. Nothing is asserted. ::

    python benchmarks/mismatch_cost.py --threads 2 --sizes 1024,4096,8192 --json
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import LoadRecord, add_json_option, format_table, machine_info, set_threads, write_json

from kaisa.autochoice import diagonal_mismatch, scaled_product

KINDS = ("wishart", "mean", "lowrank")

#: Session 40's power iteration: products at most, relative tolerance.
POWER_ITERATIONS = 100
POWER_TOLERANCE = 1e-6


def power_mismatch(factor: torch.Tensor, damping: float) -> float:
    """Session 40's measure: power iteration from the all-ones vector, Rayleigh quotient.

    The library's scaled factor, ``D^{-1/2} (F/mean + γI) D^{-1/2}``, through
    the library's own products with ``factor`` (:func:`kaisa.autochoice.scaled_product`).
    """
    product = scaled_product(factor, damping)
    if product is None:
        return 1.0
    n = factor.shape[0]
    v = torch.full((n,), n**-0.5, dtype=torch.float64, device=factor.device)
    value = 0.0
    for _ in range(POWER_ITERATIONS):
        w = product(v)
        new = float(v @ w)
        norm = float(w.norm())
        if not norm > 0.0:
            return 1.0
        v = w / norm
        converged = abs(new - value) <= POWER_TOLERANCE * abs(new)
        value = new
        if converged:
            break
    return max(value, 1.0) if math.isfinite(value) else 1.0


def dense_mismatch(factor: torch.Tensor, damping: float) -> float:
    """The same eigenvalue from the dense float64 matrix (``eigvalsh``)."""
    f = factor.double()
    n = f.shape[0]
    f = f / (f.diagonal().sum() / n)
    gamma = math.sqrt(damping)
    s = (f.diagonal().clamp_min(0.0) + gamma).rsqrt()
    m = s[:, None] * (f + gamma * torch.eye(n, dtype=torch.float64)) * s[None, :]
    return max(float(torch.linalg.eigvalsh(m)[-1]), 1.0)


def make_rows(kind: str, rows: int, n: int, seed: int) -> torch.Tensor:
    """``rows × n`` float32 rows of the given kind (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    if kind == "mean":
        x += 3.0
    elif kind == "lowrank":
        k = min(64, n)
        basis = torch.randn(k, n, generator=g) / math.sqrt(n)
        x = torch.randn(rows, k, generator=g) @ basis * math.sqrt(n / k) + 0.1 * x
    return x


def products_with(
    factor: torch.Tensor, measure: Callable[[torch.Tensor, float], float], damping: float
) -> int:
    """How many products with ``factor`` (its storage) one call of ``measure`` makes."""
    count = 0
    storage = factor.data_ptr()

    class Counter(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            nonlocal count
            first = args[0] if args else None
            if (
                func is torch.Tensor.matmul
                and isinstance(first, torch.Tensor)
                and first.data_ptr() == storage
            ):
                count += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        measure(factor, damping)
    return count


def measure(
    kind: str, n: int, rows: int, repeat: int, damping: float, dense_up_to: int, seed: int = 0
) -> dict[str, Any]:
    """One row: the arms timed in lockstep over ``repeat`` rounds, products, values, errors."""
    x = make_rows(kind, rows, n, seed)
    times: dict[str, list[float]] = {"gram": [], "library": [], "power": []}
    factor = x.T @ x / rows
    values: dict[str, float] = {}
    for r in range(repeat):
        order = ("gram", "library", "power") if r % 2 == 0 else ("power", "library", "gram")
        for arm in order:
            start = time.perf_counter()
            if arm == "gram":
                factor = x.T @ x / rows
            elif arm == "library":
                values["library"] = diagonal_mismatch(factor, damping)
            else:
                values["power"] = power_mismatch(factor, damping)
            times[arm].append(time.perf_counter() - start)
    dense = dense_mismatch(factor, damping) if n <= dense_up_to else math.nan

    def error(value: float) -> float:
        return abs(value - dense) / dense if math.isfinite(dense) else math.nan

    return {
        "kind": kind,
        "n": n,
        "rows": rows,
        "gram_ms": statistics.median(times["gram"]) * 1e3,
        "library_ms": statistics.median(times["library"]) * 1e3,
        "power_ms": statistics.median(times["power"]) * 1e3,
        # Counted in calls of their own, outside the timed ones.
        "library_products": products_with(factor, diagonal_mismatch, damping),
        "power_products": products_with(factor, power_mismatch, damping),
        "library_value": values["library"],
        "power_value": values["power"],
        "dense_value": dense,
        "library_error": error(values["library"]),
        "power_error": error(values["power"]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sizes", default="1024,4096,8192", help="factor widths, comma-separated")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    p.add_argument("--rows", type=int, default=1024, help="rows of each gram (tokens)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--damping", type=float, default=1e-3)
    p.add_argument(
        "--dense-up-to", type=int, default=4096, help="widths with a dense float64 reference"
    )
    add_json_option(p, Path(__file__).parent / "results" / "mismatch_cost.json")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        if k not in KINDS:
            p.error(f"--kinds: {k!r} is not one of {', '.join(KINDS)}")
    if args.repeat < 1 or args.rows < 1 or any(n < 1 for n in sizes):
        p.error("--repeat, --rows and every size must be at least 1")
    set_threads(args.threads)
    with LoadRecord() as load:
        rows = [
            measure(kind, n, args.rows, args.repeat, args.damping, args.dense_up_to)
            for n in sizes
            for kind in kinds
        ]
    print(
        format_table(
            [
                "n",
                "kind",
                "gram ms",
                "Lanczos ms",
                "products",
                "error",
                "power ms",
                "products",
                "error",
            ],
            [
                [
                    r["n"],
                    r["kind"],
                    r["gram_ms"],
                    r["library_ms"],
                    r["library_products"],
                    r["library_error"],
                    r["power_ms"],
                    r["power_products"],
                    r["power_error"],
                ]
                for r in rows
            ],
            title=f"diagonal_mismatch against the power iteration ({args.threads} threads)",
        )
    )
    print(load.describe())
    result = {
        "settings": vars(args),
        "machine": machine_info(),
        "load": load.as_dict(),
        "rows": rows,
    }
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
