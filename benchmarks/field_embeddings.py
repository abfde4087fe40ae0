"""The language-model profile on a model whose lookups are not a sequence: field embeddings.

``profile='auto'`` reads 'language-model' from any ``nn.Embedding``. A
recommender's or a tabular model's field embeddings are lookups too (one
table row per value of each categorical field, the rows concatenated into an
MLP), and nothing chose the profile on such a model. This measures what the
profile does there against 'general' and against AdamW alone, on real data:
scikit-learn's digits (1797 8x8 scans, shipped with scikit-learn), each of
the 64 pixels read as a categorical field of 17 values (0-16), each field's
value looked up in one table (64 x 17 rows, 8 wide; :class:`FieldModel`),
the 64 vectors concatenated into a 512-128-10 GELU MLP. A fixed split holds
out 360 images (:data:`SPLIT_SEED`); batch 64 drawn with replacement, AdamW
(weight decay 0.01) at a constant learning rate, test accuracy every
``--eval-every`` steps (off the clock) until ``--target``.

Arms: ``adamw`` (AdamW alone), ``kaisa-auto`` (AdamW + kaisa, every option
at its default: the profile read from the model, 'language-model'),
``kaisa-general`` (the same with ``profile='general'``), each at every
learning rate of ``--lrs``, all of a seed's (arm, rate) runs in lockstep (one
step of each in turn, so the machine's load falls on all alike). Per arm and
seed the best rate is the one with the fewest steps to target (ties: less
time); reported per arm: the medians over seeds of its best steps, ms per
step and time. ``--arm NAME=JSON`` (repeatable) adds an AdamW + kaisa arm
with those options (e.g. ``'skip-table={"skip_layers": ["table"]}'``).
Nothing is asserted. ::

    python benchmarks/field_embeddings.py --threads 2 --seeds 0,1,2 --target 0.9 \\
        --json benchmarks/results/field_embeddings_s50.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
from budget_value import Run
from common import (
    ARM_SUMMARY_HEADERS,
    LoadRecord,
    arm_summaries,
    arm_summary_table,
    floats,
    format_table,
    machine_info,
    set_threads,
    write_json,
)
from torch import nn

import kaisa

#: The held-out images are the same for every run.
SPLIT_SEED = 1234
#: Images held out for the test accuracy.
TEST_IMAGES = 360
#: The arms: name and the preconditioner's options (``None``: AdamW alone).
ARMS: dict[str, dict[str, Any] | None] = {
    "adamw": None,
    "kaisa-auto": {},
    "kaisa-general": {"profile": "general"},
}


class FieldModel(nn.Module):
    """Categorical fields looked up in one embedding table, concatenated into an MLP."""

    def __init__(
        self, fields: int = 64, values: int = 17, width: int = 8, hidden: int = 128
    ) -> None:
        super().__init__()
        self.values = values
        self.table = nn.Embedding(fields * values, width)
        self.register_buffer("offsets", torch.arange(fields) * values, persistent=False)
        self.mlp = nn.Sequential(
            nn.Linear(fields * width, hidden), nn.GELU(), nn.Linear(hidden, 10)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``: ``(batch, fields)`` values in ``[0, values)``."""
        return self.mlp(self.table(ids + self.offsets).flatten(1))


@dataclasses.dataclass
class Data:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def load_digits_fields() -> Data:
    """scikit-learn's digits as 64 categorical fields, split by :data:`SPLIT_SEED`."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.as_tensor(digits.data, dtype=torch.long)
    y = torch.as_tensor(digits.target, dtype=torch.long)
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(SPLIT_SEED))
    test, train = order[:TEST_IMAGES], order[TEST_IMAGES:]
    return Data(x[train], y[train], x[test], y[test])


def make_run(arm: str, lr: float, seed: int, options: dict[str, Any] | None) -> Run:
    """One arm at one rate (``options``: the preconditioner's; ``None``: AdamW alone)."""
    torch.manual_seed(seed)  # the same initial weights for every arm of a seed
    model = FieldModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    pre = (
        None if options is None else kaisa.KFACPreconditioner(model, optimizer=optimizer, **options)
    )
    # The same batches for every arm of a seed.
    return Run(arm, lr, model, optimizer, pre, torch.Generator().manual_seed(seed))


def run_seed(args: argparse.Namespace, data: Data, seed: int) -> list[dict[str, Any]]:
    runs = [make_run(arm, lr, seed, options) for arm, options in args.arms for lr in args.lrs]
    for step in range(1, args.max_steps + 1):
        live = [r for r in runs if r.hit is None]
        if not live:
            break
        for r in live:
            idx = torch.randint(0, data.train_x.shape[0], (args.batch_size,), generator=r.generator)
            start = time.perf_counter()
            r.optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(r.model(data.train_x[idx]), data.train_y[idx])
            loss.backward()
            if r.preconditioner is not None:
                r.preconditioner.step()
            r.optimizer.step()
            r.seconds += time.perf_counter() - start
            r.steps = step
            if step % args.eval_every == 0:
                with torch.no_grad():
                    r.model.eval()
                    pred = r.model(data.test_x).argmax(1)
                    r.model.train()
                r.last_accuracy = (pred == data.test_y).float().mean().item()
                if r.last_accuracy >= args.target:
                    r.hit = step
    rows = []
    for r in runs:
        row = dict(seed=seed, **r.result())
        if r.preconditioner is not None:
            row["profile"] = r.preconditioner.options.profile
        rows.append(row)
    return rows


def _arm(text: str) -> tuple[str, dict[str, Any]]:
    name, sep, options = text.partition("=")
    try:
        parsed = json.loads(options) if sep else None
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--arm {name}: options are not JSON ({exc})") from None
    if not name or name in ARMS or not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(
            f"--arm takes NAME=JSON, a new name and a JSON object of kaisa options; got {text!r}"
        )
    return name, parsed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lrs", type=floats, default=[1e-3, 3e-3, 1e-2])
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-steps", type=int, default=1500)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument(
        "--arm",
        type=_arm,
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="an AdamW + kaisa arm with these options, besides the three (repeatable)",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    args.arms = [*ARMS.items(), *args.arm]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    set_threads(args.threads)
    data = load_digits_fields()
    print(f"target: test accuracy {args.target:g} on {TEST_IMAGES} held-out digits", flush=True)

    rows: list[dict[str, Any]] = []
    with LoadRecord() as load:
        for seed in seeds:
            rows += run_seed(args, data, seed)
            print(f"seed {seed} done", flush=True)

    summary = arm_summaries([arm for arm, _ in args.arms], rows, seeds)
    table = arm_summary_table(summary, decimals=2)
    print(format_table(ARM_SUMMARY_HEADERS, table))
    print(f"load average: {load.describe()}")
    result = {
        "target": args.target,
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "arm")},
        "machine": machine_info(),
        "load": load.as_dict(),
        "rows": rows,
        "summary": summary,
    }
    if args.json is not None:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
