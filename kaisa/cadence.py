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
to 1, the intervals as given). Curvature that stays put is then refreshed
less often, and curvature that moves keeps the intervals given. The share is
summed over the ranks (each side is refreshed by one rank), so every rank
holds the same multiplier. The first inverse update with sides that could
keep a basis is no evidence and is skipped: those sides held the identity
they start from, which a factor either fails (every side decomposes) or, at
a loose tolerance, passes for no reason of its own. It is a pure function of
the counts: two runs with the same seed stretch alike.
"""

from __future__ import annotations

from typing import Any

from kaisa.validation import check_count, check_flag

__all__ = ["MAX_STRETCH", "STALE_HIGH", "STALE_LOW", "IntervalStretch"]

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

    def observe(self, keepable: int, kept: int) -> bool:
        """One inverse update's counts over all ranks; returns whether the multiplier changed.

        ``keepable``: sides refreshed that could have kept their eigenbasis
        (exact, eigen method); ``kept``: of those, the ones that did.
        """
        if not self.enabled or keepable <= 0:
            return False
        if not 0 <= kept <= keepable:
            raise ValueError(f"kept ({kept}) must be in [0, keepable={keepable}]")
        if not self.started:  # the sides held their starting identity: no evidence
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
