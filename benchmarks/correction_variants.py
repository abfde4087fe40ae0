"""Experiments on the eigenvalue correction that the library does not offer as options.

``steps_probe.py`` with in-process changes to kaisa's exact and corrected
solves (issue 31's study of why the correction wins on the language model
and loses on the image workloads, and of what would make it cheaper or
take fewer steps). They are experiments, not library options: each patches
a function or class of the library before the run, and nothing here is
asserted. Each row of ``--out`` names
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
    only the steps are measured, not the time. ``--block-sides REGEX``
    blocks only the sides whose name (``layer.a``, ``layer.g``) matches.
``--project-scales``
    at each basis refresh ``S`` is carried into the new eigenbasis
    (``S ← (R_G∘R_G) S (R_A∘R_A)ᵀ``, ``R = Q_newᵀ Q_old``) instead of being
    kept in place, coordinate by coordinate. ``--match-scales``: each new
    eigenvector takes the ``S`` of the old one an assignment on ``|Q_newᵀQ_old|``
    pairs it with (no moment mixed).
``--token-scales``
    ``S`` is folded from each token's gradient ``δ_i āᵢᵀ`` (EKFAC's
    per-example second moments) at the factor steps, instead of from the
    batch gradient's square at every step (``nn.Linear`` layers).
``--scale-power P``
    ``'ekfac'`` divides by ``S^P`` rescaled to the factors' mean (``P = 1``:
    the library).
``--separable MODE``
    ``'ekfac'`` divides by the rank-one (separable) part of ``S``:
    ``S̃ = r cᵀ / m``, ``r`` and ``c`` its row and column means (weighted by
    the coordinates each entry stands for), ``m`` its mean, which a solve
    could apply as two side matrices ``Q diag(·) Qᵀ`` (K-FAC's inverse
    form, two products a step instead of four). ``elementwise``: ``S̃·μ/m +
    γ``, the library's damping; ``split``: ``(r̂ + γ_G)(ĉ + γ_A)`` with
    ``r̂, ĉ`` each at mean 1 and ``γ_G = γ_A = √γ`` (relative damping's
    split, what the two-matrix form would apply).
``--scale-every K``
    ``S`` is folded at one step in ``K`` (each layer's first call and every
    ``K``-th after it) with the decay ``ξ^K`` (the same window in steps,
    ``K`` times fewer samples); the other steps solve with ``S`` as it is.
    With ``--separable split`` this is what a solve through two side
    matrices rebuilt only when ``S`` changes would compute.
``--precondition-until S``
    kaisa preconditions the first ``S`` steps only: at its ``S + 1``-th
    ``step()`` it discards that step's captures and removes its hooks, and
    from then on the optimizer gets the raw gradients (does the curvature
    late in a run buy steps, or only the early curvature?).
``--row-cap R``
    factor products from every ``k``-th row, at most ``R`` of a call's
    rows, scaled to the full sum (cheaper factors on long batches).

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import steps_probe
import torch

import kaisa
import kaisa.curvature.block as block
import kaisa.curvature.representations as rep
from kaisa.demo.cli import positive_int


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


def precondition_until(steps: int) -> None:
    """kaisa's ``step()`` preconditions ``steps`` times, then detaches (raw gradients after)."""
    library_step = kaisa.KFACPreconditioner.step

    def step(self: kaisa.KFACPreconditioner) -> None:
        calls = getattr(self, "_variant_calls", 0)  # each preconditioner (seed) its own
        self._variant_calls = calls + 1  # type: ignore[attr-defined]
        if calls < steps:
            library_step(self)
        elif calls == steps:  # this step's captures go, and no later step captures
            self.discard_captures()
            self.remove_hooks()

    kaisa.KFACPreconditioner.step = step  # type: ignore[method-assign]


def use_blocks(size: int, sides: str | None = None) -> None:
    """Exact sides wider than ``size`` decomposed in diagonal blocks (block-diagonal ``Q``);
    with ``sides``, only the sides whose name (``layer.a`` or ``layer.g``) matches it."""
    compute = rep.ExactSide._compute_state
    regex = re.compile(sides) if sides is not None else None

    def blocked(self: Any, damping: float) -> list[torch.Tensor]:
        chosen = regex is None or regex.search(self.name)
        if self.method != "eigen" or self.size <= size or not chosen:
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


def carry_scales(match: bool) -> None:
    """At each basis refresh, carry ``S`` into the new eigenbasis instead of keeping it in place.

    ``R = Q_newᵀ Q_old`` per exact side. Projected (``match`` false):
    ``S ← (R_G∘R_G) S (R_A∘R_A)ᵀ``, each old coordinate's second moment spread
    over the new coordinates by the squared overlaps (the cross terms dropped).
    Matched: each new eigenvector takes the ``S`` of the old one it is paired
    with, the pairing that maximises the total ``|R|`` (an assignment, so no
    moment is mixed or used twice), so an eigenvector that swapped places with
    its neighbour keeps its own scale.
    """
    from scipy.optimize import linear_sum_assignment

    decompose = block.KroneckerBlock.decompose
    finish = block.KroneckerBlock.finish_update

    def stashed(self: Any, which: Any, damping: float) -> bool:
        side = self.sides[which]
        # Exact sides only: a diagonal side has no basis to carry through, and a
        # low-rank side's S has a rest row or column that no rotation maps.
        low_rank = any(isinstance(s, rep.LowRankSide) for s in self.sides.values())
        exact = isinstance(side, rep.ExactSide) and not low_rank
        if self.eigen_scales is not None and self.eigen_scales.updates and side.state and exact:
            old = getattr(self, "_old_bases", {})
            old[which] = side.work_state()[0].clone()
            self._old_bases = old
        return decompose(self, which, damping)

    def carried(r: torch.Tensor) -> torch.Tensor:
        """The matrix ``M`` (new × old) with ``S_new = M S_old`` on that side."""
        if not match:
            return r.square()
        _, old_of_new = linear_sum_assignment(r.abs().double().cpu().numpy(), maximize=True)
        m = torch.zeros_like(r)
        m[torch.arange(r.shape[0]), torch.as_tensor(old_of_new, device=r.device)] = 1.0
        return m

    def moved(self: Any, damping: float) -> None:
        finish(self, damping)
        old = getattr(self, "_old_bases", None)
        if not old or self.eigen_scales is None:
            return
        s = self.eigen_scales.scales
        new = {w: self.sides[w].work_state()[0] for w in old}
        if "g" in old:
            s = carried((new["g"].t() @ old["g"]).to(s.dtype)) @ s
        if "a" in old:
            s = s @ carried((new["a"].t() @ old["a"]).to(s.dtype)).t()
        self.eigen_scales.scales.copy_(s)
        self._old_bases = {}

    block.KroneckerBlock.decompose = stashed  # type: ignore[method-assign]
    block.KroneckerBlock.finish_update = moved  # type: ignore[method-assign]


def token_scales() -> None:
    """``S`` from each token's gradient (EKFAC's per-example second moments), not the batch's.

    A linear layer's token ``i`` has the gradient ``δ_i āᵢᵀ``; in the Kronecker
    eigenbasis its square is ``(Q_Gᵀδ_i)² (Q_Aᵀā_i)²ᵀ``, and their sum over the
    step's ``N`` tokens is one matrix product,
    ``((Δ Q_G)∘(Δ Q_G))ᵀ ((Ā Q_A)∘(Ā Q_A)) / N``. It is folded into ``S`` at the
    factor steps only (where the rows are captured; ``eigenvalue_decay`` per
    fold), and the batch gradient's square is not folded at all. Layers that
    are not ``nn.Linear`` keep the batch gradient's square.
    """
    import kaisa.capture as capture
    from kaisa.curvature.eigencorrection import corrected_solve
    from kaisa.layers.linear import LinearHandler

    rows: dict[str, dict[str, torch.Tensor]] = {}
    linear: set[str] = set()
    accumulate = capture.LayerCaptures.accumulate
    precondition = block.KroneckerBlock.precondition

    def stashed(self: Any, which: str, x: torch.Tensor, sampler: Any = None) -> None:
        if isinstance(self.handler, LinearHandler) and x.is_floating_point():
            r = x.reshape(-1, x.shape[-1]).float()
            if which == "a" and self.handler.has_bias:
                r = torch.cat([r, r.new_ones(r.shape[0], 1)], dim=1)
            rows.setdefault(self.name, {})[which] = r
            linear.add(self.name)
        accumulate(self, which, x, sampler)

    def solved(self: Any, grad: torch.Tensor, damping: float) -> torch.Tensor:
        es = self.eigen_scales
        a, g = self.sides["a"], self.sides["g"]
        low_rank = isinstance(a, rep.LowRankSide) or isinstance(g, rep.LowRankSide)
        if es is None or self.name not in linear or low_rank:
            # The library's solve and fold (a low-rank side's S has a rest row or column).
            return precondition(self, grad, damping)
        qa, qg = (
            side.work_state()[0] if isinstance(side, rep.ExactSide) else None for side in (a, g)
        )
        if len(rows.get(self.name, {})) == 2:
            step = rows.pop(self.name)
            a_rot = step["a"] @ qa if qa is not None else step["a"]
            g_rot = step["g"] @ qg if qg is not None else step["g"]
            tokens = (g_rot.square().t() @ a_rot.square()).div_(a_rot.shape[0])
            k = es.updates
            xi = min(self.correction_decay, k / (k + 1))
            es.scales.mul_(xi).add_(tokens, alpha=1.0 - xi)
            es.updates += 1
        relative = self.damping_mode == "relative"
        kron_mean = 1.0 if relative else g.mean_eigenvalue() * a.mean_eigenvalue()
        return corrected_solve(
            grad, qa, qg, es.scales, damping, self.correction, relative, kron_mean
        ).contiguous()

    capture.LayerCaptures.accumulate = stashed  # type: ignore[method-assign]
    block.KroneckerBlock.precondition = solved  # type: ignore[method-assign]


#: ``(library's divisor, S, γ, relative, μ, shares, mean) -> divisor``: a replacement for
#: :func:`kaisa.curvature.eigencorrection.divisor` under ``'ekfac'``.
EkfacDivisor = Callable[..., torch.Tensor]


def _replace_ekfac_divisor(replacement: EkfacDivisor) -> None:
    """Route the library's ``'ekfac'`` divisors through ``replacement`` (``'adam'`` unchanged)."""
    import kaisa.curvature.eigencorrection as ec

    divisor = ec.divisor

    def patched(
        scales: torch.Tensor,
        damping: float,
        correction: Any,
        relative: bool,
        kron_mean: Any = 1.0,
        shares: torch.Tensor | None = None,
        mean: float | None = None,
    ) -> torch.Tensor:
        if correction != "ekfac":
            return divisor(scales, damping, correction, relative, kron_mean, shares, mean)
        return replacement(divisor, scales, damping, relative, kron_mean, shares, mean)

    ec.divisor = patched


def scale_power(power: float) -> None:
    """``'ekfac'`` divides by ``S^power`` rescaled to the factors' mean (1: the library's)."""

    # (S's mean read on the host is not its power's: recomputed.)
    _replace_ekfac_divisor(
        lambda divisor, scales, damping, relative, kron_mean, shares, _mean: divisor(
            scales.clamp_min(0).pow(power), damping, "ekfac", relative, kron_mean, shares, None
        )
    )


def separable(mode: str) -> None:
    """``'ekfac'`` with ``S`` replaced by its rank-one part (module docstring)."""

    def rank_one(
        divisor: EkfacDivisor,
        scales: torch.Tensor,
        damping: float,
        relative: bool,
        kron_mean: Any,
        shares: torch.Tensor | None,
        mean: float | None,
    ) -> torch.Tensor:
        g, a = scales.shape
        if shares is None:
            shares = torch.full_like(scales, 1.0 / (g * a))
        p, q = shares.sum(1), shares.sum(0)  # shares = p qᵀ, each summing to 1
        rows = (scales * q).sum(1)  # the mean over each row, by the columns' shares
        cols = (scales * p.unsqueeze(1)).sum(0)
        m = float((scales * shares).sum())
        if mode == "elementwise":
            separable_part = torch.outer(rows, cols) / max(m, 1e-30)
            return divisor(separable_part, damping, "ekfac", relative, kron_mean, shares, None)
        if not relative:
            raise ValueError("--separable split is relative damping's split (γ_G = γ_A = √γ)")
        rows = rows / max(float((rows * p).sum()), 1e-30)
        cols = cols / max(float((cols * q).sum()), 1e-30)
        root = damping**0.5
        return torch.outer(rows + root, cols + root)

    _replace_ekfac_divisor(rank_one)


def scale_every(k: int) -> None:
    """``S`` folded at one step in ``k`` with the decay ``ξ^k`` (module docstring)."""
    import kaisa.curvature.eigencorrection as ec

    solve = ec.EigenScales.solve

    def sparse(
        self: Any,
        grad: torch.Tensor,
        qa: Any,
        qg: Any,
        damping: float,
        decay: float,
        correction: Any,
        relative: bool,
        kron_mean: Any = 1.0,
    ) -> torch.Tensor:
        n = getattr(self, "variant_calls", 0)  # this layer's calls so far
        self.variant_calls = n + 1
        if n % k == 0:
            return solve(self, grad, qa, qg, damping, decay**k, correction, relative, kron_mean)
        if ec.has_rest(qa) or ec.has_rest(qg):
            dtype = ec._dtype(qa, qg, self.scales)
            partial = ec.rotate_partial(grad, qa, qg, dtype)
            d = ec.divisor(self.scales, damping, correction, relative, kron_mean, self.shares)
            return ec.partial_solve(partial, qa, qg, d).to(grad.dtype)
        return ec.corrected_solve(
            grad, qa, qg, self.scales, damping, correction, relative, kron_mean
        )

    ec.EigenScales.solve = sparse  # type: ignore[method-assign]


def cap_rows(cap: int) -> None:
    """Factor products from every ``k``-th row, ``k = ⌈R/cap⌉`` (at most ``cap`` of a call's
    ``R`` rows), scaled by ``R`` over the rows used: an estimate of the full sum at
    about ``cap/R`` of its cost (linear layers, and whatever else uses ``gram``)."""
    import kaisa.layers.base as base
    import kaisa.layers.linear as linear

    gram = base.gram

    def capped(rows: torch.Tensor, out: torch.Tensor | None, scale: float = 1.0) -> torch.Tensor:
        n = rows.shape[0]
        if n <= cap:
            return gram(rows, out, scale)
        sub = rows[:: -(-n // cap)]
        return gram(sub, out, scale * n / sub.shape[0])

    base.gram = capped
    linear.gram = capped  # type: ignore[attr-defined]


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
    p.add_argument("--block-size", type=positive_int, default=None, metavar="B")
    p.add_argument("--block-sides", default=None, metavar="REGEX")
    p.add_argument("--project-scales", action="store_const", const="on", default=None)
    p.add_argument("--match-scales", action="store_const", const="on", default=None)
    p.add_argument("--token-scales", action="store_const", const="on", default=None)
    p.add_argument("--scale-power", type=float, default=None, metavar="P")
    p.add_argument("--row-cap", type=positive_int, default=None, metavar="R")
    p.add_argument("--separable", choices=("elementwise", "split"), default=None)
    p.add_argument("--scale-every", type=positive_int, default=None, metavar="K")
    p.add_argument("--precondition-until", type=positive_int, default=None, metavar="S")
    ours, rest = p.parse_known_args(argv)
    given = {k.replace("_", "-"): v for k, v in vars(ours).items() if v is not None}
    variant = " ".join(f"--{name} {value}" for name, value in given.items())
    if ours.power is not None:
        if not 0 < ours.power <= 2:
            p.error(f"--power must be in (0, 2]; got {ours.power}")
        use_power(ours.power)
    if ours.block_sides is not None and ours.block_size is None:
        p.error("--block-sides needs --block-size")
    if ours.block_size is not None:
        use_blocks(ours.block_size, ours.block_sides)
    if ours.project_scales is not None and ours.match_scales is not None:
        p.error("--project-scales and --match-scales are two ways to carry S; give one")
    if ours.project_scales is not None or ours.match_scales is not None:
        carry_scales(match=ours.match_scales is not None)
    if ours.token_scales is not None:
        token_scales()
    if ours.scale_power is not None:
        if not 0 < ours.scale_power <= 2:
            p.error(f"--scale-power must be in (0, 2]; got {ours.scale_power}")
        scale_power(ours.scale_power)
    if ours.scale_every is not None:
        scale_every(ours.scale_every)
    if ours.separable is not None:
        separable(ours.separable)
    if ours.row_cap is not None:
        cap_rows(ours.row_cap)
    if ours.precondition_until is not None:
        precondition_until(ours.precondition_until)
    if ours.correct_layers is not None:
        correct_only(ours.correct_layers)
    if ours.diagnose is not None:
        diagnose(ours.diagnose, " ".join(rest))
    return steps_probe.main(rest, variant=variant or None)


if __name__ == "__main__":
    raise SystemExit(main())
