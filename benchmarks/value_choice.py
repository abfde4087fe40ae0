"""An automatic choice judged by what each side buys: the experiment behind the protected side.

Issue 31 (item 2) asks for the automatic curvature choice to weigh what
curvature buys, not only what it costs. The library's rule
(:func:`kaisa.curvature.budget.choose_curvature`) moved, while over budget,
whichever side or interval saved the most work; on a cheap-step MLP that is
the first layer's 785-wide input side, the one side that buys the steps
(``benchmarks/README.md``, "What a larger budget buys"). This script patches
the choice, in process, with a rule that also sees a value per side and
rung, and runs ``steps_probe.py`` (``probe``) or ``budget_value.py``
(``mlp``) with it. Nothing here is asserted. The library has since taken
the ``protect`` rule below as its own (``choose_curvature(protect=)``), so
under this script ``protect`` repeats it and ``worst`` is the experiment.

**The value** (:func:`top_ratio`): for each side, from the first
factor-update step's gram (the choice is made there, every free side held
exact until then), ``F`` scaled to mean eigenvalue 1 and the side's share
``γ = √damping`` of relative damping: the largest eigenvalue of
``(H + γI)⁻¹ (F + γI)``, ``H`` the matrix the rung holds (``F`` itself when
exact; the top ``k`` eigenpairs and the mean of the rest for ``lowrank:k``;
``diag(F)`` for ``diagonal``; ``kvec`` is valued as ``diagonal``; one
eigendecomposition of ``F`` and one of its diagonally scaled form per side,
once per run). It is how
far the worst direction the rung leaves is from its preconditioned scale:
with one learning rate for the whole model, the largest of these over all
sides bounds the stable step.

**The rules** (:func:`choose_valued`, ``--rule``): as the library's, except
how the next move is picked.

``worst`` (the default)
    the move after which the largest log-ratio over all sides (``J``) is
    smallest, ties to the largest saving (interval moves leave ``J`` as it
    is). So sides that do not bind are given up first and the side that
    binds last.
``protect``
    the library's move (the largest saving), except that the free side
    whose diagonal leaves the worst direction (the one that binds) is not
    taken below its lowest low rank while any other move is left: now the
    library's own rule (``choose_curvature(protect=)``), here with the
    side these values find.

::

    python benchmarks/value_choice.py mlp --seeds 0,1,2 --budgets 0.1 \\
        --exact "" --no-first-input-side --json results/value_choice_mlp.json
    python benchmarks/value_choice.py mlp --rule protect --seeds 0,1,2 ...
    python benchmarks/value_choice.py probe --workload small_cnn \\
        --arm kaisa-adamw --lr 0.004 --seeds 0,1,2 --threads 1 --out F
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

import kaisa.autochoice as autochoice
from kaisa.curvature import budget
from kaisa.curvature.costs import DEFAULT_COST_MODEL, CostModel, SideSpec

#: The rules :func:`choose_valued` knows (module docstring).
RULES = ("worst", "protect")
#: Per (layer, 'a' or 'g', rung as text): log of :func:`top_ratio`.
Values = Mapping[tuple[str, str, str], float]


def top_ratio(factor: torch.Tensor, spec: SideSpec, gamma: float) -> float:
    """Largest eigenvalue of ``(H + γI)⁻¹ (F + γI)``, ``F`` the factor at mean eigenvalue 1.

    ``H`` is what ``spec`` holds of ``F`` (module docstring). Float64.
    """
    return top_ratios(factor, [spec], gamma)[0]


def top_ratios(factor: torch.Tensor, specs: Sequence[SideSpec], gamma: float) -> list[float]:
    """:func:`top_ratio` for each of ``specs``, with one eigendecomposition of each kind."""
    f = factor.double()
    f = f / (f.trace() / f.shape[0])
    n = f.shape[0]
    eigenvalues: torch.Tensor | None = None
    diagonal: float | None = None
    out = []
    for spec in specs:
        if spec.kind == "exact":
            out.append(1.0)
        elif spec.kind == "lowrank":
            if eigenvalues is None:
                eigenvalues = torch.linalg.eigvalsh(f)
            rest = eigenvalues[: n - spec.rank]
            sigma = float(rest.mean())
            # Held directions are solved exactly (ratio 1); the rest by one scalar.
            out.append(max(1.0, (float(rest[-1]) + gamma) / (sigma + gamma)))
        else:  # 'diagonal' (and 'kvec', valued as it): the diagonally scaled factor
            if diagonal is None:
                d = (f.diagonal() + gamma).rsqrt()
                scaled = d[:, None] * (f + gamma * torch.eye(n, dtype=f.dtype)) * d[None, :]
                diagonal = float(torch.linalg.eigvalsh(scaled)[-1])
            out.append(diagonal)
    return out


def side_values(
    handlers: Sequence[tuple[str, Any]],
    reduced: Mapping[str, Mapping[tuple[str, str], tuple[torch.Tensor, float]]],
    damping: float,
) -> dict[tuple[str, str, str], float]:
    """:data:`Values` for every side whose gram this step captured."""
    gamma = math.sqrt(damping)
    out = {}
    for name, handler in handlers:
        payload = reduced.get(name, {})
        for side, size in (("a", handler.a_size), ("g", handler.g_size)):
            if (side, "gram") not in payload:
                continue
            total, rows = payload[side, "gram"]
            rungs = budget.ladder(size)
            for spec, ratio in zip(rungs, top_ratios(total / rows, rungs, gamma), strict=True):
                out[name, side, str(spec)] = math.log(ratio)
    return out


def choose_valued(
    layers: Sequence[budget.LayerWork],
    time_budget: float,
    values: Values,
    *,
    factor_update_steps: int | None = None,
    inv_update_steps: int | None = None,
    compute_method: str = "eigen",
    scale: float = 1.0,
    calibrated: bool = False,
    cost_model: CostModel = DEFAULT_COST_MODEL,
    rule: str = "worst",
) -> budget.BudgetChoice:
    """A rule of the module docstring (``rule``); the arguments are ``choose_curvature``'s."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}; got {rule!r}")
    if rule == "protect":
        # The library's rule, protecting the free side these values say binds.
        mismatch = {
            (layer.name, side): math.exp(values.get((layer.name, side, "diagonal"), 0.0))
            for layer in layers
            for side, fixed in (("a", layer.a_fixed), ("g", layer.g_fixed))
            if fixed is None
        }
        return budget.choose_curvature(
            layers,
            time_budget,
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            compute_method=compute_method,
            scale=scale,
            calibrated=calibrated,
            cost_model=cost_model,
            protect=budget.binding_side(mismatch),
        )
    ladders = [
        [
            [SideSpec.parse(fixed)] if fixed is not None else budget.ladder(n)
            for fixed, n in ((layer.a_fixed, layer.a_size), (layer.g_fixed, layer.g_size))
        ]
        for layer in layers
    ]
    index = [[0, 0] for _ in layers]
    f = factor_update_steps if factor_update_steps is not None else budget.MIN_FACTOR_STEPS
    i = inv_update_steps if inv_update_steps is not None else max(budget.MIN_INV_STEPS, f)

    def work(k: int, rungs: Sequence[int], f_: int, i_: int) -> float:
        a, g = ladders[k][0][rungs[0]], ladders[k][1][rungs[1]]
        return budget.kfac_work(layers[k], a, g, f_, i_, compute_method, cost_model=cost_model)

    def total(f_: int, i_: int) -> float:
        return sum(work(k, index[k], f_, i_) for k in range(len(layers)))

    def worst(moved: tuple[int, int, int] | None = None) -> float:
        """``J``: the largest log-ratio over the sides, with ``moved`` (layer, side, rung)."""
        out = 0.0
        for k, layer in enumerate(layers):
            for side in (0, 1):
                rung = moved[2] if moved is not None and moved[:2] == (k, side) else index[k][side]
                key = (layer.name, "ag"[side], str(ladders[k][side][rung]))
                out = max(out, values.get(key, 0.0))
        return out

    def key(k: int, side: int, rung: int) -> float:
        """``J`` after moving ``side`` of layer ``k`` to ``rung`` (interval moves: ``J`` now)."""
        return round(worst((k, side, rung)), 9)

    train = sum(budget.training_work(layer) for layer in layers)
    allowed = time_budget * scale * train
    current = total(f, i)
    while current > allowed:
        now = round(worst(), 9)
        # (the rule's key, -saving, kind, layer, side, rung); kind 0 a side, 1/2 an interval.
        moves: list[tuple[float, float, int, int, int, int]] = []
        for k in range(len(layers)):
            here = work(k, index[k], f, i)
            for side in (0, 1):
                trial = list(index[k])
                while trial[side] + 1 < len(ladders[k][side]):
                    trial[side] += 1
                    saving = here - work(k, trial, f, i)
                    if saving > 0.0:
                        moves.append((key(k, side, trial[side]), -saving, 0, k, side, trial[side]))
                        break
        if factor_update_steps is None and 2 * f <= budget.MAX_FACTOR_STEPS:
            new_i = i if inv_update_steps is not None else max(i, 2 * f)
            saving = current - total(2 * f, new_i)
            if saving > 0.0:
                moves.append((now, -saving, 1, 0, 0, 0))
        if inv_update_steps is None and 2 * i <= budget.MAX_INV_STEPS:
            saving = current - total(f, 2 * i)
            if saving > 0.0:
                moves.append((now, -saving, 2, 0, 0, 0))
        if not moves:
            break
        _, _, kind, k, side, rung = min(moves)
        if kind == 0:
            index[k][side] = rung
        elif kind == 1:
            f *= 2
            if inv_update_steps is None:
                i = max(i, f)
        else:
            i *= 2
        current = total(f, i)
    if inv_update_steps is None and current <= allowed:
        fresher = f
        while fresher < i and total(f, fresher) > allowed:
            fresher *= 2
        if fresher < i:
            i, current = fresher, total(f, fresher)
    return budget.BudgetChoice(
        specs={
            layer.name: (str(ladders[k][0][index[k][0]]), str(ladders[k][1][index[k][1]]))
            for k, layer in enumerate(layers)
        },
        factor_update_steps=f,
        inv_update_steps=i,
        kfac_work=current,
        training_work=train,
        budget=float(time_budget),
        within_budget=current <= allowed,
        time_scale=float(scale),
        calibrated=calibrated,
    )


def install(rule: str = "worst") -> None:
    """Make every automatic choice in this process :func:`choose_valued`'s under ``rule``.

    The values are computed once per preconditioner, at its first choice
    (where every free side captured a gram), and reused by a calibrated one.
    """
    original = autochoice.choose_curvature

    def choose(
        self: Any, handlers: Any, keys: Any, reduced: Any, steps: int, hyper: Any, comm: Any
    ) -> Any:
        if not hasattr(self, "_side_values"):
            self._side_values = side_values(handlers, reduced, float(hyper.damping))

        def valued(works: Any, time_budget: float, **kw: Any) -> budget.BudgetChoice:
            # The library's own protected side is replaced by the rule's values.
            kw.pop("protect", None)
            return choose_valued(works, time_budget, self._side_values, rule=rule, **kw)

        autochoice.choose_curvature = valued
        try:
            return plain_choose(self, handlers, keys, reduced, steps, hyper, comm)
        finally:
            autochoice.choose_curvature = original

    plain_choose = autochoice.AutoChoice.choose
    autochoice.AutoChoice.choose = choose  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    rule = "worst"
    if "--rule" in args[1:]:
        at = args.index("--rule", 1)
        if at + 1 >= len(args) or args[at + 1] not in RULES:
            print(f"value_choice.py: --rule must be one of {', '.join(RULES)}")
            return 2
        rule = args[at + 1]
        del args[at : at + 2]
    if not args or args[0] not in ("probe", "mlp"):
        print(
            "usage: value_choice.py {probe,mlp} [--rule worst|protect] "
            "[steps_probe.py's or budget_value.py's options]"
        )
        return 2
    install(rule)
    if args[0] == "probe":
        import steps_probe

        variant = "value-aware choice" + ("" if rule == "worst" else f" ({rule})")
        return steps_probe.main(args[1:], variant=variant)
    import budget_value

    budget_value.main(args[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
