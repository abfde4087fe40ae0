"""Argument checks, defined once: each names the argument, what is allowed and what was given.

Every public entry point checks its arguments with these, so that a bad
value reads the same wherever it is given: ``"<name> must be <what is
allowed>; got <value>"``, a ``TypeError`` for a value of the wrong kind and
a ``ValueError`` for one of the right kind outside what is allowed.

Torch-free at import time (``kaisa plan`` and the cost model import this
without torch): the checks of tensors and dtypes import torch when called.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar, cast, overload

if TYPE_CHECKING:
    import torch

#: One of a string option's allowed values (a ``Literal`` of :mod:`kaisa.choices`).
Choice = TypeVar("Choice", bound=str)


@dataclass(frozen=True)
class Rule:
    """What values a number allows: integer or real, and its bounds.

    A hyperparameter's rule (:mod:`kaisa.schedules`) checks constants and
    the values its schedule returns; :func:`check_number` is the same rule
    for an argument that cannot be a schedule. NaN is never allowed;
    infinities only with ``finite=False`` (and then within the bounds).
    """

    name: str
    integer: bool = False
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    finite: bool = True

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return kind + (" " + " and ".join(parts) if parts else "")

    def check(self, value: object, where: str = "") -> float:
        """Return ``value`` as a number, or raise naming the hyperparameter.

        The ``TypeError`` for a value that is no number says that a callable
        (a schedule) is allowed too; ``where`` is appended to the allowed
        values (e.g. the step at which a schedule returned ``value``).
        """
        return self.number(value, where, schedule=True)

    def number(self, value: object, where: str = "", *, schedule: bool = False) -> float:
        """Return ``value`` as a float, or raise ``TypeError``/``ValueError`` naming it.

        ``schedule``: a hyperparameter's value, which may also be a 0-d real
        tensor (``lr=torch.tensor(0.01)``, as compiled optimizers take it);
        the ``TypeError`` for a value that is no number says that a callable
        ``step -> value`` is allowed too.
        """
        if schedule and is_tensor(value):
            value = scalar_of_tensor(value, self.name, self.describe(), where)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            also = " or a callable step -> value" if schedule else ""
            raise TypeError(f"{self.name} must be {self.describe()}{also}{where}; got {value!r}")
        number = float(value)
        bad = math.isnan(number) or (self.finite and math.isinf(number))
        if self.integer and not bad and not number.is_integer():
            raise TypeError(f"{self.name} must be {self.describe()}{where}; got {value!r}")
        if self.low is not None:
            bad = bad or (number <= self.low if self.low_open else number < self.low)
        if self.high is not None:
            bad = bad or (number >= self.high if self.high_open else number > self.high)
        if bad:
            raise ValueError(f"{self.name} must be {self.describe()}{where}; got {value!r}")
        return number


def is_tensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.Tensor`` (without importing torch when it is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def scalar_of_tensor(value: object, name: str, allowed: str, where: str = "") -> float:
    """A 0-d real tensor's value as a float; else a ``TypeError``/``ValueError`` naming ``name``.

    ``allowed`` describes the number expected (e.g. ``'a number >= 0'``).
    The value's bounds are the caller's to check.
    """
    import torch

    assert isinstance(value, torch.Tensor)
    if value.dtype == torch.bool or value.is_complex():
        raise TypeError(
            f"{name} must be {allowed}, or a 0-d real tensor{where}; got a tensor of dtype "
            f"{str(value.dtype).removeprefix('torch.')}"
        )
    if value.dim() != 0:
        raise ValueError(
            f"{name} must be {allowed}, or a 0-d real tensor{where}; got a tensor of shape "
            f"{tuple(value.shape)}"
        )
    return float(value.detach().item())


def check_number(
    value: object,
    what: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
    finite: bool = True,
) -> float:
    """``value`` as a float if it is a number (not a bool) within the bounds; else raise.

    ``TypeError`` for a value that is no number (or, with ``integer``, not a
    whole number), ``ValueError`` for NaN, an infinity (unless ``finite`` is
    off) or a number outside ``[low, high]`` (``low_open``/``high_open``:
    the bound itself excluded). The message is :class:`Rule`'s.
    """
    rule = Rule(what, integer, low, high, low_open, high_open, finite)
    return rule.number(value)


def check_count(
    value: object,
    what: str,
    low: int = 0,
    *,
    high: int | None = None,
    type_error: type[Exception] = TypeError,
) -> int:
    """``value`` if it is an integer (not a bool) ``>= low`` (and ``< high``); else raise.

    ``type_error`` (default ``TypeError``) for a value that is no integer,
    ``ValueError`` for one out of range. The work plan and its cost model
    pass ``type_error=ValueError``: they refuse every bad argument with a
    ``ValueError``.
    """
    allowed = f"an integer >= {low}" + ("" if high is None else f" and < {high}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(f"{what} must be {allowed}; got {value!r}")
    if value < low or (high is not None and value >= high):
        raise ValueError(f"{what} must be {allowed}; got {value!r}")
    return value


def check_flag(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False`` (not ``0``/``1``); else a ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return value


def one_of(name: str, value: object, allowed: tuple[Choice, ...]) -> Choice:
    """``value`` lower-cased if it is one of ``allowed``; else a ``ValueError`` naming both."""
    if not isinstance(value, str) or value.lower() not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return cast(Choice, value.lower())


def float_dtypes() -> tuple[torch.dtype, ...]:
    """The floating dtypes a factor or a second-order state may be held in."""
    import torch

    return (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@overload
def check_dtype(name: str, value: object, allow_none: Literal[False]) -> torch.dtype: ...
@overload
def check_dtype(name: str, value: object, allow_none: bool = True) -> torch.dtype | None: ...
def check_dtype(name: str, value: object, allow_none: bool = True) -> torch.dtype | None:
    """``value`` if it is a floating ``torch.dtype`` (or ``None``, with ``allow_none``).

    Else a ``TypeError`` listing the allowed dtypes.
    """
    if value is None and allow_none:
        return None
    import torch

    allowed = float_dtypes()
    if not isinstance(value, torch.dtype) or value not in allowed:
        raise TypeError(
            f"{name} must be a floating torch.dtype ({', '.join(map(str, allowed))})"
            f"{' or None' if allow_none else ''}; got {value!r}"
        )
    return value


def check_tensor(
    value: object,
    what: str,
    shape: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    """A finite floating tensor of ``shape``, cast to ``dtype`` (``None``: its own) on ``device``.

    ``TypeError`` for a non-tensor or a non-floating dtype, ``ValueError`` for
    another shape or an entry that is NaN or infinite (checked after the
    cast, which can overflow). ``what`` names the tensor in the messages.
    """
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what} must be a tensor; got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor; got dtype {value.dtype}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{what} has shape {tuple(value.shape)}, expected {shape}")
    cast = value.detach().to(device=device, dtype=value.dtype if dtype is None else dtype)
    if not bool(torch.isfinite(cast).all()):
        note = f" (as {cast.dtype})" if cast.dtype != value.dtype else ""
        raise ValueError(f"{what} holds NaN or Inf{note}")
    return cast


__all__ = [
    "Rule",
    "check_count",
    "check_dtype",
    "check_flag",
    "check_number",
    "check_tensor",
    "float_dtypes",
    "one_of",
]


def key_differences(
    mapping: Mapping[object, object], required: Sequence[object], optional: Sequence[object] = ()
) -> tuple[list[object], list[str]]:
    """The keys ``mapping`` lacks (in ``required``'s order) and those it should not hold.

    The unexpected keys come as sorted ``repr``s, ready for a message; a key
    is expected when it is in ``required`` or ``optional``.
    """
    missing = [key for key in required if key not in mapping]
    allowed = [*required, *optional]
    unexpected = sorted(repr(key) for key in mapping if key not in allowed)
    return missing, unexpected
