"""Experiment: the demo and the sweep with two proposed K-FAC changes patched in.

Not a benchmark of the library as it is: this script monkeypatches two
behaviours of ``kaisa`` in its own process to measure what they would buy in
time to accuracy, before they are made real options of the core.

1. **No identity in the running averages.** Factors start as the identity
   and ``F <- xi F + (1 - xi) F_batch``. With the spec's scaling (conv ``A``
   divided by ``T^2``, ``delta`` as autograd delivers it for a mean loss) the
   batch factors' eigenvalues are 1e-20 to 1e-5, so the identity dominates
   the factors for thousands of steps (``0.95^k`` after ``k`` updates) and the
   preconditioner is SGD with a step-wise growing learning rate. Patched:
   ``factor_decay`` at the ``k``-th factor update is ``min(xi, k / (k + 1))``
   (the first update replaces the identity, then a running mean, then the
   usual decay). This part is possible with the public API (a callable
   ``factor_decay``) but does not help alone.
2. **Damping relative to each layer's factors.** The eigen solve divides by
   ``lambda_G lambda_A^T + gamma``; an absolute ``gamma`` of 1e-3 is 10^10
   times larger than a conv layer's eigenvalue products, so only the last
   Linear layer is really preconditioned. Patched: the eigenvalues are divided
   by their means before the outer product (``gamma`` relative to
   ``mean(lambda_G) mean(lambda_A)``), so every layer's preconditioner has
   unit mean scale and ``gamma`` means the same in every layer.

Usage (single process only: torchrun workers would not be patched)::

    python benchmarks/kfac_fix_experiment.py sweep --out benchmarks/results/lr_sweep_fixes.json \\
        --arm kaisa --lrs 0.1,0.2 --dampings 0.003,0.01,0.03 --conv-factor-estimator reduce
    python benchmarks/kfac_fix_experiment.py demo --kaisa-lr 0.1 --damping 0.03 --out runs/fixes
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kaisa.preconditioner as _pre
from kaisa.curvature import block as _block

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _finish_update(self: Any, damping: float) -> None:
    if self.eigen_outer_product:
        lg = self.second_order["g"][1].clamp(min=0)
        la = self.second_order["a"][1].clamp(min=0)
        lg = lg / lg.mean().clamp(min=1e-30)
        la = la / la.mean().clamp(min=1e-30)
        self.outer_inverse = _block.eigen_outer_inverse(lg, la, damping)
        self.outer_damping = damping


def _decay_schedule(every: int, decay: float) -> Callable[[int], float]:
    def at(step: int) -> float:
        k = step // every
        return min(decay, k / (k + 1))

    return at


_original_init = _pre.KFACPreconditioner.__init__


def _init(self: Any, model: torch.nn.Module, **kwargs: Any) -> None:
    every = kwargs.get("factor_update_steps", 10)
    decay = kwargs.get("factor_decay", 0.95)
    if not isinstance(every, int) or callable(decay):
        raise SystemExit("kfac_fix_experiment: numeric factor_update_steps and factor_decay only")
    kwargs["factor_decay"] = _decay_schedule(every, float(decay))
    kwargs["compute_method"] = "eigen"
    kwargs["compute_eigenvalue_outer_product"] = True
    _original_init(self, model, **kwargs)


def main(argv: list[str]) -> int:
    _block.KroneckerBlock.finish_update = _finish_update  # type: ignore[method-assign]
    _pre.KFACPreconditioner.__init__ = _init  # type: ignore[method-assign]
    if not argv or argv[0] not in ("sweep", "demo"):
        print(__doc__)
        return 2
    if argv[0] == "sweep":
        import lr_sweep

        return lr_sweep.main(argv[1:])
    if "--nproc" in argv:
        raise SystemExit("kfac_fix_experiment: single process only")
    from kaisa.demo.cli import main as demo_main

    return demo_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
