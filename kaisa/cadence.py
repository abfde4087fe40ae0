"""Intervals that follow the curvature: ``adaptive_intervals``.

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
to :data:`MIN_STRETCH`: half the intervals given, at least 1 step). Curvature
that stays put is then refreshed less often, and curvature that moves fast
(a language model's early steps) more often than given. The share is summed
over the ranks (each side is refreshed by one rank), so every rank holds the
same multiplier. The first inverse update is no evidence (its sides hold the
identity they start from, which fails the tolerance): the rule starts at the
second. It is a pure function of the counts: two runs with the same seed
stretch alike.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_STRETCH", "MIN_STRETCH", "STALE_HIGH", "STALE_LOW", "IntervalStretch", "stretched"]

#: Below this share of decomposed bases at an inverse update, the intervals double.
STALE_LOW = 0.2
#: Above this share, they halve (down to MIN_STRETCH times the intervals given).
STALE_HIGH = 0.4
#: The largest multiplier of the intervals given.
MAX_STRETCH = 8
#: The smallest: half the intervals given (never below one step).
MIN_STRETCH = 0.5
#: The multipliers the rule can hold (powers of 2 from MIN_STRETCH to MAX_STRETCH).
_LEVELS = (0.5, 1, 2, 4, 8)


def stretched(interval: int, stretch: float) -> int:
    """An interval of ``interval`` steps under the multiplier ``stretch``: rounded down,
    at least 1 (5 steps at ½ are 2)."""
    return max(1, int(interval * stretch))


class IntervalStretch:
    """The multiplier of the factor and inverse intervals (``adaptive_intervals``).

    Args:
        enabled: ``False`` holds the multiplier at 1 (what :meth:`observe` sees
            is then ignored).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        #: The intervals in force are the given (or chosen) ones times this
        #: (:func:`stretched`): ½, 1, 2, 4 or 8.
        self.factor: float = 1
        #: Whether an inverse update with keepable sides was seen (the first is skipped).
        self.started = False

    def observe(self, keepable: int, kept: int) -> bool:
        """One inverse update's counts over all ranks; returns whether the multiplier changed.

        ``keepable``: sides refreshed that could have kept their eigenbasis
        (exact, eigen method); ``kept``: of those, the ones that did.
        """
        if not self.enabled or keepable <= 0:
            return False
        if not 0 <= kept <= keepable:
            raise ValueError(f"kept ({kept}) must be in [0, keepable={keepable}]")
        if not self.started:  # the identity the sides start from: no evidence
            self.started = True
            return False
        stale = 1.0 - kept / keepable
        before = self.factor
        level = _LEVELS.index(self.factor)
        if stale < STALE_LOW:
            level = min(len(_LEVELS) - 1, level + 1)
        elif stale > STALE_HIGH:
            level = max(0, level - 1)
        self.factor = _LEVELS[level]
        return self.factor != before

    def state_dict(self) -> dict[str, Any]:
        return {"factor": self.factor, "started": self.started}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved multiplier; a bad value raises and changes nothing."""
        factor = state.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool):
            raise TypeError(
                f"state_dict 'interval_stretch' factor must be a number; got "
                f"{type(factor).__name__}"
            )
        if factor not in _LEVELS:
            raise ValueError(
                f"state_dict 'interval_stretch' factor must be one of "
                f"{', '.join(f'{x:g}' for x in _LEVELS)}; got {factor!r}"
            )
        started = state.get("started", True)  # (checkpoints before it: past the first)
        if not isinstance(started, bool):
            raise TypeError(
                f"state_dict 'interval_stretch' started must be a bool; got "
                f"{type(started).__name__}"
            )
        self.factor = _LEVELS[_LEVELS.index(factor)]
        self.started = started
