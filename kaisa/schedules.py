"""Hyperparameter schedules: every number may also be a callable ``f(step)``.

``step`` is the number of completed ``preconditioner.step()`` calls. A
schedule's value is checked against the same rule as a constant, and a bad
value names the hyperparameter and the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """What values a hyperparameter allows: integer or real, and its bounds."""

    name: str
    integer: bool = False
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return kind + (" " + " and ".join(parts) if parts else "")

    def check(self, value: object, where: str = "") -> float:
        """Return ``value`` as a number, or raise naming the hyperparameter."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"{self.name} must be {self.describe()} or a callable step -> value{where}; "
                f"got {value!r}"
            )
        number = float(value)
        bad = math.isnan(number) or math.isinf(number)
        if self.integer and not bad and not number.is_integer():
            raise TypeError(f"{self.name} must be {self.describe()}{where}; got {value!r}")
        if self.low is not None:
            bad = bad or (number <= self.low if self.low_open else number < self.low)
        if self.high is not None:
            bad = bad or (number >= self.high if self.high_open else number > self.high)
        if bad:
            raise ValueError(f"{self.name} must be {self.describe()}{where}; got {value!r}")
        return number


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
