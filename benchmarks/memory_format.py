"""Step and test-pass time of the demo's network in contiguous and channels_last layout.

The demo trains both arms in ``torch.channels_last`` (``DemoConfig.channels_last``).
This measures what that buys: GapCNN (the demo's model) on Fashion-MNIST-sized
input (batch 128, 1x28x28, random values and labels), SGD with momentum with
and without ``kaisa.KFACPreconditioner`` (the demo's K-FAC settings), in both
layouts. The four configurations are timed in rounds, interleaved, each round
``--steps`` training steps per configuration after ``--warmup`` untimed ones
(so factor and inverse updates fall in the timed steps as in training); one
10,000-image test pass (batch 256, no gradients) per layout and round is
timed as well. Reported: the medians over rounds of the mean step time and of
the test pass, the ratios, and the load average before and after. Nothing is
asserted.

    python benchmarks/memory_format.py --threads 2 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from common import format_table, load_average, set_threads

from kaisa import KFACPreconditioner
from kaisa.models import build_model

KFAC: dict[str, Any] = {
    "factor_update_steps": 10,
    "inv_update_steps": 100,
    "damping": 0.03,
    "kl_clip": 0.003,
    "lr": 0.05,
    "conv_factor_estimator": "reduce",
    "damping_mode": "relative",
    "factor_init": "first_batch",
}


class Arm:
    """One model, optimizer and (optionally) preconditioner in one layout."""

    def __init__(self, kfac: bool, layout: torch.memory_format, batch: int) -> None:
        torch.manual_seed(0)
        self.layout = layout
        self.model = build_model("gap_cnn").to(memory_format=layout)  # type: ignore[call-overload]
        self.opt = torch.optim.SGD(
            self.model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4
        )
        self.pre = KFACPreconditioner(self.model, **KFAC) if kfac else None
        self.x = torch.randn(batch, 1, 28, 28)
        self.y = torch.randint(0, 10, (batch,))

    def steps(self, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            x = self.x.contiguous(memory_format=self.layout)
            self.opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(self.model(x), self.y)
            loss.backward()
            if self.pre is not None:
                self.pre.step()
            self.opt.step()
            float(loss.detach())
        return (time.perf_counter() - start) / n


@torch.no_grad()
def test_pass(layout: torch.memory_format, images: torch.Tensor) -> float:
    model = build_model("gap_cnn").to(memory_format=layout).eval()  # type: ignore[call-overload]
    start = time.perf_counter()
    for i in range(0, images.shape[0], 256):
        model(images[i : i + 256].contiguous(memory_format=layout))
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=128)
    args = p.parse_args()
    for name in ("threads", "rounds", "steps", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    set_threads(args.threads)
    before = [round(v, 2) for v in load_average()]
    layouts = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
    arms = {
        (kind, name): Arm(kind == "kaisa", layout, args.batch_size)
        for kind in ("sgd", "kaisa")
        for name, layout in layouts.items()
    }
    for arm in arms.values():
        arm.steps(args.warmup)
    images = torch.randn(10_000, 1, 28, 28)
    step_times: dict[tuple[str, str], list[float]] = {key: [] for key in arms}
    pass_times: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(args.rounds):
        for key, arm in arms.items():
            step_times[key].append(arm.steps(args.steps))
        for name, layout in layouts.items():
            pass_times[name].append(test_pass(layout, images))
    after = [round(v, 2) for v in load_average()]

    med = {key: statistics.median(v) * 1e3 for key, v in step_times.items()}
    rows = []
    for kind in ("sgd", "kaisa"):
        c, cl = med[(kind, "contiguous")], med[(kind, "channels_last")]
        rows.append([f"{kind} step (ms)", f"{c:.1f}", f"{cl:.1f}", f"{cl / c:.2f}"])
    c, cl = (statistics.median(pass_times[n]) for n in layouts)
    rows.append(["test pass, 10k images (s)", f"{c:.2f}", f"{cl:.2f}", f"{cl / c:.2f}"])
    print(
        format_table(
            ["", "contiguous", "channels_last", "ratio"],
            rows,
            title=(
                f"GapCNN, batch {args.batch_size}, {args.threads} threads, median of "
                f"{args.rounds} rounds of {args.steps} steps; load {before} -> {after}"
            ),
        )
    )
    for name in layouts:
        k, s = med[("kaisa", name)], med[("sgd", name)]
        print(f"KAISA / SGD step, {name}: {k / s:.3f}")


if __name__ == "__main__":
    main()
