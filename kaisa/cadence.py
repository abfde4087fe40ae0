"""Intervals that follow the curvature: ``adaptive_intervals``, ``stale_refresh`` and
``fresh_start_steps``.

With ``eigenbasis_tolerance`` an inverse update tells how stale the held
eigenbases were: each exact eigen side either keeps its basis (it still
diagonalises the factor to within the tolerance) or decomposes. The share
that decomposed is a measure of how fast the curvature moves, which differs
by model: on the suite's image workloads 12–34% of the bases go stale
between refreshes 5 steps apart, on its language models 40–56%.

:class:`IntervalStretch` turns that share into a multiplier of the factor
and inverse intervals in force (given or chosen by the budget): after an
inverse update at which fewer than :data:`STALE_LOW` of the bases that could
be kept decomposed, the multiplier doubles (up to :data:`MAX_STRETCH`);
after one at which more than :data:`STALE_HIGH` decomposed, it halves (down
to 1, the intervals as given). Curvature that stays put is then refreshed
less often, and curvature that moves keeps the intervals given. The share is
summed over the ranks (each side is refreshed by one rank), so every rank
holds the same multiplier. The first inverse update with sides that could
keep a basis is no evidence and is skipped: those sides held the identity
they start from, which a factor either fails (every side decomposes) or, at
a loose tolerance, passes for no reason of its own. It is a pure function of
the counts: two runs with the same seed stretch alike.

:class:`StaleRefresh` shortens them instead, when the held curvature no
longer describes the gradients. Its signal is each layer's ``‖P‖_F/‖∇‖_F``,
the preconditioned over the raw gradient (before grafting and KL clipping),
which costs two norms per layer. Right after an inverse update that ratio is
the layer's reference; while the factors describe the gradients it stays
within a small factor of it (on timm's EVA-02 refreshed at every step, no
layer's ratio moved 4x from one step to the next, and at most 19% moved
2x), and when they go stale it moves by orders of magnitude: there, under
the automatic intervals (factors every 80 steps, inverses every 320), 71%
of the layers moved more than 10x one step after the first refresh, as the
gradients left the directions the factors held and damping alone set the
step (``benchmarks/README.md``, session 47). After a step that did not
update the inverses, when at least :data:`DRIFT_SHARE` of the layers, and at
least :data:`DRIFT_LAYERS` of them, moved by more than :data:`DRIFT_FACTOR`
either way, the curvature is stale: the
intervals in force are capped at one step (factors and inverses at every
step from the next one), and the cap doubles at each inverse update until
it reaches the intervals given or chosen, when it goes. A stale refresh
during the climb cuts it back to one. The ranks agree on "stale" by an
all-reduce, so they cap alike.

:func:`fresh_start_cap` holds the intervals to at most
:data:`FRESH_START_INTERVAL` steps for the first ``fresh_start_steps`` steps,
when the curvature moves fastest. On the suite's language model all the steps
that factors and bases refreshed every 2 steps save over every 5 were saved in
the first 200 steps of the 1500 (``benchmarks/README.md``, session 25).
:class:`IntervalStretch` does not move during it: the share of bases that go
stale in 2 steps says nothing of the intervals it multiplies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kaisa.validation import check_count, check_flag

__all__ = [
    "DRIFT_FACTOR",
    "DRIFT_LAYERS",
    "DRIFT_SHARE",
    "FRESH_START_INTERVAL",
    "MAX_STRETCH",
    "STALE_HIGH",
    "STALE_LOW",
    "IntervalStretch",
    "StaleRefresh",
    "fresh_start_cap",
    "size_ratios",
]

#: Below this share of decomposed bases at an inverse update, the intervals double.
STALE_LOW = 0.2
#: Above this share, they halve (never below the intervals given).
STALE_HIGH = 0.4
#: The largest multiplier of the intervals given.
MAX_STRETCH = 8


class IntervalStretch:
    """The multiplier of the factor and inverse intervals (``adaptive_intervals``).

    Args:
        enabled: ``False`` holds the multiplier at 1 (what :meth:`observe` sees
            is then ignored).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        #: The intervals in force are the given (or chosen) ones times this.
        self.factor = 1
        #: Whether the first inverse update with keepable sides (skipped) was seen.
        self.started = False

    def observe(self, keepable: int, kept: int, hold: bool = False) -> bool:
        """One inverse update's counts over all ranks; returns whether the multiplier changed.

        ``keepable``: sides refreshed that could have kept their eigenbasis
        (exact, eigen method); ``kept``: of those, the ones that did.
        ``hold``: the intervals in force are not the ones the multiplier
        stretches (``fresh_start_steps``): the update counts as seen, and the
        multiplier stays.
        """
        if not self.enabled or keepable <= 0:
            return False
        if not 0 <= kept <= keepable:
            raise ValueError(f"kept ({kept}) must be in [0, keepable={keepable}]")
        if not self.started or hold:  # the starting identity, or other intervals: no evidence
            self.started = True
            return False
        stale = 1.0 - kept / keepable
        before = self.factor
        if stale < STALE_LOW:
            self.factor = min(MAX_STRETCH, 2 * self.factor)
        elif stale > STALE_HIGH:
            self.factor = max(1, self.factor // 2)
        return self.factor != before

    def state_dict(self) -> dict[str, Any]:
        return {"factor": self.factor, "started": self.started}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved multiplier; a bad value raises and changes nothing."""
        factor = check_count(state.get("factor"), "state_dict 'interval_stretch' factor")
        if factor < 1 or factor > MAX_STRETCH or factor & (factor - 1):
            raise ValueError(
                f"state_dict 'interval_stretch' factor must be a power of 2 in [1, "
                f"{MAX_STRETCH}]; got {factor}"
            )
        # (A checkpoint written before 'started' was saved past its first update.)
        started = check_flag("state_dict 'interval_stretch' started", state.get("started", True))
        self.factor = factor
        self.started = started


#: A layer whose preconditioned-over-raw gradient norm moved by more than this
#: factor (either way) since its last inverse update counts as drifted.
DRIFT_FACTOR = 4.0
#: When at least this share of the layers measured drifted, the curvature is stale.
DRIFT_SHARE = 0.25
#: ... and at least this many of them (all of them in a model with fewer): one
#: layer alone is not the model's curvature. On the suite's SmallCNN (4 layers)
#: the 10-way classifier alone crossed 4x at every trigger, five a run, and the
#: refreshes took K-FAC from 15% to 25% of the step (``benchmarks/README.md``,
#: session 48).
DRIFT_LAYERS = 2


class StaleRefresh:
    """A cap on the intervals while the curvature is stale (``stale_refresh``).

    Args:
        enabled: ``False`` leaves the intervals alone.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        #: The intervals in force are at most this (``None``: no cap).
        self.cap: int | None = None
        #: Each layer's ``‖P‖/‖∇‖`` at its last inverse update.
        self.reference: dict[str, float] = {}

    def watches(self, factor_steps: int, inv_steps: int) -> bool:
        """Whether this step is measured: on, and an interval (or a cap) left to shorten.

        With intervals of 1 and no cap there is nothing to shorten; the references
        are dropped then, as they would be out of date when the intervals grow.
        """
        if not self.enabled:
            return False
        if self.cap is None and factor_steps == 1 and inv_steps == 1:
            self.reference.clear()
            return False
        return True

    def follow(
        self,
        ratios: Mapping[str, float],
        refreshed: bool,
        agree: Callable[[Sequence[bool]], list[bool]],
        longest: int,
    ) -> bool:
        """One measured step; returns whether the curvature was found stale (cap cut to 1).

        ``agree`` ORs flags over the ranks: a rank may recompute its inverses when
        another does not (after loading another rank's checkpoint), and every rank
        must cap alike. ``longest``: the longer of the uncapped intervals in force.
        """
        stale = not refreshed and self.stale(ratios)
        refreshed, stale = agree([refreshed, stale])
        if refreshed:
            self.refreshed(ratios, longest)
        elif stale:
            self.cap = 1
        return stale and not refreshed

    def stale(self, ratios: Mapping[str, float]) -> bool:
        """Whether at least :data:`DRIFT_SHARE` of the layers, and at least
        :data:`DRIFT_LAYERS` of them, drifted since their refresh."""
        bound = math.log(DRIFT_FACTOR)
        moved = total = 0
        for name, ratio in ratios.items():
            reference = self.reference.get(name)
            if reference is None or not _usable(ratio) or not _usable(reference):
                continue
            total += 1
            moved += abs(math.log(ratio / reference)) > bound
        return total > 0 and moved >= max(DRIFT_SHARE * total, min(DRIFT_LAYERS, total))

    def state_dict(self) -> dict[str, Any]:
        return {"cap": self.cap, "reference": dict(self.reference)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a saved cap and references; a bad value raises and changes nothing."""
        where = "state_dict 'stale_refresh'"
        if set(state) != {"cap", "reference"}:
            raise ValueError(
                f"{where} is malformed: it must hold 'cap' and 'reference'; got "
                f"{sorted(map(repr, state))}"
            )
        cap = state["cap"]
        if cap is not None:
            cap = check_count(cap, f"{where} cap")
            if cap < 1 or cap & (cap - 1):
                raise ValueError(f"{where} cap must be None or a power of 2 >= 1; got {cap}")
        saved = state["reference"]
        if not isinstance(saved, Mapping):
            raise TypeError(f"{where} reference must map layer names to ratios")
        reference: dict[str, float] = {}
        for name, value in saved.items():
            if (
                not isinstance(name, str)
                or isinstance(value, bool)
                or not isinstance(value, (int, float))
            ):
                raise TypeError(f"{where} reference[{name!r}] must be a ratio; got {value!r}")
            if not (math.isnan(value) or (math.isfinite(value) and value >= 0)):
                raise ValueError(
                    f"{where} reference[{name!r}] must be a finite ratio >= 0 (or NaN); "
                    f"got {value!r}"
                )
            reference[name] = float(value)
        self.cap, self.reference = cap, reference

    def refreshed(self, ratios: Mapping[str, float], longest: int) -> None:
        """An inverse update: new references; a cap in force doubles, and goes at ``longest``."""
        self.reference.update(ratios)
        if self.cap is not None:
            self.cap *= 2
            if self.cap >= longest:
                self.cap = None


#: The longest factor and inverse interval during ``fresh_start_steps``.
FRESH_START_INTERVAL = 2


def fresh_start_cap(cap: int | None, step: int, fresh_start_steps: int) -> int | None:
    """The cap on the intervals at ``step``: ``cap`` (``stale_refresh``'s; ``None``: none),
    held to :data:`FRESH_START_INTERVAL` before step ``fresh_start_steps``."""
    if step >= fresh_start_steps:
        return cap
    return FRESH_START_INTERVAL if cap is None else min(cap, FRESH_START_INTERVAL)


def size_ratios(pairs: Sequence[tuple[str, torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Each layer's ``‖P‖_F/‖∇‖_F`` from ``(name, preconditioned, raw)``, with one host sync
    (NaN for a zero raw gradient)."""
    if not pairs:
        return {}
    dtype = torch.float32
    sizes = torch.stack(
        [torch.stack([p.to(dtype).norm(), g.to(dtype).norm()]) for _, p, g in pairs]
    ).tolist()
    return {
        name: (p / g if g > 0 else float("nan"))
        for (name, _, _), (p, g) in zip(pairs, sizes, strict=True)
    }


def _usable(value: float) -> bool:
    return math.isfinite(value) and value > 0
