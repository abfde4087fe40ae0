"""The automatic choice (spec §8): curvature that fits a time budget.

Given each layer's factor sides and the rows it sees per step, choose, for
every side, a representation and, for the run, the factor and inverse
intervals, so that K-FAC's work per step is at most ``time_budget`` times the
work of the registered layers' own forward and backward passes. Everything is
counted in multiply-adds (:func:`kaisa.curvature.costs.side_cost`), each kind
of K-FAC work weighed against a training pass's multiply-adds by a
:class:`~kaisa.curvature.costs.CostModel` (``cost_model``; by default
:data:`~kaisa.curvature.costs.DEFAULT_COST_MODEL`, and
``benchmarks/cost_weights.py`` measures the weights on the machine it runs
on), so the choice is a pure function of shapes, rows, options, weights
and the protected side (step 2, found from the first factor update's
all-reduced factors): every rank that sees the same rows reaches the same
choice, and a test can check it without a clock.

The rule, in full:

1. Start with every free side exact and the shortest free intervals
   (factors every :data:`MIN_FACTOR_STEPS`, inverses every
   :data:`MIN_INV_STEPS` steps).
2. While the work per step is over the budget, take the one move that saves
   the most work: move one side down its ladder (exact, then low rank
   ``k`` = 256, 128, …, 8 for the ``k`` at most half the side, then Kronecker
   vectors, then diagonal) to the nearest rung that saves anything, or
   double the factor interval (up to :data:`MAX_FACTOR_STEPS`), or double
   the inverse interval (up to :data:`MAX_INV_STEPS`; never below the
   factor interval). Ties go to the earlier layer, ``A`` before ``G``,
   sides before intervals. The ladder is the same with an eigenvalue
   correction on: it reaches the exact, low-rank and diagonal rungs, and a
   layer given a Kronecker-vector side keeps K-FAC's solve (SmallCNN took
   800 steps with its 3137-wide input side corrected on its diagonal, 300
   with it in rank 128 uncorrected: ``benchmarks/README.md``, session 23).
   One side is protected (``protect``, from :func:`binding_side`): the
   free side whose diagonal would leave the worst direction, the one that
   bounds the step a single learning rate can take. Moves that take it
   below its lowest low rank wait until no other move is left. (On a
   cheap-step MLP the widest side, the first layer's pixels, is the one
   that buys the steps, and the largest saving would give it up first:
   ``benchmarks/README.md``, "An automatic choice judged by what it buys".)
3. When no move is left the choice is the cheapest one and
   :attr:`BudgetChoice.within_budget` is ``False`` (the caller warns once).
4. When the choice fits and the inverse interval is free, spend what is left
   of the allowance on fresher eigenbases: the inverse interval becomes the
   shortest ``f·2^k`` (``f`` the factor interval, ``k ≥ 0``) below the one
   chosen that still fits, if there is one. Steps 1–3 decide the
   representations and the factor interval; this step only refreshes more
   often what they kept. What it does to the steps the suite's workloads
   take to their targets: ``benchmarks/README.md``, "Held-out seeds".

Sides and intervals the user fixed are counted but never moved.

**Calibration by the clock** (:func:`time_scale`). The registered layers'
multiply-adds are not the whole iteration: a transformer also runs attention
scores, softmax, normalisation, activations and many small operators the model
does not count (the scales the suite's workloads measure:
``benchmarks/README.md``). So after a few steps the preconditioner measures
the forward and backward passes and one factor update on the clock, converts
the passes into capture multiply-adds at the measured capture speed (and
those into training ones by the cost model's ``capture`` weight), and chooses
again with the allowance scaled by
``time_scale`` = measured over modelled training work (at least 1, rounded
down to a power of √2, at most :data:`MAX_TIME_SCALE`). The rule above is
unchanged; only its allowance grows where the iteration is slower than its
counted multiply-adds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kaisa.curvature.costs import (
    DEFAULT_COST_MODEL,
    CostModel,
    SideSpec,
    check_cost_model,
    side_cost,
)
from kaisa.validation import check_count

__all__ = [
    "LOW_RANKS",
    "MAX_FACTOR_STEPS",
    "MAX_INV_STEPS",
    "MAX_TIME_SCALE",
    "MIN_FACTOR_STEPS",
    "MIN_INV_STEPS",
    "BudgetChoice",
    "LayerWork",
    "binding_side",
    "choose_curvature",
    "kfac_work",
    "ladder",
    "operator_scale",
    "time_scale",
    "training_work",
]

MIN_FACTOR_STEPS = 10
MAX_FACTOR_STEPS = 80
MIN_INV_STEPS = 100
MAX_INV_STEPS = 800
LOW_RANKS = (256, 128, 64, 32, 16, 8)
#: The largest factor by which a measured iteration widens the allowance.
MAX_TIME_SCALE = 16.0


@dataclass(frozen=True)
class LayerWork:
    """One layer as the budget sees it, in multiply-adds per step on one rank.

    ``training``: the layer's forward and backward passes; ``a_gram`` …
    ``g_moments``: one factor-update step's captures of each side, as a full
    gram or as moments (the layer handler knows what its products cost);
    ``a_fixed`` / ``g_fixed``: a representation the user chose for that side
    (never moved), or ``None``. :meth:`from_rows` fills the work in for plain
    row products.
    """

    name: str
    a_size: int
    g_size: int
    training: float
    a_gram: float
    g_gram: float
    a_moments: float
    g_moments: float
    a_fixed: str | None = None
    g_fixed: str | None = None

    @staticmethod
    def from_rows(
        name: str,
        a_size: int,
        g_size: int,
        rows: float,
        a_fixed: str | None = None,
        g_fixed: str | None = None,
    ) -> LayerWork:
        """A layer whose ``rows`` rows per step are multiplied out plainly (Linear)."""
        return LayerWork(
            name,
            a_size,
            g_size,
            training=3.0 * rows * a_size * g_size,
            a_gram=rows * a_size * a_size,
            g_gram=rows * g_size * g_size,
            a_moments=2.0 * rows * a_size,
            g_moments=2.0 * rows * g_size,
            a_fixed=a_fixed,
            g_fixed=g_fixed,
        )

    def capture(self, which: str, spec: SideSpec) -> float:
        """One factor-update step's capture work for side ``which`` held as ``spec``."""
        gram = spec.capture == "gram"
        if which == "a":
            return self.a_gram if gram else self.a_moments
        return self.g_gram if gram else self.g_moments


@dataclass(frozen=True)
class BudgetChoice:
    """The outcome: a representation per side, the intervals, and the work they cost."""

    specs: dict[str, tuple[str, str]]
    factor_update_steps: int
    inv_update_steps: int
    kfac_work: float
    training_work: float
    budget: float
    within_budget: bool
    #: Measured iteration over modelled training work (1: the model alone).
    time_scale: float = 1.0
    #: Whether this choice was made after the clock calibration.
    calibrated: bool = False
    #: The side kept at its lowest low rank or above while other moves were
    #: left (``(layer, 'a' | 'g')``; ``None``: none).
    protected: tuple[str, str] | None = None

    @property
    def share(self) -> float:
        """K-FAC's work per step over the layers' training work (as modelled)."""
        return self.kfac_work / self.training_work if self.training_work else 0.0

    def state_dict(self) -> dict[str, Any]:
        """The choice as plain data (``dataclasses.asdict``); :meth:`from_state` reads it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(
        cls, saved: object, where: str = "state_dict 'curvature_choice'"
    ) -> BudgetChoice:
        """The choice a :meth:`state_dict` holds, checked completely for form.

        ``TypeError`` for a value of the wrong type, ``ValueError`` for a
        malformed dict or a value out of range, each naming ``where`` and the
        field. ``time_scale`` and ``calibrated`` may be missing (choices saved
        before the clock calibration: 1 and ``False``). Only the choice's own
        fields are checked; whether its layers, sizes and fixed sides fit a
        preconditioner is the caller's to check.
        """
        if not isinstance(saved, Mapping):
            raise TypeError(f"{where} must be a dict or None; got {type(saved).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        optional = ("time_scale", "calibrated", "protected")
        missing = [name for name in names if name not in saved and name not in optional]
        unexpected = sorted(repr(key) for key in saved if key not in names)
        if missing or unexpected:
            raise ValueError(
                f"{where} is malformed: missing {missing}, unexpected [{', '.join(unexpected)}]"
            )
        raw = saved["specs"]
        if not isinstance(raw, Mapping):
            raise TypeError(
                f"{where} is malformed: 'specs' must map layer names to (A, G); "
                f"got {type(raw).__name__}"
            )
        specs: dict[str, tuple[str, str]] = {}
        for name, pair in raw.items():
            if not isinstance(name, str) or not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise TypeError(
                    f"{where} is malformed: specs[{name!r}] must be a pair (A, G) of "
                    f"representations; got {pair!r}"
                )
            try:
                a, g = (str(SideSpec.parse(text)) for text in pair)
            except (TypeError, ValueError) as error:
                raise ValueError(f"{where} is malformed: specs[{name!r}]: {error}") from None
            specs[name] = (a, g)
        factor_steps, inv_steps = (
            check_count(saved[key], f"{where}: {key!r}", low=1)
            for key in ("factor_update_steps", "inv_update_steps")
        )
        work: list[float] = []
        for key in ("kfac_work", "training_work", "budget"):
            value = saved[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{where}: {key!r} must be a number; got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{where}: {key!r} must be a finite number >= 0; got {value!r}")
            work.append(float(value))
        within = saved["within_budget"]
        if not isinstance(within, bool):
            raise TypeError(f"{where}: 'within_budget' must be True or False; got {within!r}")
        calibrated = saved.get("calibrated", False)
        if not isinstance(calibrated, bool):
            raise TypeError(f"{where}: 'calibrated' must be True or False; got {calibrated!r}")
        scale = saved.get("time_scale", 1.0)
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not 1.0 <= scale <= MAX_TIME_SCALE
        ):
            raise ValueError(
                f"{where}: 'time_scale' must be a number in [1, {MAX_TIME_SCALE:g}]; got {scale!r}"
            )
        protected = saved.get("protected")
        if protected is not None:
            if (
                not isinstance(protected, (list, tuple))
                or len(protected) != 2
                or not isinstance(protected[0], str)
                or protected[1] not in ("a", "g")
            ):
                raise ValueError(
                    f"{where}: 'protected' must be None or a pair (layer name, 'a' or 'g'); "
                    f"got {protected!r}"
                )
            protected = (protected[0], protected[1])
        return cls(
            specs=specs,
            factor_update_steps=factor_steps,
            inv_update_steps=inv_steps,
            kfac_work=work[0],
            training_work=work[1],
            budget=work[2],
            within_budget=within,
            time_scale=float(scale),
            calibrated=calibrated,
            protected=protected,
        )

    def describe(self) -> str:
        lines = [
            f"curvature budget {self.budget:g}: K-FAC work {self.share:.3f} of the layers' "
            f"training work"
            + (f" (the iteration measured at {self.time_scale:.3g}x it)" if self.calibrated else "")
            + f"; factors every {self.factor_update_steps}, inverses every "
            f"{self.inv_update_steps} steps"
            + ("" if self.within_budget else " (over budget: cheapest choice)")
        ]
        if self.protected is not None:
            name, side = self.protected
            lines.append(f"  protected: {name} {side.upper()} (the side that binds)")
        for name, (a, g) in self.specs.items():
            lines.append(f"  {name}: A {a}, G {g}")
        return "\n".join(lines)


def ladder(n: int) -> list[SideSpec]:
    """A side's representations, most curvature first.

    With an eigenvalue correction on the ladder is the same: the correction
    reaches the exact, low-rank and diagonal rungs
    (:mod:`kaisa.curvature.eigencorrection`), and a layer the choice gives a
    Kronecker-vector side keeps K-FAC's solve (the preconditioner names such
    layers once).
    """
    rungs = [SideSpec("exact")]
    rungs += [SideSpec("lowrank", k) for k in LOW_RANKS if 2 * k <= n]
    rungs += [SideSpec("kvec"), SideSpec("diagonal")]
    return rungs


def training_work(layer: LayerWork) -> float:
    """Multiply-adds of a layer's forward and backward passes per step."""
    return layer.training


def kfac_work(
    layer: LayerWork,
    a_spec: SideSpec,
    g_spec: SideSpec,
    factor_update_steps: int,
    inv_update_steps: int,
    compute_method: str = "eigen",
    *,
    cost_model: CostModel = DEFAULT_COST_MODEL,
) -> float:
    """Multiply-adds K-FAC spends on one layer per step, averaged over the intervals.

    Captures (every factor update), one refresh of each side (every inverse
    update) and the preconditioning of the ``(g, a)`` gradient (every step),
    each weighed by ``cost_model``, so the sum is in training multiply-adds.
    """
    exact = a_spec.kind == "exact" and g_spec.kind == "exact"
    method = compute_method if exact else "eigen"
    a, g = layer.a_size, layer.g_size
    ca = side_cost(a_spec, a, method, cost_model=cost_model)
    cg = side_cost(g_spec, g, method, cost_model=cost_model)
    capture = (layer.capture("a", a_spec) + layer.capture("g", g_spec)) / factor_update_steps
    refresh = (ca.refresh + cg.refresh) / inv_update_steps
    apply = ca.apply_per_column * g + cg.apply_per_column * a
    return cost_model.capture * capture + refresh + cost_model.apply * apply


def choose_curvature(
    layers: Sequence[LayerWork],
    time_budget: float,
    *,
    factor_update_steps: int | None = None,
    inv_update_steps: int | None = None,
    compute_method: str = "eigen",
    scale: float = 1.0,
    calibrated: bool = False,
    cost_model: CostModel = DEFAULT_COST_MODEL,
    protect: tuple[str, str] | None = None,
) -> BudgetChoice:
    """Apply the rule of the module docstring; ``None`` intervals are free to choose.

    ``scale`` (from :func:`time_scale`) multiplies the allowance:
    ``time_budget * scale * training work``. ``cost_model`` weighs K-FAC's
    kinds of work against the training multiply-adds (measure one for your
    machine with ``benchmarks/cost_weights.py``). ``protect``: ``(layer
    name, 'a' | 'g')``, the side kept at its lowest low rank or above while
    any other move is left (:func:`binding_side`); ignored when that side
    is fixed or not among ``layers``.
    """
    if isinstance(time_budget, bool) or not isinstance(time_budget, (int, float)):
        raise TypeError(f"time_budget must be a number > 0; got {time_budget!r}")
    if not time_budget > 0 or time_budget == float("inf"):
        raise ValueError(f"time_budget must be a finite number > 0; got {time_budget!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a number in [1, {MAX_TIME_SCALE:g}]; got {scale!r}")
    if not 1.0 <= scale <= MAX_TIME_SCALE:
        raise ValueError(f"scale must be a number in [1, {MAX_TIME_SCALE:g}]; got {scale!r}")
    check_cost_model(cost_model)
    ladders: list[list[list[SideSpec]]] = []
    index: list[list[int]] = []
    for layer in layers:
        sides = []
        for fixed, n in ((layer.a_fixed, layer.a_size), (layer.g_fixed, layer.g_size)):
            sides.append([SideSpec.parse(fixed)] if fixed is not None else ladder(n))
        ladders.append(sides)
        index.append([0, 0])
    f = factor_update_steps if factor_update_steps is not None else MIN_FACTOR_STEPS
    i = inv_update_steps if inv_update_steps is not None else max(MIN_INV_STEPS, f)
    # The protected side, as (layer index, side), and the last rung it may take
    # while other moves are left: its lowest low rank (exact if it has none).
    guarded: tuple[int, int] | None = None
    floor = 0
    names = [layer.name for layer in layers]
    if protect is not None and protect[0] in names and protect[1] in ("a", "g"):
        k, side = names.index(protect[0]), "ag".index(protect[1])
        if len(ladders[k][side]) > 1:
            guarded = (k, side)
            floor = max(
                j for j, spec in enumerate(ladders[k][side]) if spec.kind in ("exact", "lowrank")
            )

    def work(k: int, rungs: Sequence[int], f_: int, i_: int) -> float:
        sa, sg = ladders[k][0][rungs[0]], ladders[k][1][rungs[1]]
        return kfac_work(layers[k], sa, sg, f_, i_, compute_method, cost_model=cost_model)

    def total(f_: int, i_: int) -> float:
        return sum(work(k, index[k], f_, i_) for k in range(len(layers)))

    train = sum(training_work(layer) for layer in layers)
    allowed = time_budget * scale * train
    current = total(f, i)
    while current > allowed:
        best: tuple[float, int, int, int, int] | None = None  # (saving, kind, layer, side, rung)
        waiting: tuple[float, int, int, int, int] | None = None  # the protected side's move
        for k in range(len(layers)):
            here = work(k, index[k], f, i)
            for side in (0, 1):
                # The nearest lower rung that saves anything (a low rank can cost
                # as much as the exact side it replaces; it is passed over then).
                trial = list(index[k])
                while trial[side] + 1 < len(ladders[k][side]):
                    trial[side] += 1
                    saving = here - work(k, trial, f, i)
                    if saving > 0.0:
                        if (k, side) == guarded and trial[side] > floor:
                            waiting = (saving, 0, k, side, trial[side])
                        elif best is None or saving > best[0]:
                            best = (saving, 0, k, side, trial[side])
                        break
        if factor_update_steps is None and 2 * f <= MAX_FACTOR_STEPS:
            new_i = i if inv_update_steps is not None else max(i, 2 * f)
            saving = current - total(2 * f, new_i)
            if best is None or saving > best[0]:
                best = (saving, 1, 0, 0, 0)
        if inv_update_steps is None and 2 * i <= MAX_INV_STEPS:
            saving = current - total(f, 2 * i)
            if best is None or saving > best[0]:
                best = (saving, 2, 0, 0, 0)
        if best is None or best[0] <= 0.0:
            best = waiting
        if best is None or best[0] <= 0.0:
            break
        _, kind, k, side, rung = best
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
    specs = {
        layer.name: (str(ladders[k][0][index[k][0]]), str(ladders[k][1][index[k][1]]))
        for k, layer in enumerate(layers)
    }
    return BudgetChoice(
        specs=specs,
        factor_update_steps=f,
        inv_update_steps=i,
        kfac_work=current,
        training_work=train,
        budget=float(time_budget),
        within_budget=current <= allowed,
        time_scale=float(scale),
        calibrated=calibrated,
        protected=None if guarded is None else (names[guarded[0]], "ag"[guarded[1]]),
    )


def binding_side(mismatch: Mapping[tuple[str, str], float]) -> tuple[str, str] | None:
    """The side with the largest mismatch above 1 (ties: the first), or ``None``.

    ``mismatch``: per ``(layer name, 'a' | 'g')``, what a diagonal hold of
    the side leaves (:func:`kaisa.autochoice.diagonal_mismatch`).
    """
    best: tuple[str, str] | None = None
    top = 1.0
    for key, value in mismatch.items():
        if value > top:
            best, top = key, value
    return best


def _rounded_scale(ratio: float) -> float:
    """``ratio`` as a scale: at least 1, rounded down to a power of √2, at most the maximum."""
    if not math.isfinite(ratio) or ratio <= 1.0:
        return 1.0
    steps = math.floor(2.0 * math.log2(ratio) + 1e-9)  # powers of √2
    return float(min(MAX_TIME_SCALE, 2.0 ** (steps / 2.0)))


def operator_scale(
    training: float, operator_calls: float, *, cost_model: CostModel = DEFAULT_COST_MODEL
) -> float:
    """How much more work the iteration is than its modelled training work, from a count.

    ``operator_calls``: the operator calls of one forward and backward pass
    (the preconditioner counts a training forward's and takes the backward
    pass as twice it); each costs ``cost_model.operator`` training
    multiply-adds beyond the registered layers' ``training`` work. The scale
    is ``(training + calls · operator) / training``, rounded as
    :func:`time_scale`'s. Deterministic: shapes and the model's structure
    alone decide it (the same on every machine with the same cost model).
    """
    check_cost_model(cost_model)
    values = (training, operator_calls)
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values):
        return 1.0
    if training <= 0:
        return 1.0
    return _rounded_scale((training + operator_calls * cost_model.operator) / training)


def time_scale(
    training_seconds: float,
    capture_seconds: float,
    capture_work: float,
    training: float,
    *,
    cost_model: CostModel = DEFAULT_COST_MODEL,
) -> float:
    """How much slower the iteration runs than its modelled training work, on the clock.

    ``training_seconds``: one step's forward and backward passes;
    ``capture_seconds``: one factor update's captures, which were
    ``capture_work`` multiply-adds; ``training``: the registered layers'
    modelled training work. A capture multiply-add weighs ``cost_model.capture``
    training ones (:class:`~kaisa.curvature.costs.CostModel`), so the passes
    are worth ``training_seconds / (capture_seconds / capture_work /
    cost_model.capture)`` modelled multiply-adds; the scale is that over
    ``training``, at least 1 (time the model does not see only adds), rounded
    down to a power of √2 (a small change in a measurement rarely changes the
    choice) and at most :data:`MAX_TIME_SCALE`. Without a usable measurement
    (any value not finite and > 0) it is 1.
    """
    check_cost_model(cost_model)
    values = (training_seconds, capture_seconds, capture_work, training)
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values):
        return 1.0
    measured = training_seconds * capture_work * cost_model.capture / capture_seconds
    return _rounded_scale(measured / training)
