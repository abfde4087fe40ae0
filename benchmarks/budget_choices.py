"""The automatic choice of each suite workload at several ``time_budget`` values.

The choice (each side's representation and the intervals) depends on the
layers' shapes and the iteration's operator count only, not on the data or
the clock (``calibrate_budget=False``, the default), so one training step of
each workload's model on a random batch of its shape reads it. The other
options are the suite's one configuration (``--kfac``, JSON; default session
24's: factors and inverses every 5 steps, ``eigenvalue_correction='ekfac'``,
``eigenbasis_tolerance=0.05``, ``adaptive_intervals``). Prints, per
workload and budget, the sides held other than exact and the modelled share;
measures nothing on the clock.

    python benchmarks/budget_choices.py --workloads gpt,small_cnn,vit,gap_cnn \
        --budgets 1,1.25,1.5,2
"""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from common import kfac_json, set_threads

import kaisa
from kaisa.demo.config import WORKLOADS
from kaisa.demo.text import VOCAB_SIZE
from kaisa.demo.train import build_demo_model

CONFIGURATION = (
    '{"factor_update_steps": 5, "inv_update_steps": 5, "eigenvalue_correction": "ekfac", '
    '"eigenbasis_tolerance": 0.05, "adaptive_intervals": true}'
)
"""Session 24's one configuration without its budget (which the script varies)."""


def choice(workload: str, budget: float, options: dict[str, Any]) -> dict[str, Any]:
    """The automatic choice of ``workload``'s kaisa arm at ``budget``, after one step."""
    spec = WORKLOADS[workload]
    torch.manual_seed(0)
    if spec.dataset == "fortunes":
        model = build_demo_model(spec.model, context=spec.context)
        tokens = torch.randint(0, VOCAB_SIZE, (spec.batch_size, spec.context + 1))
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
    else:  # Fashion-MNIST's shape
        model = build_demo_model(spec.model, (1, 28, 28))
        inputs = torch.randn(spec.batch_size, 1, 28, 28)
        targets = torch.randint(0, 10, (spec.batch_size,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. layers the correction leaves out
        pre = kaisa.KFACPreconditioner(
            model, optimizer=optimizer, **{**options, "time_budget": budget}
        )
        out = model(inputs)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1)).backward()
        pre.step()
    made = pre.curvature_choice
    assert made is not None, "the options leave nothing to the automatic choice"
    pre.remove_hooks()
    return {
        "workload": workload,
        "time_budget": budget,
        "share": round(made.share, 3),
        "intervals": [made.factor_update_steps, made.inv_update_steps],
        "not_exact": {k: list(v) for k, v in made.specs.items() if tuple(v) != ("exact", "exact")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="gpt,small_cnn,vit,gap_cnn")
    parser.add_argument("--budgets", default="1,1.25,1.5,2")
    parser.add_argument("--kfac", default=CONFIGURATION, help="the other options (JSON)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    set_threads(args.threads)
    options = kfac_json(args.kfac)
    for workload in filter(None, args.workloads.split(",")):
        for budget in (float(b) for b in args.budgets.split(",")):
            print(json.dumps(choice(workload, budget, options)), flush=True)


if __name__ == "__main__":
    main()
