"""Fail fast when the ranks of a process group are not set up alike (spec §10).

Every rank must register the same layers and use the same options that shape
the collectives or the maths; otherwise the collectives of the
:class:`~kaisa.distributed.Communicator` mismatch, which hangs or aborts the
process (gloo), or silently averages unrelated tensors. At construction,
:func:`check_agreement` has the ranks compare a digest of all of this
(:func:`agreement_digest`) and, on a difference, raises
:class:`RankDisagreementError` on **every** rank, naming each differing item
and every rank's value::

    kaisa: ranks disagree on damping: rank 0 has 0.03, rank 1 has 0.01

The exchange is one all-gather of a fixed-length ``int64`` tensor (a format
number, the digest's length and a 63-bit hash of it), whatever the digests
hold; only when the hashes differ (which every rank sees alike) do the ranks
gather the digests themselves (``all_gather_object``) to name the differences.
It runs on the preconditioner's data-parallel group (the default process
group unless ``process_group=`` was given); with NCCL the tensor lives on the current
CUDA device (``torch.cuda.set_device`` must have been called, as for any NCCL
``all_gather_object``).

Schedules (callables) and 0-d tensors cannot be compared as given: the
digest holds their values at step 0 (``lr (at step 0)``), and
:class:`ScheduleCheck` compares their later values at the end of a
``step()`` for the next one (before the next iteration's hooks may launch a
factor all-reduce that a rank on another factor interval would not match):
one all-gather of a few float64, only when some hyperparameter is a
schedule or a tensor. When a factor or inverse interval is a schedule, at
every step; otherwise (the intervals agreed at construction) only before
the steps that update factors or second-order state, so an ``lr`` read from
the optimizer (``optimizer=``) costs no collective and no host sync on the
other steps; a difference in ``lr``, ``damping``, ``factor_decay`` or
``kl_clip`` is then named at the next update step. (A tensor changed in
place between steps is read at the end of the step that used it: one step
late.) A difference raises
:class:`RankDisagreementError` on every rank, naming the hyperparameter, the
step and every rank's value, instead of ranks diverging silently or a
collective mismatch (with different factor intervals, gloo aborts the
process).

A rank that never reaches the check cannot be told from a slow one without a
timeout. With gloo the check therefore starts with
``torch.distributed.monitored_barrier``: a peer that does not arrive within
``KAISA_AGREEMENT_TIMEOUT_S`` seconds (environment variable, default 300)
makes the check raise :class:`RankDisagreementError` naming the missing
rank(s), rather than leaving the others waiting for the process group's own
timeout (30 minutes by default). After that error gloo has closed the
connections to the late rank(s), so the process group is unusable: the job
should end. Other backends have no monitored barrier and
rely on the process group's timeout.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from kaisa.distributed.plan import WorkPlan

#: The environment variable holding the timeout of the arrival check, in seconds.
TIMEOUT_ENV = "KAISA_AGREEMENT_TIMEOUT_S"
#: The arrival timeout when :data:`TIMEOUT_ENV` is not set, in seconds.
DEFAULT_TIMEOUT_S = 300.0
#: The largest timeout an environment variable may set, in seconds (a week).
MAX_TIMEOUT_S = 7 * 24 * 3600.0
#: At most this many differences are listed in the error.
MAX_LISTED = 10
#: The format of the exchanged header (bumped if the digest changes meaning).
_FORMAT = 1
#: The options whose values are constants or schedules (see :func:`_hyper`).
_HYPER = ("factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip", "lr")
#: The hyperparameters that decide which steps run collectives.
_INTERVALS = ("factor_update_steps", "inv_update_steps")
#: Options compared as given (after validation).
_PLAIN = (
    "accumulation_steps",
    "compute_method",
    "compute_eigenvalue_outer_product",
    "symmetry_aware",
    "assignment_strategy",
    "colocate_factors",
    "allreduce_bucket_cap_mb",
    "damping_mode",
    "factor_init",
    "eigenvalue_correction",
    "eigenvalue_decay",
    "eigenbasis_tolerance",
    "adaptive_intervals",
    "stale_refresh",
    "fresh_start_steps",
    "grafting",
    "time_budget",
    "calibrate_budget",
    "update_factors_in_hook",
    "conv_factor_estimator",
    "factor_sample",
    "profile",
)


class RankDisagreementError(RuntimeError):
    """The ranks differ in what must agree, or a rank did not arrive in time.

    A ``RuntimeError`` (as torch.distributed's own failures are): the
    arguments of each rank may be valid by themselves; what is wrong is the
    set-up of the job.
    """


def _hyper(options: Any, name: str) -> object:
    """A constant as a float, ``'schedule'`` for a callable, ``'tensor'`` for a 0-d tensor
    (read at every step), ``'auto'`` if left to kaisa."""
    if name in options.auto:
        return "auto"
    hyper = options.hyper.get(name)
    if hyper is None:  # kl_clip=None: no clipping
        return None
    if hyper.live:
        return "tensor"
    if hyper.is_schedule:
        return "schedule"
    return float(hyper.constant)


#: What a schedule's value is recorded as when it raises (the step reports it).
_RAISES = float("inf")


def _value_at(options: Any, name: str, step: int) -> float:
    """A schedule's or tensor's value at ``step``; ``inf`` if it raises (the step says why:
    read ahead of its step, a schedule's exception is the step's to report)."""
    try:
        return float(options.hyper[name].at(step))
    except Exception:
        return _RAISES


class ScheduleCheck:
    """The ranks' schedules and tensor hyperparameters agree at every step (module docstring).

    Args:
        options: the :class:`~kaisa.options.KFACOptions` (which
            hyperparameters are schedules or tensors).
        comm: the :class:`~kaisa.distributed.Communicator` (its
            ``gather_values`` and ``distributed``).
    """

    def __init__(self, options: Any, comm: Any) -> None:
        self.options = options
        self.comm = comm
        #: The hyperparameters compared: schedules and tensors, not left to kaisa.
        self.names = [
            name
            for name in _HYPER
            if name in options.hyper
            and name not in options.auto
            and options.hyper[name].is_schedule
        ]
        #: Whether an interval is a schedule: then the ranks could disagree on
        #: which steps update, so every name is compared at every step.
        self.every_step = any(name in _INTERVALS for name in self.names)
        #: How many all-gathers the check has made.
        self.exchanges = 0

    def check(self, step: int, *, update_due: bool = True) -> None:
        """Raise :class:`RankDisagreementError` on every rank unless all values at ``step`` match.

        Collective (every rank calls it at the end of every ``step()``); a
        no-op with one rank or without schedules. With constant (or
        automatic) intervals, which every rank was shown to share at
        construction, the values are compared only when ``update_due`` (step
        ``step`` updates factors or second-order state: the steps whose
        collectives a difference could mismatch), so an optimizer's ``lr``
        read each step costs no all-gather and no host sync on the others.
        """
        if not self.names or not self.comm.distributed:
            return
        if not (self.every_step or update_due):
            return
        self.exchanges += 1
        rows = self.comm.gather_values([_value_at(self.options, n, step) for n in self.names])
        parts = []
        for i, name in enumerate(self.names):
            values = [row[i] for row in rows]
            if any(v != values[0] for v in values[1:]):
                ranks = ", ".join(
                    f"rank {r} has {'a raising schedule' if v == _RAISES else _show(v)}"
                    for r, v in enumerate(values)
                )
                parts.append(f"{name} at step {step}: {ranks}")
        if parts:
            raise RankDisagreementError(
                "kaisa: ranks disagree on "
                + "; ".join(parts)
                + " (every rank must pass the same schedules: the ranks would precondition "
                "differently, or mismatch their collectives)"
            )


def _dtype(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def agreement_digest(
    options: Any,
    plan: WorkPlan,
    layers: Sequence[tuple[str, int, int]],
    *,
    factor_dtype: torch.dtype | None = None,
    inv_dtype: torch.dtype | None = None,
    product_dtype: torch.dtype | None = None,
) -> dict[str, object]:
    """What every rank must have alike, as a flat JSON-able dict.

    Args:
        options: the :class:`~kaisa.options.KFACOptions`.
        plan: the work plan (gives the world size and the gradient workers per
            layer, ``m``, resolved from ``grad_worker_fraction``).
        layers: the registered layers as ``(name, a_size, g_size)``, in order.
        factor_dtype, inv_dtype, product_dtype: the resolved dtypes (``None``:
            the option as given).

    Hyperparameters record their constant, ``'schedule'`` for a callable (two
    schedules are not compared) or ``'auto'`` when left to the automatic
    choice. Keys name what a reader of the error needs: ``damping``,
    ``layers[1].g_size``.
    """
    digest: dict[str, object] = {
        "world_size": int(plan.world_size),
        "grad_workers": int(plan.grad_workers),
        "grad_worker_fraction": "auto" if options.grad_worker_fraction == "auto" else "given",
    }
    for name in _HYPER:
        digest[name] = _hyper(options, name)
    for name in _PLAIN:
        value = getattr(options, name)
        digest[name] = float(value) if name in ("allreduce_bucket_cap_mb", "time_budget") else value
    for name in _HYPER:
        if digest[name] in ("schedule", "tensor"):
            digest[f"{name} (at step 0)"] = _value_at(options, name, 0)
    digest["curvature"] = [[pattern, [a, g]] for pattern, (a, g) in options.curvature_rules]
    for field, weight in dataclasses.asdict(options.cost_model).items():
        digest[f"cost_model.{field}"] = float(weight)
    digest["factor_dtype"] = _dtype(factor_dtype or options.factor_dtype)
    digest["inv_dtype"] = _dtype(inv_dtype or options.inv_dtype)
    digest["factor_product_dtype"] = _dtype(product_dtype or options.factor_product_dtype)
    digest["layers"] = len(layers)
    for i, (name, a_size, g_size) in enumerate(layers):
        digest[f"layers[{i}].name"] = name
        digest[f"layers[{i}].a_size"] = int(a_size)
        digest[f"layers[{i}].g_size"] = int(g_size)
    return digest


def encode(digest: dict[str, object]) -> bytes:
    """The digest's canonical bytes (sorted keys, compact JSON)."""
    return json.dumps(digest, sort_keys=True, separators=(",", ":")).encode()


def header(digest: dict[str, object]) -> torch.Tensor:
    """The fixed-length ``int64`` tensor the ranks exchange: format, length, 63-bit hash."""
    data = encode(digest)
    hashed = int.from_bytes(hashlib.sha256(data).digest()[:8], "big") >> 1
    return torch.tensor([_FORMAT, len(data), hashed], dtype=torch.int64)


_ABSENT = "<absent>"


def differences(digests: Sequence[dict[str, object]]) -> list[tuple[str, list[object]]]:
    """Each key on which the ranks' digests differ, with every rank's value, in key order.

    A key some rank lacks (e.g. a layer index past its last layer) has
    ``'<absent>'`` there.
    """
    keys: list[str] = []
    for digest in digests:
        keys.extend(k for k in digest if k not in keys)
    out = []
    for key in keys:
        values = [d.get(key, _ABSENT) for d in digests]
        if any(v != values[0] for v in values[1:]):
            out.append((key, values))
    return out


def _label(key: str, digests: Sequence[dict[str, object]]) -> str:
    """``key``, plus the layer's name(s) for a per-layer size, or the option behind it."""
    if key == "grad_workers":
        return "grad_workers per layer (from grad_worker_fraction)"
    if key.startswith("layers[") and not key.endswith(".name"):
        names = {str(d.get(key.rsplit(".", 1)[0] + ".name", _ABSENT)) for d in digests}
        names.discard(_ABSENT)
        if names:
            return f"{key} (layer {' / '.join(map(repr, sorted(names)))})"
    return key


def describe(digests: Sequence[dict[str, object]]) -> str | None:
    """The error message for the ranks' digests, or ``None`` if they agree."""
    found = differences(digests)
    if not found:
        return None
    parts = []
    for key, values in found[:MAX_LISTED]:
        ranks = ", ".join(f"rank {r} has {_show(v)}" for r, v in enumerate(values))
        parts.append(f"{_label(key, digests)}: {ranks}")
    more = len(found) - MAX_LISTED
    tail = f"; and {more} more difference{'s' if more > 1 else ''}" if more > 0 else ""
    return (
        "kaisa: ranks disagree on "
        + "; ".join(parts)
        + tail
        + " (every rank must register the same layers and pass the same options)"
    )


def _show(value: object) -> str:
    if isinstance(value, str):
        return (
            value
            if value in (_ABSENT, "auto", "given", "probed", "schedule", "tensor")
            else repr(value)
        )
    if isinstance(value, float):
        return f"{value:g}" if float(f"{value:g}") == value else repr(value)
    return json.dumps(value) if isinstance(value, list) else repr(value)


def seconds_from_env(name: str, default: float) -> float:
    """A timeout in seconds from the environment variable ``name`` (``default`` if unset).

    Raises ``ValueError`` naming the variable unless it is a finite number
    > 0 and at most :data:`MAX_TIMEOUT_S` (a week: beyond it a timeout is no
    timeout, and ``1e300`` overflows ``datetime.timedelta`` and the
    backends' millisecond counters).
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_TIMEOUT_S:  # (NaN and the infinities fail too)
        raise ValueError(
            f"{name} must be a number of seconds > 0 and at most {MAX_TIMEOUT_S:g} "
            f"(a week); got {text!r}"
        )
    return value


def agreement_timeout() -> float:
    """The arrival timeout from :data:`TIMEOUT_ENV`, in seconds (default 300)."""
    return seconds_from_env(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def check_agreement(digest: dict[str, object], group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`RankDisagreementError` on every rank unless all ranks' digests match.

    Among the ranks of ``group`` (the default group when ``None``). A no-op
    without an initialised process group of more than one rank. Every rank
    of the group must call it (it is collective).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return
    world = dist.get_world_size(group)
    backend = str(dist.get_backend(group))
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    if backend == "gloo":
        timeout = agreement_timeout()
        try:
            dist.monitored_barrier(
                group, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True
            )
        except RuntimeError as error:
            raise RankDisagreementError(
                f"kaisa: not every rank reached the agreement check within {timeout:g} s "
                f"(set {TIMEOUT_ENV} to wait longer); torch.distributed reported: {error}"
            ) from error
    mine = header(digest).to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    if all(torch.equal(h, gathered[0]) for h in gathered[1:]):
        return
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, digest, group=group)
    message = describe(digests)
    if message is None:  # equal digests, different encodings: cannot happen
        message = "kaisa: ranks disagree on the agreement digest's encoding (mixed versions?)"
    # Every rank raises, and most jobs then end. A rank that leaves while a peer
    # is still reading its part of the gather above closes the connection under
    # it; past this barrier every rank has all it needs, so each can exit with
    # the error (and a launcher that stops the others at the first exit finds
    # them raising too).
    dist.barrier(group=group)
    raise RankDisagreementError(message)
