"""The automatic curvature choice over a run: when it is made, from what, and its calibration.

:func:`kaisa.curvature.budget.choose_curvature` is the rule (a pure function
of shapes, rows and options). :class:`AutoChoice` is its state over a run:

1. until the first factor-update step that captures rows, the choice is
   *pending*: sides left to it are held exact and capture everything (a
   gram and the moments), so that any representation can start from them;
2. on that step the front door calls :meth:`AutoChoice.choose` with the
   all-reduced rows (equal on every rank) and installs the result; the
   same step's grams give the side the choice protects
   (:func:`diagonal_mismatch`, :func:`~kaisa.curvature.budget.binding_side`;
   maxima over ranks, so every rank protects the same side);
3. with ``calibrate_budget``, :data:`CALIBRATION_STEPS` steps later the choice
   reopens once: the passes timed since (:meth:`pass_started`,
   :meth:`pass_ended`) and one factor update's captures scale the budget's
   allowance (:func:`kaisa.curvature.budget.time_scale`), and the choice is
   made again.

It knows nothing of hooks, blocks or ranks beyond the maxima it asks the
communicator for.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kaisa.capture import ALL_KEYS
from kaisa.curvature.budget import (
    MIN_FACTOR_STEPS,
    MIN_INV_STEPS,
    BudgetChoice,
    LayerWork,
    binding_side,
    choose_curvature,
    operator_scale,
    time_scale,
)
from kaisa.curvature.costs import DEFAULT_COST_MODEL, CostModel, SideSpec
from kaisa.distributed.comm import Communicator, PayloadKey
from kaisa.layers import LayerHandler
from kaisa.options import KFACOptions, StepHyper
from kaisa.telemetry import Telemetry
from kaisa.warn import warn

__all__ = ["CALIBRATION_STEPS", "AutoChoice", "FixedSides", "diagonal_mismatch"]

log = logging.getLogger("kaisa")

#: Steps between the first automatic choice and its clock calibration
#: (``calibrate_budget``): their forward and backward passes are timed.
CALIBRATION_STEPS = 10

#: Lanczos steps (products with the factor) at most for :func:`diagonal_mismatch`,
#: and the relative change of its estimate at which it stops.
MISMATCH_ITERATIONS = 40
MISMATCH_TOLERANCE = 1e-6


def scaled_product(
    factor: torch.Tensor, damping: float
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``v ↦ D^{-1/2} (F/mean + γI) D^{-1/2} v`` for :func:`diagonal_mismatch`'s matrix.

    ``F`` the factor, ``mean`` its mean eigenvalue, ``γ = √damping`` and
    ``D = diag(F)/mean + γ``; the product runs with ``F`` in its own float32 or
    float64 (a lower precision is cast once), the scalings and ``v`` in
    float64. ``None`` for an empty or all-zero factor (no scale to measure).
    """
    f = factor.detach()
    if f.dtype not in (torch.float32, torch.float64):
        f = f.float()
    n = f.shape[0]
    diagonal = f.diagonal().to(torch.float64)
    mean = float(diagonal.sum()) / n if n else 0.0
    if n == 0 or not mean > 0.0 or not math.isfinite(mean):
        return None
    gamma = math.sqrt(damping)
    d = (diagonal / mean).clamp_min(0.0).add(gamma).rsqrt()
    shift = gamma * d * d

    def product(v: torch.Tensor) -> torch.Tensor:
        return d * (f @ (d * v).to(f.dtype)).to(torch.float64) / mean + shift * v

    return product


def diagonal_mismatch(factor: torch.Tensor, damping: float) -> float:
    """How far the worst direction a diagonal hold of ``factor`` leaves is from its scale.

    The largest eigenvalue of ``D^{-1/2} (F + γI) D^{-1/2}``, ``F`` the factor
    scaled to mean eigenvalue 1, ``γ = √damping`` (one side's share of
    relative damping) and ``D = diag(F) + γ``: 1 when ``F`` is diagonal, large
    when a few directions dominate across coordinates (a layer's raw inputs).

    Lanczos from the all-ones vector with full reorthogonalisation
    (deterministic; at most :data:`MISMATCH_ITERATIONS` products with ``F`` in
    its own float32 or float64, the scalings, vectors and the tridiagonal
    matrix in float64, no copy of ``F`` unless it is in a lower precision).
    The estimate is the largest Ritz value, a lower bound that rises to the
    eigenvalue; it stops when that changes by at most
    :data:`MISMATCH_TOLERANCE` of itself, or when the Krylov space is
    exhausted (then it is exact). Where the top eigenvalues cluster, as in a
    gram of many similar rows, it gets within a fraction of the cluster's
    width in a few dozen products where a power iteration needs hundreds.
    1 for an empty or all-zero factor.
    """
    product = scaled_product(factor, damping)
    if product is None:
        return 1.0
    n, device = factor.shape[0], factor.device
    steps = min(n, MISMATCH_ITERATIONS)
    basis = torch.zeros(steps, n, dtype=torch.float64, device=device)
    tridiagonal = torch.zeros(steps, steps, dtype=torch.float64)
    v = torch.full((n,), n**-0.5, dtype=torch.float64, device=device)
    value = previous = 0.0
    for j in range(steps):
        basis[j] = v
        w = product(v)
        tridiagonal[j, j] = float(v @ w)
        # Twice against every earlier vector: the basis stays orthogonal in floating point.
        for _ in range(2):
            w = w - basis[: j + 1].T @ (basis[: j + 1] @ w)
        value = float(torch.linalg.eigvalsh(tridiagonal[: j + 1, : j + 1])[-1])
        if not math.isfinite(value):
            return 1.0
        beta = float(w.norm())
        if j and abs(value - previous) <= MISMATCH_TOLERANCE * abs(value):
            break
        if not beta > 1e-12 * max(abs(value), 1.0):
            break  # an invariant subspace: the Ritz value is an eigenvalue
        if j + 1 < steps:
            tridiagonal[j, j + 1] = tridiagonal[j + 1, j] = beta
            v = w / beta
        previous = value
    return max(value, 1.0)


#: A layer's ``(A, G)`` representations fixed by the user or the layer kind (``None``: automatic).
FixedSides = tuple[str | None, str | None]
#: The all-reduced payloads of a factor-update step: per layer, per key, the sum and its rows.
Reduced = Mapping[str, Mapping[PayloadKey, tuple[torch.Tensor, float]]]


class OperatorCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the operator calls that do work (views and aliases do none) while it is active."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if not getattr(func, "is_view", False):
            self.calls += 1
        return func(*args, **(kwargs or {}))


class AutoChoice:
    """The automatic choice's state: pending or made, and its clock calibration.

    Args:
        fixed: every registered layer's fixed sides, in registration order.
        auto_options: the options left to kaisa (``KFACOptions.auto``).
        time_budget, calibrate_budget, compute_method: the options of that name.
        telemetry: whose capture timers the calibration reads.
        device: the device whose queue is waited for around a timed pass.
    """

    def __init__(
        self,
        fixed: Mapping[str, FixedSides],
        auto_options: frozenset[str],
        *,
        time_budget: float,
        calibrate_budget: bool,
        compute_method: str,
        telemetry: Telemetry,
        device: torch.device,
        cost_model: CostModel = DEFAULT_COST_MODEL,
    ) -> None:
        self.fixed = dict(fixed)
        self.cost_model = cost_model
        self.auto_options = auto_options
        self.time_budget = time_budget
        self.calibrate_budget = calibrate_budget
        self.compute_method = compute_method
        self.telemetry = telemetry
        self.device = device
        #: The choice made (``None`` before it, or when nothing was left to it).
        self.choice: BudgetChoice | None = None
        # The decay alone needs no rows: it follows the (fixed) factor interval.
        #: Whether any layer's side is left to the choice (not only intervals).
        self.sides_left = any(side is None for sides in self.fixed.values() for side in sides)
        self.pending = bool(auto_options - {"factor_decay"}) or self.sides_left
        # The clock calibration: the step that reopens the choice (None: none to
        # come), whether the next choice is the calibrated one, and the timed passes.
        self.calibrate_at: int | None = None
        self.calibrating = False
        self._pass_start: float | None = None
        self._pass_seconds: list[float] = []
        self._pass_mark = 0.0
        self._capture_mark = 0.0
        # The operator calls of one training forward (counted once, while the
        # first choice is pending) and the counter while it counts.
        self.forward_calls: int | None = None
        self._counter: OperatorCounter | None = None

    @classmethod
    def for_layers(
        cls,
        layers: Sequence[tuple[str, LayerHandler]],
        options: KFACOptions,
        telemetry: Telemetry,
        device: torch.device,
    ) -> AutoChoice:
        """The choice for these layers and options: a side the user fixes wins, else the
        layer kind's own (an embedding's diagonal ``A``), else it is left to the choice."""
        fixed: dict[str, FixedSides] = {}
        for name, handler in layers:
            user_a, user_g = options.fixed_sides(name)
            kind_a, kind_g = handler.default_sides
            fixed[name] = (user_a or kind_a, user_g or kind_g)
        return cls(
            fixed,
            options.auto,
            time_budget=options.time_budget,
            calibrate_budget=options.calibrate_budget,
            compute_method=options.compute_method,
            telemetry=telemetry,
            device=device,
            cost_model=options.cost_model,
        )

    # -- what the rest of the preconditioner reads ----------------------------------
    def provisional(self, name: str) -> tuple[str, str]:
        """A layer's representations until the choice: its fixed sides, else exact."""
        a, g = self.fixed[name]
        return a or "exact", g or "exact"

    @property
    def intervals(self) -> tuple[int, int] | None:
        """The chosen ``(factor, inverse)`` intervals; ``None`` while the first choice is pending.

        With nothing left to the choice but ``factor_decay``, the decay follows
        the fixed factor interval from the start (the placeholders returned
        then stand for intervals the user fixed and are never read).
        """
        if self.choice is not None:
            return self.choice.factor_update_steps, self.choice.inv_update_steps
        return None if self.pending else (MIN_FACTOR_STEPS, MIN_INV_STEPS)

    def keys(self, name: str, specs: Sequence[SideSpec]) -> tuple[PayloadKey, ...]:
        """What a layer captures: both captures of an automatic side while pending, else its own."""
        if not self.pending:
            return (("a", specs[0].capture), ("g", specs[1].capture))
        keys: list[PayloadKey] = []
        for which, fixed in zip(("a", "g"), self.fixed[name], strict=True):
            if fixed is None:
                keys += [key for key in ALL_KEYS if key[0] == which]
            else:
                keys.append((which, SideSpec.parse(fixed).capture))
        return tuple(keys)

    # -- the operator count (deterministic) ----------------------------------------------
    def forward_began(self) -> None:
        """A training forward of the whole model begins: count its operators, once."""
        if self.forward_calls is not None or self._counter is not None or not self.pending:
            return
        if torch.compiler.is_compiling():
            return  # a graph being traced: the count would be the tracer's
        self._counter = OperatorCounter()
        self._counter.__enter__()  # type: ignore[no-untyped-call]

    def forward_ended(self) -> None:
        """The forward ended (or raised): stop counting."""
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self.forward_calls = counter.calls

    # -- the clock calibration ----------------------------------------------------------
    def pass_started(self) -> None:
        """A training forward of the whole model begins (timed while a calibration is due)."""
        if self.calibrate_at is not None and self._pass_start is None:
            self._sync_clock()
            self._pass_mark = self._captured_seconds()
            self._pass_start = time.perf_counter()

    def pass_ended(self) -> None:
        """``step()`` begins: the timed passes end, without the captures kaisa ran in them."""
        if self._pass_start is None:
            return
        self._sync_clock()
        captured = self._captured_seconds() - self._pass_mark
        self._pass_seconds.append(time.perf_counter() - self._pass_start - captured)
        self._pass_start = None

    def reopen_due(self, steps: int) -> bool:
        """Whether the calibration is due after ``steps`` completed steps."""
        return self.calibrate_at is not None and steps >= self.calibrate_at

    def reopen(self) -> None:
        """Capture everything once more, and choose again with the clock's scale."""
        self.calibrate_at = None
        self.calibrating = True
        self.pending = True
        self._capture_mark = self._captured_seconds()

    def restored(self, steps: int) -> None:
        """A checkpoint set the step count: an uncalibrated choice measures from here."""
        if self.calibrate_at is not None:
            self.calibrate_at = steps + CALIBRATION_STEPS

    def _captured_seconds(self) -> float:
        phases = self.telemetry.phase_seconds
        return phases.get("capture", 0.0) + phases.get("factor_products", 0.0)

    def _sync_clock(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- the choice ------------------------------------------------------------------
    def choose(
        self,
        handlers: Sequence[tuple[str, LayerHandler]],
        keys: Mapping[str, Sequence[PayloadKey]],
        reduced: Reduced,
        steps: int,
        hyper: StepHyper,
        comm: Communicator,
    ) -> BudgetChoice:
        """Make the choice from this step's rows (equal on every rank); the caller installs it.

        ``hyper``: this step's values, whose intervals the choice keeps where
        the user fixed them. Warns once when the budget cannot be met.
        """

        def rows(name: str, key: PayloadKey) -> float:
            payload = reduced.get(name)
            return float(payload[key][1]) if payload is not None and key in payload else 0.0

        works = []
        for name, h in handlers:
            works.append(
                LayerWork(
                    name,
                    h.a_size,
                    h.g_size,
                    # (A captured as a gram or as moments: the same rows.)
                    training=h.training_work(
                        max(rows(name, ("a", "moments")), rows(name, ("a", "gram")))
                    ),
                    a_gram=h.capture_work("a", "gram", rows(name, ("a", "gram"))),
                    g_gram=h.capture_work("g", "gram", rows(name, ("g", "gram"))),
                    a_moments=h.capture_work("a", "moments", rows(name, ("a", "moments"))),
                    g_moments=h.capture_work("g", "moments", rows(name, ("g", "moments"))),
                    a_fixed=self.fixed[name][0],
                    g_fixed=self.fixed[name][1],
                )
            )
        training = sum(work.training for work in works)
        # The backward pass runs about two operators for each of the forward's.
        calls = 3.0 * (self.forward_calls or 0)
        if comm.distributed:
            (calls,) = comm.max_over_ranks([calls])
        scale = operator_scale(training, calls, cost_model=self.cost_model)
        if self.calibrating:
            capture_work = sum(
                h.capture_work(key[0], key[1], rows(name, key))
                for name, h in handlers
                for key in keys[name]
            )
            scale = self._measured_scale(works, capture_work, steps, comm)
        # The protected side is found once, at the first choice (where every free
        # side captured a gram); a later one (the calibration) keeps the installed
        # choice's, which a checkpoint restores with it.
        protect = (
            self.choice.protected
            if self.choice is not None
            else self._binding_side(handlers, reduced, hyper.damping, comm)
        )
        choice = choose_curvature(
            works,
            self.time_budget,
            factor_update_steps=None
            if "factor_update_steps" in self.auto_options
            else hyper.factor_update_steps,
            inv_update_steps=None
            if "inv_update_steps" in self.auto_options
            else hyper.inv_update_steps,
            compute_method=self.compute_method,
            cost_model=self.cost_model,
            scale=scale,
            calibrated=self.calibrating,
            protect=protect,
        )
        previous = self.choice
        if not choice.within_budget and (previous is None or previous.within_budget):
            warn(
                f"kaisa: time_budget={self.time_budget:g} cannot be met on this model "
                f"(the cheapest curvature costs {choice.share:.3g} of the layers' work); "
                "using the cheapest representations and intervals"
            )
        return choice

    def install(self, choice: BudgetChoice, steps: int) -> None:
        """Adopt ``choice`` (made now, or restored from a checkpoint) after ``steps`` steps."""
        self.pending = False
        self.choice = choice
        self.calibrating = False
        if choice.calibrated or not self.calibrate_budget:
            self.calibrate_at = None
        else:
            self.calibrate_at = steps + CALIBRATION_STEPS
            self._pass_seconds.clear()
        if log.isEnabledFor(logging.INFO):
            log.info("kaisa: automatic curvature choice at step %d:\n%s", steps, choice.describe())

    def _binding_side(
        self,
        handlers: Sequence[tuple[str, LayerHandler]],
        reduced: Reduced,
        damping: float,
        comm: Communicator,
    ) -> tuple[str, str] | None:
        """The free side whose diagonal leaves the worst direction, from this step's grams.

        Every side left to the choice captured a gram on this (its first)
        factor-update step; the mismatches are maxima over ranks, so every
        rank protects the same side.
        """
        keys: list[tuple[str, str]] = []
        values: list[float] = []
        for name, _ in handlers:
            payload = reduced.get(name, {})
            for k, side in enumerate(("a", "g")):
                if self.fixed[name][k] is not None or (side, "gram") not in payload:
                    continue
                total, _rows = payload[side, "gram"]
                keys.append((name, side))
                values.append(diagonal_mismatch(total, damping))
        if comm.distributed and values:
            values = comm.max_over_ranks(values)
        return binding_side(dict(zip(keys, values, strict=True)))

    def _measured_scale(
        self, works: Sequence[LayerWork], capture_work: float, steps: int, comm: Communicator
    ) -> float:
        """The budget's time scale from the clock (equal on every rank: maxima)."""
        capture_seconds = self._captured_seconds() - self._capture_mark
        passes = statistics.median(self._pass_seconds) if self._pass_seconds else 0.0
        passes, capture_seconds = comm.max_over_ranks([passes, capture_seconds])
        training = sum(work.training for work in works)
        scale = time_scale(
            passes, capture_seconds, capture_work, training, cost_model=self.cost_model
        )
        log.info(
            "kaisa: budget calibration at step %d: forward+backward %.2f ms (median of %d), "
            "captures %.2f ms for %.3g multiply-adds; time scale %.3g",
            steps,
            passes * 1e3,
            len(self._pass_seconds),
            capture_seconds * 1e3,
            capture_work,
            scale,
        )
        return scale
