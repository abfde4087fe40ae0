"""The front door: hooks, the step schedule, and the rooms called in order.

A step reads like the README's description of one: the hooks capture
(:mod:`kaisa.capture`), the factors are all-reduced and folded
(:mod:`kaisa.distributed`, :mod:`kaisa.curvature`), the automatic choice is
made when due (:mod:`kaisa.autochoice`), the second-order state is refreshed
on the ranks the plan assigns, the gradients are preconditioned and
broadcast, and KL clipping scales them. Gradients are read and written
through the engine the model needs (:mod:`kaisa.engines`); checkpoints are
:mod:`kaisa.checkpoint`'s. This module holds no formula of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kaisa.attachment import attach, claim, holders, release, replaced, taken_over
from kaisa.autochoice import AutoChoice
from kaisa.cadence import IntervalStretch, StaleRefresh, fresh_start_cap, size_ratios
from kaisa.capture import Capturer
from kaisa.checkpoint import CheckpointTarget, StateDictOnly, read_state, write_state
from kaisa.curvature.block import (
    Factor,
)
from kaisa.curvature.budget import BudgetChoice
from kaisa.curvature.costs import DEFAULT_COST_MODEL, CostModel
from kaisa.curvature.fold import fold_batch
from kaisa.curvature.grafting import graft
from kaisa.curvature.linalg import kl_clip_scale
from kaisa.distributed.agreement import ScheduleCheck
from kaisa.distributed.comm import (
    Communicator,
    PayloadKey,
    data_parallel_group,
    default_world,
    payload_layout,
)
from kaisa.distributed.plan import LayerShape, WorkPlan, make_plan
from kaisa.distributed.probe import settle_fraction
from kaisa.engines import select_engine
from kaisa.engines.base import LossScale
from kaisa.layers import LayerHandler
from kaisa.layers.base import Detachable
from kaisa.layers.registry import Coverage, survey
from kaisa.options import REFERENCE_DEFAULTS, KFACOptions, StepHyper
from kaisa.profiles import left_auto, model_profile, partial_profile_warning, profile_report
from kaisa.roster import Layer, Roster
from kaisa.telemetry import Telemetry
from kaisa.views import RegisteredLayer
from kaisa.warn import warn
from kaisa.watch import Watch

__all__ = ["KFACPreconditioner", "RegisteredLayer"]

#: kaisa's log (``logging.getLogger("kaisa")``): what it decided, at INFO.
#: Problems remain warnings (``warnings.warn``), so that they reach the user
#: whatever the logging configuration.
log = logging.getLogger("kaisa")


#: The usual reasons why ``step()`` finds no gradient on layers that ran.
_NO_GRADIENT_CAUSES = (
    "Likely causes: DeepSpeed ZeRO-1/2 keeps gradients in partitioned buffers (.grad is None): "
    "build the preconditioner on the engine deepspeed.initialize returned; a wrapper that "
    "hides .grad; or step() called after optimizer.zero_grad() (call it between backward and "
    "the optimizer's step); reported once"
)


def _draws_rows(handler: LayerHandler) -> bool:
    """Whether ``handler`` can draw a share of a capture's rows (``factor_sample``)."""
    return type(handler).sample_rows is not LayerHandler.sample_rows


class KFACPreconditioner(StateDictOnly):
    r"""K-FAC gradient preconditioning with KAISA's adaptable placement of work.

    For every registered layer with gradient :math:`\nabla` (``(out, in[+1])``)
    and Kronecker factors :math:`A \approx E[\bar a \bar a^\top]`,
    :math:`G \approx E[\delta\delta^\top]` (running averages with decay
    ``factor_decay``), :meth:`step` replaces the gradient by

    .. math::
        P = (G \otimes A + \gamma I)^{-1} \operatorname{vec}(\nabla)
        \quad\text{(eigen)}\qquad
        P = (G + \gamma I)^{-1} \nabla (A + \gamma I)^{-1} \quad\text{(inverse)}

    scaled by :math:`\nu = \min(1, \sqrt{\kappa / |lr^2 \sum P \odot \nabla|})`
    (KL clipping). It never changes weights, so any ``torch.optim`` optimizer,
    scheduler, gradient scaler or data-parallel wrapper can follow it::

        preconditioner = kaisa.KFACPreconditioner(model, optimizer=optimizer)
        ...
        loss.backward()
        preconditioner.step()
        optimizer.step()

    Under ``torch.distributed`` (DDP or gradients averaged by the user), the
    work is split as KAISA prescribes: ``grad_worker_fraction`` ``f`` gives
    ``max(1, round(f·N))`` gradient workers per layer, from MEM-OPT (``1/N``)
    to COMM-OPT (``1``).

    Args:
        model: the model (plain, DDP, a DeepSpeed engine with ZeRO 0, 1 or 2,
            FSDP2/HSDP's ``fully_shard``, tensor-parallel ``nn.Linear``: build the
            preconditioner after those; ``docs/deepspeed-fsdp.md``); its
            ``nn.Linear``, ``nn.Conv1d``/``nn.Conv2d`` (grouped ones too),
            ``nn.MultiheadAttention`` (four blocks) and ``nn.Embedding`` layers
            are registered (:meth:`coverage` lists every parameter's treatment).
        **options: every other argument is an option, named and meant as in the
            published KAISA implementation where it has one, each documented
            (allowed values, defaults) on :class:`kaisa.options.KFACOptions`.
            KL clipping (on by default) needs ``optimizer=`` (its current
            learning rate is read at every step) or ``lr=``.

    The intervals, ``time_budget``, ``eigenvalue_correction``,
    ``eigenbasis_tolerance`` and ``adaptive_intervals`` default to ``'auto'``:
    the values of the model's ``profile`` ('language-model' when it has an
    ``nn.Embedding``, else 'general'; :data:`kaisa.profiles.PROFILE_DEFAULTS`).
    ``factor_decay`` defaults to ``None``, as do the intervals under 'general':
    chosen by the budget (the decay keeps a 200-step averaging window,
    ``1 − interval/200``). Every numeric hyperparameter may also be a
    callable ``f(step) -> value``. The published KAISA implementation's
    defaults are one switch away: :meth:`with_reference_defaults`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: int | Callable[[int], int] | str | None = "auto",
        inv_update_steps: int | Callable[[int], int] | str | None = "auto",
        damping: float | Callable[[int], float] = 0.03,
        factor_decay: float | Callable[[int], float] | None = None,
        kl_clip: float | Callable[[int], float] | None = 0.003,
        lr: float | torch.Tensor | Callable[[int], float] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        accumulation_steps: int | None = None,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: str = "compute",
        colocate_factors: bool = True,
        compute_method: str = "eigen",
        compute_eigenvalue_outer_product: bool = True,
        grad_worker_fraction: float | str = "comm-opt",
        memory_budget: int | str | None = None,
        symmetry_aware: bool = False,
        grad_scaler: Any = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype | None = torch.float32,
        skip_layers: str | Iterable[str] | None = None,
        update_factors_in_hook: bool = True,
        conv_factor_estimator: str = "expand",
        factor_product_dtype: torch.dtype | None = None,
        factor_sample: float = 1.0,
        damping_mode: str = "relative",
        factor_init: str = "first_batch",
        curvature: str | tuple[str, str] | Mapping[str, str | tuple[str, str]] = "auto",
        time_budget: float | str = "auto",
        calibrate_budget: bool = False,
        eigenvalue_correction: str = "auto",
        eigenvalue_decay: float = 0.99,
        eigenbasis_tolerance: float | str | None = "auto",
        adaptive_intervals: bool | str = "auto",
        stale_refresh: bool = True,
        fresh_start_steps: int = 0,
        grafting: str = "off",
        cost_model: CostModel = DEFAULT_COST_MODEL,
        profile: str = "auto",
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        # How gradients are read and written, from what the model is (plain, DDP,
        # a DeepSpeed engine, FSDP2); the engine also fixes accumulation and scale.
        grad_access = select_engine(model)
        accumulation_steps = grad_access.accumulation_steps(accumulation_steps)
        grad_scaler = grad_access.grad_scaler(grad_scaler)
        # Every argument but the model and the group is an option, checked there;
        # the profile left 'auto' is read from the model (its token lookups).
        given = locals()
        read = left_auto(profile)
        if read:
            given["profile"] = model_profile(model)
        self.options = options = KFACOptions(
            **{f.name: given[f.name] for f in dataclasses.fields(KFACOptions) if f.init}
        )
        said = profile_report(options, model if read else None)
        if said is not None:
            log.info("%s", said)
        surveyed = survey(model, options.skip_layers, conv_estimator=options.conv_factor_estimator)
        for message in surveyed.warnings:
            warn(message, UserWarning)
        found = surveyed.layers
        if not found:
            raise ValueError(
                f"model ({type(model).__name__}) has no layer K-FAC can precondition: kaisa "
                "handles nn.Linear, nn.Conv1d/nn.Conv2d, nn.MultiheadAttention "
                "and nn.Embedding whose parameters require gradients and that skip_layers "
                "does not exclude"
            )
        if options.factor_sample < 1.0:
            undrawn = [name for name, h in found if not _draws_rows(h)]
            if undrawn:
                warn(
                    f"kaisa: factor_sample={options.factor_sample:g} cannot draw the rows of "
                    f"{len(undrawn)} layer(s) ({', '.join(undrawn)}): their factor products "
                    "take every row (their handlers do not implement sample_rows)",
                    UserWarning,
                )
        self.model = model
        self._grads = grad_access
        self._grads.bind([p for _, handler in found for p in handler.parameters()])
        for _, handler in found:
            handler.grads = grad_access
        self._treatments = surveyed.treatments
        #: The data-parallel group KAISA plans over (``None``: the whole world).
        self.process_group = data_parallel_group(grad_access.process_group(process_group))
        self.rank, self.world_size = default_world(self.process_group)
        partial = partial_profile_warning(options, read, self.world_size, default_world()[1])
        if partial is not None:
            warn(partial)
        first_weight = found[0][1].weight
        self.device = first_weight.device
        self.factor_dtype, self.inv_dtype, self.product_dtype = options.dtypes(first_weight.dtype)
        self.telemetry = Telemetry()
        self._auto = AutoChoice.for_layers(found, options, self.telemetry, self.device)
        provisional = {name: self._auto.provisional(name) for name, _ in found}
        # The fraction, given or 'auto' (measured and chosen), and the ranks' agreement
        # check, before the communicator makes its groups (spec §10).
        self.grad_worker_choice = settle_fraction(
            options,
            [LayerShape(name, h.a_size, h.g_size, *provisional[name]) for name, h in found],
            *(self.world_size, self.process_group, self.device),
            factor_dtype=self.factor_dtype,
            inv_dtype=self.inv_dtype,
            product_dtype=self.product_dtype,
        )
        self.plan: WorkPlan = self._make_plan(dict(found), provisional)
        self._roster = Roster(
            found,
            provisional,
            self._auto.keys,
            options=options,
            factor_dtype=self.factor_dtype,
            inv_dtype=self.inv_dtype,
            ties=surveyed.ties,
        )
        self._roster.place(self.plan, self.rank)
        self.comm = Communicator(
            self.plan,
            self.rank,
            self.telemetry,
            bucket_cap_mb=options.allreduce_bucket_cap_mb,
            symmetry_aware=options.symmetry_aware,
            device=self.device,
            dtype=self.factor_dtype,
            layout=self._layout(),
            group=self.process_group,
        )
        self._schedules = ScheduleCheck(options, self.comm)  # the ranks' schedules, each step
        #: The loss scale the captures and gradients carry (AMP, a DeepSpeed engine's).
        self.loss_scale = LossScale(options.grad_scaler)
        self._capturer = Capturer(
            self._roster.captures,
            self.comm,
            self.telemetry,
            accumulation_steps=options.accumulation_steps,
            update_in_hook=options.update_factors_in_hook,
            product_dtype=self.product_dtype,
            device_type=self.device.type,
            grad_scale=self.loss_scale.reader(),
            factor_sample=options.factor_sample,
        )
        # Nothing below can fail; one still on these layers hands them over to this one.
        modules = [layer.handler.module for layer in self._roster]
        for previous in holders(modules, exclude=self):
            previous._hand_over(self)
        # The model's hooks hold the preconditioner weakly; when it is collected
        # without remove_hooks(), its finalizer removes them.
        self._handles: list[Detachable] = attach(
            self, model, list(self._roster.handlers.values()), self._capturer
        )
        claim(modules, self)
        #: The newer preconditioner that took these layers over (see _hand_over).
        self._replaced_by: str | None = None
        self._watch = Watch(model, modules)  # once-only reports; the loop's checks
        self._steps = 0
        self._peak_capture_bytes = 0
        #: The intervals' multiplier (``adaptive_intervals``; 1 otherwise).
        self._stretch = IntervalStretch(options.adaptive_intervals)
        #: Shorter intervals while the curvature is stale (``stale_refresh``).
        self._stale = StaleRefresh(options.stale_refresh)
        self._capturer.arm(self._is_factor_step(), self._steps)
        self._force_inverse_update = False
        if not self._auto.pending:
            self._report_uncorrected()
        log.info(
            "kaisa: %d layer(s) registered on rank %d of %d (%d gradient worker(s) per layer)",
            len(self._roster),
            self.rank,
            self.world_size,
            self.plan.grad_workers,
        )

    @classmethod
    def with_reference_defaults(cls, model: nn.Module, **kwargs: Any) -> KFACPreconditioner:
        """A preconditioner with the published KAISA implementation's defaults.

        :data:`kaisa.options.REFERENCE_DEFAULTS` (exact curvature, factors and inverses
        every step, absolute damping 0.001, decay 0.95, KL clip 0.001, identity start);
        any argument given here wins."""
        return cls(model, **{**REFERENCE_DEFAULTS, **kwargs})

    # -- plan, blocks and the automatic choice -------------------------------------------
    def _make_plan(
        self, handlers: Mapping[str, LayerHandler], specs: Mapping[str, tuple[str, str]], m: int = 0
    ) -> WorkPlan:
        return make_plan(
            [LayerShape(name, h.a_size, h.g_size, *specs[name]) for name, h in handlers.items()],
            self.world_size,
            (m or self.grad_worker_choice.grad_workers) / self.world_size,
            self.options.assignment_strategy,
            self.options.colocate_factors,
        )

    def _layout(self) -> dict[str, tuple[tuple[PayloadKey, int], ...]]:
        return payload_layout(self._roster.keys(), self.plan)

    def _apply_choice(self, choice: BudgetChoice) -> None:
        """Install a choice: blocks, plan, factor layout and intervals (between steps)."""
        self._auto.install(choice, self._steps)
        self._roster.install(choice.specs, self._auto.keys)
        self._report_uncorrected()
        self.plan = self._make_plan(self._roster.handlers, choice.specs)
        self.comm.set_layout(self._layout(), self.plan)
        self._roster.place(self.plan, self.rank)
        self._capturer.arm(self._is_factor_step(), self._steps)

    def _report_scheduled_choice(self, hyper: StepHyper) -> None:
        """Warn once when the automatic choice of sides costs intervals that are schedules.

        The choice is made once, at the intervals in force at its step; a schedule
        whose intervals grow later keeps sides chosen for its short ones.
        """
        scheduled = self.options.scheduled_intervals()
        if not scheduled or not self._auto.sides_left or not self._watch.once("scheduled"):
            return
        values = ", ".join(f"{name}={getattr(hyper, name)}" for name in scheduled)
        what = "value of a schedule" if len(scheduled) == 1 else "values of schedules"
        warn(
            f"kaisa: the automatic choice of curvature was made at step {self._steps} for "
            f"{values}, this step's {what}; the sides it chose stay when the schedule "
            "changes, so intervals that grow later run on sides cheaper than "
            f"time_budget={self.options.time_budget:g} would allow them (and intervals that "
            "shrink, on dearer ones). With such a schedule give the sides, e.g. "
            "curvature='exact' or a curvature rule; curvature_choice shows what was chosen"
        )

    def _report_uncorrected(self) -> None:
        """Warn once when the eigenvalue correction leaves layers out (never silently)."""
        message = self._roster.uncorrected_message()
        if message is None or not self._watch.once("uncorrected"):
            return
        if "eigenvalue_correction" in self.options.profiled:
            log.info("%s", message)  # the profile's choice, not the user's: reported, not warned
        else:
            warn(message)

    def _reopen_choice(self) -> None:
        """The clock calibration is due: capture everything once more and choose again."""
        self._auto.reopen()
        self._roster.rekey(self._auto.keys)
        self.comm.set_layout(self._layout(), self.plan)
        self._capturer.arm(True, self._steps)

    @property
    def curvature_choice(self) -> BudgetChoice | None:
        """The automatic choice, once made (``None`` before, or when nothing was left to it)."""
        return self._auto.choice

    @property
    def choice_pending(self) -> bool:
        """Whether the automatic choice is still to be made (at the next capturing step)."""
        return self._auto.pending

    @property
    def capturing(self) -> bool:
        """Whether this iteration's training passes capture factors (a factor-update step)."""
        return self._capturer.enabled

    @property
    def inverse_update_due(self) -> bool:
        """Whether the next ``step()`` recomputes the second-order state off its schedule."""
        return self._force_inverse_update

    def request_inverse_update(self) -> None:
        """Recompute every layer's second-order state at the next ``step()`` (e.g. after a
        large change of damping), whatever ``inv_update_steps`` says."""
        self._force_inverse_update = True

    def discard_captures(self) -> None:
        """Drop what this iteration captured so far: the next training forward starts afresh.

        For a batch skipped after its forward or backward pass (a NaN loss, an
        exception, ``optimizer.zero_grad()`` with no ``step()``): call it
        instead of ``step()``, and the batch leaves no trace in the factors;
        factors, second-order state and the step count are unchanged. With
        several ranks call it on every rank alike. When it is not called, and
        on several ranks: :mod:`kaisa.capture`.
        """
        self._capturer.discard()

    @property
    def layers(self) -> tuple[RegisteredLayer, ...]:
        """The registered layers, in registration order (a read-only snapshot)."""
        return tuple(layer.view() for layer in self._roster)

    # -- hyperparameters at the current step ---------------------------------------
    @property
    def steps(self) -> int:
        """Completed ``step()`` calls."""
        return self._steps

    def hyperparameters(self) -> StepHyper:
        """Every hyperparameter's value at the current step (a bad schedule value raises)."""
        return self.options.resolve(
            self._steps, self._auto.intervals, self._stretch.factor, self._cap()
        )

    def hyperparameter(self, name: str) -> float | None:
        """The value of a hyperparameter at the current step (``None`` for kl_clip off)."""
        if name not in StepHyper.__dataclass_fields__:
            raise KeyError(f"unknown hyperparameter {name!r}")
        value = getattr(self.hyperparameters(), name)
        return None if value is None else float(value)

    def _cap(self) -> int | None:
        """The cap on the intervals in force: ``stale_refresh``'s, and ``fresh_start_steps``'."""
        return fresh_start_cap(self._stale.cap, self._steps, self.options.fresh_start_steps)

    @property
    def interval_stretch(self) -> int:
        """The multiplier of the factor and inverse intervals in force (``adaptive_intervals``:
        1, 2, 4 or 8; always 1 without it)."""
        return self._stretch.factor

    def _is_factor_step(self) -> bool:
        interval = self.options.factor_interval(
            self._steps, self._auto.intervals, self._stretch.factor, self._cap()
        )
        return self._steps % interval == 0

    def _is_update_step(self) -> bool:
        """The current step updates factors or second-order state (by the schedules)."""
        inv = self.options.inverse_interval(
            self._steps, self._auto.intervals, self._stretch.factor, self._cap()
        )
        return self._is_factor_step() or self._steps % inv == 0

    # -- hooks -----------------------------------------------------------------------
    def _root_forward(self, module: nn.Module, args: object) -> None:
        """A forward pass of the whole model (while training with autograd on) begins."""
        # (A deep copy of the model carries the hook along: its forward is not ours.)
        if module is self.model and module.training and torch.is_grad_enabled():
            self._auto.pass_started()
            self._auto.forward_began()
            self._capturer.root_forward(module)

    def _root_forward_done(self, module: nn.Module, args: object, output: object) -> None:
        """The whole model's forward ended, or raised (the operator count stops)."""
        if module is self.model:
            self._auto.forward_ended()

    # -- the step ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of the registered layers, in place.

        Call after the backward pass(es) of a step and before ``optimizer.step()``.
        With a DeepSpeed engine call it after every ``engine.backward()``: on the
        micro-steps where the engine only accumulates it does nothing. It ends
        the iteration: its captures are folded (on a factor-update step) and
        forgotten. An iteration that ends without it (a skipped batch) is
        dropped by :meth:`discard_captures`, or when the next one begins
        (:mod:`kaisa.capture`).
        """
        if self._replaced_by is not None:
            raise RuntimeError(replaced(self._replaced_by))
        if not self._grads.at_boundary():
            return  # a DeepSpeed micro-step inside an accumulation cycle
        # Every schedule is read (and checked) before anything changes: a bad
        # value raises here, leaving captures, factors and the step count as
        # they were.
        hyper = self.hyperparameters()
        self._watch.before_step(self.loss_scale, thorough=self._capturer.enabled)
        held = sum(c.capture_bytes() for c in self._roster.captures)
        self._peak_capture_bytes = max(self._peak_capture_bytes, held)
        self._auto.pass_ended()
        self._watch.evaluation_mode(self._roster, began=self._capturer.began)
        try:
            if self._capturer.enabled:
                if self.model.training:
                    hyper = self._update_factors(hyper, self._capturer.collect())
                else:
                    # Nothing captured here; the all-reduce the hooks launched
                    # completes, and when other ranks trained their factors are
                    # folded here too (the ranks stay alike).
                    reduced = self._capturer.settle()
                    if reduced is not None:
                        hyper = self._update_factors(hyper, reduced)
            refreshed = self._steps % hyper.inv_update_steps == 0 or self._force_inverse_update
            if refreshed:
                self._update_second_order(hyper.damping)
                self._force_inverse_update = False
            # (The intervals agree over the ranks: they measure alike.)
            watching = self._stale.watches(hyper.factor_update_steps, hyper.inv_update_steps)
            ratios = self._precondition(hyper, watching)
            if watching:
                self._follow_staleness(ratios, refreshed)
        finally:
            self._capturer.end_iteration()
            self._grads.release()
            self._steps += 1
            self._capturer.arm(self._is_factor_step(), self._steps)
            if self._auto.reopen_due(self._steps):
                self._reopen_choice()
            self.telemetry.end_step()
        # Before the next iteration's hooks (all ranks): the intervals every
        # step, the other schedules when the next step updates factors or
        # inverses (no collective and host sync per step for an optimizer's lr).
        self._schedules.check(self._steps, update_due=self._is_update_step())

    def _update_factors(
        self, hyper: StepHyper, payloads: Mapping[str, Mapping[PayloadKey, tuple[Any, float]]]
    ) -> StepHyper:
        """Make the automatic choice if due and fold this step's all-reduced captures.

        Returns the hyperparameters in force after it (a choice sets intervals).
        """
        self._force_inverse_update |= self._roster.check_idle(
            payloads,
            began=self._capturer.began,
            step=self._steps,
            once=self._watch.once,
            removed=self._watch.structure.removed,
            quiet_eval=self._watch.evaluation_reported,
        )
        if not payloads:
            return hyper
        if self._auto.pending and any(
            rows > 0 for payload in payloads.values() for _, rows in payload.values()
        ):
            calibrating = self._auto.calibrating
            # The choice lasts the run: it costs the intervals after a fresh start.
            lasting = self.options.resolve(
                self._steps, self._auto.intervals, self._stretch.factor, self._stale.cap
            )
            choice = self._auto.choose(
                [(layer.name, layer.handler) for layer in self._roster],
                {c.name: c.keys for c in self._roster.captures},
                payloads,
                self._steps,
                lasting,
                self.comm,
            )
            self._apply_choice(choice)
            self._report_scheduled_choice(hyper)
            # After the calibration, re-made blocks start from this step's
            # factors: every block decomposes now.
            self._force_inverse_update |= calibrating
            hyper = self.hyperparameters()
        # Each block folds the captures its representations hold; the gradients
        # (each parameter once, read through the engine) must be finite too.
        read = (self._grads.read(p) for p in self._roster.parameters())
        grads = [g for g in read if g is not None]
        blocks = {layer.name: layer.block for layer in self._roster}
        outcome = fold_batch(blocks, payloads, grads, hyper.factor_decay)
        self.telemetry.skipped_factor_updates += int(outcome.skipped)
        self.telemetry.outlier_factor_updates += len(outcome.outliers)
        self._watch.folded(outcome, payloads, self.product_dtype)
        return hyper

    def _update_second_order(self, damping: float) -> None:
        rank = self.rank
        keepable = kept = 0  # this rank's sides that could keep their eigenbasis, and did
        with self.telemetry.timer("decomposition"):
            for layer in self._roster:
                if not layer.active:  # (dormant, or a shared weight's other use)
                    continue
                assignment = self.plan.layer(layer.name)
                done: list[Factor] = []
                for which, owner in (("a", assignment.a_rank), ("g", assignment.g_rank)):
                    if owner != rank:
                        continue
                    self.telemetry.side_refreshes += 1
                    if layer.decompose(which, damping):  # type: ignore[arg-type]
                        done.append(which)  # type: ignore[arg-type]
                        held = layer.basis_kept(which)  # type: ignore[arg-type]
                        self.telemetry.kept_eigenbases += held
                        if layer.can_keep_basis(which):  # type: ignore[arg-type]
                            keepable, kept = keepable + 1, kept + held
                    else:
                        self.telemetry.failed_decompositions += 1
                # Too coarse in float32 for this damping: redone in float64.
                redone = layer.refine(done, damping) if done else {}
                if redone:
                    self.telemetry.float64_decompositions += len(redone)
                    self._watch.refined(layer.name, redone, damping, self._steps, self.factor_dtype)
        working = [layer for layer in self._roster if layer.grad_worker and layer.active]
        self.comm.broadcast_decompositions(
            {layer.name: (layer.state_tensors("a"), layer.state_tensors("g")) for layer in working}
        )
        with self.telemetry.timer("decomposition"):
            for layer in working:
                layer.finish_update(damping)
        if self._stretch.enabled:
            # Each side is refreshed by one rank: the sums are every rank's counts.
            rows = self.comm.gather_values([keepable, kept])
            totals = [int(sum(column)) for column in zip(*rows, strict=True)]
            if totals[0] == 0 and self._watch.once("adaptive without bases"):
                warn(
                    "kaisa: adaptive_intervals follows the eigenbases that eigenbasis_tolerance "
                    "may keep, and no side here holds one (none is exact with "
                    "compute_method='eigen'; see coverage()): the intervals stay as given. Hold "
                    "sides exact (curvature='exact', or a larger time_budget), or leave "
                    "adaptive_intervals=False"
                )
            # The first update after a fresh start is 2 steps from the last one in it.
            fresh = self._steps <= self.options.fresh_start_steps
            if self._stretch.observe(totals[0], totals[1], hold=fresh):
                self.telemetry.interval_changes += 1
                log.info(
                    "kaisa: step %d: %d of %d eigenbases decomposed; intervals now x%d",
                    self._steps,
                    totals[0] - totals[1],
                    totals[0],
                    self._stretch.factor,
                )

    def _follow_staleness(self, ratios: dict[str, float], refreshed: bool) -> None:
        """``stale_refresh`` (:class:`~kaisa.cadence.StaleRefresh`) after a measured step."""
        longest = max(
            self.options.factor_interval(self._steps, self._auto.intervals, self._stretch.factor),
            self.options.inverse_interval(self._steps, self._auto.intervals, self._stretch.factor),
        )
        if self._stale.follow(ratios, refreshed, self.comm.any_rank, longest):
            self.telemetry.stale_refreshes += 1
            log.info("kaisa: step %d: the curvature went stale; refreshing", self._steps)

    def _precondition(self, hyper: StepHyper, measure: bool = False) -> dict[str, float]:
        """Precondition every layer's gradient; with ``measure``, return each layer's
        ``‖P‖/‖∇‖`` before grafting and KL clipping (``stale_refresh``)."""
        pairs: list[tuple[Layer, torch.Tensor, torch.Tensor]] = []
        sends: list[tuple[str, torch.Tensor]] = []
        # A layer not called this step keeps its raw gradient. With several ranks
        # a data-dependent branch may call it on some ranks only; the ranks agree
        # (called anywhere) so that broadcasts pair up and weights stay identical.
        called = self.comm.any_rank(self._roster.called())
        with self.telemetry.timer("precondition"):
            for layer, was_called in zip(self._roster, called, strict=True):
                if not was_called or not layer.active:
                    continue
                grad = layer.handler.grad_matrix()
                if grad is None:
                    continue
                if layer.grad_worker:
                    preconditioned = layer.precondition(grad, hyper.damping)
                else:  # the plan's source in this rank's row sends it
                    preconditioned = torch.empty_like(grad)
                pairs.append((layer, preconditioned, grad))
                sends.append((layer.name, preconditioned))
        if not pairs:
            ran = [
                la.name for la, c in zip(self._roster, called, strict=True) if c and not la.dormant
            ]
            if ran and self._watch.once("no gradients"):
                warn(
                    f"kaisa: step() found no gradient on any registered layer, though "
                    f"{len(ran)} ran this step (e.g. {ran[0]!r}): nothing was preconditioned. "
                    + _NO_GRADIENT_CAUSES
                )
        self.comm.broadcast_gradients(sends)
        ratios = size_ratios([(la.name, p, g) for la, p, g in pairs]) if measure else {}
        if self.options.grafting == "layer":
            for _, preconditioned, grad in pairs:
                graft(preconditioned, grad)
        scale = 1.0
        if hyper.kl_clip is not None:
            with self.telemetry.timer("kl_clip"):
                # Gradients a DeepSpeed engine has not unscaled yet (fp16) carry its
                # loss scale S, and so does P (preconditioning is linear); KL
                # clipping is not: lr/S gives lr²·ΣP∇/S², its value unscaled.
                loss_scale = self._grads.loss_scale() if pairs else 1.0
                scale = kl_clip_scale(
                    [(p, g) for _, p, g in pairs], hyper.lr / loss_scale, hyper.kl_clip
                )
        self.telemetry.record_kl_scale(scale)
        with self.telemetry.timer("precondition"):
            for layer, preconditioned, _ in pairs:
                if scale != 1.0:
                    preconditioned.mul_(scale)
                layer.handler.set_grad_matrix(preconditioned)
            self._grads.flush()  # (staged accesses: ZeRO's partitions, FSDP2's shards)
        return ratios

    # -- inspection, checkpoints, teardown ------------------------------------------------
    def coverage(self) -> Coverage:
        """Every trainable parameter and how it is treated; ``print()`` it for a table.

        A preconditioned parameter names its block(s) and their kind with the
        representations of ``A`` and ``G`` (as chosen so far); a raw one says
        why (no handler, a normalisation layer, ``skip_layers``, a weight shared
        beyond registered layers, a frozen partner, or a layer that captured nothing).
        """
        return self._roster.coverage(self._treatments)

    def memory_usage(self) -> dict[str, int]:
        """Bytes held on this rank, by category.

        ``factors`` (running averages), ``second_order`` (eigenbases and
        eigenvalues or inverses, only for this rank's layers), ``captures``
        (what the hooks hold right now: factor accumulators, or raw inputs and
        output gradients with ``update_factors_in_hook=False``; released by
        ``step()``), ``captures_peak`` (the most captures held when a ``step()``
        began) and ``total`` (factors + second-order + captures).
        """
        usage = self._roster.memory()
        usage["total"] = sum(usage.values())
        usage["captures_peak"] = self._peak_capture_bytes
        return usage

    def state_dict(self) -> dict[str, Any]:
        """All that is needed to continue bit-identically (schema: :mod:`kaisa.checkpoint`)."""
        return write_state(
            steps=self._steps,
            world_size=self.world_size,
            grad_workers=self.plan.grad_workers,
            options=self.options,
            choice=self._auto.choice,
            blocks={layer.name: layer.state_dict() for layer in self._roster},
            fraction=self.grad_worker_choice,
            stretch=self._stretch,
            stale=self._stale,
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; a refused one leaves the preconditioner as it was.

        Everything is checked before anything changes; a bad checkpoint raises
        ``TypeError`` or ``ValueError`` naming the layer, the key or the option.
        Layers are matched by name; one written with other options or another
        placement is converted (:mod:`kaisa.checkpoint` says how).
        """
        target = CheckpointTarget(
            layers=[layer.slot(self._auto.fixed[layer.name]) for layer in self._roster],
            options=self.options,
            pending=self._auto.pending,
            choice=self._auto.choice,
            plan=self.plan,
            make_plan=functools.partial(self._make_plan, self._roster.handlers),
            rank=self.rank,
            world_size=self.world_size,
            factor_dtype=self.factor_dtype,
            inv_dtype=self.inv_dtype,
            fraction=self.grad_worker_choice,
        )
        restore = read_state(state_dict, target)  # (warns of what it converts)
        if restore.fraction is not None:  # the checkpoint's 'auto' choice wins (collective)
            self.comm.regroup(restore.plan, payload_layout(self._roster.keys(), restore.plan))
            self.grad_worker_choice, self.plan = restore.fraction, restore.plan
            self._roster.place(self.plan, self.rank)
        # Nothing below can fail: every value was checked above.
        if restore.choice is not None:
            self._apply_choice(restore.choice)
        for layer in self._roster:
            second, shared = layer.name in restore.second_order, restore.shared.get(layer.name)
            layer.load_checked(restore.blocks[layer.name], second_order=second, shared=shared)
        self._steps = restore.steps
        if self._stretch.enabled:
            saved = restore.stretch.state_dict() if restore.stretch is not None else {"factor": 1}
            self._stretch.load_state_dict(saved)
        if self._stale.enabled:
            self._stale.load_state_dict(
                restore.stale.state_dict()
                if restore.stale is not None
                else {"cap": None, "reference": {}}
            )
        self._auto.restored(self._steps)
        self._capturer.arm(self._is_factor_step(), self._steps)
        self._force_inverse_update = restore.recompute

    def remove_hooks(self) -> None:
        """Detach from the model: call it before replacing or dropping a preconditioner.

        The preconditioner can no longer capture; another one may be built on
        the same layers without a warning. (A preconditioner dropped without
        it is not kept alive by the model: its hooks hold it weakly and are
        removed when it is collected. One built on layers another still holds
        takes them over, with a warning.)
        """
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        release([layer.handler.module for layer in self._roster], self)

    def _hand_over(self, successor: KFACPreconditioner) -> None:
        """A newer preconditioner was built on layers this one holds: it takes over.

        This one's hooks are removed (no gradient is preconditioned twice) and
        its ``step()`` raises from now on.
        """
        theirs = {id(layer.handler.module) for layer in successor._roster}
        shared = [la.name for la in self._roster if id(la.handler.module) in theirs]
        self.remove_hooks()
        self._replaced_by = f"at 0x{id(successor):x}"
        warn(taken_over(shared, f"at 0x{id(self):x} ({len(self._roster)} layers)"), UserWarning)

    def __repr__(self) -> str:
        hyper = self.options.describe_hyper(self.hyperparameters())
        return (
            f"KFACPreconditioner({len(self._roster)} layers, world_size={self.world_size}, "
            f"grad_workers={self.plan.grad_workers}, {hyper})"
        )
