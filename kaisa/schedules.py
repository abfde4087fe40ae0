"""Hyperparameter schedules: every number may also be a callable ``f(step)``.

``step`` is the number of completed ``preconditioner.step()`` calls. A
schedule's value is checked against the same rule as a constant, and a bad
value names the hyperparameter and the step.

A 0-d real tensor (``lr=torch.tensor(0.01)``, the form compiled optimizers
take, updated in place by their schedulers) is *live*: checked when given and
read again at every step, so that it follows the optimizer's tensor. A
schedule may return one too.
"""

from __future__ import annotations

from kaisa.validation import Rule, is_tensor


class Hyperparameter:
    """A validated constant or schedule; :meth:`at` reads it at a step."""

    def __init__(self, rule: Rule, value: object) -> None:
        self.rule = rule
        self.value = value
        #: A 0-d tensor, read at every step (see the module docstring).
        self.live = is_tensor(value)
        checked = None if callable(value) else rule.check(value)
        self.constant: float | None = None if self.live else checked

    @property
    def is_schedule(self) -> bool:
        """A callable or a live tensor: the value may change from step to step."""
        return self.constant is None

    def at(self, step: int) -> float:
        if self.constant is not None:
            return self.constant
        if self.live:
            return self.rule.check(self.value, f" (the tensor's value at step {step})")
        assert callable(self.value)
        return self.rule.check(self.value(step), f" (the schedule returned it at step {step})")

    def int_at(self, step: int) -> int:
        return int(self.at(step))

    def __repr__(self) -> str:
        return f"{self.rule.name}={self.value!r}"
