"""Experiments on the eigenvalue correction that the library does not offer as options.

``steps_probe.py`` with one of three in-process changes to kaisa's exact
solve (issue 31's study of why the correction wins on the language model
and loses on the image workloads). They are experiments, not library
options: each patches one function or class of ``kaisa.curvature.block``
before the run, and nothing here is asserted. Each row of ``--out`` names
the change (``variant``).

``--power P``
    the exact eigen solve divides the rotated gradient by
    ``(λ_G λ_Aᵀ + γ)^P`` instead of ``(λ_G λ_Aᵀ + γ)`` (``P = 1`` is
    K-FAC; ``P = ½`` is its Adagrad/Shampoo-like square root, which the
    correction's ``√S`` resembles when ``S`` is dominated by gradient
    noise). Layers with non-exact sides are unchanged.
``--correct-layers REGEX``
    ``eigenvalue_correction`` applies only to layers whose name matches
    ``REGEX`` (the others keep K-FAC's solve), to find where its gain is.
``--diagnose FILE``
    every 100 steps, for each corrected layer with exact sides, fit
    ``log S`` (the measured second moments in the eigenbasis) against
    ``log λ_G λ_A`` (K-FAC's prediction of them) and append the slope,
    R², residual and spreads to ``FILE`` as a JSON line (slope 1 and a
    small residual: the Kronecker eigenvalues rank the coordinates as the
    gradients do). Needs ``--kfac '{"curvature": "exact",
    "eigenvalue_correction": "adam", ...}'``.

``--block-size B``
    every exact side wider than ``B`` (eigen method) is decomposed block by
    block: the factor's diagonal blocks of at most ``B`` rows (equal splits)
    are decomposed alone and ``Q`` is block-diagonal, as blocked Shampoo
    does, which would make the decomposition and the per-step rotations
    cheaper for wide sides. Here ``Q`` is still stored and applied dense, so
    only the steps are measured, not the time.

Every other argument is ``steps_probe.py``'s::

    python benchmarks/correction_variants.py --power 0.5 --workload gpt \\
        --arm kaisa-adamw --lr 0.003 --seeds 0 --max-steps 1000 \\
        --kfac '{"curvature": "exact", "factor_update_steps": 10,
                 "inv_update_steps": 20, "damping": 0.003}'
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from pathlib import Path
from typing import Any

import steps_probe
import torch

import kaisa
import kaisa.curvature.block as block
import kaisa.curvature.representations as rep


def use_power(power: float) -> None:
    """The exact eigen solve with ``(λ_G λ_Aᵀ + γ)^-power`` (both of its code paths)."""

    def scaled(dg: torch.Tensor, da: torch.Tensor, damping: float) -> torch.Tensor:
        return torch.outer(dg, da).add_(damping).clamp_min_(0).pow_(-power)

    solve = block.precondition_eigen

    def precondition_eigen(
        grad: torch.Tensor, qa: torch.Tensor, qg: torch.Tensor, **given: Any
    ) -> torch.Tensor:
        # The library's solve, given the divisor's powered reciprocal.
        outer = given.get("outer_inverse")
        if outer is None:
            outer = scaled(given["dg"], given["da"], given["damping"])
        return solve(grad, qa, qg, outer_inverse=outer)

    block.precondition_eigen = precondition_eigen  # type: ignore[assignment]
    block.eigen_outer_inverse = scaled  # type: ignore[assignment]


def use_blocks(size: int) -> None:
    """Exact sides wider than ``size`` decomposed in diagonal blocks (block-diagonal ``Q``)."""
    compute = rep.ExactSide._compute_state

    def blocked(self: Any, damping: float) -> list[torch.Tensor]:
        if self.method != "eigen" or self.size <= size:
            return compute(self, damping)
        n, factor = self.size, self.factor
        q = torch.zeros(n, n, dtype=self.inv_dtype, device=factor.device)
        values = torch.empty(n, dtype=self.inv_dtype, device=factor.device)
        parts = -(-n // size)
        edges = [round(k * n / parts) for k in range(parts + 1)]
        for lo, hi in itertools.pairwise(edges):
            q[lo:hi, lo:hi], values[lo:hi] = rep.symmetric_eigen(
                factor[lo:hi, lo:hi], self.inv_dtype
            )
        return [q, values]

    rep.ExactSide._compute_state = blocked  # type: ignore[method-assign]


def correct_only(pattern: str) -> None:
    """The eigenvalue correction on layers whose name matches ``pattern`` only."""
    regex = re.compile(pattern)
    init = block.KroneckerBlock.__init__

    def patched(self: Any, name: str, *args: Any, **kwargs: Any) -> None:
        if not regex.search(name):
            kwargs["correction"] = "off"
        init(self, name, *args, **kwargs)

    block.KroneckerBlock.__init__ = patched  # type: ignore[method-assign]


def layer_fit(layer: Any) -> dict[str, Any] | None:
    """How ``log S`` follows ``log λ_G λ_A`` in one corrected exact layer (None otherwise)."""
    b = layer.block
    if b.eigen_scales is None or not b.exact:
        return None
    s = b.eigen_scales.scales.double()
    dg, da = (t.double() for t in b._eigenvalues())
    k = torch.outer(dg, da)
    keep = (k > 1e-8 * k.max()) & (s > 0)
    x, y = k[keep].log(), s[keep].log()
    xc, yc = x - x.mean(), y - y.mean()
    slope = float((xc * yc).sum() / (xc * xc).sum())
    r2 = float((xc * yc).sum() ** 2 / ((xc * xc).sum() * (yc * yc).sum()))
    return {
        "layer": layer.name,
        "shape": list(s.shape),
        "slope": round(slope, 3),
        "r2": round(r2, 3),
        "residual_sd": round(float((yc - slope * xc).std()), 3),
        "log_ratio_sd": round(float((y - x).std()), 3),
        "log_k_sd": round(float(x.std()), 3),
        "log_s_sd": round(float(y.std()), 3),
    }


def diagnose(out: Path, tag: str) -> None:
    """Append every corrected layer's :func:`layer_fit` to ``out`` every 100 steps."""
    step = kaisa.KFACPreconditioner.step

    def logged(self: kaisa.KFACPreconditioner) -> None:
        step(self)
        if self.steps % 100 == 0:
            fits = [f for f in (layer_fit(layer) for layer in self._roster) if f is not None]
            with out.open("a") as f:
                f.write(json.dumps({"tag": tag, "step": self.steps, "layers": fits}) + "\n")

    kaisa.KFACPreconditioner.step = logged  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--power", type=float, default=None)
    p.add_argument("--correct-layers", default=None, metavar="REGEX")
    p.add_argument("--diagnose", type=Path, default=None, metavar="FILE")
    p.add_argument("--block-size", type=int, default=None, metavar="B")
    ours, rest = p.parse_known_args(argv)
    given = {k.replace("_", "-"): v for k, v in vars(ours).items() if v is not None}
    variant = " ".join(f"--{name} {value}" for name, value in given.items())
    if ours.power is not None:
        if not 0 < ours.power <= 2:
            p.error(f"--power must be in (0, 2]; got {ours.power}")
        use_power(ours.power)
    if ours.block_size is not None:
        if ours.block_size < 1:
            p.error(f"--block-size must be a positive integer; got {ours.block_size}")
        use_blocks(ours.block_size)
    if ours.correct_layers is not None:
        correct_only(ours.correct_layers)
    if ours.diagnose is not None:
        diagnose(ours.diagnose, " ".join(rest))
    return steps_probe.main(rest, variant=variant or None)


if __name__ == "__main__":
    raise SystemExit(main())
