"""What batching the eigenvalue-corrected solves of same-shape layers would save per step.

kaisa preconditions layer by layer: for each layer the rotation into the
Kronecker eigenbasis ``V = Q_Gᵀ ∇ Q_A``, the running average of ``V²``, the
division and the rotation back (``kaisa.curvature.eigencorrection``), about
a dozen operator calls. A transformer repeats its blocks, so its layers come
in groups of one shape. This measures, on the shapes of a model's Linear
layers, the per-layer solve as kaisa runs it (``EigenScales.solve``) against
the same solve with each group of same-shape layers stacked and computed by
batched products (``torch.bmm``) and one element-wise pass per group, and,
as a floor, the four products per layer alone. Random orthonormal bases and
gradients of the real shapes (``nn.Linear`` layers only: the packed projections
of ``nn.MultiheadAttention`` are not counted); the stacked copies of the gradients (and the
unstacking) are counted in the batched arm. The arms alternate, ``--rounds``
rounds of ``--repeats`` calls each; medians of the per-round means are
printed with the machine's load. Nothing is asserted; the batched arm is a
measurement of what a batched implementation could reach, not kaisa's code.

    python benchmarks/batched_rotations.py                      # gpt's shapes
    python benchmarks/batched_rotations.py --model vit --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from common import LoadRecord, format_table, set_threads
from torch import nn

from kaisa.curvature.eigencorrection import EigenScales, divisor
from kaisa.demo.train import build_demo_model


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """``(g, a)`` of every Linear layer: its gradient matrix with the bias column."""
    return [
        (m.out_features, m.in_features + (1 if m.bias is not None else 0))
        for m in model.modules()
        if isinstance(m, nn.Linear)
    ]


def orthonormal(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, n, generator=generator)).Q


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    set_threads(args.threads)
    model = (
        build_demo_model("gpt", context=64)
        if args.model == "gpt"
        else build_demo_model(args.model, (1, 28, 28))  # Fashion-MNIST's images
    )
    shapes = linear_shapes(model)
    gen = torch.Generator().manual_seed(0)
    layers = []
    for g, a in shapes:
        scales = EigenScales(torch.rand(g, a, generator=gen) + 0.1, updates=10)
        layers.append(
            (torch.randn(g, a, generator=gen), orthonormal(a, gen), orthonormal(g, gen), scales)
        )
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, (g, a) in enumerate(shapes):
        groups[(g, a)].append(i)
    stacked = {
        key: (
            torch.stack([layers[i][1] for i in idx]),
            torch.stack([layers[i][2] for i in idx]),
            torch.stack([layers[i][3].scales for i in idx]),
        )
        for key, idx in groups.items()
    }
    damping, decay = 0.03, 0.99

    def per_layer() -> None:
        for grad, qa, qg, scales in layers:
            scales.solve(grad, qa, qg, damping, decay, "ekfac", True)

    def batched() -> None:
        for key, idx in groups.items():
            qa, qg, s = stacked[key]
            grads = torch.stack([layers[i][0] for i in idx])
            v = torch.bmm(torch.bmm(qg.transpose(1, 2), grads), qa)
            s.mul_(decay).addcmul_(v, v, value=1.0 - decay)
            v.div_(torch.stack([divisor(s[j], damping, "ekfac", True) for j in range(len(idx))]))
            out = torch.bmm(torch.bmm(qg, v), qa.transpose(1, 2))
            for j, _ in enumerate(idx):
                out[j].contiguous()

    def products_only() -> None:
        for grad, qa, qg, _ in layers:
            v = qg.t() @ grad @ qa
            qg @ v @ qa.t()

    arms: dict[str, Callable[[], None]] = {
        "per-layer (kaisa's solve)": per_layer,
        "batched by shape": batched,
        "the products alone": products_only,
    }
    for fn in arms.values():  # warm-up
        for _ in range(3):
            fn()
    means: dict[str, list[float]] = {name: [] for name in arms}
    with LoadRecord() as load:
        for r in range(args.rounds):
            names = list(arms)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                start = time.perf_counter()
                for _ in range(args.repeats):
                    arms[name]()
                means[name].append(1000.0 * (time.perf_counter() - start) / args.repeats)
    base = statistics.median(means["per-layer (kaisa's solve)"])
    rows = [
        [name, round(statistics.median(ms), 2), round(statistics.median(ms) / base, 3)]
        for name, ms in means.items()
    ]
    flops = sum(2 * g * a * (g + a) * 2 for g, a in shapes)
    print(
        f"{args.model}: {len(shapes)} Linear layers in {len(groups)} shapes; "
        f"{flops / 1e9:.2f} GFLOP of rotations per step"
    )
    print(format_table(["arm", "ms per step", "vs per-layer"], rows))
    print("load:", load.as_dict())


if __name__ == "__main__":
    main()
