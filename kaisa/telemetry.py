"""What the preconditioner did: time per phase, elements and bytes sent, skips.

Timers use the host clock. On an accelerator the host runs ahead of the
device, so per-phase times there are launch times unless ``synchronize`` is
set (``preconditioner.telemetry.synchronize = True``), which waits for the
device at each phase boundary (slower; for profiling).

Every phase is also a ``torch.profiler.record_function`` range named
``kaisa.<phase>``, so profiles show it. Inside a graph that ``torch.compile``
is tracing (the capture hooks of a compiled model) a timer does nothing: the
host clock there would break the graph, and the time would be that of the
tracing, not of the run.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

#: Phases timed by the preconditioner.
PHASES = (
    "capture",
    "factor_products",
    "factor_allreduce",
    "decomposition",
    "inverse_broadcast",
    "precondition",
    "grad_broadcast",
    "kl_clip",
)

#: Kinds of collective whose traffic is counted: the three of spec §5's cost
#: model, and two small additions outside it, only with several ranks: the
#: per-step agreement on which layers ran (``len(layers)`` elements) and the
#: row counts that travel with each factor all-reduce (two per layer, in the
#: same call, so each bucket counts one call of each kind).
COLLECTIVES = (
    "factor_allreduce",
    "inverse_broadcast",
    "grad_broadcast",
    "layer_flags",
    "factor_rows",
)


def _synchronize(device: torch.device | None) -> None:
    """Wait for the work queued on ``device`` (``None``: the current accelerator, if any)."""
    if device is None:
        if not torch.accelerator.is_available():
            return
    elif device.type == "cpu":
        return
    torch.accelerator.synchronize(device)


class Telemetry:
    """Cumulative counters since the last :meth:`reset`, plus the last step's traffic.

    Attributes:
        phase_seconds: seconds spent per phase (see :data:`PHASES`).
        elements: elements passed to collectives this rank took part in, per kind.
        bytes: the same in bytes.
        calls: number of collective calls per kind.
        last_step_elements: ``elements`` of the most recent ``step()`` only.
        steps: ``step()`` calls counted.
        skipped_factor_updates: factor updates dropped because of NaN/Inf.
        outlier_factor_updates: layer batch factors refused as outlier batches (held
            back, and the next update was back at the running average's scale).
        side_refreshes: refreshes of a side's second-order state this rank ran
            (one per side owned, at each inverse-update step; failed ones too).
        kept_eigenbases: of those, refreshes that kept the held eigenbasis and
            refreshed only the eigenvalues (``eigenbasis_tolerance``): each one
            a decomposition saved.
        interval_changes: changes of the intervals' multiplier
            (``adaptive_intervals``; the multiplier in force is
            ``KFACPreconditioner.interval_stretch``).
        stale_refreshes: steps at which ``stale_refresh`` found the curvature
            stale and cut the intervals to one step.
        failed_decompositions: decompositions that failed (state kept).
        float64_decompositions: float32 eigendecompositions redone in float64
            because the damped solve would have been inaccurate
            (:data:`kaisa.curvature.block.EIGEN_TOLERANCE`).
        kl_clipped_steps: steps at which KL clipping shrank the update (``ν < 1``).
        last_kl_scale: ``ν`` of the most recent step (1.0 without clipping).
        synchronize: wait for the accelerator at each phase boundary, so that
            the phase times are the device's (slower; for profiling). No
            effect without an accelerator. Kept by :meth:`reset`.
    """

    def __init__(self, synchronize: bool = False) -> None:
        self.synchronize = synchronize
        self.reset()

    def reset(self) -> None:
        self.phase_seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.elements: dict[str, int] = dict.fromkeys(COLLECTIVES, 0)
        self.bytes: dict[str, int] = dict.fromkeys(COLLECTIVES, 0)
        self.calls: dict[str, int] = dict.fromkeys(COLLECTIVES, 0)
        self.last_step_elements: dict[str, int] = dict.fromkeys(COLLECTIVES, 0)
        self._step_elements: defaultdict[str, int] = defaultdict(int)
        self.steps = 0
        self.skipped_factor_updates = 0
        self.outlier_factor_updates = 0
        self.side_refreshes = 0
        self.kept_eigenbases = 0
        self.interval_changes = 0
        self.stale_refreshes = 0
        self.failed_decompositions = 0
        self.float64_decompositions = 0
        self.kl_clipped_steps = 0
        self.last_kl_scale = 1.0

    def record_kl_scale(self, scale: float) -> None:
        """Record the KL-clipping factor ``ν`` applied at this step."""
        self.last_kl_scale = scale
        if scale < 1.0:
            self.kl_clipped_steps += 1

    def timer(self, phase: str, device: torch.device | None = None) -> AbstractContextManager[None]:
        """Add the time spent inside the block to ``phase_seconds[phase]``.

        With :attr:`synchronize`, waits for ``device`` (``None``: the current
        accelerator, if there is one) before and after the block. The block is
        a profiler range ``kaisa.<phase>``. While ``torch.compile`` traces the
        block this is ``contextlib.nullcontext()``, which Dynamo traces (and
        breaks a graph in) like no context at all: nothing is timed.
        """
        if torch.compiler.is_compiling():
            return nullcontext()
        return self._timed(phase, device)

    @contextmanager
    def _timed(self, phase: str, device: torch.device | None) -> Iterator[None]:
        with torch.profiler.record_function(f"kaisa.{phase}"):
            if self.synchronize:
                _synchronize(device)
            start = time.perf_counter()
            try:
                yield
            finally:
                if self.synchronize:
                    _synchronize(device)
                self.phase_seconds[phase] = (
                    self.phase_seconds.get(phase, 0.0) + time.perf_counter() - start
                )

    def count(self, kind: str, tensor: torch.Tensor) -> None:
        """Record one collective call of ``kind`` on ``tensor``."""
        numel = tensor.numel()
        self.elements[kind] += numel
        self.bytes[kind] += numel * tensor.element_size()
        self.calls[kind] += 1
        self._step_elements[kind] += numel

    def end_step(self) -> None:
        self.last_step_elements = {kind: self._step_elements[kind] for kind in COLLECTIVES}
        self._step_elements.clear()
        self.steps += 1

    def __repr__(self) -> str:
        phases = ", ".join(f"{k} {v:.3f}s" for k, v in self.phase_seconds.items() if v)
        sent = sum(self.bytes.values())
        return (
            f"Telemetry(steps={self.steps}, phases=[{phases}], bytes={sent}, "
            f"skipped_factor_updates={self.skipped_factor_updates}, "
            f"outlier_factor_updates={self.outlier_factor_updates}, "
            f"side_refreshes={self.side_refreshes}, "
            f"kept_eigenbases={self.kept_eigenbases}, "
            f"interval_changes={self.interval_changes}, "
            f"stale_refreshes={self.stale_refreshes}, "
            f"failed_decompositions={self.failed_decompositions}, "
            f"float64_decompositions={self.float64_decompositions}, "
            f"kl_clipped_steps={self.kl_clipped_steps})"
        )

    def summary(self) -> dict[str, object]:
        """A JSON-friendly snapshot of every counter."""
        return {
            "steps": self.steps,
            "phase_seconds": dict(self.phase_seconds),
            "elements": dict(self.elements),
            "bytes": dict(self.bytes),
            "calls": dict(self.calls),
            "last_step_elements": dict(self.last_step_elements),
            "skipped_factor_updates": self.skipped_factor_updates,
            "outlier_factor_updates": self.outlier_factor_updates,
            "side_refreshes": self.side_refreshes,
            "kept_eigenbases": self.kept_eigenbases,
            "interval_changes": self.interval_changes,
            "stale_refreshes": self.stale_refreshes,
            "failed_decompositions": self.failed_decompositions,
            "float64_decompositions": self.float64_decompositions,
            "kl_clipped_steps": self.kl_clipped_steps,
            "last_kl_scale": self.last_kl_scale,
        }
