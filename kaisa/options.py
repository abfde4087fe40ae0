"""Every choice of :class:`~kaisa.KFACPreconditioner`, validated in one place.

Names and meanings follow the published KAISA implementation (spec §1) so
that its users find what they know. Each bad value raises ``TypeError`` (wrong
kind) or ``ValueError`` (wrong value) naming the argument, the value given and
what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kaisa.choices import (
    ASSIGNMENT_STRATEGIES,
    COMPUTE_METHODS,
    CONV_ESTIMATORS,
    DAMPING_MODES,
    EIGEN_CORRECTIONS,
    FACTOR_INITS,
    GRAFTINGS,
    PROFILES,
    AssignmentStrategy,
    ComputeMethod,
    ConvEstimator,
    DampingMode,
    FactorInit,
    Grafting,
    Profile,
)
from kaisa.curvature.budget import MIN_FACTOR_STEPS, MIN_INV_STEPS
from kaisa.curvature.costs import DEFAULT_COST_MODEL, CostModel, SideSpec, check_cost_model
from kaisa.distributed.fraction import parse_bytes
from kaisa.distributed.plan import FractionSpec, resolve_grad_workers
from kaisa.profiles import PROFILE_DEFAULTS, PROFILED_OPTIONS, left_auto
from kaisa.schedules import Hyperparameter
from kaisa.validation import Rule, check_count, check_dtype, check_flag, check_number, one_of

#: Options left to the automatic choice when given as ``None``.
AUTO_OPTIONS = ("factor_update_steps", "inv_update_steps", "factor_decay")
#: The averaging window of the factors, in steps, that the automatic
#: ``factor_decay`` keeps whatever the factor interval: ``1 − interval / window``.
DECAY_WINDOW_STEPS = 200.0

#: The published KAISA implementation's defaults (spec §1, §3, §4), for
#: :meth:`kaisa.KFACPreconditioner.with_reference_defaults`.
REFERENCE_DEFAULTS: dict[str, Any] = {
    "factor_update_steps": 1,
    "inv_update_steps": 1,
    "damping": 0.001,
    "factor_decay": 0.95,
    "kl_clip": 0.001,
    "curvature": "exact",
    "damping_mode": "absolute",
    "factor_init": "identity",
    "stale_refresh": False,
    "profile": "general",
}

#: A side's fixed representation, or ``None`` for the automatic choice.
FixedSides = tuple[str | None, str | None]


def auto_decay(factor_update_steps: int) -> float:
    """``factor_decay`` when left to kaisa: ``1 − interval / 200`` in ``[0.5, 0.95]``.

    Keeps the factors' averaging window near 200 steps whatever the interval
    (every 10 steps 0.95, every 20 0.9, every 40 0.8, every 80 0.6).
    """
    return min(0.95, max(0.5, 1.0 - factor_update_steps / DECAY_WINDOW_STEPS))


def _curvature_rules(value: object) -> tuple[tuple[str, FixedSides], ...]:
    """``curvature`` as ``(regex, (A, G))`` rules; ``None`` sides are left to the budget."""

    def sides(item: object, where: str) -> FixedSides:
        if isinstance(item, (tuple, list)):
            if len(item) != 2:
                raise ValueError(
                    f"{where} must be one representation or a pair (A, G); got {item!r}"
                )
            a, g = item
        else:
            a = g = item
        out: list[str | None] = []
        for text in (a, g):
            if isinstance(text, str) and text.strip().lower() == "auto":
                out.append(None)
            else:
                try:
                    out.append(str(SideSpec.parse(text)))
                except (TypeError, ValueError) as error:
                    raise ValueError(
                        f"{where}: {error}; allowed: 'auto', 'exact', 'lowrank:K', 'kvec', "
                        "'diagonal'"
                    ) from None
        return out[0], out[1]

    if isinstance(value, (str, tuple, list)):
        return ((".*", sides(value, "curvature")),)
    if isinstance(value, Mapping):
        rules = []
        for pattern, item in value.items():
            if not isinstance(pattern, str):
                raise TypeError(f"curvature keys must be regular expressions; got {pattern!r}")
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"curvature holds an invalid regular expression {pattern!r}: {error}"
                ) from error
            rules.append((pattern, sides(item, f"curvature[{pattern!r}]")))
        return tuple(rules)
    raise TypeError(
        "curvature must be 'auto', a representation ('exact', 'lowrank:K', 'kvec', "
        "'diagonal'), a pair (A, G) of them, or a mapping from layer-name regular "
        f"expressions to those; got {value!r}"
    )


#: The smallest damping accepted. Below it damping cannot regularise a solve
#: in float32 or float64: with a singular factor the eigen solve divides by
#: about the damping alone (1/1e-40 overflows float32 to inf, then NaN), and
#: an inverse of ``F + γI`` is as singular as ``F``.
MIN_DAMPING = 1e-12


class _ReadOnly(Mapping[str, Hyperparameter]):
    """A mapping that cannot be changed (and, unlike ``MappingProxyType``, can be copied)."""

    __slots__ = ("_items",)

    def __init__(self, items: dict[str, Hyperparameter]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Hyperparameter:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


#: Why ``factor_dtype`` and ``inv_dtype`` refuse ``torch.float16`` (the error's text).
HALF_REFUSED = (
    "K-FAC's curvature spans more than float16's range (G's entries are squared output "
    "gradients, often below float16's smallest number, 6e-8; measured: preconditioned "
    "gradients 35% to 6900% off a float64 run, even with the solve in float32). Use "
    "torch.bfloat16 (float32's range: the second-order state is computed and applied in "
    "float32 and stored in bfloat16) or torch.float32"
)


#: Why a preconditioner with KL clipping on and no learning rate is refused.
LR_REQUIRED = (
    "KL clipping (kl_clip={kl_clip!r}) needs the learning rate the optimizer steps with: "
    "pass optimizer=<your optimizer> (its param_groups[0]['lr'] is read at every step, so "
    "it follows a scheduler), or lr=<a number, or a callable step -> lr>; or turn KL "
    "clipping off with kl_clip=None"
)


class OptimizerLR:
    """``lr`` read from an optimizer at every step: its first parameter group's ``'lr'``.

    The first group's, as the framework integrations read it; with groups at
    different rates, pass ``lr=`` (a callable may combine them).
    """

    __slots__ = ("optimizer",)

    def __init__(self, optimizer: Any) -> None:
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, list) or not groups or not isinstance(groups[0], Mapping):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer (its param_groups[0]['lr'] is read "
                f"at every step for KL clipping); got {type(optimizer).__name__}"
            )
        if "lr" not in groups[0]:
            raise ValueError(
                f"optimizer ({type(optimizer).__name__}) has no 'lr' in param_groups[0]; pass "
                "lr= (a number, or a callable step -> lr) instead"
            )
        self.optimizer = optimizer

    def __call__(self, step: int) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def __repr__(self) -> str:
        return f"<{type(self.optimizer).__name__}.param_groups[0]['lr']>"


@dataclass(frozen=True)
class StepHyper:
    """Every hyperparameter's value at one step (:meth:`KFACOptions.resolve`)."""

    factor_update_steps: int
    inv_update_steps: int
    damping: float
    factor_decay: float
    kl_clip: float | None  # None: KL clipping off
    lr: float


@dataclass(frozen=True)
class KFACOptions:
    """The validated constructor arguments of :class:`~kaisa.KFACPreconditioner`.

    Each option, as the constructor takes it (every bad value raises
    ``TypeError`` or ``ValueError`` naming it and what is allowed).

    Attributes:
        factor_update_steps: update the factors every this many steps
            (``'auto'``, the default: the profile's; ``None``: chosen by the
            budget).
        inv_update_steps: recompute the second-order state every this many steps
            (``'auto'``: the profile's; under 'language-model' the factors'
            interval when that one is given; ``None``: chosen by the budget).
        damping: Tikhonov damping ``γ`` (>= 1e-12: below, no float32 or float64
            solve is regularised; a singular factor would give inf or NaN).
        factor_decay: running-average decay ``ξ`` in ``[0, 1)``.
        kl_clip: KL-clipping bound ``κ`` (> 0), or ``None`` to turn clipping off.
        lr: the learning rate KL clipping assumes (a number, a schedule, or a 0-d real
            tensor such as a compiled optimizer's own ``lr``, read at every step;
            ``None``: not given). Required while ``kl_clip`` is on, unless
            ``optimizer`` is given; unused (and optional) with ``kl_clip=None``.
        optimizer: the optimizer that steps after the preconditioner; KL
            clipping then reads its ``param_groups[0]['lr']`` at every step
            (so it follows any scheduler). Give it or ``lr``, not both.
        accumulation_steps: forward/backward passes per ``step()`` (default 1;
            with a DeepSpeed engine, its ``gradient_accumulation_steps``).
        allreduce_bucket_cap_mb: size bound of one factor all-reduce bucket.
        assignment_strategy: balance decompositions by 'compute' (``n³``) or
            'memory' (``n²``).
        colocate_factors: decompose a layer's ``A`` and ``G`` on the same rank.
        compute_method: 'eigen' (exact solve) or 'inverse' (damped inverses).
        compute_eigenvalue_outer_product: precompute ``1 ⊘ (λ_G λ_Aᵀ + γ)`` at
            each inverse update (damping frozen until the next one).
        grad_worker_fraction: float in ``[0, 1]`` (0 means ``1/N``),
            'comm-opt', 'hybrid-opt', 'mem-opt', or 'auto': the fraction that
            fits ``memory_budget`` and has the least modelled time per step,
            with the network's latency and bandwidth measured on the process
            group at construction (:mod:`kaisa.distributed.fraction`;
            ``grad_worker_choice`` holds the outcome).
        memory_budget: bytes per rank for the factors and second-order state
            under ``grad_worker_fraction='auto'`` (a number, or a string such
            as ``'2GiB'``); ``None``: the device's free memory on a CUDA
            device, no limit elsewhere. Only with ``'auto'``.
        symmetry_aware: all-reduce only the upper triangles of the factors.
        grad_scaler: a ``torch.amp.GradScaler`` or a callable returning the
            current loss scale; captured output gradients are unscaled with it.
        factor_dtype: dtype of the captures' products and the factors (default:
            the weights' dtype, at least float32; ``torch.float16`` is refused,
            as for ``inv_dtype``).
        inv_dtype: dtype the second-order state is stored in (default float32;
            ``None`` follows the factors). It is computed, and every solve
            runs, in at least float32 whatever this dtype (spec §4);
            ``torch.bfloat16`` halves its memory and traffic (the
            preconditioned gradients were 2–3% off a float64 run on the test
            model, against 1e-4 in float32). ``torch.float16`` is refused
            (:data:`HALF_REFUSED`): the curvature does not fit its range.
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
        factor_sample: the share of each captured call's rows that the
            factor products ``āᵀā`` and ``δᵀδ`` multiply out, in ``(0, 1]``
            (default 1: every row). Below 1, a random subset of the rows
            (tokens of a Linear, an attention projection or an embedding; whole
            examples of a convolution) of at least one row, drawn anew at
            every factor update, stands for all of them: the factors are
            averaged over the rows drawn, and the products cost that share of
            their full price. The draw is a function of the step, the layer,
            the side and the call only (two runs with the same seed draw
            alike, a resumed run draws as an uninterrupted one). The moments the diagonal and
            Kronecker-vector sides use are cheap and always take every row; a
            layer whose handler cannot draw rows (``LayerHandler.sample_rows``)
            takes all of them, and the constructor warns. At 0.25 the suite's
            language model took about the same steps for half the products'
            time, and its ViT more steps (``docs/language-models.md``).
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
            layers' forward and backward work (``> 0``; ``'auto'``, the default:
            the profile's, 0.1 or 1.25). At the
            first factor-update step kaisa chooses every 'auto' side's
            representation and the intervals left as ``None`` to fit it
            (:mod:`kaisa.curvature.budget`; ``curvature_choice`` holds the
            outcome). It gives up first the work that saves the most, except
            for one side: the one whose diagonal would leave the worst
            direction (measured on that step's factors), which keeps its
            lowest low rank while anything else can be given up. The choice
            depends on the rows each rank sees. Given
            intervals that are schedules, it costs the intervals in force
            at that step: a schedule that refreshes often at first and
            rarely later gets the cheap sides of its first intervals (give
            the sides, e.g. ``curvature='exact'``, with such a schedule;
            kaisa warns once when a choice of sides is costed on a schedule).
        calibrate_budget: measure the iteration on the clock and choose again
            (default ``False``: the choice is deterministic). The automatic
            choice always scales its allowance by the iteration's operator
            calls, counted on the first training forward
            (:func:`kaisa.curvature.budget.operator_scale`: shapes and
            structure only, the same on every run). ``True``:
            :data:`~kaisa.autochoice.CALIBRATION_STEPS` steps after the first
            choice, the median forward-and-backward time of those steps and
            one factor update's captures scale the allowance instead
            (:func:`kaisa.curvature.budget.time_scale`; maxima over the ranks,
            so every rank chooses alike), which can differ between runs on
            the same machine when a measurement lands near a rounding step.
        eigenvalue_correction: 'off' (K-FAC's eigenvalue products), 'ekfac'
            or 'adam' (``'auto'``, the default: the profile's, 'off' or
            'ekfac'). Layers whose sides have explicit eigenbases (exact
            with the eigen method, low-rank: its top ``k`` eigenvectors and
            one entry for the rest, or diagonal) keep ``S``, a running average
            of the squared gradient in the Kronecker eigenbasis refreshed
            every step, and divide the rotated gradient by it: 'ekfac' by
            ``S`` rescaled to the factors' mean eigenvalue product, plus the
            damping (EKFAC's solve; with ``S`` proportional to K-FAC's
            products it is K-FAC's solve); 'adam' by ``√S`` (Adam's second
            moment in that basis, as SOAP). Other layers solve as before
            (:mod:`kaisa.curvature.eigencorrection`, spec §11).
        eigenvalue_decay: the decay ``ξ`` of ``S`` per step, in ``[0, 1)``
            (default 0.99, a window of about 100 steps; on the ViT workload
            0.95 cost 'ekfac' 23% more steps, and on the language model the
            two were level: ``benchmarks/README.md``).
        eigenbasis_tolerance: ``'auto'`` (the default: the profile's, ``None``
            or 0.05; ``None`` under ``compute_method='inverse'``), ``None``
            (every inverse update decomposes), or a share in ``[0, 1)``: at an inverse update, an
            exact side held with the eigen method keeps its eigenbasis ``Q``
            while ``Q`` still diagonalises the current factor ``F`` to within
            it (``‖offdiag(QᵀFQ)‖_F ≤ tolerance · ‖QᵀFQ‖_F``) and refreshes only
            its eigenvalues, to ``diag(QᵀFQ)``: one matrix product (``FQ``)
            instead of a decomposition. Bases are then refreshed when they have gone
            stale rather than on a clock; give it with ``inv_update_steps``
            equal to ``factor_update_steps``, so that any factor update can
            refresh them. Tied weights' shared bases follow the same rule.
            Refused with ``compute_method='inverse'`` and every side exact
            (no eigenbasis is held then).
            ``telemetry.kept_eigenbases`` counts the decompositions saved. On
            three small language models with ``eigenvalue_correction='ekfac'``
            and factors and inverses every 5 steps, 0.05 decomposed 40–54% of
            the time and took 0–11% fewer steps than inverses every 10 at
            about its step time (``benchmarks/README.md``, session 22; not
            measured on image models).
        adaptive_intervals: ``'auto'`` (the default: the profile's, ``False``
            or ``True``; ``False`` without a tolerance or with interval
            schedules), ``False`` (the intervals as given or chosen), or
            ``True``: with ``eigenbasis_tolerance``, the factor
            and inverse intervals in force are the given (or chosen) ones
            times a multiplier of 1, 2, 4 or 8 that doubles after an inverse
            update at which fewer than 20% of the eigenbases that could be
            kept decomposed and halves after one at which more than 40% did
            (:mod:`kaisa.cadence`; the first such update, from the
            identity the sides start from, is not counted): curvature that
            stays put is refreshed less often. Needs
            ``eigenbasis_tolerance`` and intervals that are numbers or left
            to kaisa, not schedules. An automatic ``factor_decay`` follows
            the stretched factor interval.
        stale_refresh: ``True`` (default), or ``False`` (the intervals as
            given or chosen): after each step that did not update the
            inverses, compare each layer's ``‖P‖_F / ‖∇‖_F`` (its
            preconditioned over its raw gradient, before grafting and KL
            clipping) with its value at the layer's last inverse update; when
            at least a quarter of the layers, and at least two of them (the one
            layer of a one-layer model), moved by more than 4x either way
            (:mod:`kaisa.cadence`), the curvature is stale: factors and
            inverses are updated at every step from the next one, and the cap
            on the intervals doubles at each update until it reaches the
            intervals given or chosen. An automatic ``factor_decay`` follows the
            capped interval. It costs two norms per layer and one host sync per
            step and, with several ranks, a two-element all-reduce; nothing
            when the intervals are 1. On timm's EVA-02, whose classifier starts
            near zero and whose curvature moves fast early, AdamW + kaisa at
            AdamW's rate went from 3.65–42.1 points behind AdamW alone after
            100 steps to a mean of 4.4 points ahead (seeds 0–3); on timm's
            ConvNeXt-atto, EfficientNet-B0, ResNet-18 and ViT-tiny it moved
            the final accuracy by −0.14 to +1.40 points; the suite's time
            ratios to Muon stayed within 0.04 of those without it (SmallCNN
            0.65x against 0.63x, the ViT 0.64x against 0.67x, GapCNN 0.86x
            both, ``gpt`` 1.35x against 1.39x; ``benchmarks/README.md``,
            sessions 47–48).
        fresh_start_steps: 0 (default: off), or a number of steps ``N``: for
            the first ``N`` steps factors and inverses are updated at least
            every 2 steps (:func:`kaisa.cadence.fresh_start_cap`), then at the
            intervals given or chosen. The curvature moves fastest early: on
            the suite's language model (a 100-step warm-up in 1500 steps)
            every step that refreshing every 2 steps saved over every 5 was
            saved in the first 200. ``adaptive_intervals`` counts no inverse
            update before step ``N + 1`` (their bases were 2 steps old), and
            the budget's choice costs the intervals after it. It buys steps, not
            time, on a CPU: see ``docs/language-models.md`` for what it
            measured.
        grafting: 'off', or 'layer': each layer's preconditioned gradient is
            rescaled to the raw gradient's Frobenius norm before KL clipping,
            so kaisa keeps the step size the optimizer behind it was tuned for
            and gives only the direction.
        cost_model: the weights of the automatic choice's cost model
            (:class:`kaisa.curvature.costs.CostModel`; the default was
            measured on this project's CPUs: ``benchmarks/cost_weights.py``
            measures them on yours).
        profile: which values the options left ``'auto'``
            (:data:`kaisa.profiles.PROFILED_OPTIONS`) take
            (:data:`kaisa.profiles.PROFILE_DEFAULTS`).
            'auto' (the default): 'language-model' when the model has an
            ``nn.Embedding`` (it reads token ids: a decoder, a text encoder,
            a sequence-to-sequence model), 'general' otherwise
            (:func:`kaisa.profiles.model_profile`; a :class:`KFACOptions` built without a
            model takes 'general'). 'general': the intervals and the sides
            chosen by the budget at ``time_budget=0.1``, no eigenvalue
            correction. 'language-model': EKFAC (``'ekfac'``) with factors and
            inverses every 5 steps, ``eigenbasis_tolerance=0.05``,
            ``adaptive_intervals=True`` and ``time_budget=1.25``: on the
            suite's language model 436 steps to its target against 770 under
            'general' (Muon 522, SOAP 484), 1.11x Muon's time against 1.35x;
            on HuggingFace's GPT-2 and Llama, on which no choice was made,
            410 and 312 steps; the image workloads, which have no embedding,
            keep 'general' (``benchmarks/README.md``, session 49). Give the profile by
            name where the token lookup lives elsewhere (a later pipeline
            stage, a model fed precomputed embeddings; under a
            ``process_group`` smaller than the world, 'general' read from the
            model is warned, since another stage may hold the lookup); any
            option given wins over it. ``options.profiled`` lists the options
            it set.
        process_group: the data-parallel group over which this model's layers
            are replicated (default: the whole world). KAISA's plan, its
            collectives and the agreement check span this group only, so
            each pipeline stage (or model-parallel shard) builds its own
            preconditioner over the replicas of its own layers; only the
            group's members construct it. Gradients must already be averaged
            over the group when ``step()`` runs (as DDP with this group does).

    ``factor_decay`` defaults to ``None`` (as do the intervals under the
    'general' profile): chosen by the budget (the decay keeps a 200-step
    averaging window, ``1 − interval/200``). Every numeric hyperparameter may also be a
    callable ``f(step) -> value`` (a schedule), read once per step
    (:meth:`resolve`). The instance never changes after construction.
    """

    factor_update_steps: Any = "auto"
    inv_update_steps: Any = "auto"
    damping: Any = 0.03
    factor_decay: Any = None
    kl_clip: Any = 0.003
    lr: Any = None
    optimizer: Any = field(default=None, repr=False, compare=False)
    accumulation_steps: int = 1
    allreduce_bucket_cap_mb: float = 25.0
    assignment_strategy: AssignmentStrategy = "compute"
    colocate_factors: bool = True
    compute_method: ComputeMethod = "eigen"
    compute_eigenvalue_outer_product: bool = True
    grad_worker_fraction: FractionSpec = "comm-opt"
    memory_budget: int | str | None = None
    symmetry_aware: bool = False
    grad_scaler: object = None
    factor_dtype: torch.dtype | None = None
    inv_dtype: torch.dtype | None = torch.float32
    skip_layers: Sequence[str] = ()
    update_factors_in_hook: bool = True
    conv_factor_estimator: ConvEstimator = "expand"
    factor_product_dtype: torch.dtype | None = None
    factor_sample: float = 1.0
    damping_mode: DampingMode = "relative"
    factor_init: FactorInit = "first_batch"
    curvature: Any = "auto"
    time_budget: Any = "auto"
    calibrate_budget: bool = False
    eigenvalue_correction: Any = "auto"
    eigenvalue_decay: float = 0.99
    eigenbasis_tolerance: Any = "auto"
    adaptive_intervals: Any = "auto"
    stale_refresh: bool = True
    fresh_start_steps: int = 0
    grafting: Grafting = "off"
    cost_model: CostModel = DEFAULT_COST_MODEL
    profile: Profile = "auto"
    # Derived, validated views.
    hyper: Mapping[str, Hyperparameter] = field(init=False, repr=False, compare=False)
    #: Which of :data:`AUTO_OPTIONS` were left to the automatic choice.
    auto: frozenset[str] = field(init=False, repr=False, compare=False)
    #: ``curvature`` as ``(regex, (A, G))`` rules, first match wins.
    curvature_rules: tuple[tuple[str, FixedSides], ...] = field(
        init=False, repr=False, compare=False
    )
    #: Which of :data:`kaisa.profiles.PROFILED_OPTIONS` took their value from the profile.
    profiled: frozenset[str] = field(init=False, repr=False, compare=False)

    def _apply_profile(self) -> None:
        """Give every option left ``'auto'`` the profile's value (``'auto'`` alone: 'general').

        A profile's value yields to what was given: no eigenbasis tolerance
        with ``compute_method='inverse'`` (its exact sides hold no basis), and
        no adaptive intervals without a tolerance or with interval schedules.
        """
        set_ = object.__setattr__
        profile = one_of("profile", self.profile, PROFILES)
        if profile == "auto":  # no model here: KFACPreconditioner resolves it from one
            profile = "general"
        set_(self, "profile", profile)
        values = PROFILE_DEFAULTS[profile]
        chosen = {name for name in PROFILED_OPTIONS if left_auto(getattr(self, name))}
        for name in chosen:
            set_(self, name, values[name])
        pair = ("factor_update_steps", "inv_update_steps")
        if values[pair[0]] is not None and len(chosen.intersection(pair)) == 1:
            # A profile with fixed intervals refreshes the bases at every factor
            # update: the one left 'auto' takes the one given.
            left, given = pair if pair[0] in chosen else pair[::-1]
            set_(self, left, getattr(self, given))
        if "eigenbasis_tolerance" in chosen and self.compute_method == "inverse":
            set_(self, "eigenbasis_tolerance", None)
        scheduled = any(
            callable(v) or isinstance(v, torch.Tensor)
            for v in (self.factor_update_steps, self.inv_update_steps)
        )
        if (
            "adaptive_intervals" in chosen
            and self.adaptive_intervals
            and (self.eigenbasis_tolerance is None or scheduled)
        ):
            set_(self, "adaptive_intervals", False)
        set_(self, "profiled", frozenset(chosen))

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        self._apply_profile()
        set_(self, "auto", frozenset(n for n in AUTO_OPTIONS if getattr(self, n) is None))
        # Placeholders for the automatic ones (never read: see resolve()).
        provisional = {
            "factor_update_steps": MIN_FACTOR_STEPS,
            "inv_update_steps": MIN_INV_STEPS,
            "factor_decay": auto_decay(MIN_FACTOR_STEPS),
        }

        def value(name: str) -> Any:
            given = getattr(self, name)
            return provisional[name] if given is None else given

        hyper: dict[str, Hyperparameter] = {
            "factor_update_steps": Hyperparameter(
                Rule("factor_update_steps", integer=True, low=1), value("factor_update_steps")
            ),
            "inv_update_steps": Hyperparameter(
                Rule("inv_update_steps", integer=True, low=1), value("inv_update_steps")
            ),
            "damping": Hyperparameter(Rule("damping", low=MIN_DAMPING), self.damping),
            "factor_decay": Hyperparameter(
                Rule("factor_decay", low=0.0, high=1.0, high_open=True), value("factor_decay")
            ),
        }
        lr = self.lr
        if self.optimizer is not None:
            if lr is not None:
                raise ValueError(
                    "give KL clipping its learning rate either as lr= or as optimizer= (read "
                    f"at every step), not both; got lr={lr!r} and optimizer="
                    f"{type(self.optimizer).__name__}"
                )
            lr = OptimizerLR(self.optimizer)
        if lr is not None:
            hyper["lr"] = Hyperparameter(Rule("lr", low=0.0), lr)
        if self.kl_clip is not None:
            hyper["kl_clip"] = Hyperparameter(Rule("kl_clip", low=0.0, low_open=True), self.kl_clip)
        set_(self, "hyper", _ReadOnly(hyper))
        steps = self.accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise TypeError(f"accumulation_steps must be an integer >= 1; got {steps!r}")
        if steps < 1:
            raise ValueError(f"accumulation_steps must be an integer >= 1; got {steps!r}")
        cap = self.allreduce_bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)):
            raise TypeError(f"allreduce_bucket_cap_mb must be a number > 0; got {cap!r}")
        if not cap > 0 or cap == float("inf"):
            raise ValueError(f"allreduce_bucket_cap_mb must be a finite number > 0; got {cap!r}")
        set_(
            self,
            "assignment_strategy",
            one_of("assignment_strategy", self.assignment_strategy, ASSIGNMENT_STRATEGIES),
        )
        set_(
            self,
            "compute_method",
            one_of("compute_method", self.compute_method, COMPUTE_METHODS),
        )
        set_(
            self,
            "conv_factor_estimator",
            one_of("conv_factor_estimator", self.conv_factor_estimator, CONV_ESTIMATORS),
        )
        set_(
            self,
            "damping_mode",
            one_of("damping_mode", self.damping_mode, DAMPING_MODES),
        )
        set_(
            self,
            "factor_init",
            one_of("factor_init", self.factor_init, FACTOR_INITS),
        )
        set_(
            self,
            "eigenvalue_correction",
            one_of("eigenvalue_correction", self.eigenvalue_correction, EIGEN_CORRECTIONS),
        )
        set_(self, "grafting", one_of("grafting", self.grafting, GRAFTINGS))
        check_cost_model(self.cost_model)
        check_number(self.eigenvalue_decay, "eigenvalue_decay", low=0.0, high=1.0, high_open=True)
        set_(
            self,
            "factor_sample",
            check_number(self.factor_sample, "factor_sample", low=0.0, high=1.0, low_open=True),
        )
        set_(self, "fresh_start_steps", check_count(self.fresh_start_steps, "fresh_start_steps"))
        if self.eigenbasis_tolerance is not None:
            tolerance = check_number(
                self.eigenbasis_tolerance, "eigenbasis_tolerance", low=0.0, high=1.0, high_open=True
            )
            set_(self, "eigenbasis_tolerance", tolerance)
        for name in (
            "colocate_factors",
            "compute_eigenvalue_outer_product",
            "symmetry_aware",
            "update_factors_in_hook",
            "calibrate_budget",
            "adaptive_intervals",
            "stale_refresh",
        ):
            check_flag(name, getattr(self, name))
        if self.adaptive_intervals:
            if self.eigenbasis_tolerance is None:
                raise ValueError(
                    "adaptive_intervals follows how many eigenbases eigenbasis_tolerance keeps "
                    "at each inverse update; give eigenbasis_tolerance too (e.g. 0.05), or "
                    "leave adaptive_intervals=False"
                )
            scheduled = self.scheduled_intervals()
            if scheduled:
                raise ValueError(
                    f"adaptive_intervals stretches fixed intervals, and {' and '.join(scheduled)} "
                    f"{'is a schedule' if len(scheduled) == 1 else 'are schedules'}: give "
                    "numbers (or leave them to kaisa), or leave adaptive_intervals=False"
                )
        # The fraction is checked against every world size later; here its form.
        fraction = self.grad_worker_fraction
        if isinstance(fraction, str) and fraction.strip().lower() == "auto":
            set_(self, "grad_worker_fraction", "auto")
        else:
            resolve_grad_workers(fraction, 1)
        if self.memory_budget is not None:
            if self.grad_worker_fraction != "auto":
                raise ValueError(
                    "memory_budget is the budget of grad_worker_fraction='auto'; got "
                    f"memory_budget={self.memory_budget!r} with grad_worker_fraction="
                    f"{fraction!r} (leave memory_budget=None, or let kaisa choose the fraction)"
                )
            set_(self, "memory_budget", parse_bytes(self.memory_budget, "memory_budget"))
        scaler = self.grad_scaler
        if scaler is not None and not (callable(scaler) or hasattr(scaler, "get_scale")):
            raise TypeError(
                "grad_scaler must be a torch.amp.GradScaler, a callable returning the current "
                f"loss scale, or None; got {scaler!r}"
            )
        check_dtype("factor_dtype", self.factor_dtype)
        check_dtype("inv_dtype", self.inv_dtype)
        check_dtype("factor_product_dtype", self.factor_product_dtype)
        for name in ("factor_dtype", "inv_dtype"):
            if getattr(self, name) == torch.float16:
                raise ValueError(f"{name}=torch.float16 is refused: {HALF_REFUSED}")
        skip = self.skip_layers
        if skip is None:
            skip = ()
        if isinstance(skip, str):
            skip = (skip,)
        elif isinstance(skip, Iterable) and not isinstance(skip, (list, tuple)):
            skip = list(skip)  # a set, a generator
        if not isinstance(skip, (list, tuple)) or not all(isinstance(p, str) for p in skip):
            raise TypeError(
                f"skip_layers must be a regular expression or a list of them; got {skip!r}"
            )
        for pattern in skip:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"skip_layers holds an invalid regular expression {pattern!r}: {error}"
                ) from error
        set_(self, "skip_layers", tuple(skip))
        set_(self, "curvature_rules", _curvature_rules(self.curvature))
        exact_everywhere = all(sides == ("exact", "exact") for _, sides in self.curvature_rules)
        if (
            self.eigenbasis_tolerance is not None
            and self.compute_method == "inverse"
            and exact_everywhere
        ):
            raise ValueError(
                "eigenbasis_tolerance keeps eigenbases, and compute_method='inverse' with every "
                "side exact holds none (damped inverses): use compute_method='eigen', or leave "
                "eigenbasis_tolerance=None"
            )
        budget = self.time_budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise TypeError(f"time_budget must be a number > 0; got {budget!r}")
        if not budget > 0 or budget == float("inf"):
            raise ValueError(
                f"time_budget must be a finite number > 0 (K-FAC's share of the layers' "
                f"work per step, e.g. 0.1); got {budget!r}"
            )
        # Last: an argument that is wrong is named before one that is missing.
        if "lr" not in hyper and self.kl_clip is not None:
            raise ValueError(LR_REQUIRED.format(kl_clip=self.kl_clip))

    def dtypes(self, weight_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        """``(factor, second-order, product)`` dtypes for weights of ``weight_dtype``.

        Factors default to the weights' dtype, at least float32; the
        second-order state and the products default to the factors'.
        """
        factor = self.factor_dtype or torch.promote_types(weight_dtype, torch.float32)
        return factor, self.inv_dtype or factor, self.factor_product_dtype or factor

    def fixed_sides(self, layer_name: str) -> FixedSides:
        """The representations the user fixed for a layer's ``(A, G)`` (``None``: automatic)."""
        for pattern, sides in self.curvature_rules:
            if re.search(pattern, layer_name):
                return sides
        return None, None

    def resolve(
        self,
        step: int,
        chosen: tuple[int, int] | None = None,
        stretch: int = 1,
        cap: int | None = None,
    ) -> StepHyper:
        """Every hyperparameter's value at ``step``, checked (a bad schedule value raises).

        ``chosen``: the automatic choice's ``(factor, inverse)`` intervals once
        it is made (``None`` before); they replace the options left to it,
        and an automatic ``factor_decay`` follows the factor interval in force
        (:func:`auto_decay`). Before the choice the automatic options hold
        placeholders (factors every :data:`MIN_FACTOR_STEPS`, inverses every
        :data:`MIN_INV_STEPS` steps). ``stretch`` (``adaptive_intervals``,
        :mod:`kaisa.cadence`) multiplies both intervals; an automatic decay
        follows the stretched factor interval.
        """
        hyper, auto = self.hyper, self.auto
        factor_steps = self.factor_interval(step, chosen, stretch, cap)
        inv_steps = self.inverse_interval(step, chosen, stretch, cap)
        if "factor_decay" not in auto:
            decay = hyper["factor_decay"].at(step)
        elif chosen is None:
            decay = auto_decay(MIN_FACTOR_STEPS)
        else:
            # The interval in force when the choice was installed: a schedule's
            # value cannot stand for it, so the shortest automatic one does.
            steps = hyper["factor_update_steps"]
            interval = (
                chosen[0]
                if "factor_update_steps" in auto
                else int(steps.constant)
                if steps.constant is not None
                else MIN_FACTOR_STEPS
            )
            decay = auto_decay(_capped(interval * stretch, cap))
        kl_clip = hyper.get("kl_clip")
        return StepHyper(
            factor_update_steps=factor_steps,
            inv_update_steps=inv_steps,
            damping=hyper["damping"].at(step),
            factor_decay=decay,
            kl_clip=None if kl_clip is None else kl_clip.at(step),
            # Read by KL clipping only: without it, lr may be left out.
            lr=hyper["lr"].at(step) if "lr" in hyper else 0.0,
        )

    def scheduled_intervals(self) -> list[str]:
        """The intervals the user gave as schedules (callables or live tensors), by name."""
        return [
            name
            for name in ("factor_update_steps", "inv_update_steps")
            if name not in self.auto and self.hyper[name].is_schedule
        ]

    def factor_interval(
        self,
        step: int,
        chosen: tuple[int, int] | None = None,
        stretch: int = 1,
        cap: int | None = None,
    ) -> int:
        """``factor_update_steps`` at ``step`` (see :meth:`resolve`), alone."""
        if "factor_update_steps" in self.auto:
            base = chosen[0] if chosen is not None else MIN_FACTOR_STEPS
        else:
            base = self.hyper["factor_update_steps"].int_at(step)
        return _capped(base * stretch, cap)

    def inverse_interval(
        self,
        step: int,
        chosen: tuple[int, int] | None = None,
        stretch: int = 1,
        cap: int | None = None,
    ) -> int:
        """``inv_update_steps`` at ``step`` (see :meth:`resolve`), alone."""
        if "inv_update_steps" in self.auto:
            base = chosen[1] if chosen is not None else MIN_INV_STEPS
        else:
            base = self.hyper["inv_update_steps"].int_at(step)
        return _capped(base * stretch, cap)

    def describe_hyper(self, values: StepHyper) -> str:
        """``name=value`` for each hyperparameter: as given, or as chosen when automatic."""
        parts = []
        for name, hyper in self.hyper.items():
            shown = getattr(values, name) if name in self.auto else hyper.value
            parts.append(f"{name}={shown!r}")
        if "kl_clip" not in self.hyper:
            parts.append("kl_clip=None")
        return ", ".join(parts)


def _capped(interval: int, cap: int | None) -> int:
    """An interval held to at most ``cap`` (``stale_refresh``; ``None``: as it is)."""
    return interval if cap is None else min(interval, cap)
