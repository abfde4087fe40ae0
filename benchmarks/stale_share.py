"""How the share of eigenbases that go stale between refreshes changes over training.

One run of a suite workload's model with AdamW (constant learning rate, no
warm-up) behind ``kaisa.KFACPreconditioner`` with exact curvature, EKFAC,
``eigenbasis_tolerance`` and fixed factor and inverse intervals. After each
inverse update the script reads the telemetry: of the sides refreshed, the
share that decomposed (did not keep their basis). It prints that share
averaged over windows of ``--window`` steps, the measure
``adaptive_intervals`` acts on (``kaisa/cadence.py``). Nothing is asserted.

    python benchmarks/stale_share.py --workload gpt [--steps 400] [--window 50] [--json F]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import kaisa
from kaisa.demo.data import DEFAULT_DATA_DIR, load_fashion_mnist
from kaisa.demo.text import DEFAULT_TEXT_DIR, load_text_corpus
from kaisa.demo.train import build_demo_model

Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def _setup(workload: str, seed: int) -> tuple[torch.nn.Module, Batch, float]:
    """The workload's model, its batches by step, and AdamW's weight decay."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    if workload == "gpt":
        text = load_text_corpus(DEFAULT_TEXT_DIR)
        return (
            build_demo_model("gpt", context=64),
            lambda _step: text.sample_batch(16, 64, g),
            0.1,
        )
    data = load_fashion_mnist(DEFAULT_DATA_DIR)
    n = data.train_x.shape[0] // 128 * 128
    perm = torch.randperm(data.train_x.shape[0], generator=g)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = perm[(step * 128) % n : (step * 128) % n + 128]
        return data.train_x[idx], data.train_y[idx]

    return build_demo_model(workload, data.image_shape), batch, 5e-4


def stale_shares(
    workload: str, steps: int, interval: int, lr: float, tolerance: float, seed: int
) -> list[tuple[int, float]]:
    """``(step, share decomposed)`` after every inverse update of one run."""
    model, batch, weight_decay = _setup(workload, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    pre = kaisa.KFACPreconditioner(
        model,
        optimizer=opt,
        curvature="exact",
        factor_update_steps=interval,
        inv_update_steps=interval,
        eigenvalue_correction="ekfac",
        eigenbasis_tolerance=tolerance,
    )
    rows = []
    seen = kept = 0
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        out = model(x)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        pre.step()
        opt.step()
        t = pre.telemetry
        if t.side_refreshes != seen:
            share = 1.0 - (t.kept_eigenbases - kept) / (t.side_refreshes - seen)
            rows.append((step, share))
            seen, kept = t.side_refreshes, t.kept_eigenbases
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True, choices=["gpt", "gap_cnn", "small_cnn", "vit"])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.002)
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = stale_shares(
        args.workload, args.steps, args.interval, args.lr, args.tolerance, args.seed
    )
    windows = []
    for start in range(0, args.steps, args.window):
        shares = [s for step, s in rows if start <= step < start + args.window]
        if shares:
            mean = sum(shares) / len(shares)
            windows.append({"from": start, "to": start + args.window - 1, "share": mean})
            print(f"{args.workload} steps {start}-{start + args.window - 1}: decomposed {mean:.2f}")
    if args.json:
        record = {"settings": vars(args) | {"json": str(args.json)}, "windows": windows}
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
