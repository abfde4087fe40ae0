"""Learning-rate transfer on timm's models: AdamW alone against AdamW + kaisa at AdamW's rates.

Issue 31's rule: kaisa put in front of an optimizer, at that optimizer's own
tuned learning rate, must not lose to the optimizer alone. Checked here on
models people bring (timm's definitions, random initialisation) on real
data: Fashion-MNIST, padded to 32 × 32, one input channel, 10 classes.

For each model, AdamW (weight decay 0.05, 10% linear warm-up, then cosine
to zero over ``--steps``) at each rate of ``--lrs``, and AdamW with a
``KFACPreconditioner`` at its defaults in front of it at the same rates:
the same initial weights and the same batches for every run of a seed.
Reported per run: test accuracy (all 10,000 test images, or ``--test-images``) every
``--eval-every`` steps and at the end, and ms per step (runs one after
another on the same device, not in lockstep: a rough cost). Per model: the
rate at which AdamW alone ends best, and kaisa's accuracy at that rate and
at its own best rate::

    PYTHONPATH=. python benchmarks/timm_lr_transfer.py --device cuda \\
        --data-dir /usr/share/datasets/fashion-mnist --json OUT

Needs ``timm`` (and so ``torchvision``): see ``timm_coverage.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import timm
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.demo.data import load_fashion_mnist

#: (timm name, options for 32 × 32 single-channel inputs)
MODELS: dict[str, dict[str, Any]] = {
    "resnet18": {},
    "convnext_atto": {},
    "vit_tiny_patch16_224": {"img_size": 32, "patch_size": 4},
    "efficientnet_b0": {},
    "tf_efficientnet_b0": {},  # its strided convolutions pad as TensorFlow's 'SAME'
    # Its attention applies qkv with F.linear itself; rotary positions.
    "eva02_tiny_patch14_224": {"img_size": 32, "patch_size": 4},
    # timm has no small BEiT: its base configuration at EVA-02-tiny's width (192, 3 heads,
    # 12 blocks); like EVA's, its head starts at head_init_scale=0.001 of the usual scale.
    "beit_base_patch16_224": {
        "img_size": 32,
        "patch_size": 4,
        "embed_dim": 192,
        "depth": 12,
        "num_heads": 3,
    },
}


def _schedule(step: int, steps: int) -> float:
    warm = max(1, steps // 10)
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


@torch.no_grad()
def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    right = 0
    for i in range(0, x.shape[0], 1000):
        right += int((model(x[i : i + 1000]).argmax(1) == y[i : i + 1000]).sum())
    model.train()
    return right / x.shape[0]


def _run(
    name: str,
    start: dict[str, torch.Tensor],
    data: tuple[torch.Tensor, ...],
    lr: float,
    with_kaisa: bool,
    seed: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    train_x, train_y, test_x, test_y = data
    model = timm.create_model(name, pretrained=False, num_classes=10, in_chans=1, **MODELS[name])
    model.load_state_dict(start)
    model.to(args.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _schedule(s, args.steps))
    pre = (
        kaisa.KFACPreconditioner(model, optimizer=optimizer, **json.loads(args.kfac))
        if with_kaisa
        else None
    )
    order = torch.Generator().manual_seed(1000 + seed)
    curve: list[tuple[int, float]] = []
    clock: list[float] = []  # training seconds (evaluation excluded) at each evaluation
    losses: list[float] = []
    elapsed = 0.0
    for step in range(args.steps):
        idx = torch.randint(0, train_x.shape[0], (args.batch,), generator=order)
        x, y = train_x[idx].to(args.device), train_y[idx].to(args.device)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if pre is not None:
            pre.step()
        optimizer.step()
        scheduler.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed += time.perf_counter() - t0
        losses.append(float(loss.detach()))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append((step + 1, _accuracy(model, test_x, test_y)))
            clock.append(elapsed)
    raw = [t.parameter for t in pre.coverage().raw()] if pre is not None else []
    return {
        "model": name,
        "arm": "adamw+kaisa" if with_kaisa else "adamw",
        "lr": lr,
        "seed": seed,
        "final_accuracy": curve[-1][1],
        "curve": curve,
        "train_seconds_at_eval": clock,
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "finite": all(math.isfinite(v) for v in losses),
        "ms_per_step": 1000 * elapsed / args.steps,
        "raw": raw,
        "kfac": json.loads(args.kfac) if with_kaisa else None,
        # How often the curvature was found stale, the side refreshes in all, and
        # the intervals in force at the end (kaisa arm only).
        "stale_refreshes": pre.telemetry.stale_refreshes if pre is not None else None,
        "side_refreshes": pre.telemetry.side_refreshes if pre is not None else None,
        "intervals": (
            [pre.hyperparameters().factor_update_steps, pre.hyperparameters().inv_update_steps]
            if pre is not None
            else None
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--models", default="resnet18,convnext_atto,vit_tiny_patch16_224")
    parser.add_argument("--lrs", default="0.001,0.002,0.004")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--test-images", type=int, default=10000, help="the first N test images")
    parser.add_argument(
        "--kfac", default="{}", help="KFACPreconditioner options as JSON (default: its defaults)"
    )
    parser.add_argument("--arms", default="adamw,kaisa", help="adamw, kaisa or both")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    fm = load_fashion_mnist(args.data_dir)
    data = tuple(
        t if t.dtype == torch.int64 else F.pad(t, (2, 2, 2, 2), value=float(t.min()))
        for t in (fm.train_x, fm.train_y, fm.test_x, fm.test_y)
    )
    test = (
        data[2][: args.test_images].to(args.device),
        data[3][: args.test_images].to(args.device),
    )
    data = (data[0], data[1], *test)
    lrs = [float(v) for v in args.lrs.split(",")]
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in args.models.split(","):
            torch.manual_seed(seed)
            start = timm.create_model(
                name, pretrained=False, num_classes=10, in_chans=1, **MODELS[name]
            ).state_dict()
            arms = args.arms.split(",")
            for with_kaisa in [a == "kaisa" for a in ("adamw", "kaisa") if a in arms]:
                for lr in lrs:
                    row = _run(name, start, data, lr, with_kaisa, seed, args)
                    rows.append(row)
                    print(
                        f"{name} seed {seed} {row['arm']} lr {lr:g}: "
                        f"{100 * row['final_accuracy']:.2f}% "
                        f"({', '.join(f'{s}: {100 * a:.1f}' for s, a in row['curve'])}), "
                        f"{row['ms_per_step']:.1f} ms/step"
                        + ("" if row["finite"] else " NOT FINITE"),
                        flush=True,
                    )
    print(
        f"\ntimm {timm.__version__}, torch {torch.__version__}, device {args.device}, "
        f"{args.steps} steps, batch {args.batch}\n"
    )
    print(
        "| model | seed | AdamW's best rate: AdamW | AdamW + kaisa at that rate | "
        "AdamW + kaisa at its best rate | ms/step AdamW, + kaisa |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for seed in sorted({r["seed"] for r in rows}):
        for name in args.models.split(","):
            mine = [r for r in rows if r["model"] == name and r["seed"] == seed]
            if {r["arm"] for r in mine} != {"adamw", "adamw+kaisa"}:
                continue  # one arm only: its rows above are the result
            alone = max((r for r in mine if r["arm"] == "adamw"), key=lambda r: r["final_accuracy"])
            kaisa_rows = [r for r in mine if r["arm"] != "adamw"]
            same = next(r for r in kaisa_rows if r["lr"] == alone["lr"])
            best = max(kaisa_rows, key=lambda r: r["final_accuracy"])
            print(
                f"| {name} | {seed} | {alone['lr']:g}: {100 * alone['final_accuracy']:.2f}% | "
                f"{100 * same['final_accuracy']:.2f}% | {best['lr']:g}: "
                f"{100 * best['final_accuracy']:.2f}% | {alone['ms_per_step']:.1f}, "
                f"{same['ms_per_step']:.1f} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
