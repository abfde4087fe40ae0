"""The front door: hooks, the step schedule, and the three rooms called in order.

The preconditioner registers a forward hook on every module a layer handler
supports (:mod:`kaisa.layers`), keeps one :class:`~kaisa.curvature.KroneckerBlock`
per layer (:mod:`kaisa.curvature`), and places work and traffic according to a
:class:`~kaisa.distributed.WorkPlan` through a
:class:`~kaisa.distributed.Communicator`. It holds no formula of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kaisa.choices import COMPUTE_METHODS, DAMPING_MODES, FACTOR_INITS
from kaisa.curvature.block import (
    OUTLIER_PATIENCE,
    OUTLIER_RATIO,
    BlockLayout,
    CheckedBlockState,
    KroneckerBlock,
    check_block_state,
    check_count,
)
from kaisa.curvature.budget import (
    MAX_TIME_SCALE,
    BudgetChoice,
    LayerWork,
    choose_curvature,
    time_scale,
)
from kaisa.curvature.costs import Capture, SideSpec
from kaisa.curvature.linalg import (
    finite_with_values,
    kl_clip_scale,
    split_invariant_g,
    unscale,
)
from kaisa.distributed.agreement import agreement_digest, check_agreement
from kaisa.distributed.comm import (
    Communicator,
    Payload,
    PayloadKey,
    data_parallel_group,
    default_world,
    plan_layout,
)
from kaisa.distributed.plan import LayerShape, WorkPlan, make_plan
from kaisa.layers import LayerHandler
from kaisa.layers.base import Detachable, GradSelect
from kaisa.layers.grads import grad_access_for
from kaisa.layers.registry import Coverage, survey
from kaisa.options import REFERENCE_DEFAULTS, KFACOptions
from kaisa.telemetry import Telemetry

#: What a layer captures while the automatic choice is pending: everything.
_ALL_KEYS: tuple[PayloadKey, ...] = (
    ("a", "gram"),
    ("a", "moments"),
    ("g", "gram"),
    ("g", "moments"),
)


#: kaisa's log (``logging.getLogger("kaisa")``): what it decided, at INFO.
#: Problems remain warnings (``warnings.warn``), so that they reach the user
#: whatever the logging configuration.
log = logging.getLogger("kaisa")

#: Steps between the first automatic choice and its clock calibration
#: (``calibrate_budget``): their forward and backward passes are timed.
CALIBRATION_STEPS = 10

#: The checkpoint format :meth:`KFACPreconditioner.state_dict` writes. A state
#: dict without a ``"format"`` key is format 1, from before curvature
#: representations (exact curvature only, no options recorded).
STATE_FORMAT = 2
#: The options that shape the saved state, with their allowed values; the
#: state dict records them.
_STATE_OPTIONS: dict[str, tuple[object, ...]] = {
    "compute_method": COMPUTE_METHODS,
    "damping_mode": DAMPING_MODES,
    "compute_eigenvalue_outer_product": (True, False),
    "factor_init": FACTOR_INITS,
}


@dataclass(frozen=True)
class _Restore:
    """A checked checkpoint, ready to install: nothing in it can fail any more."""

    choice: BudgetChoice | None  # an automatic choice to adopt
    blocks: dict[str, CheckedBlockState]
    second_order: set[str]  # layers whose second-order state is loaded
    steps: int
    recompute: bool  # the second-order state is recomputed at the next step()
    converted: list[str]  # options whose other value in the checkpoint was converted


def _legacy_method(saved: object, default: str) -> tuple[str, bool]:
    """The compute method and outer product a format-1 layer state was written with.

    Format 1 records no options; its exact sides hold ``[Q, λ]`` (eigen) or
    ``[(F + γI)⁻¹]`` (inverse), and an outer product only with the eigen
    method. The state is then checked against that (and recomputed anyway).
    """
    if not isinstance(saved, Mapping):
        return default, False
    second = saved.get("second_order")
    tensors = second.get("a") if isinstance(second, Mapping) else None
    method = default
    if isinstance(tensors, (list, tuple)):
        method = "eigen" if len(tensors) == 2 else "inverse"
    return method, "outer_inverse" in saved


#: Functions of ``torch.distributed.pipelining`` that run the stage module on
#: placeholder tensors to learn its shapes (the first step of a schedule).
_SHAPE_INFERENCE = frozenset({"_forward_metadata_inference", "_shape_inference"})


def _inferring_pipeline_shapes() -> bool:
    """Whether this forward call comes from a pipeline stage's shape inference.

    ``PipelineStage`` (without static ``input_args``/``output_args``) runs
    the stage once on placeholders, with autograd on, and on the last stage
    a backward pass through them: kaisa must not take that for a micro-batch.
    """
    if "torch.distributed.pipelining" not in sys.modules:
        return False
    frame = sys._getframe(1)
    for _ in range(64):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name in _SHAPE_INFERENCE and "pipelining" in code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


@dataclass(frozen=True)
class RegisteredLayer:
    """One registered layer, as :attr:`KFACPreconditioner.layers` shows it (read-only).

    ``curvature`` is the representation of ``A`` and of ``G`` (provisional
    until the automatic choice is made); ``grad_worker``: this rank
    preconditions the layer's gradient (KAISA's plan); ``dormant``: it
    captured nothing on the last factor-update step and keeps its raw
    gradient.
    """

    name: str
    module: nn.Module
    kind: str
    a_size: int
    g_size: int
    curvature: tuple[str, str]
    grad_worker: bool
    dormant: bool


@dataclass
class _Layer:
    """Runtime state of one registered layer (captures of the current step).

    ``keys``: what the layer captures on a factor-update step, per side a
    full gram or the moments of the rows (both while the automatic choice is
    pending); ``sums`` / ``rows``: this step's accumulated captures per key.
    """

    name: str
    handler: LayerHandler
    block: KroneckerBlock
    keys: tuple[PayloadKey, ...]
    called: bool = False
    micro_batches: int = 0  # passes whose every capture of this layer is complete
    #: Per open pass (see ``KFACPreconditioner._pass_of``), its calls of this
    #: layer whose output gradient has not arrived yet.
    open_passes: dict[int, int] = field(default_factory=dict)
    last_pass: int = 0  # the pass of the most recent call
    sums: dict[PayloadKey, torch.Tensor] = field(default_factory=dict)
    rows: dict[PayloadKey, int] = field(default_factory=dict)
    inputs: list[torch.Tensor] = field(default_factory=list)
    grad_outputs: list[torch.Tensor] = field(default_factory=list)
    submitted: bool = False
    #: Captured nothing on the last factor-update step (on any rank): no
    #: second-order state, raw gradient, until it captures again.
    dormant: bool = False
    extra_passes: int = 0  # forward calls beyond accumulation_steps this step
    #: This rank preconditions the layer's gradient (KAISA's plan; set with the plan).
    grad_worker: bool = True

    @property
    def pending(self) -> int:
        """Forward calls whose output gradient has not arrived yet."""
        return sum(self.open_passes.values())

    def reset(self) -> None:
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


class KFACPreconditioner:
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

        preconditioner = kaisa.KFACPreconditioner(model)
        ...
        loss.backward()
        preconditioner.step()
        optimizer.step()

    Under ``torch.distributed`` (DDP or gradients averaged by the user), the
    work is split as KAISA prescribes: ``grad_worker_fraction`` ``f`` gives
    ``max(1, round(f·N))`` gradient workers per layer, from MEM-OPT (``1/N``)
    to COMM-OPT (``1``).

    Args:
        model: the model (plain, wrapped in DDP, a DeepSpeed engine with ZeRO
            stage 0, 1 or 2, or sharded with FSDP2's ``fully_shard``: build the
            preconditioner after those; ``docs/deepspeed-fsdp.md``); its
            ``nn.Linear``, ``nn.Conv1d``/``nn.Conv2d`` (groups = 1),
            ``nn.MultiheadAttention`` (four blocks) and ``nn.Embedding`` layers
            are registered (:meth:`coverage` lists every parameter's treatment).
        factor_update_steps: update the factors every this many steps.
        inv_update_steps: recompute the second-order state every this many steps.
        damping: Tikhonov damping ``γ`` (>= 1e-12: below, no float32 or float64
            solve is regularised; a singular factor would give inf or NaN).
        factor_decay: running-average decay ``ξ`` in ``[0, 1)``.
        kl_clip: KL-clipping bound ``κ`` (> 0), or ``None`` to turn clipping off.
        lr: learning rate used by KL clipping (should follow the optimizer's).
        accumulation_steps: forward/backward passes per ``step()`` (default 1;
            with a DeepSpeed engine, its ``gradient_accumulation_steps``).
        allreduce_bucket_cap_mb: size bound of one factor all-reduce bucket.
        assignment_strategy: balance decompositions by 'compute' (``n³``) or
            'memory' (``n²``).
        colocate_factors: decompose a layer's ``A`` and ``G`` on the same rank.
        compute_method: 'eigen' (exact solve) or 'inverse' (damped inverses).
        compute_eigenvalue_outer_product: precompute ``1 ⊘ (λ_G λ_Aᵀ + γ)`` at
            each inverse update (damping frozen until the next one).
        grad_worker_fraction: float in ``[0, 1]`` (0 means ``1/N``) or
            'comm-opt', 'hybrid-opt', 'mem-opt'.
        symmetry_aware: all-reduce only the upper triangles of the factors.
        grad_scaler: a ``torch.amp.GradScaler`` or a callable returning the
            current loss scale; captured output gradients are unscaled with it.
        factor_dtype: dtype of the captures' products and the factors (default:
            the weights' dtype, at least float32).
        inv_dtype: dtype of the second-order state (default float32; ``None``
            follows the factors).
        skip_layers: regular expressions; a module whose name or class name
            matches one is not registered, nor is anything inside it.
        update_factors_in_hook: compute factor products inside the hooks (so the
            all-reduce overlaps the backward pass) rather than in ``step()``.
        conv_factor_estimator: 'expand' (spec §3, every patch is a row) or
            'reduce' (patches averaged over output positions before the outer
            product: ``N`` rows instead of ``N·T``; much cheaper, an
            approximation whose effect on accuracy the demo measures).
        factor_product_dtype: dtype the captures are cast to for the factor
            products (default ``factor_dtype``). ``torch.bfloat16`` runs the
            products about 3× faster on CPUs with bf16 matrix support; the
            results are accumulated and averaged in ``factor_dtype``.
        damping_mode: 'absolute' (spec §4: ``γ`` is added to ``λ_G λ_Aᵀ``, or to
            each factor for 'inverse') or 'relative' (each factor is first
            divided by its mean eigenvalue ``trace/size``, so ``γ`` means the
            same in layers whose curvature differs by orders of magnitude).
        factor_init: 'identity' (spec §3: factors start as ``I`` and every
            update uses ``factor_decay``) or 'first_batch' (the ``k``-th update
            of a layer uses ``min(factor_decay, k/(k+1))``: the first replaces
            the identity, then an equal-weight mean until the exponential
            average takes over).
        curvature: how each side of each layer is held (spec §8): 'auto' (the
            default: chosen to fit ``time_budget``), or 'exact', 'lowrank:K',
            'kvec', 'diagonal', a pair ``(A, G)`` of those (or 'auto'), or a
            mapping from layer-name regular expressions to those (first match
            wins; unmatched layers are 'auto').
        time_budget: K-FAC's work per step as a share of the registered
            layers' forward and backward work (``> 0``, default 0.1). At the
            first factor-update step kaisa chooses every 'auto' side's
            representation and the intervals left as ``None`` to fit it
            (:mod:`kaisa.curvature.budget`; ``curvature_choice`` holds the
            outcome). The choice depends on the rows each rank sees.
        calibrate_budget: measure the iteration on the clock and choose again
            (default ``True``): :data:`CALIBRATION_STEPS` steps after the
            first choice, the median forward-and-backward time of those steps
            and one factor update's captures scale the budget's allowance by
            how much slower the iteration runs than the registered layers'
            multiply-adds suggest (:func:`kaisa.curvature.budget.time_scale`;
            maxima over the ranks, so every rank chooses alike). ``False``:
            the cost model alone, the same choice on every machine.
        process_group: the data-parallel group over which this model's layers
            are replicated (default: the whole world). KAISA's plan, its
            collectives and the agreement check span this group only, so
            each pipeline stage (or model-parallel shard) builds its own
            preconditioner over the replicas of its own layers; only the
            group's members construct it. Gradients must already be averaged
            over the group when ``step()`` runs (as DDP with this group does).

    ``factor_update_steps``, ``inv_update_steps`` and ``factor_decay`` default
    to ``None``: chosen by the budget (the decay keeps a 200-step averaging
    window, ``1 − interval/200``). Every numeric hyperparameter may also be a
    callable ``f(step) -> value``. The published KAISA implementation's
    defaults are one switch away: :meth:`with_reference_defaults`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: int | Callable[[int], int] | None = None,
        inv_update_steps: int | Callable[[int], int] | None = None,
        damping: float | Callable[[int], float] = 0.03,
        factor_decay: float | Callable[[int], float] | None = None,
        kl_clip: float | Callable[[int], float] | None = 0.003,
        lr: float | Callable[[int], float] = 0.1,
        accumulation_steps: int | None = None,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: str = "compute",
        colocate_factors: bool = True,
        compute_method: str = "eigen",
        compute_eigenvalue_outer_product: bool = True,
        grad_worker_fraction: float | str = "comm-opt",
        symmetry_aware: bool = False,
        grad_scaler: Any = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype | None = torch.float32,
        skip_layers: str | Iterable[str] | None = None,
        update_factors_in_hook: bool = True,
        conv_factor_estimator: str = "expand",
        factor_product_dtype: torch.dtype | None = None,
        damping_mode: str = "relative",
        factor_init: str = "first_batch",
        curvature: str | tuple[str, str] | Mapping[str, str | tuple[str, str]] = "auto",
        time_budget: float = 0.1,
        calibrate_budget: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        # How gradients are read and written, from what the model is (plain, DDP,
        # a DeepSpeed engine, FSDP2); the engine also fixes accumulation and scale.
        grad_access = grad_access_for(model)
        accumulation_steps = grad_access.accumulation_steps(accumulation_steps)
        grad_scaler = grad_access.grad_scaler(grad_scaler)
        skip: Any = skip_layers
        if isinstance(skip, Iterable) and not isinstance(skip, (str, list, tuple)):
            skip = list(skip)
        self.options = KFACOptions(
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            damping=damping,
            factor_decay=factor_decay,
            kl_clip=kl_clip,
            lr=lr,
            accumulation_steps=accumulation_steps,
            allreduce_bucket_cap_mb=allreduce_bucket_cap_mb,
            assignment_strategy=assignment_strategy,  # type: ignore[arg-type]
            colocate_factors=colocate_factors,
            compute_method=compute_method,  # type: ignore[arg-type]
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
            grad_worker_fraction=grad_worker_fraction,
            symmetry_aware=symmetry_aware,
            grad_scaler=grad_scaler,
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            skip_layers=skip,
            update_factors_in_hook=update_factors_in_hook,
            conv_factor_estimator=conv_factor_estimator,  # type: ignore[arg-type]
            factor_product_dtype=factor_product_dtype,
            damping_mode=damping_mode,  # type: ignore[arg-type]
            factor_init=factor_init,  # type: ignore[arg-type]
            curvature=curvature,
            time_budget=time_budget,
            calibrate_budget=calibrate_budget,
        )
        surveyed = survey(
            model, self.options.skip_layers, conv_estimator=self.options.conv_factor_estimator
        )
        for message in surveyed.warnings:
            warnings.warn(message, stacklevel=2)
        found = surveyed.layers
        if not found:
            raise ValueError(
                f"model ({type(model).__name__}) has no layer K-FAC can precondition: kaisa "
                "handles nn.Linear, nn.Conv1d/nn.Conv2d (groups=1), nn.MultiheadAttention "
                "and nn.Embedding whose parameters require gradients and that skip_layers "
                "does not exclude"
            )
        self.model = model
        self._grads = grad_access
        self._warned_no_grads = False
        self._grads.bind([p for _, handler in found for p in handler.parameters()])
        for _, handler in found:
            handler.grads = grad_access
        self._treatments = surveyed.treatments
        #: The data-parallel group KAISA plans over (``None``: the whole world).
        self.process_group = data_parallel_group(grad_access.process_group(process_group))
        self.rank, self.world_size = default_world(self.process_group)
        # A side the user fixes wins; else the layer kind's own (an embedding's
        # diagonal A); else the automatic choice.
        self._fixed = {
            name: tuple(
                user or kind
                for user, kind in zip(
                    self.options.fixed_sides(name), handler.default_sides, strict=True
                )
            )
            for name, handler in found
        }
        # Until the first factor-update step shows the rows, 'auto' sides are
        # held exact (nothing is folded before the choice replaces them).
        provisional = {name: (a or "exact", g or "exact") for name, (a, g) in self._fixed.items()}
        for name, handler in found:
            LayerShape(name, handler.a_size, handler.g_size, *provisional[name])  # validates
        #: The automatic choice, once made (``None`` before, or when nothing was left to it).
        self.curvature_choice: BudgetChoice | None = None
        # The decay alone needs no rows: it follows the (fixed) factor interval.
        self._choice_pending = bool(self.options.auto - {"factor_decay"}) or any(
            side is None for sides in self._fixed.values() for side in sides
        )
        if not self._choice_pending:  # only the decay, if anything, is left automatic
            self.options.set_chosen(0, 0)
        # The clock calibration (calibrate_budget): the step that reopens the
        # automatic choice (None: none to come), and the passes timed until then.
        self._calibrate_at: int | None = None
        self._calibrating = False
        self._pass_start: float | None = None
        self._pass_seconds: list[float] = []
        self._pass_mark = 0.0
        self._capture_mark = 0.0
        self.plan: WorkPlan = self._make_plan([(name, h, provisional[name]) for name, h in found])
        first_weight = found[0][1].weight
        self.device = first_weight.device
        self.factor_dtype = self.options.factor_dtype or torch.promote_types(
            first_weight.dtype, torch.float32
        )
        self.inv_dtype = self.options.inv_dtype or self.factor_dtype
        self.product_dtype = self.options.factor_product_dtype or self.factor_dtype
        # Before the communicator makes its process groups: ranks set up
        # differently would hang or abort there (spec §10).
        check_agreement(
            agreement_digest(
                self.options,
                self.plan,
                [(name, h.a_size, h.g_size) for name, h in found],
                factor_dtype=self.factor_dtype,
                inv_dtype=self.inv_dtype,
                product_dtype=self.product_dtype,
            ),
            self.process_group,
        )
        self.telemetry = Telemetry()
        self.comm = Communicator(
            self.plan,
            self.rank,
            self.telemetry,
            bucket_cap_mb=self.options.allreduce_bucket_cap_mb,
            symmetry_aware=self.options.symmetry_aware,
            device=self.device,
            dtype=self.factor_dtype,
            layout=self._layout(),
            group=self.process_group,
        )
        self._grad_scale = self.options.grad_scale_reader()
        self._step_scale: float | None = None
        self._layers: list[_Layer] = []
        for name, handler in found:
            block = self._make_block(name, handler, provisional[name])
            layer = _Layer(name, handler, block, self._keys(name, block))
            # Decided here and with every new plan, read everywhere else.
            layer.grad_worker = self.plan.is_grad_worker(name, self.rank)
            if layer.grad_worker:
                block.allocate_second_order()
            self._layers.append(layer)
        self._handles: list[Detachable] = [
            layer.handler.attach(functools.partial(self._capture, layer)) for layer in self._layers
        ]
        self._root_passes = 0  # the model's training forward calls since the last step()
        self._ignored_passes: set[int] = set()  # of those, a pipeline's shape inference
        self._handles.append(model.register_forward_pre_hook(self._root_forward))
        self._reported_idle: set[str] = set()
        self._reported_outliers: set[str] = set()
        self._warned_scaled = False
        self._steps = 0
        self._peak_capture_bytes = 0
        self._capture_this_step = self._is_factor_step()
        self._force_inverse_update = False
        log.info(
            "kaisa: %d layer(s) registered on rank %d of %d (%d gradient worker(s) per layer)",
            len(self._layers),
            self.rank,
            self.world_size,
            self.plan.grad_workers,
        )

    @classmethod
    def with_reference_defaults(cls, model: nn.Module, **kwargs: Any) -> KFACPreconditioner:
        """A preconditioner with the published KAISA implementation's defaults.

        Exact curvature, factors and inverses every step, damping 0.001
        (absolute), decay 0.95, KL clip 0.001, factors starting as the
        identity (:data:`kaisa.options.REFERENCE_DEFAULTS`); any argument
        given here wins, with the same names and meanings as the reference.
        """
        return cls(model, **{**REFERENCE_DEFAULTS, **kwargs})

    # -- plan, blocks and what they capture ----------------------------------------
    def _make_plan(self, layers: Sequence[tuple[str, LayerHandler, tuple[str, str]]]) -> WorkPlan:
        return make_plan(
            [LayerShape(name, h.a_size, h.g_size, *specs) for name, h, specs in layers],
            self.world_size,
            self.options.grad_worker_fraction,
            self.options.assignment_strategy,
            self.options.colocate_factors,
        )

    def _make_block(
        self, name: str, handler: LayerHandler, specs: tuple[str, str]
    ) -> KroneckerBlock:
        return KroneckerBlock(
            name,
            handler.a_size,
            handler.g_size,
            device=handler.weight.device,
            factor_dtype=self.factor_dtype,
            inv_dtype=self.inv_dtype,
            method=self.options.compute_method,
            eigen_outer_product=self.options.compute_eigenvalue_outer_product,
            damping_mode=self.options.damping_mode,
            factor_init=self.options.factor_init,
            a_spec=specs[0],
            g_spec=specs[1],
        )

    def _keys(self, name: str, block: KroneckerBlock) -> tuple[PayloadKey, ...]:
        if self._choice_pending:
            return self._pending_keys(name)
        captures: list[Capture] = [spec.capture for spec in block.specs]
        return (("a", captures[0]), ("g", captures[1]))

    def _pending_keys(self, name: str) -> tuple[PayloadKey, ...]:
        """While the choice is pending: both captures of an automatic side, one of a fixed side."""
        keys: list[PayloadKey] = []
        for which, fixed in zip(("a", "g"), self._fixed[name], strict=True):
            if fixed is None:
                keys += [key for key in _ALL_KEYS if key[0] == which]
            else:
                keys.append((which, SideSpec.parse(fixed).capture))
        return tuple(keys)

    def _layout(self) -> dict[str, tuple[tuple[PayloadKey, int], ...]]:
        if not self._choice_pending:
            return plan_layout(self.plan)
        return {
            la.name: tuple(
                (key, la.a_size if key[0] == "a" else la.g_size)
                for key in self._pending_keys(la.name)
            )
            for la in self.plan.layers
        }

    def _choose(self, reduced: dict[str, dict[PayloadKey, tuple[torch.Tensor, float]]]) -> None:
        """Make the automatic choice from this step's rows (equal on every rank)."""

        def rows(name: str, key: PayloadKey) -> float:
            payload = reduced.get(name)
            return float(payload[key][1]) if payload is not None and key in payload else 0.0

        works = []
        for layer in self._layers:
            h, name = layer.handler, layer.name
            works.append(
                LayerWork(
                    name,
                    h.a_size,
                    h.g_size,
                    # (A captured as a gram or as moments: the same rows.)
                    training=h.training_work(
                        max(rows(name, ("a", "moments")), rows(name, ("a", "gram")))
                    ),
                    a_gram=h.capture_work("a", "gram", rows(name, ("a", "gram"))),
                    g_gram=h.capture_work("g", "gram", rows(name, ("g", "gram"))),
                    a_moments=h.capture_work("a", "moments", rows(name, ("a", "moments"))),
                    g_moments=h.capture_work("g", "moments", rows(name, ("g", "moments"))),
                    a_fixed=self._fixed[name][0],
                    g_fixed=self._fixed[name][1],
                )
            )
        hyper = self.options.hyper
        auto = self.options.auto
        scale = self._measured_scale(works, rows) if self._calibrating else 1.0
        choice = choose_curvature(
            works,
            self.options.time_budget,
            factor_update_steps=None
            if "factor_update_steps" in auto
            else hyper["factor_update_steps"].int_at(self._steps),
            inv_update_steps=None
            if "inv_update_steps" in auto
            else hyper["inv_update_steps"].int_at(self._steps),
            compute_method=self.options.compute_method,
            scale=scale,
            calibrated=self._calibrating,
        )
        previous = self.curvature_choice
        if not choice.within_budget and (previous is None or previous.within_budget):
            warnings.warn(
                f"kaisa: time_budget={self.options.time_budget:g} cannot be met on this model "
                f"(the cheapest curvature costs {choice.share:.3g} of the layers' work); "
                "using the cheapest representations and intervals",
                RuntimeWarning,
                stacklevel=5,  # _choose, _update_factors, step, torch's no_grad wrapper, user
            )
        self._apply_choice(choice)
        if self._calibrating:
            # Re-made blocks start from this step's factors; every block decomposes now.
            self._calibrating = False
            self._force_inverse_update = True

    def _measured_scale(
        self, works: Sequence[LayerWork], rows: Callable[[str, PayloadKey], float]
    ) -> float:
        """The budget's time scale from the clock (equal on every rank: maxima)."""
        capture_seconds = self._captured_seconds() - self._capture_mark
        passes = statistics.median(self._pass_seconds) if self._pass_seconds else 0.0
        passes, capture_seconds = self.comm.max_over_ranks([passes, capture_seconds])
        capture_work = sum(
            layer.handler.capture_work(key[0], key[1], rows(layer.name, key))
            for layer in self._layers
            for key in layer.keys
        )
        training = sum(work.training for work in works)
        scale = time_scale(passes, capture_seconds, capture_work, training)
        log.info(
            "kaisa: budget calibration at step %d: forward+backward %.2f ms (median of %d), "
            "captures %.2f ms for %.3g multiply-adds; time scale %.3g",
            self._steps,
            passes * 1e3,
            len(self._pass_seconds),
            capture_seconds * 1e3,
            capture_work,
            scale,
        )
        return scale

    def _reopen_choice(self) -> None:
        """After CALIBRATION_STEPS steps: capture everything once more and choose again."""
        self._calibrate_at = None
        self._calibrating = True
        self._choice_pending = True
        for layer in self._layers:
            layer.keys = self._keys(layer.name, layer.block)
        self.comm.set_layout(self._layout(), self.plan)
        self._capture_this_step = True
        self._capture_mark = self._captured_seconds()

    def _captured_seconds(self) -> float:
        phases = self.telemetry.phase_seconds
        return phases.get("capture", 0.0) + phases.get("factor_products", 0.0)

    def _sync_clock(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _apply_choice(self, choice: BudgetChoice) -> None:
        """Install a choice: blocks, plan, factor layout and intervals (between steps)."""
        self._choice_pending = False
        self.curvature_choice = choice
        if choice.calibrated or not self.options.calibrate_budget:
            self._calibrate_at = None
        else:
            self._calibrate_at = self._steps + CALIBRATION_STEPS
            self._pass_seconds.clear()
        if log.isEnabledFor(logging.INFO):
            log.info(
                "kaisa: automatic curvature choice at step %d:\n%s", self._steps, choice.describe()
            )
        self.options.set_chosen(choice.factor_update_steps, choice.inv_update_steps)
        for layer in self._layers:
            specs = choice.specs[layer.name]
            if tuple(str(spec) for spec in layer.block.specs) != specs:
                layer.block = self._make_block(layer.name, layer.handler, specs)
        self.plan = self._make_plan(
            [(layer.name, layer.handler, choice.specs[layer.name]) for layer in self._layers]
        )
        self.comm.set_layout(plan_layout(self.plan), self.plan)
        for layer in self._layers:
            layer.keys = self._keys(layer.name, layer.block)
            layer.grad_worker = self.plan.is_grad_worker(layer.name, self.rank)
            if layer.grad_worker and not layer.dormant:
                layer.block.allocate_second_order()
        self._capture_this_step = self._is_factor_step()

    @property
    def layers(self) -> tuple[RegisteredLayer, ...]:
        """The registered layers, in registration order (a read-only snapshot)."""
        return tuple(
            RegisteredLayer(
                name=layer.name,
                module=layer.handler.module,
                kind=layer.handler.kind,
                a_size=layer.handler.a_size,
                g_size=layer.handler.g_size,
                curvature=(str(layer.block.specs[0]), str(layer.block.specs[1])),
                grad_worker=layer.grad_worker,
                dormant=layer.dormant,
            )
            for layer in self._layers
        )

    # -- hyperparameters at the current step ---------------------------------------
    @property
    def steps(self) -> int:
        """Completed ``step()`` calls."""
        return self._steps

    def hyperparameter(self, name: str) -> float | None:
        """The value of a hyperparameter at the current step (``None`` for kl_clip off)."""
        hyper = self.options.hyper.get(name)
        if hyper is None:
            if name == "kl_clip":
                return None
            raise KeyError(f"unknown hyperparameter {name!r}")
        return hyper.at(self._steps)

    def _is_factor_step(self) -> bool:
        return self._steps % self.options.hyper["factor_update_steps"].int_at(self._steps) == 0

    def _is_inverse_step(self) -> bool:
        return self._steps % self.options.hyper["inv_update_steps"].int_at(self._steps) == 0

    # -- hooks -----------------------------------------------------------------------
    def _capture(
        self, layer: _Layer, x: torch.Tensor, output: torch.Tensor, select: GradSelect
    ) -> None:
        """One call of a layer: its input ``x`` and its output (whose gradient gives ``δ``)."""
        if not (layer.handler.module.training and torch.is_grad_enabled() and output.requires_grad):
            return  # evaluation, or no gradient will reach this call
        layer.called = True
        if not self._capture_this_step:
            return
        pass_id = self._pass_of(layer)
        if pass_id in self._ignored_passes:
            return
        if (
            pass_id not in layer.open_passes
            and layer.micro_batches >= self.options.accumulation_steps
        ):
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
                functools.partial(self._grad_output_hook, layer, select, x.detach(), pass_id)
            )

    def _root_forward(self, module: nn.Module, args: object) -> None:
        """A forward pass of the whole model (while training with autograd on) begins."""
        if module.training and torch.is_grad_enabled():
            if self._calibrate_at is not None and self._pass_start is None:
                self._sync_clock()
                self._pass_mark = self._captured_seconds()
                self._pass_start = time.perf_counter()
            self._root_passes += 1
            # (Only a capture can take a placeholder pass for a micro-batch.)
            if self._capture_this_step and _inferring_pipeline_shapes():
                self._ignored_passes.add(self._root_passes)

    def _pass_of(self, layer: _Layer) -> int:
        """The forward/backward pass a call of ``layer`` belongs to.

        The model's own forward calls number the passes (pipeline schedules
        run several micro-batches' forwards before their backwards, so passes
        overlap). Without them (layers called outside the model's forward) a
        call starts a new pass when none of the layer's calls is waiting for
        its gradient.
        """
        if self._root_passes:
            return self._root_passes
        if not layer.open_passes:
            layer.last_pass -= 1  # negative: apart from the model's numbering
        return layer.last_pass

    def _grad_output_hook(
        self,
        layer: _Layer,
        select: GradSelect,
        x: torch.Tensor,
        pass_id: int,
        grad: torch.Tensor,
    ) -> None:
        with torch.autocast(self.device.type, enabled=False):
            with self.telemetry.timer("capture"):
                if x.is_floating_point():  # (an embedding's indices stay integers)
                    x = x.to(self.product_dtype)
                if select is not None:
                    grad = select(grad)
                delta = grad.detach().to(self.product_dtype)
                if self._step_scale is None and self._grad_scale is not None:
                    self._step_scale = self._grad_scale()
                if self._step_scale is not None and self._step_scale != 1.0:
                    # Unscaled before the products: δ at a loss scale of 2^70 would
                    # overflow δᵀδ in float32, and the squared scale overflows from 2^64.
                    delta = unscale(delta, self._step_scale)
            if self.options.update_factors_in_hook:
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
                and self.options.update_factors_in_hook
                and layer.micro_batches == self.options.accumulation_steps
                and not layer.open_passes
            ):
                self._submit(layer)

    def _factor_sums(self, layer: _Layer) -> Payload | None:
        """This step's capture sums per key and their row counts, ``None`` without captures.

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
            layer.sums.get(("g", "gram")), layer.sums.get(("g", "moments")), self.world_size
        )
        return {key: (layer.sums[key], float(layer.rows[key])) for key in layer.keys}

    def _submit(self, layer: _Layer) -> None:
        batch = self._factor_sums(layer)
        layer.submitted = True
        if batch is not None:
            self.comm.submit_factors(layer.name, batch)

    # -- the step ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of the registered layers, in place.

        Call after the backward pass(es) of a step and before ``optimizer.step()``.
        With a DeepSpeed engine call it after every ``engine.backward()``: on the
        micro-steps where the engine only accumulates it does nothing.
        """
        if not self._grads.at_boundary():
            return  # a DeepSpeed micro-step inside an accumulation cycle
        # Every schedule is read (and checked) before anything changes: a bad
        # value raises here, leaving captures, factors and the step count as
        # they were.
        for hyper in self.options.hyper.values():
            hyper.at(self._steps)
        extra = max(layer.extra_passes for layer in self._layers)
        if extra:
            # With several ranks the factors left in the backward pass that
            # completed accumulation_steps; later passes cannot reach them.
            raise RuntimeError(
                f"kaisa: more forward/backward passes before this step() than "
                f"accumulation_steps={self.options.accumulation_steps} ({extra} more): set "
                "accumulation_steps to the number of passes per optimizer step"
            )
        if not self._warned_scaled and self.options.scaler_still_scaled():
            self._warned_scaled = True
            warnings.warn(
                "kaisa: the grad_scaler has unscaled no optimizer's gradients this iteration: "
                "call scaler.unscale_(optimizer) before preconditioner.step() (KL clipping on "
                "gradients still multiplied by the loss scale shrinks every step to nearly "
                "nothing); reported once",
                RuntimeWarning,
                stacklevel=3,  # step, torch's no_grad wrapper, user
            )
        held = sum(layer.capture_bytes() for layer in self._layers)
        self._peak_capture_bytes = max(self._peak_capture_bytes, held)
        if self._pass_start is not None:
            # The passes without the captures kaisa ran inside them.
            self._sync_clock()
            captured = self._captured_seconds() - self._pass_mark
            self._pass_seconds.append(time.perf_counter() - self._pass_start - captured)
        try:
            if self._capture_this_step and self.model.training:
                self._update_factors()
            if self._is_inverse_step() or self._force_inverse_update:
                self._update_second_order()
                self._force_inverse_update = False
            self._precondition()
        finally:
            for layer in self._layers:
                layer.reset()
            self._root_passes = 0
            self._ignored_passes.clear()
            self._step_scale = None
            self._grads.release()
            self._steps += 1
            self._pass_start = None
            self._capture_this_step = self._is_factor_step()
            if self._calibrate_at is not None and self._steps >= self._calibrate_at:
                self._reopen_choice()
            self.telemetry.end_step()

    def _update_factors(self) -> None:
        passes = max(layer.micro_batches for layer in self._layers)
        if 0 < passes < self.options.accumulation_steps:
            warnings.warn(
                f"kaisa: {passes} forward/backward pass(es) before this step() but "
                f"accumulation_steps={self.options.accumulation_steps}: the factors hold what "
                "there was; set accumulation_steps to the passes per step",
                RuntimeWarning,
                stacklevel=4,  # _update_factors, step, torch's no_grad wrapper, user
            )
        for layer in self._layers:
            if layer.open_passes:
                warnings.warn(
                    f"kaisa: layer {layer.name!r} ran forward without a backward pass this "
                    "step; its unfinished captures are dropped",
                    RuntimeWarning,
                    stacklevel=4,  # _update_factors, step, torch's no_grad wrapper, user
                )
                layer.open_passes.clear()
            if not layer.submitted:
                self._submit(layer)
        payloads = self.comm.reduced_factors()
        self._check_idle(payloads)
        if not payloads:
            return
        if self._choice_pending and any(
            rows > 0 for payload in payloads.values() for _, rows in payload.values()
        ):
            self._choose(payloads)
        # Each block folds the captures its representations hold.
        reduced: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        captured: dict[str, bool] = {}
        traces: list[torch.Tensor] = []
        for layer in self._layers:
            payload = payloads.get(layer.name)
            if payload is None:
                continue
            (a, a_rows), (g, g_rows) = (
                payload[(which, spec.capture)]
                for which, spec in zip(("a", "g"), layer.block.specs, strict=True)
            )
            reduced[layer.name] = (a, g)
            captured[layer.name] = a_rows > 0 and g_rows > 0
            # The batch's and the running averages' traces: A's batch trace is 0
            # when the layer saw only zeros, or nothing (not folded); a spike
            # against the running average is an outlier batch.
            traces += layer.block.traces(a, g)
        names = [name for name in (layer.name for layer in self._layers) if name in reduced]
        # Each parameter once (attention projections share theirs).
        params = {id(p): p for layer in self._layers for p in layer.handler.parameters()}
        # (Read through the gradient access: ZeRO's partitions, FSDP2's shards.)
        read = (self._grads.read(p) for p in params.values())
        grads = [g for g in read if g is not None]
        # One host sync for all checks: finite factors, finite gradients (an AMP
        # overflow must not reach the running averages), and the traces.
        finite, trace_values = finite_with_values(
            [t for name in names for t in reduced[name]] + grads, traces
        )
        layer_traces = {name: trace_values[4 * i : 4 * i + 4] for i, name in enumerate(names)}
        if not finite:
            self.telemetry.skipped_factor_updates += 1
            return
        decay = self.options.hyper["factor_decay"].at(self._steps)
        by_name = {layer.name: layer for layer in self._layers}
        for name in names:
            # Rows on some rank and a non-zero A (a layer captured nowhere, or
            # fed only zeros, is skipped).
            if not (captured[name] and layer_traces[name][0] != 0.0):
                continue
            if not by_name[name].block.fold_unless_outlier(
                *reduced[name], decay, layer_traces[name]
            ):
                self.telemetry.outlier_factor_updates += 1
                if name not in self._reported_outliers:
                    self._reported_outliers.add(name)
                    warnings.warn(
                        f"kaisa: layer {name!r}: a batch factor over {OUTLIER_RATIO:g}x its "
                        "running average (an outlier batch) was not folded; kaisa takes such a "
                        f"scale in after {OUTLIER_PATIENCE} in a row (reported once per layer)",
                        RuntimeWarning,
                        stacklevel=4,  # _update_factors, step, torch's no_grad wrapper, user
                    )

    def _check_idle(self, payloads: Mapping[str, Mapping[PayloadKey, tuple[Any, float]]]) -> None:
        """Layers that captured nothing this factor-update step (rows are equal on every rank).

        Each is reported once; its second-order state is released and its
        factors start afresh, and it keeps its raw gradient until it captures.
        """
        for layer in self._layers:
            payload = payloads.get(layer.name)
            captured = payload is not None and all(rows > 0 for _, rows in payload.values())
            if captured and layer.dormant:
                layer.dormant = False
                if layer.grad_worker:
                    layer.block.allocate_second_order()
                self._force_inverse_update = True
            elif not captured and not layer.dormant:
                layer.dormant = True
                a_spec, g_spec = layer.block.specs
                layer.block = self._make_block(
                    layer.name, layer.handler, (str(a_spec), str(g_spec))
                )
                if layer.name not in self._reported_idle:
                    self._reported_idle.add(layer.name)
                    warnings.warn(
                        f"kaisa: layer {layer.name!r} captured nothing on factor-update step "
                        f"{self._steps} in training mode (it did not run, or ran outside the "
                        "module call kaisa hooks); its second-order state is released and its "
                        "gradient left raw until it captures",
                        RuntimeWarning,
                        stacklevel=5,  # _check_idle, _update_factors, step, no_grad, user
                    )

    def _update_second_order(self) -> None:
        damping = self.options.hyper["damping"].at(self._steps)
        rank = self.rank
        with self.telemetry.timer("decomposition"):
            for layer in self._layers:
                if layer.dormant:
                    continue
                assignment = self.plan.layer(layer.name)
                for which, owner in (("a", assignment.a_rank), ("g", assignment.g_rank)):
                    # stacklevel: decompose, this, step, torch's no_grad wrapper, the user
                    if owner == rank and not layer.block.decompose(which, damping, stacklevel=5):  # type: ignore[arg-type]
                        self.telemetry.failed_decompositions += 1
        working = [layer for layer in self._layers if layer.grad_worker and not layer.dormant]
        self.comm.broadcast_decompositions(
            {
                layer.name: (layer.block.state_tensors("a"), layer.block.state_tensors("g"))
                for layer in working
            }
        )
        with self.telemetry.timer("decomposition"):
            for layer in working:
                layer.block.finish_update(damping)

    def _precondition(self) -> None:
        damping = self.options.hyper["damping"].at(self._steps)
        pairs: list[tuple[_Layer, torch.Tensor, torch.Tensor]] = []
        sends: list[tuple[str, torch.Tensor]] = []
        # A layer not called this step keeps its raw gradient. With several ranks
        # a data-dependent branch may call it on some ranks only; the ranks agree
        # (called anywhere) so that broadcasts pair up and weights stay identical.
        called = self.comm.any_rank([layer.called for layer in self._layers])
        with self.telemetry.timer("precondition"):
            for layer, was_called in zip(self._layers, called, strict=True):
                if not was_called or layer.dormant:
                    continue
                grad = layer.handler.grad_matrix()
                if grad is None:
                    continue
                if layer.grad_worker:
                    preconditioned = layer.block.precondition(grad, damping)
                else:  # the plan's source in this rank's row sends it
                    preconditioned = torch.empty_like(grad)
                pairs.append((layer, preconditioned, grad))
                sends.append((layer.name, preconditioned))
        if not pairs and not self._warned_no_grads:
            ran = [
                la.name for la, c in zip(self._layers, called, strict=True) if c and not la.dormant
            ]
            if ran:
                self._warned_no_grads = True
                warnings.warn(
                    f"kaisa: step() found no gradient on any registered layer, though "
                    f"{len(ran)} ran this step (e.g. {ran[0]!r}): nothing was preconditioned. "
                    "Likely causes: DeepSpeed ZeRO-1/2 keeps gradients in partitioned buffers "
                    "(.grad is None): build the preconditioner on the engine deepspeed."
                    "initialize returned; a wrapper that hides .grad; or step() called after "
                    "optimizer.zero_grad() (call it between backward and the optimizer's "
                    "step); reported once",
                    RuntimeWarning,
                    stacklevel=4,  # _precondition, step, torch's no_grad wrapper, user
                )
        self.comm.broadcast_gradients(sends)
        scale = 1.0
        kl_clip = self.hyperparameter("kl_clip")
        if kl_clip is not None:
            with self.telemetry.timer("kl_clip"):
                lr = self.options.hyper["lr"].at(self._steps)
                # Gradients a DeepSpeed engine has not unscaled yet (fp16) carry its
                # loss scale S, and so does P (preconditioning is linear); KL
                # clipping is not: lr/S gives lr²·ΣP∇/S², its value unscaled.
                loss_scale = self._grads.loss_scale() if pairs else 1.0
                scale = kl_clip_scale([(p, g) for _, p, g in pairs], lr / loss_scale, kl_clip)
        self.telemetry.record_kl_scale(scale)
        with self.telemetry.timer("precondition"):
            for layer, preconditioned, _ in pairs:
                if scale != 1.0:
                    preconditioned.mul_(scale)
                layer.handler.set_grad_matrix(preconditioned)
            self._grads.flush()  # (staged accesses: ZeRO's partitions, FSDP2's shards)

    # -- inspection, checkpoints, teardown ------------------------------------------------
    def coverage(self) -> Coverage:
        """Every trainable parameter and how it is treated; ``print()`` it for a table.

        A preconditioned parameter names its block(s) and their kind with the
        representations of ``A`` and ``G`` (as chosen so far); a raw one says
        why (no handler, a normalisation layer, ``skip_layers``, shared by
        two modules, a frozen partner, or a layer that captured nothing).
        """
        specs = {
            layer.name: (layer.dormant, "/".join(str(s) for s in layer.block.specs))
            for layer in self._layers
        }
        entries = []
        for t in self._treatments:
            if t.kind != "raw":
                dormant = [b for b in t.blocks if specs[b][0]]
                if dormant:
                    t = dataclasses.replace(
                        t, kind="raw", reason=f"{dormant[0]} captured nothing (see the warning)"
                    )
                else:
                    reps = sorted({specs[b][1] for b in t.blocks})
                    t = dataclasses.replace(t, kind=f"{t.kind} (A/G {', '.join(reps)})")
            entries.append(t)
        return Coverage(tuple(entries))

    def memory_usage(self) -> dict[str, int]:
        """Bytes held on this rank, by category.

        ``factors`` (running averages), ``second_order`` (eigenbases and
        eigenvalues or inverses, only for this rank's layers), ``captures``
        (what the hooks hold right now: factor accumulators, or raw inputs and
        output gradients with ``update_factors_in_hook=False``; released by
        ``step()``), ``captures_peak`` (the most captures held when a ``step()``
        began) and ``total`` (factors + second-order + captures).
        """
        usage = {
            "factors": sum(layer.block.factor_bytes() for layer in self._layers),
            "second_order": sum(layer.block.second_order_bytes() for layer in self._layers),
            "captures": sum(layer.capture_bytes() for layer in self._layers),
        }
        usage["total"] = sum(usage.values())
        usage["captures_peak"] = self._peak_capture_bytes
        return usage

    def state_dict(self) -> dict[str, Any]:
        """All that is needed to continue bit-identically: steps, factors, second-order state.

        Also recorded: the format version (:data:`STATE_FORMAT`), the placement
        it was written under, the options that shape the state
        (``compute_method``, ``damping_mode``,
        ``compute_eigenvalue_outer_product``, ``factor_init``), the automatic
        curvature choice, and each layer's representations.
        """
        choice = self.curvature_choice
        return {
            "format": STATE_FORMAT,
            "steps": self._steps,
            "world_size": self.world_size,
            "grad_workers": self.plan.grad_workers,
            "options": {name: getattr(self.options, name) for name in _STATE_OPTIONS},
            "curvature_choice": None if choice is None else dataclasses.asdict(choice),
            "layers": {layer.name: layer.block.state_dict() for layer in self._layers},
        }

    def _saved_choice(self, saved: object) -> BudgetChoice | None:
        """The checkpoint's automatic choice, checked against this preconditioner (no change)."""
        if saved is None:
            return None
        where = "state_dict 'curvature_choice'"
        if not isinstance(saved, Mapping):
            raise TypeError(f"{where} must be a dict or None; got {type(saved).__name__}")
        fields = [f.name for f in dataclasses.fields(BudgetChoice)]
        # (Checkpoints from before the clock calibration lack its two fields.)
        optional = ("time_scale", "calibrated")
        missing = [name for name in fields if name not in saved and name not in optional]
        unexpected = sorted(repr(key) for key in saved if key not in fields)
        if missing or unexpected:
            raise ValueError(
                f"{where} is malformed: missing {missing}, unexpected [{', '.join(unexpected)}]"
            )
        raw = saved["specs"]
        if not isinstance(raw, Mapping):
            raise TypeError(
                f"{where} is malformed: 'specs' must map layer names to (A, G); "
                f"got {type(raw).__name__}"
            )
        specs: dict[str, tuple[str, str]] = {}
        for name, pair in raw.items():
            if not isinstance(name, str) or not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise TypeError(
                    f"{where} is malformed: specs[{name!r}] must be a pair (A, G) of "
                    f"representations; got {pair!r}"
                )
            try:
                a, g = (str(SideSpec.parse(text)) for text in pair)
            except (TypeError, ValueError) as error:
                raise ValueError(f"{where} is malformed: specs[{name!r}]: {error}") from None
            specs[name] = (a, g)
        factor_steps, inv_steps = (
            check_count(saved[key], f"{where}: {key!r}", low=1)
            for key in ("factor_update_steps", "inv_update_steps")
        )
        work: list[float] = []
        for key in ("kfac_work", "training_work", "budget"):
            value = saved[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{where}: {key!r} must be a number; got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{where}: {key!r} must be a finite number >= 0; got {value!r}")
            work.append(float(value))
        within = saved["within_budget"]
        if not isinstance(within, bool):
            raise TypeError(f"{where}: 'within_budget' must be True or False; got {within!r}")
        calibrated = saved.get("calibrated", False)
        if not isinstance(calibrated, bool):
            raise TypeError(f"{where}: 'calibrated' must be True or False; got {calibrated!r}")
        scale = saved.get("time_scale", 1.0)
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not 1.0 <= scale <= MAX_TIME_SCALE
        ):
            raise ValueError(
                f"{where}: 'time_scale' must be a number in [1, {MAX_TIME_SCALE:g}]; got {scale!r}"
            )
        choice = BudgetChoice(
            specs=specs,
            factor_update_steps=factor_steps,
            inv_update_steps=inv_steps,
            kfac_work=work[0],
            training_work=work[1],
            budget=work[2],
            within_budget=within,
            time_scale=float(scale),
            calibrated=calibrated,
        )
        if set(specs) != {layer.name for layer in self._layers}:
            raise ValueError(f"{where} names other layers than registered")
        for layer in self._layers:
            for side, size, fixed, chosen in zip(
                "AG",
                (layer.handler.a_size, layer.handler.g_size),
                self._fixed[layer.name],
                specs[layer.name],
                strict=True,
            ):
                SideSpec.parse(chosen).check_size(size, f"{where}: layer {layer.name!r}, {side}")
                if fixed is not None and fixed != chosen:
                    raise ValueError(
                        f"state_dict holds {side} of layer {layer.name!r} as {chosen!r}, but "
                        f"curvature fixes it to {fixed!r}"
                    )
        mine = self.curvature_choice
        if mine is not None and (
            mine.specs != specs
            or (mine.factor_update_steps, mine.inv_update_steps)
            != (choice.factor_update_steps, choice.inv_update_steps)
        ):
            raise ValueError(
                "state_dict holds another automatic curvature choice than this preconditioner "
                "made; load it into a new preconditioner (before its first step)"
            )
        return choice

    def _saved_options(self, saved: object) -> dict[str, object]:
        """The checkpoint's ``'options'``, checked for form (their values may differ from ours)."""
        where = "state_dict 'options'"
        if not isinstance(saved, Mapping):
            raise TypeError(f"{where} must be a dict; got {type(saved).__name__}")
        missing = [name for name in _STATE_OPTIONS if name not in saved]
        unexpected = sorted(repr(key) for key in saved if key not in _STATE_OPTIONS)
        if missing or unexpected:
            raise ValueError(
                f"{where} is malformed: missing {missing}, unexpected [{', '.join(unexpected)}]"
            )
        for name, allowed in _STATE_OPTIONS.items():
            value = saved[name]
            if type(value) is not type(allowed[0]):
                raise TypeError(f"{where}: {name} must be one of {allowed}; got {value!r}")
            if value not in allowed:
                raise ValueError(f"{where}: {name} must be one of {allowed}; got {value!r}")
        return dict(saved)

    def _check_state_dict(self, state_dict: object) -> _Restore:
        """Everything :meth:`load_state_dict` will install, checked; nothing is changed here."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                "state_dict must be a dict from KFACPreconditioner.state_dict(); "
                f"got {type(state_dict).__name__}"
            )
        version = state_dict.get("format", 1)
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"state_dict 'format' must be an integer; got {version!r}")
        if version not in (1, STATE_FORMAT):
            raise ValueError(
                f"state_dict has format version {version}; this kaisa reads versions 1 and "
                f"{STATE_FORMAT} (was it written by a newer kaisa?)"
            )
        legacy = version == 1
        required = ["grad_workers", "layers", "steps", "world_size"]
        if not legacy:
            required += ["curvature_choice", "format", "options"]
        allowed = [*required, "curvature_choice", "format"]
        missing = sorted(key for key in required if key not in state_dict)
        if missing:
            raise ValueError(
                f"state_dict is not a KFACPreconditioner state dict (format {version}): "
                f"it lacks the keys {missing}"
            )
        unexpected = sorted(repr(key) for key in state_dict if key not in allowed)
        if unexpected:
            raise ValueError(
                f"state_dict (format {version}) holds unexpected keys {', '.join(unexpected)}"
            )
        steps = check_count(state_dict["steps"], "state_dict 'steps'")
        world_size = check_count(state_dict["world_size"], "state_dict 'world_size'", low=1)
        grad_workers = check_count(state_dict["grad_workers"], "state_dict 'grad_workers'", low=1)
        saved_options = None if legacy else self._saved_options(state_dict["options"])
        layers = state_dict["layers"]
        if not isinstance(layers, Mapping):
            raise TypeError(
                f"state_dict 'layers' must be a dict of layer states; got {type(layers).__name__}"
            )
        names = {layer.name for layer in self._layers}
        missing_layers = sorted(name for name in names if name not in layers)
        unexpected_layers = sorted(repr(key) for key in layers if key not in names)
        if missing_layers or unexpected_layers:
            raise ValueError(
                "state_dict layers do not match the registered layers: "
                f"missing {missing_layers}, unexpected [{', '.join(unexpected_layers)}]"
            )
        choice = self._saved_choice(state_dict.get("curvature_choice"))
        adopt = choice if choice is not None and self._choice_pending else None
        if adopt is not None:
            specs = {layer.name: adopt.specs[layer.name] for layer in self._layers}
            plan = self._make_plan([(la.name, la.handler, specs[la.name]) for la in self._layers])
        else:
            specs = {
                layer.name: (str(layer.block.specs[0]), str(layer.block.specs[1]))
                for layer in self._layers
            }
            plan = self.plan
        if legacy:
            for name, (a, g) in specs.items():
                if (a, g) != ("exact", "exact"):
                    raise ValueError(
                        "state_dict has no 'format': it was written before curvature "
                        f"representations (format 1, exact curvature only), but this "
                        f"preconditioner holds layer {name!r} as ({a!r}, {g!r}); construct "
                        "it with curvature='exact' to load it"
                    )
        auto_sides = [
            f"{name}.{side}"
            for name, fixed in self._fixed.items()
            for side, value in zip("AG", fixed, strict=True)
            if value is None
        ]
        # A well-formed positive counter (a bad one is refused below, by name).
        folded = legacy or any(
            isinstance(entry, Mapping)
            and type(entry.get("updates")) is int
            and entry["updates"] > 0
            for entry in layers.values()
        )
        if choice is None and self._choice_pending and auto_sides and folded:
            raise ValueError(
                "state_dict has no automatic curvature choice but holds folded factors (it was "
                "written with fixed curvature), while this preconditioner leaves "
                f"{', '.join(auto_sides)} to curvature='auto', whose choice at the first factor "
                "update would replace them; construct it with the checkpoint's curvature "
                "(each layer's 'representation')"
            )
        # Options that shape the second-order state: another value converts (the
        # state is recomputed from the factors); factor_init only steers later
        # updates of the factors and is accepted as it is.
        converted = []
        if saved_options is not None:
            for name in ("compute_method", "damping_mode", "compute_eigenvalue_outer_product"):
                if saved_options[name] != getattr(self.options, name):
                    converted.append(
                        f"{name}={saved_options[name]!r} (this preconditioner: "
                        f"{getattr(self.options, name)!r})"
                    )
        same_plan = world_size == self.world_size and grad_workers == plan.grad_workers
        keep = same_plan and not legacy and not converted
        recompute = not keep
        blocks: dict[str, CheckedBlockState] = {}
        load_second_order: set[str] = set()
        for layer in self._layers:
            saved = layers[layer.name]
            if saved_options is not None:
                method, outer = (
                    saved_options["compute_method"],
                    saved_options["compute_eigenvalue_outer_product"],
                )
            else:
                method, outer = _legacy_method(saved, self.options.compute_method)
            handler = layer.handler
            layout = BlockLayout(
                layer.name,
                handler.a_size,
                handler.g_size,
                (SideSpec.parse(specs[layer.name][0]), SideSpec.parse(specs[layer.name][1])),
                method,  # type: ignore[arg-type]
                bool(outer),
                device=handler.weight.device,
                factor_dtype=self.factor_dtype,
                inv_dtype=self.inv_dtype,
            )
            works_here = plan.is_grad_worker(layer.name, self.rank)
            checked = check_block_state(
                saved, layout, legacy=legacy, second_order=keep and works_here
            )
            blocks[layer.name] = checked
            if keep and works_here:
                if checked.second_order is not None:
                    load_second_order.add(layer.name)
                else:
                    # Written by a rank of another column. Every rank of this column
                    # sees the same checkpoint and decides alike, and the recompute
                    # only talks inside the column, so ranks need not agree on this.
                    recompute = True
        return _Restore(adopt, blocks, load_second_order, steps, recompute, converted)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; a refused one leaves the preconditioner as it was.

        Everything is checked before anything changes: the form and format
        version, layer names, the automatic curvature choice, each layer's
        representations, factor shapes and dtypes, counters, every
        second-order tensor's count and shape, and that all tensors are
        finite. A bad checkpoint raises ``TypeError`` or ``ValueError`` naming
        the layer, the key or the option.

        Layers are matched by name. A checkpoint written with another
        ``compute_method``, ``damping_mode`` or
        ``compute_eigenvalue_outer_product`` is converted (with a warning):
        its factors are loaded and the second-order state is recomputed from
        them at the next ``step()``; another ``factor_init`` is accepted (it
        only steers later factor updates). A checkpoint without a format
        version (format 1, written before curvature representations) loads
        into all-exact layers only, and its second-order state is recomputed.

        If the checkpoint was written under a different placement (world size
        or fraction), second-order state is recomputed from the factors at
        the next ``step()``. Under KAISA each rank holds second-order state
        only for its own column's layers, so a checkpoint written by one rank
        (the usual "save on rank 0") lacks the other columns' state: a rank
        recomputes its layers' state from the factors at the next ``step()``
        when the checkpoint does not have it, and ignores state for layers it
        does not work on. Restoring each rank's own checkpoint continues
        bit-identically.
        """
        restore = self._check_state_dict(state_dict)
        if restore.converted:
            warnings.warn(
                "kaisa: the checkpoint was written with "
                + ", ".join(restore.converted)
                + "; its factors are loaded and the second-order state is recomputed from "
                "them at the next step()",
                RuntimeWarning,
                stacklevel=2,
            )
        # Nothing below can fail: every value was checked above.
        if restore.choice is not None:
            self._apply_choice(restore.choice)
        for layer in self._layers:
            layer.block.load_checked(
                restore.blocks[layer.name], second_order=layer.name in restore.second_order
            )
        self._steps = restore.steps
        if self._calibrate_at is not None:  # an uncalibrated choice: measure from here
            self._calibrate_at = self._steps + CALIBRATION_STEPS
        self._capture_this_step = self._is_factor_step()
        self._force_inverse_update = restore.recompute

    def remove_hooks(self) -> None:
        """Detach from the model (the preconditioner can no longer capture)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __repr__(self) -> str:
        hyper = ", ".join(repr(h) for h in self.options.hyper.values())
        if "kl_clip" not in self.options.hyper:
            hyper += ", kl_clip=None"
        return (
            f"KFACPreconditioner({len(self._layers)} layers, world_size={self.world_size}, "
            f"grad_workers={self.plan.grad_workers}, {hyper})"
        )
