"""Why AdamW + kaisa loses to AdamW on timm's EVA-02: short runs, one change each.

The run of ``timm_lr_transfer.py`` for ``eva02_tiny_patch14_224`` (32 × 32
Fashion-MNIST, patch 4, AdamW at 1e-3, 10% warm-up then cosine over
``--steps``, batch 128, seed 0), cut after ``--stop`` steps: the same
initial weights and batches as that script's seed 0, so its step-50
accuracy is this script's with ``--stop 50``. One line per run: test
accuracy on the first 2,000 test images after the last step, and the
training loss averaged over each 10 steps. Each run is one change:

- ``--kfac JSON``: ``KFACPreconditioner`` options (no ``--kfac``: AdamW
  alone), for example ``{"skip_layers": ["head"]}`` or
  ``{"curvature": {"^head$": ["diagonal", "auto"]}}``;
- ``--depth``: fewer blocks than the model's 12;
- ``--head-std``: the classifier re-drawn from N(0, std²) (timm draws
  EVA's at about 2e-5: ``head_init_scale=0.001``; ViT's at 0.02);
- ``--max-scaled-damping``: an experiment, not a kaisa option: exact sides
  take the relative damping's scale from their largest eigenvalue instead
  of their mean one (``ExactSide._scale_source`` replaced), so ``γ`` caps
  each side's spread at ``1/γ``;
- ``--trace``: every 5 steps, the layers whose preconditioned gradient is
  least aligned with the raw one (cosine/norm ratio), and those it
  scales most;
- ``--signal FILE``: every step, one JSON line: the loss, whether the step
  updated factors and inverses, the KL-clipping scale, and for every
  parameter of two or more dimensions the cosine between its preconditioned
  and raw gradients and their norm ratio (KL clipping divided out): the
  signal ``stale_refresh`` reads (session 47);
- ``--spectrum``: no training; the spectrum of the classifier's ``A``
  factor (its input with the bias's 1 appended, second moment over the
  first batch) at initialisation, in float64: the largest eigenvalue's
  share of the trace, the largest and the median over the mean.

Needs ``timm`` (and so ``torchvision``): see ``timm_coverage.py``::

    PYTHONPATH=. python benchmarks/eva_head_diagnosis.py --stop 50 --kfac '{}'
"""

from __future__ import annotations

import argparse
import json
import time

import timm
import torch
import torch.nn.functional as F
from timm_lr_transfer import MODELS, _schedule

import kaisa
from kaisa.demo.data import load_fashion_mnist


def _max_scaled_damping() -> None:
    """Exact sides scale their relative damping by their largest eigenvalue (experiment)."""
    from kaisa.curvature import representations

    def largest(side: representations.ExactSide) -> torch.Tensor:
        if side.method == "eigen":
            return side.work_state()[1].max().reshape(1)
        return side.factor.diagonal().max().reshape(1).to(side.work_dtype)

    representations.ExactSide._scale_source = largest  # type: ignore[method-assign]


def _alignment(
    raw: dict[str, torch.Tensor], model: torch.nn.Module
) -> list[tuple[float, float, str]]:
    rows = []
    for name, param in model.named_parameters():
        if name in raw and param.grad is not None:
            r, p = raw[name].flatten(), param.grad.flatten()
            cosine = float(r.dot(p) / (r.norm() * p.norm()).clamp_min(1e-30))
            rows.append((cosine, float(p.norm() / r.norm().clamp_min(1e-30)), name))
    return rows


def _print_head_spectrum(
    model: torch.nn.Module, train_x: torch.Tensor, args: argparse.Namespace
) -> None:
    """The classifier's ``A`` factor at initialisation, from the run's first batch."""
    order = torch.Generator().manual_seed(1000 + args.seed)
    idx = torch.randint(0, train_x.shape[0], (args.batch,), generator=order)
    seen: list[torch.Tensor] = []
    handle = model.get_classifier().register_forward_hook(
        lambda _m, inputs, _out: seen.append(inputs[0].detach())
    )
    with torch.no_grad():
        model(train_x[idx])
    handle.remove()
    a = seen[0].double().flatten(0, -2)
    a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], dim=1)
    values = torch.linalg.eigvalsh(a.T @ a / a.shape[0]).flip(0)
    mean = values.mean()
    print(
        f"{args.model} depth {args.depth or 'as built'} seed {args.seed}: head A of side "
        f"{values.numel()}: largest eigenvalue {float(values[0] / values.sum()):.3f} of the "
        f"trace, {float(values[0] / mean):.1f}x the mean; second {float(values[1] / mean):.1f}x; "
        f"median {float(values.median() / mean):.2g}x",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="eva02_tiny_patch14_224")
    parser.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=100, help="the schedule's length")
    parser.add_argument("--stop", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--head-std", type=float, default=None)
    parser.add_argument("--kfac", default=None, help="KFACPreconditioner options as JSON")
    parser.add_argument("--max-scaled-damping", action="store_true")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--spectrum", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--signal", default=None, help="write per-step per-layer JSON lines here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.max_scaled_damping:
        _max_scaled_damping()
    fm = load_fashion_mnist(args.data_dir)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (2, 2, 2, 2), value=float(t.min()))

    train_x, train_y = pad(fm.train_x), fm.train_y
    test_x, test_y = pad(fm.test_x)[:2000], fm.test_y[:2000]
    options = dict(MODELS[args.model])
    if args.depth is not None:
        options["depth"] = args.depth
    torch.manual_seed(args.seed)
    model = timm.create_model(
        args.model, pretrained=False, num_classes=10, in_chans=1, **options
    ).train()
    if args.head_std is not None:
        torch.nn.init.normal_(model.get_classifier().weight, std=args.head_std)
    if args.spectrum:
        _print_head_spectrum(model, train_x, args)
        return
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _schedule(s, args.steps))
    pre = (
        kaisa.KFACPreconditioner(model, optimizer=optimizer, **json.loads(args.kfac))
        if args.kfac is not None
        else None
    )
    order = torch.Generator().manual_seed(1000 + args.seed)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(args.stop or args.steps):
        idx = torch.randint(0, train_x.shape[0], (args.batch,), generator=order)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
        loss.backward()
        tracing = pre is not None and (args.signal or (args.trace and step % 5 == 4))
        raw = {
            n: p.grad.detach().clone()
            for n, p in model.named_parameters()
            if tracing and p.grad is not None and p.dim() >= 2
        }
        if pre is not None:
            captured, refreshes = pre.capturing, pre.telemetry.side_refreshes
            pre.step()
        if tracing and args.signal:
            kl = pre.telemetry.last_kl_scale
            rows = {n: (round(c, 4), m / kl) for c, m, n in _alignment(raw, model)}
            record = {
                "step": step + 1,
                "loss": round(loss.item(), 4),
                "factors": captured,
                "inverses": pre.telemetry.side_refreshes > refreshes,
                "kl": kl,
                "layers": rows,
            }
            with open(args.signal, "a") as out:
                out.write(json.dumps(record) + "\n")
        elif tracing:
            rows = _alignment(raw, model)
            least = sorted(rows)[:5]
            most = sorted(rows, key=lambda r: -r[1])[:5]
            show = " ".join(f"{n}:{c:.2f}/{m:.2g}" for c, m, n in least)
            print(f"step {step + 1} loss {loss.item():.3f} least aligned {show}", flush=True)
            show = " ".join(f"{n}:{c:.2f}/{m:.2g}" for c, m, n in most)
            print(f"    most scaled {show}", flush=True)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        accuracy = float((model(test_x).argmax(1) == test_y).float().mean())
    means = [
        round(sum(losses[i : i + 10]) / len(losses[i : i + 10]), 3)
        for i in range(0, len(losses), 10)
    ]
    hyper = pre.hyperparameters() if pre is not None else None
    print(
        f"{args.model} depth {args.depth or 'as built'} head_std {args.head_std} "
        f"kfac {args.kfac} max_scaled {args.max_scaled_damping}: "
        f"{100 * accuracy:.2f}% after {len(losses)} steps; loss per 10 steps {means}; "
        + (
            f"intervals at the end {hyper.factor_update_steps}/{hyper.inv_update_steps}, "
            f"factor decay {hyper.factor_decay:g}; stale refreshes "
            f"{pre.telemetry.stale_refreshes}; "
            if hyper is not None
            else ""
        )
        + f"{time.perf_counter() - start:.0f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
