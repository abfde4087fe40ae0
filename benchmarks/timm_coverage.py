"""timm's image models with kaisa's defaults: what is preconditioned, and do they train.

For each model of a list of widely used timm architectures (CNNs, ViTs,
Swin, MLP-Mixer, MetaFormers, mobile nets), built from timm's own
definitions with random weights (nothing downloaded):

- **at its published size** on the meta device (no memory; on the CPU where
  an initialiser does not run on the meta device): the share of the
  elements of its trainable parameters of two or more dimensions that kaisa
  preconditions (:func:`kaisa.layers.survey`), and what it leaves raw, with
  the reason and whether construction warns about it;
- **in a short run** (``--steps`` steps of AdamW with a ``KFACPreconditioner``
  at its defaults, ``--batch`` random images of ``--size`` pixels, 10 classes,
  on ``--device``): whether every loss and weight is finite, what
  ``coverage()`` lists as raw after training, the warnings raised, or the
  exception that stopped it.

::

    PYTHONPATH=. python benchmarks/timm_coverage.py [--device cuda] [--json OUT]

Needs ``timm`` (which needs ``torchvision``: not installable beside the
pinned CPU torch). It runs where both are, such as a GPU machine's image,
or on the CPU with timm installed on its own and the committed stand-in
for torchvision (``benchmarks/torchvision_standin/sitecustomize.py``; none
of these models calls torchvision)::

    pip install --no-deps --target /tmp/timmsite timm==1.0.31
    PYTHONPATH=benchmarks/torchvision_standin:/tmp/timmsite:. python benchmarks/...
"""

from __future__ import annotations

import argparse
import json
import math
import traceback
import warnings
from typing import Any

import timm
import torch
import torch.nn.functional as F
from weight_coverage import coverage

import kaisa

#: (timm name, options for the short run's smaller input)
MODELS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("resnet50", {}),
    ("resnet18", {}),
    ("resnext50_32x4d", {}),
    ("convnext_tiny", {}),
    ("efficientnet_b0", {}),
    ("tf_efficientnet_b0", {}),
    ("mobilenetv3_large_100", {}),
    ("regnety_016", {}),
    ("vit_small_patch16_224", {"img_size": 64}),
    ("deit_tiny_distilled_patch16_224", {"img_size": 64}),
    ("swin_tiny_patch4_window7_224", {"img_size": 112}),
    ("mixer_s16_224", {"img_size": 64}),
    ("poolformer_s12", {}),
    ("convmixer_768_32", {}),
    ("levit_128s", {"img_size": 64}),
    ("eva02_tiny_patch14_224", {"img_size": 56}),
)


def _survey(name: str) -> dict[str, Any]:
    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        where = "meta"
    except (NotImplementedError, RuntimeError):  # an initialiser the meta device lacks
        model = timm.create_model(name, pretrained=False)
        where = "cpu"
    share, total, raw = coverage(model)
    return {
        "elements": total,
        "preconditioned": share,
        "raw": [r._asdict() for r in raw],
        "built_on": where,
    }


def _run(name: str, options: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = timm.create_model(name, pretrained=False, num_classes=10, **options).to(device)
    model.train()
    size = options.get("img_size", args.size)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, size, size, generator=g).to(device)
    y = torch.randint(0, 10, (args.batch,), generator=g).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses: list[float] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pre = kaisa.KFACPreconditioner(model, optimizer=optimizer)
            for _ in range(args.steps):
                optimizer.zero_grad()
                out = model(x)
                if isinstance(out, tuple):  # distilled heads in training mode
                    out = sum(out) / len(out)
                loss = F.cross_entropy(out, y)
                loss.backward()
                pre.step()
                optimizer.step()
                losses.append(float(loss))
        except Exception as e:  # reported, not raised: the survey goes on
            return {
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc(),
                "losses": losses,
                "warnings": sorted({str(w.message) for w in caught}),
            }
    raw = [
        t.parameter
        for t in pre.coverage().raw()
        if dict(model.named_parameters())[t.parameter].ndim >= 2
    ]
    return {
        "finite": all(math.isfinite(v) for v in losses)
        and all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "losses": losses,
        "raw_after": raw,
        "reasons": {t.parameter: t.reason for t in pre.coverage().raw()},
        "warnings": sorted({str(w.message) for w in caught}),
    }


def _short(p: str) -> str:
    return p if len(p) < 48 else p[:22] + "…" + p[-22:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--models", default=None, help="comma-separated subset")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    chosen = [m for m in MODELS if args.models is None or m[0] in args.models.split(",")]
    rows = []
    for name, options in chosen:
        row: dict[str, Any] = {"model": name}
        try:
            row["survey"] = _survey(name)
        except Exception as e:
            row["survey"] = {"error": f"{type(e).__name__}: {e}"}
        row["run"] = _run(name, options, args)
        rows.append(row)
        print(f"{name}: done", flush=True)
    print(f"\ntimm {timm.__version__}, torch {torch.__version__}, device {args.device}\n")
    print("| model | ≥2-D elements | preconditioned | raw at published size | short run |")
    print("| --- | ---: | ---: | --- | --- |")
    for row in rows:
        s, r = row["survey"], row["run"]
        if "error" in s:
            cells = ["-", "-", f"survey failed: {s['error'][:80]}"]
        else:
            listing = "; ".join(
                f"`{_short(x['parameter'])}` ({x['elements'] / 1e6:.2f}M, "
                f"{x['reason'].split(':')[0]}, {'warned' if x['warned'] else 'not warned'})"
                for x in s["raw"]
            )
            cells = [
                f"{s['elements'] / 1e6:.1f}M",
                f"{100 * s['preconditioned']:.1f}%",
                listing or "—",
            ]
        if "error" in r:
            run = f"**crashed**: {r['error'][:120]}"
        else:
            run = ("finite" if r["finite"] else "**not finite**") + (
                f", loss {r['losses'][0]:.2f}→{r['losses'][-1]:.2f}, "
                f"{len(r['raw_after'])} ≥2-D raw, {len(r['warnings'])} warnings"
            )
        print(f"| {row['model']} | " + " | ".join(cells) + f" | {run} |")
    for row in rows:
        r = row["run"]
        if r.get("warnings") or r.get("error"):
            print(f"\n{row['model']}:")
            for w in r.get("warnings", []):
                print("  warning:", w[:300])
            if r.get("error"):
                print(r["trace"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
