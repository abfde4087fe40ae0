"""The iteration's captures: which forward call belongs to which pass, what enters the sums.

On a factor-update step every training call of a registered layer leaves its
input; when the call's output gradient ``δ`` arrives, both enter the layer's
factor sums (spec §3). A *pass* is one forward of the whole model and its
backward; a *micro-batch* of a layer is a pass whose every call of the layer
has its output gradient (gradient accumulation counts them up to
``accumulation_steps``). With several ranks a layer whose last micro-batch is
complete submits its sums to the factor all-reduce from the hook, so the
traffic overlaps the rest of the backward pass.

:class:`LayerCaptures` is one layer's bookkeeping for the current iteration;
:class:`Capturer` is what the hooks call. Neither knows the maths of a factor
(the layer handler turns rows into sums) nor where the sums go after the
all-reduce (the front door folds them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from kaisa.curvature.linalg import split_invariant_g, unscale
from kaisa.distributed.comm import Communicator, Payload, PayloadKey
from kaisa.engines.pipelining import inferring_pipeline_shapes
from kaisa.layers import LayerHandler
from kaisa.layers.base import GradSelect
from kaisa.telemetry import Telemetry
from kaisa.warn import warn

__all__ = ["ALL_KEYS", "Capturer", "LayerCaptures"]

#: What a layer captures while the automatic choice is pending: everything.
ALL_KEYS: tuple[PayloadKey, ...] = (
    ("a", "gram"),
    ("a", "moments"),
    ("g", "gram"),
    ("g", "moments"),
)


@dataclass
class LayerCaptures:
    """One layer's captures in the current iteration.

    ``keys``: what the layer captures on a factor-update step, per side a
    full gram or the moments of the rows (both while the automatic choice is
    pending); ``sums`` / ``rows``: this iteration's accumulated captures per
    key; ``inputs`` / ``grad_outputs``: raw captures kept for ``step()``
    when the products are not computed in the hooks.
    """

    name: str
    handler: LayerHandler
    keys: tuple[PayloadKey, ...]
    called: bool = False
    micro_batches: int = 0  # passes whose every capture of this layer is complete
    #: Per open pass (see :meth:`Capturer.pass_of`), its calls of this layer
    #: whose output gradient has not arrived yet.
    open_passes: dict[int, int] = field(default_factory=dict)
    last_pass: int = 0  # the pass of the most recent call
    sums: dict[PayloadKey, torch.Tensor] = field(default_factory=dict)
    rows: dict[PayloadKey, int] = field(default_factory=dict)
    inputs: list[torch.Tensor] = field(default_factory=list)
    grad_outputs: list[torch.Tensor] = field(default_factory=list)
    submitted: bool = False
    extra_passes: int = 0  # forward calls beyond accumulation_steps this iteration

    @property
    def pending(self) -> int:
        """Forward calls whose output gradient has not arrived yet."""
        return sum(self.open_passes.values())

    def reset(self) -> None:
        """Forget the iteration (at the end of every ``step()``)."""
        self.called = False
        self.extra_passes = 0
        self.micro_batches = 0
        self.open_passes.clear()
        self.last_pass = 0
        self.sums.clear()
        self.rows.clear()
        self.inputs.clear()
        self.grad_outputs.clear()
        self.submitted = False

    def accumulate(self, which: str, x: torch.Tensor) -> None:
        """Add one call's captures of side ``which`` (input or output gradient)."""
        handler = self.handler
        for key in self.keys:
            if key[0] != which:
                continue
            out = self.sums.get(key)
            if key == ("a", "gram"):
                total, rows = handler.a_sum(x, out)
            elif key == ("a", "moments"):
                total, rows = handler.a_moments(x, out)
            elif key == ("g", "gram"):
                total, rows = handler.g_sum(x, out)
            else:
                total, rows = handler.g_moments(x, out)
            self.sums[key] = total
            self.rows[key] = self.rows.get(key, 0) + rows

    def capture_bytes(self) -> int:
        tensors = [*self.sums.values(), *self.inputs, *self.grad_outputs]
        return sum(t.numel() * t.element_size() for t in tensors)


class Capturer:
    """What the forward and output-gradient hooks do, for every registered layer.

    Args:
        comm: where complete sums go (with several ranks, from the hook).
        telemetry: the ``capture`` and ``factor_products`` timers.
        accumulation_steps: passes per ``step()``.
        update_in_hook: compute the factor products in the hooks (else at
            :meth:`factor_sums`).
        product_dtype: the dtype the captures are cast to for the products.
        device_type: the device type whose autocast is turned off in the hooks.
        grad_scale: reads the current loss scale (``None``: no scaler); the
            output gradients are unscaled with it before any product.
    """

    def __init__(
        self,
        comm: Communicator,
        telemetry: Telemetry,
        *,
        accumulation_steps: int,
        update_in_hook: bool,
        product_dtype: torch.dtype,
        device_type: str,
        grad_scale: Callable[[], float] | None,
    ) -> None:
        self.comm = comm
        self.telemetry = telemetry
        self.accumulation_steps = accumulation_steps
        self.update_in_hook = update_in_hook
        self.product_dtype = product_dtype
        self.device_type = device_type
        self.grad_scale = grad_scale
        #: Whether calls in this iteration capture (a factor-update step).
        self.enabled = False
        self.root_passes = 0  # the model's training forward calls in this iteration
        self.ignored_passes: set[int] = set()  # of those, a pipeline's shape inference
        self.step_scale: float | None = None  # the loss scale, read once per iteration

    # -- hooks ---------------------------------------------------------------------
    def root_forward(self, module: nn.Module) -> None:
        """A forward pass of the whole model (training, autograd on) begins."""
        self.root_passes += 1
        # (Only a capture can take a placeholder pass for a micro-batch.)
        if self.enabled and inferring_pipeline_shapes():
            self.ignored_passes.add(self.root_passes)

    def capture(
        self, layer: LayerCaptures, x: torch.Tensor, output: torch.Tensor, select: GradSelect
    ) -> None:
        """One call of a layer: its input ``x`` and its output (whose gradient gives ``δ``)."""
        if not (layer.handler.module.training and torch.is_grad_enabled() and output.requires_grad):
            return  # evaluation, or no gradient will reach this call
        layer.called = True
        if not self.enabled:
            return
        pass_id = self.pass_of(layer)
        if pass_id in self.ignored_passes:
            return
        if pass_id not in layer.open_passes and layer.micro_batches >= self.accumulation_steps:
            # A pass beyond accumulation_steps: step() refuses it (with several
            # ranks the factors are already on their way).
            layer.extra_passes += 1
            return
        with self.telemetry.timer("capture"):
            layer.open_passes[pass_id] = layer.open_passes.get(pass_id, 0) + 1
            # The input enters A only when its output gradient arrives: a forward
            # whose backward never runs leaves no trace in the factors. Autograd
            # holds the input for the weight gradient anyway.
            output.register_hook(  # type: ignore[no-untyped-call]
                functools.partial(self._grad_output, layer, select, x.detach(), pass_id)
            )

    def pass_of(self, layer: LayerCaptures) -> int:
        """The forward/backward pass a call of ``layer`` belongs to.

        The model's own forward calls number the passes (pipeline schedules
        run several micro-batches' forwards before their backwards, so passes
        overlap). Without them (layers called outside the model's forward) a
        call starts a new pass when none of the layer's calls is waiting for
        its gradient.
        """
        if self.root_passes:
            return self.root_passes
        if not layer.open_passes:
            layer.last_pass -= 1  # negative: apart from the model's numbering
        return layer.last_pass

    def _grad_output(
        self,
        layer: LayerCaptures,
        select: GradSelect,
        x: torch.Tensor,
        pass_id: int,
        grad: torch.Tensor,
    ) -> None:
        with torch.autocast(self.device_type, enabled=False):
            with self.telemetry.timer("capture"):
                if x.is_floating_point():  # (an embedding's indices stay integers)
                    x = x.to(self.product_dtype)
                if select is not None:
                    grad = select(grad)
                delta = grad.detach().to(self.product_dtype)
                if self.step_scale is None and self.grad_scale is not None:
                    self.step_scale = self.grad_scale()
                if self.step_scale is not None and self.step_scale != 1.0:
                    # Unscaled before the products: δ at a loss scale of 2^70 would
                    # overflow δᵀδ in float32, and the squared scale overflows from 2^64.
                    delta = unscale(delta, self.step_scale)
            if self.update_in_hook:
                with self.telemetry.timer("factor_products"):
                    layer.accumulate("a", x)
                    layer.accumulate("g", delta)
            else:
                layer.inputs.append(x)
                layer.grad_outputs.append(delta)
            left = layer.open_passes[pass_id] - 1
            if left:
                layer.open_passes[pass_id] = left
                return
            del layer.open_passes[pass_id]
            layer.micro_batches += 1
            if (
                self.comm.distributed
                and self.update_in_hook
                and layer.micro_batches == self.accumulation_steps
                and not layer.open_passes
            ):
                self.submit(layer)

    # -- at step() -----------------------------------------------------------------
    def factor_sums(self, layer: LayerCaptures) -> Payload | None:
        """This iteration's capture sums per key and their row counts, ``None`` without captures.

        The communicator divides the sums by the rows (over all ranks) into
        the batch factors (``A_batch``, ``G_batch``, or the rows' moments).
        """
        with self.telemetry.timer("factor_products"):
            for x in layer.inputs:
                layer.accumulate("a", x)
            for delta in layer.grad_outputs:
                layer.accumulate("g", delta)
        layer.inputs.clear()
        layer.grad_outputs.clear()
        if any(key not in layer.sums or not layer.rows.get(key) for key in layer.keys):
            return None
        # δ divided by the world size (by the loss scale under AMP: in the hook).
        split_invariant_g(
            layer.sums.get(("g", "gram")), layer.sums.get(("g", "moments")), self.comm.world_size
        )
        return {key: (layer.sums[key], float(layer.rows[key])) for key in layer.keys}

    def submit(self, layer: LayerCaptures) -> None:
        """Hand the layer's sums to the factor all-reduce (nothing to send: nothing captured)."""
        batch = self.factor_sums(layer)
        layer.submitted = True
        if batch is not None:
            self.comm.submit_factors(layer.name, batch)

    def check_passes(self, layers: list[LayerCaptures]) -> None:
        """Refuse a ``step()`` after more passes than ``accumulation_steps`` (a RuntimeError)."""
        extra = max(layer.extra_passes for layer in layers)
        if extra:
            # With several ranks the factors left in the backward pass that
            # completed accumulation_steps; later passes cannot reach them.
            raise RuntimeError(
                f"kaisa: more forward/backward passes before this step() than "
                f"accumulation_steps={self.accumulation_steps} ({extra} more): set "
                "accumulation_steps to the number of passes per optimizer step"
            )

    def close(self, layers: list[LayerCaptures]) -> None:
        """At a factor-update ``step()``: drop unfinished passes, submit what is not yet sent.

        Warns when fewer passes than ``accumulation_steps`` completed, and for
        each layer that ran forward without a backward pass.
        """
        passes = max(layer.micro_batches for layer in layers)
        if 0 < passes < self.accumulation_steps:
            warn(
                f"kaisa: {passes} forward/backward pass(es) before this step() but "
                f"accumulation_steps={self.accumulation_steps}: the factors hold what "
                "there was; set accumulation_steps to the passes per step"
            )
        for layer in layers:
            if layer.open_passes:
                warn(
                    f"kaisa: layer {layer.name!r} ran forward without a backward pass this "
                    "step; its unfinished captures are dropped"
                )
                layer.open_passes.clear()
            if not layer.submitted:
                self.submit(layer)

    def end_iteration(self, layers: list[LayerCaptures]) -> None:
        """Forget the iteration's captures (at the end of every ``step()``)."""
        for layer in layers:
            layer.reset()
        self.root_passes = 0
        self.ignored_passes.clear()
        self.step_scale = None
