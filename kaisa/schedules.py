"""Hyperparameter schedules: every number may also be a callable ``f(step)``.

``step`` is the number of completed ``preconditioner.step()`` calls. A
schedule's value is checked against the same rule as a constant, and a bad
value names the hyperparameter and the step.
"""

from __future__ import annotations

from kaisa.validation import Rule


class Hyperparameter:
    """A validated constant or schedule; :meth:`at` reads it at a step."""

    def __init__(self, rule: Rule, value: object) -> None:
        self.rule = rule
        self.value = value
        self.constant: float | None = None if callable(value) else rule.check(value)

    @property
    def is_schedule(self) -> bool:
        return self.constant is None

    def at(self, step: int) -> float:
        if self.constant is not None:
            return self.constant
        assert callable(self.value)
        return self.rule.check(self.value(step), f" (the schedule returned it at step {step})")

    def int_at(self, step: int) -> int:
        return int(self.at(step))

    def __repr__(self) -> str:
        return f"{self.rule.name}={self.value!r}"
