"""The iteration's captures: which forward call belongs to which pass, what enters the sums.

On a factor-update step every training call of a registered layer leaves its
input; when the call's output gradient ``δ`` arrives, both enter the layer's
factor sums (spec §3). A *pass* is one forward of the whole model and its
backward; a *micro-batch* of a layer is a pass whose every call of the layer
has its output gradient (gradient accumulation counts them up to
``accumulation_steps``). With several ranks a layer whose last micro-batch is
complete submits its sums to the factor all-reduce from the hook, so the
traffic overlaps the rest of the backward pass.

**An iteration is a transaction** (spec §11). Captures belong to one
iteration: from the first training forward after a ``step()`` (or
construction) to the next ``step()``, which folds them. An iteration that
ends otherwise leaves nothing behind for the next:

* ``preconditioner.discard_captures()`` (:meth:`Capturer.discard`) drops
  them, silently;
* a training forward of the model that begins after ``accumulation_steps``
  passes of this iteration had their backward pass (a skipped batch, an
  exception between ``backward()`` and ``step()``, a ``step()`` that raised,
  Ctrl-C during a backward pass, more passes per step than
  ``accumulation_steps``) begins a new iteration: the previous one is
  *abandoned* (:meth:`Capturer.abandon`) and its captures dropped, with one
  warning per preconditioner. Fewer passes than ``accumulation_steps`` are
  taken as the same iteration going on (they are folded at the next
  ``step()``): only ``discard_captures()`` can tell them apart from
  gradient accumulation. Layers called outside the model's forward (no
  forward of the model numbers the passes) begin a new iteration when a call
  starts a pass of a layer that already completed ``accumulation_steps``.

Output gradients of a call that arrive after its first one, or after its
iteration ended, are ignored. With several ranks, on a factor-update step,
the ranks check that all of them end the iteration alike, in every discard
and every ``step()``: a 3-element all-reduce (discards, steps in training
mode, steps in evaluation mode) where all have issued the same collectives
(after every factor bucket with the products in the hooks, before any
without). A rank that discards while another calls ``step()`` raises
:class:`~kaisa.distributed.agreement.RankDisagreementError`, on both,
instead of hanging or dying in mismatched collectives; when all discard, the
factor all-reduce the hooks launched is completed and dropped (every rank
launches every bucket once). Skipping a batch on every rank is fine; on some
ranks only it is an error (DDP has already averaged its gradient). A rank
whose model is in evaluation mode while others train captures nothing but
folds the factors the others all-reduced (:meth:`Capturer.settle`), so the
ranks stay alike.

**Several backward passes through one forward.** The first output gradient
that reaches a call enters the factors; later ones for the same call are
ignored. Autograd calls a tensor hook at most once per backward pass (or
``torch.autograd.grad``) that reaches the tensor, with a gradient of the
tensor's shape, and the graphs made by ``create_graph=True`` do not call it
again. So with two losses through one graph
(``l1.backward(retain_graph=True); l2.backward()``) ``G`` holds ``l1``'s
``δ`` (sum the losses into one ``backward()`` to have ``G`` of the sum); with a
gradient penalty (``g = autograd.grad(loss, params, create_graph=True)``,
then ``(loss + λ‖g‖²).backward()``) and with input saliency
(``autograd.grad(loss, x, retain_graph=True)``, then ``loss.backward()``) it
holds the loss's ``δ``, as without the extra pass. A call that only a later
pass reaches (``autograd.grad`` of some parameters first) takes its first
gradient from that pass.

**Gradient checkpointing.** A forward call made while a backward pass runs
is a *recomputation* (``torch.utils.checkpoint``). It is captured, but it is
not a pass of its own and is never waited for: with
``use_reentrant=False`` the original forward's calls are captured and their
gradients flow through the original graph, so the recomputed calls never
receive one (the factors are those of the model without checkpointing, and
no "forward without a backward" is reported); with ``use_reentrant=True``
the original forward ran without autograd (nothing captured there) and the
recomputed calls receive the gradients, which enter the factors once.

:class:`LayerCaptures` is one layer's bookkeeping for the current iteration;
:class:`Capturer` is what the hooks call. Neither knows the maths of a factor
(the layer handler turns rows into sums) nor where the sums go after the
all-reduce (the front door folds them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from kaisa.curvature.linalg import split_invariant_g, unscale
from kaisa.distributed.agreement import RankDisagreementError
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


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (a recomputation)."""
    return bool(torch._C._current_graph_task_id() != -1)


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

    @property
    def pending(self) -> int:
        """Forward calls whose output gradient has not arrived yet."""
        return sum(self.open_passes.values())

    def reset(self) -> None:
        """Forget the iteration (at the end of every ``step()``, or when it is discarded)."""
        self.called = False
        self.micro_batches = 0
        self.open_passes.clear()
        self.last_pass = 0
        self.sums.clear()
        self.rows.clear()
        self.inputs.clear()
        self.grad_outputs.clear()
        self.submitted = False

    def accumulate(self, which: str, x: torch.Tensor, sampler: RowSampler | None = None) -> None:
        """Add one call's captures of side ``which`` (input or output gradient).

        ``sampler`` (``factor_sample`` below 1) draws the rows the grams
        multiply out; the moments take every row.
        """
        handler = self.handler
        drawn: torch.Tensor | None = None
        for key in self.keys:
            if key[0] != which:
                continue
            out = self.sums.get(key)
            if key[1] == "gram" and sampler is not None:
                if drawn is None:
                    drawn = sampler.draw(self, which, x)
                rows_of = drawn
            else:
                rows_of = x
            if key == ("a", "gram"):
                total, rows = handler.a_sum(rows_of, out)
            elif key == ("a", "moments"):
                total, rows = handler.a_moments(rows_of, out)
            elif key == ("g", "gram"):
                total, rows = handler.g_sum(rows_of, out)
            else:
                total, rows = handler.g_moments(rows_of, out)
            self.sums[key] = total
            self.rows[key] = self.rows.get(key, 0) + rows

    def capture_bytes(self) -> int:
        tensors = [*self.sums.values(), *self.inputs, *self.grad_outputs]
        return sum(t.numel() * t.element_size() for t in tensors)


class RowSampler:
    """Draws the rows of one call's capture that the factor products use (``factor_sample``).

    ``keep`` in ``(0, 1)``. Each draw is seeded from the step, the layer's
    index, the side and the layer's calls drawn so far in the iteration alone
    (:meth:`seed`), so that it does not depend on what ran before: two runs
    draw alike, and a run resumed from a checkpoint draws as the
    uninterrupted one. The indices are drawn on the CPU (a private
    generator; the global random state is never touched) and moved to the
    capture's device.
    """

    def __init__(self, keep: float, layers: Sequence[LayerCaptures]) -> None:
        self.keep = keep
        self.step = 0
        self._index = {id(layer): i for i, layer in enumerate(layers)}
        self._calls: dict[tuple[int, str], int] = {}
        self._generator = torch.Generator()

    def begin(self, step: int) -> None:
        """A new iteration, at optimizer step ``step``: the call counts start again."""
        self.step = step
        self._calls.clear()

    def seed(self, index: int, which: str, call: int) -> int:
        """The seed of one draw: a fixed function of its coordinates."""
        return ((self.step * 1_000_003 + index) * 4_099 + call) * 2 + (which == "g")

    def draw(self, layer: LayerCaptures, which: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` cut to a random ``keep`` share of its rows (at least one) by the
        layer's handler; ``x`` itself where the handler cannot draw."""
        index = self._index[id(layer)]
        key = (index, which)
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        self._generator.manual_seed(self.seed(index, which, call))
        drawn = layer.handler.sample_rows(which, x, self.keep, self._generator)
        return x if drawn is None else drawn


def _then(
    first: Callable[[torch.Tensor], torch.Tensor], second: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``second(first(grad))``: a layer's own selection, then the tensor-parallel gather."""
    return lambda grad: second(first(grad))


@dataclass(eq=False)
class _Call:
    """One captured call of a layer, until its first output gradient arrives.

    ``x`` is the call's input (``None`` once its first gradient has been
    taken); ``iteration`` the serial of the iteration it belongs to;
    ``recomputed``: the call was made while a backward pass ran.
    """

    layer: LayerCaptures
    select: GradSelect
    x: torch.Tensor | None
    pass_id: int
    iteration: int
    recomputed: bool = False  # made during a backward pass (gradient checkpointing)


class Capturer:
    """What the forward and output-gradient hooks do, for every registered layer.

    Args:
        layers: every registered layer's captures (the objects the hooks fill).
        comm: where complete sums go (with several ranks, from the hook).
        telemetry: the ``capture`` and ``factor_products`` timers.
        accumulation_steps: passes per ``step()``.
        update_in_hook: compute the factor products in the hooks (else at
            :meth:`factor_sums`).
        product_dtype: the dtype the captures are cast to for the products.
        device_type: the device type whose autocast is turned off in the hooks.
        grad_scale: reads the current loss scale (``None``: no scaler); the
            output gradients are unscaled with it before any product.
        factor_sample: the share of each call's rows the grams multiply out
            (:class:`RowSampler`; 1: every row).
    """

    def __init__(
        self,
        layers: Sequence[LayerCaptures],
        comm: Communicator,
        telemetry: Telemetry,
        *,
        accumulation_steps: int,
        update_in_hook: bool,
        product_dtype: torch.dtype,
        device_type: str,
        grad_scale: Callable[[], float] | None,
        factor_sample: float = 1.0,
    ) -> None:
        self.layers = list(layers)
        #: Draws the rows of the grams (``factor_sample`` below 1), else ``None``.
        self.sampler = RowSampler(factor_sample, self.layers) if factor_sample < 1.0 else None
        self.comm = comm
        self.telemetry = telemetry
        self.accumulation_steps = accumulation_steps
        self.update_in_hook = update_in_hook
        self.product_dtype = product_dtype
        self.device_type = device_type
        self.grad_scale = grad_scale
        #: Whether calls in this iteration capture (a factor-update step).
        self.enabled = False
        #: The iteration's serial: output gradients of a call made in an
        #: earlier (folded or discarded) iteration are ignored.
        self.iteration = 0
        #: A training forward (of the model or of a registered layer) ran in it.
        self.began = False
        self.root_passes = 0  # the model's training forward calls in this iteration
        self.ignored_passes: set[int] = set()  # of those, a pipeline's shape inference
        #: Passes of this iteration that some output gradient reached.
        self.backward_passes: set[int] = set()
        self.step_scale: float | None = None  # the loss scale, read once per iteration
        self.abandoned = 0  # iterations abandoned so far (see abandon)

    def arm(self, enabled: bool, step: int) -> None:
        """Whether the coming iteration (optimizer step ``step``) captures."""
        self.enabled = enabled
        if self.sampler is not None:
            self.sampler.begin(step)

    # -- hooks ---------------------------------------------------------------------
    def root_forward(self, module: nn.Module) -> None:
        """A forward pass of the whole model (training, autograd on) begins."""
        if len(self.backward_passes) >= self.accumulation_steps:
            # accumulation_steps passes had their backward and no step() came.
            self.abandon()
        self.began = True
        self.root_passes += 1
        # (Only a capture can take a placeholder pass for a micro-batch.)
        if self.enabled and inferring_pipeline_shapes():
            self.ignored_passes.add(self.root_passes)

    def capture_at(
        self, index: int, x: torch.Tensor, output: torch.Tensor, select: GradSelect
    ) -> None:
        """:meth:`capture` for the ``index``-th layer (what the layer hooks call)."""
        self.capture(self.layers[index], x, output, select)

    def capture(
        self, layer: LayerCaptures, x: torch.Tensor, output: torch.Tensor, select: GradSelect
    ) -> None:
        """One call of a layer: its input ``x`` and its output (whose gradient gives ``δ``)."""
        if not (layer.handler.module.training and torch.is_grad_enabled() and output.requires_grad):
            return  # evaluation, or no gradient will reach this call
        layer.called = True
        self.began = True
        if not self.enabled:
            return
        if _in_backward():
            # A recomputation (gradient checkpointing): captured if its gradient
            # comes (reentrant), never waited for (module docstring).
            call = _Call(layer, select, x.detach(), self.root_passes, self.iteration, True)
            output.register_hook(functools.partial(self._grad_output, call))  # type: ignore[no-untyped-call]
            return
        pass_id = self.pass_of(layer)
        if pass_id in self.ignored_passes:
            return
        if pass_id not in layer.open_passes and layer.micro_batches >= self.accumulation_steps:
            if self.root_passes:
                # Called outside the model's forward after this pass completed for
                # the layer (the model's next forward begins a new iteration).
                return
            # No forward of the model numbers the passes: a pass beyond
            # accumulation_steps of this layer begins a new iteration.
            self.abandon()
            layer.called = self.began = True
            pass_id = self.pass_of(layer)
        with self.telemetry.timer("capture"):
            layer.open_passes[pass_id] = layer.open_passes.get(pass_id, 0) + 1
            # The input enters A only when its output gradient arrives: a forward
            # whose backward never runs leaves no trace in the factors. Autograd
            # holds the input for the weight gradient anyway.
            # (Tensor parallelism: the shard a layer lacks is gathered, engines.tensor_parallel.)
            whole, gather = layer.handler.grads.full_capture(
                layer.handler.module, x.detach(), output
            )
            if gather is not None:
                select = gather if select is None else _then(select, gather)
            call = _Call(layer, select, whole, pass_id, self.iteration)
            output.register_hook(functools.partial(self._grad_output, call))  # type: ignore[no-untyped-call]

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

    def _grad_output(self, call: _Call, grad: torch.Tensor) -> None:
        x = call.x
        if x is None or call.iteration != self.iteration:
            # A later backward pass through the same call (retain_graph, a
            # gradient penalty, autograd.grad before backward), or a call of an
            # iteration already folded or discarded: the first gradient counted.
            return
        call.x = None
        layer, pass_id = call.layer, call.pass_id
        with torch.autocast(self.device_type, enabled=False):
            with self.telemetry.timer("capture"):
                if x.is_floating_point():  # (an embedding's indices stay integers)
                    x = x.to(self.product_dtype)
                if call.select is not None:
                    grad = call.select(grad)
                delta = grad.detach().to(self.product_dtype)
                if self.step_scale is None and self.grad_scale is not None:
                    self.step_scale = self.grad_scale()
                if self.step_scale is not None and self.step_scale != 1.0:
                    # Unscaled before the products: δ at a loss scale of 2^70 would
                    # overflow δᵀδ in float32, and the squared scale overflows from 2^64.
                    delta = unscale(delta, self.step_scale)
            if self.update_in_hook:
                with self.telemetry.timer("factor_products"):
                    layer.accumulate("a", x, self.sampler)
                    layer.accumulate("g", delta, self.sampler)
            else:
                layer.inputs.append(x)
                layer.grad_outputs.append(delta)
            self.backward_passes.add(pass_id)
            if call.recomputed:
                return  # not a pass of its own
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

    # -- the end of an iteration without step() --------------------------------------
    def abandon(self) -> None:
        """A new iteration began before ``step()``: drop the previous one's captures.

        Warned about once per preconditioner (:attr:`abandoned` counts them).
        """
        if not self.abandoned:
            warn(
                f"kaisa: a training forward began after {self.accumulation_steps} "
                "forward/backward pass(es) with no preconditioner.step(): the previous "
                "iteration's captures are discarded (a skipped batch, an exception before "
                "step(), or more passes per step than accumulation_steps="
                f"{self.accumulation_steps}: then set accumulation_steps); call "
                "preconditioner.discard_captures() to discard them without this warning "
                "(reported once)"
            )
        self.abandoned += 1
        self.discard()

    def discard(self) -> None:
        """Drop the current iteration's captures: the next training forward starts afresh.

        With several ranks, on a factor-update step that began, the factor
        all-reduce the hooks may have launched is completed (and dropped) and
        the ranks check that each of them discards this iteration.
        """
        if self.enabled and self.began and self.comm.distributed:
            if self.update_in_hook:
                self.comm.reduced_factors()  # every bucket, once, on every rank
            self.agree(discarding=True)
        self.end_iteration()

    def agree(self, *, discarding: bool, training: bool = True) -> bool:
        """With several ranks: check that every rank ends this iteration alike.

        Called once per factor-update iteration, by :meth:`discard` and by
        ``step()`` (:meth:`collect`, :meth:`settle`), where both have issued
        the same collectives: with the products in the hooks, after every
        factor bucket (some the hooks launched, the rest launched here, a
        data-dependent branch may make the split differ between ranks);
        without, before any. Ranks where one discards while another steps
        raise :class:`RankDisagreementError` (both of them). ``training``: this
        rank steps with its model in training mode (:meth:`collect`) rather
        than in evaluation mode (:meth:`settle`).

        Returns whether some rank steps in training mode (with one rank:
        whether this one does).
        """
        if not self.comm.distributed:
            return training and not discarding
        discarded, trained, evaluated = self.comm.any_rank(
            [discarding, not discarding and training, not discarding and not training]
        )
        if discarded and (trained or evaluated):
            mine = (
                "discarded this iteration's captures (a training forward began a new "
                "iteration before step(), or discard_captures())"
                if discarding
                else "called step()"
            )
            raise RankDisagreementError(
                f"kaisa: rank {self.comm.rank} {mine} while other ranks "
                f"{'called step()' if discarding else 'discarded it'}: every rank must "
                "skip the same batches (a batch skipped after backward() on some ranks "
                "only leaves the ranks' weights and steps apart)"
            )
        return trained

    # -- at step() -----------------------------------------------------------------
    def factor_sums(self, layer: LayerCaptures) -> Payload | None:
        """This iteration's capture sums per key and their row counts, ``None`` without captures.

        The communicator divides the sums by the rows (over all ranks) into
        the batch factors (``A_batch``, ``G_batch``, or the rows' moments).
        """
        with self.telemetry.timer("factor_products"):
            for x in layer.inputs:
                layer.accumulate("a", x, self.sampler)
            for delta in layer.grad_outputs:
                layer.accumulate("g", delta, self.sampler)
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

    def collect(self) -> dict[str, dict[PayloadKey, tuple[torch.Tensor, float]]]:
        """At a factor-update ``step()``: the batch factors, all-reduced (:meth:`close` first).

        With several ranks the ranks also check that every one of them steps
        (:meth:`agree`).
        """
        if not self.update_in_hook:
            self.agree(discarding=False)
        self.close()
        payloads = self.comm.reduced_factors()
        if self.update_in_hook:
            self.agree(discarding=False)
        return payloads

    def close(self) -> None:
        """At a factor-update ``step()``: drop unfinished passes, submit what is not yet sent.

        Warns when fewer passes than ``accumulation_steps`` completed, and once
        when layers ran forward without a backward pass.
        """
        layers = self.layers
        passes = max(layer.micro_batches for layer in layers)
        if 0 < passes < self.accumulation_steps:
            warn(
                f"kaisa: {passes} forward/backward pass(es) before this step() but "
                f"accumulation_steps={self.accumulation_steps}: the factors hold what "
                "there was; set accumulation_steps to the passes per step"
            )
        unfinished = [layer.name for layer in layers if layer.open_passes]
        if unfinished:
            warn(
                f"kaisa: {len(unfinished)} layer(s) ran forward without a backward pass this "
                f"step (e.g. {unfinished[0]!r}); their unfinished captures are dropped"
            )
        for layer in layers:
            layer.open_passes.clear()
            if not layer.submitted:
                self.submit(layer)

    def settle(self) -> dict[str, dict[PayloadKey, tuple[torch.Tensor, float]]] | None:
        """A factor-update ``step()`` with the model in evaluation mode (nothing captured here).

        With several ranks the factor all-reduce the hooks may have launched
        is completed and the ranks agree that they stepped. Returns the
        all-reduced batch factors when some other rank stepped in training
        mode (this rank then folds them as the others do, so that the ranks
        stay alike), ``None`` when none did (nothing to fold).
        """
        if not self.comm.distributed:
            return None
        if not self.update_in_hook:
            trained = self.agree(discarding=False, training=False)
        payloads = self.comm.reduced_factors()
        if self.update_in_hook:
            trained = self.agree(discarding=False, training=False)
        return payloads if trained else None

    def end_iteration(self) -> None:
        """Forget the iteration's captures (at the end of every ``step()``, or a discard)."""
        for layer in self.layers:
            layer.reset()
        self.iteration += 1
        self.began = False
        self.root_passes = 0
        self.ignored_passes.clear()
        self.backward_passes.clear()
        self.step_scale = None
