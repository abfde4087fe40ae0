"""The preconditioner's checkpoint: its schema, written and read back, checked before any change.

A state dict holds the format version (:data:`STATE_FORMAT`), the step count,
the placement it was written under (world size, gradient workers), the
options that shape the state (:data:`STATE_OPTIONS`), the automatic
curvature choice, each layer's block state and, with
``adaptive_intervals``, the intervals' multiplier (``interval_stretch``;
a checkpoint without one starts the multiplier at 1) and, with
``stale_refresh``, its cap on the intervals and each layer's reference ratio
(key ``stale_refresh``; a checkpoint without them starts with neither).
Each level restores itself:
:meth:`~kaisa.curvature.budget.BudgetChoice.from_state` checks the choice,
:func:`~kaisa.curvature.block.check_block_state` a block's state; this module
checks the whole against the preconditioner that loads it
(:func:`read_state`), so that :meth:`~kaisa.KFACPreconditioner.load_state_dict`
installs a :class:`Restore` that can no longer fail.

What a load does with what it finds:

* Everything is checked before anything changes: the form and format
  version, layer names, the automatic curvature choice, each layer's
  representations, factor shapes and dtypes, counters, every second-order
  tensor's count and shape, and that all tensors are finite. A bad
  checkpoint raises ``TypeError`` or ``ValueError`` naming the layer, the key
  or the option.
* Layers are matched by name. A checkpoint written with another
  ``compute_method``, ``damping_mode`` or
  ``compute_eigenvalue_outer_product`` is converted (with a warning):
  its factors are loaded and the second-order state is recomputed from
  them at the next ``step()``; another ``factor_init`` is accepted (it
  only steers later factor updates). A checkpoint without a format
  version (format 1, written before curvature representations) loads
  into all-exact layers only, and its second-order state is recomputed.
* A ``grad_worker_fraction='auto'`` choice in the checkpoint wins over the
  loading preconditioner's own ``'auto'`` choice when both were made for
  the same world size (the ranks then remake their column and row groups:
  every rank must load) and it fits the loading preconditioner's memory
  budget (otherwise the load is refused, naming both); made for another
  world size, the loading preconditioner's choice stands, with a warning.
* If the checkpoint was written under a different placement (world size
  or fraction), second-order state is recomputed from the factors at
  the next ``step()``. Under KAISA each rank holds second-order state
  only for its own column's layers, so a checkpoint written by one rank
  (the usual "save on rank 0") lacks the other columns' state: a rank
  recomputes its layers' state from the factors at the next ``step()``
  when the checkpoint does not have it, and ignores state for layers it
  does not work on. Restoring each rank's own checkpoint continues
  bit-identically.

The preconditioner itself is not pickled (:class:`StateDictOnly`): it holds
hooks on the model's modules and a process group, none of which a pickle
could restore; ``pickle.dumps``, ``torch.save`` and ``copy.deepcopy`` of it
raise a ``TypeError`` that points at ``state_dict()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kaisa.autochoice import FixedSides
from kaisa.cadence import IntervalStretch, StaleRefresh
from kaisa.choices import COMPUTE_METHODS, DAMPING_MODES, EIGEN_CORRECTIONS, FACTOR_INITS
from kaisa.curvature.block import BlockLayout, CheckedBlockState, check_block_state
from kaisa.curvature.budget import BudgetChoice
from kaisa.curvature.costs import SideSpec
from kaisa.curvature.shared import SharedState
from kaisa.distributed.fraction import FractionChoice, format_bytes
from kaisa.distributed.plan import WorkPlan
from kaisa.options import KFACOptions
from kaisa.validation import check_count, key_differences
from kaisa.warn import warn

__all__ = [
    "STATE_FORMAT",
    "STATE_OPTIONS",
    "CheckpointTarget",
    "LayerSlot",
    "Restore",
    "StateDictOnly",
]

#: The checkpoint format :func:`write_state` writes. A state dict without a
#: ``"format"`` key is format 1, from before curvature representations (exact
#: curvature only, no options recorded).
STATE_FORMAT = 2
#: The options that shape the saved state, with their allowed values; the
#: state dict records them.
STATE_OPTIONS: dict[str, tuple[object, ...]] = {
    "compute_method": COMPUTE_METHODS,
    "damping_mode": DAMPING_MODES,
    "compute_eigenvalue_outer_product": (True, False),
    "factor_init": FACTOR_INITS,
    "eigenvalue_correction": EIGEN_CORRECTIONS,
}
#: Options a checkpoint may lack (written before they existed), with the value they had.
_OPTIONAL_OPTIONS: dict[str, object] = {"eigenvalue_correction": "off"}
#: Options that shape the second-order state: another value in a checkpoint is
#: converted (the state is recomputed from the factors). ``factor_init`` only
#: steers later updates of the factors and is accepted as it is.
_CONVERTIBLE = (
    "compute_method",
    "damping_mode",
    "compute_eigenvalue_outer_product",
    "eigenvalue_correction",
)


#: ``check(saved, where, specs)``: a shared weight's saved second-order state, checked.
SharedCheck = Callable[[object, str, Mapping[str, tuple[str, str]]], SharedState]


class StateDictOnly:
    """A mixin: pickling or copying the object raises a ``TypeError`` naming ``state_dict()``.

    (Instead of the error about a local hook function that pickle would
    give, or a deep copy whose hooks still feed the original.)
    """

    def __reduce_ex__(self, protocol: object) -> Any:
        name = type(self).__name__
        raise TypeError(
            f"kaisa: a {name} cannot be pickled or copied (pickle, torch.save, copy.deepcopy): "
            "it holds hooks on the model's modules and its process group. Save "
            f"{name}.state_dict() (with the model's and the optimizer's) and, to resume, "
            f"build a new {name} on the model and call load_state_dict() with it"
        )


@dataclass(frozen=True)
class LayerSlot:
    """One registered layer as a checkpoint sees it."""

    name: str
    a_size: int
    g_size: int
    device: torch.device
    specs: tuple[str, str]  # the block's representations now
    fixed: FixedSides  # what the user (or the layer kind) fixed
    #: The owner of a shared weight: checks its saved ``'shared'`` state for
    #: the layers' representations (:meth:`~kaisa.curvature.shared.SharedCurvature.check_state`).
    shared: SharedCheck | None = None


@dataclass(frozen=True)
class CheckpointTarget:
    """The preconditioner a checkpoint is read into (nothing here is changed).

    ``make_plan`` gives the plan for other representations (an automatic
    choice the checkpoint brings); ``pending``: the automatic choice is
    still to be made, ``choice``: the one made.
    """

    layers: Sequence[LayerSlot]
    options: KFACOptions
    pending: bool
    choice: BudgetChoice | None
    plan: WorkPlan
    make_plan: Callable[[Mapping[str, tuple[str, str]], int], WorkPlan]
    rank: int
    world_size: int
    factor_dtype: torch.dtype
    inv_dtype: torch.dtype
    fraction: FractionChoice  # the gradient workers in force, and how they were chosen


@dataclass(frozen=True)
class Restore:
    """A checked checkpoint, ready to install: nothing in it can fail any more."""

    choice: BudgetChoice | None  # an automatic choice to adopt
    blocks: dict[str, CheckedBlockState]
    second_order: set[str]  # layers whose second-order state is loaded
    steps: int
    recompute: bool  # the second-order state is recomputed at the next step()
    converted: list[str]  # options whose other value in the checkpoint was converted
    fraction: FractionChoice | None  # a grad_worker_fraction='auto' choice to adopt
    plan: WorkPlan  # the plan after the load (the adopted choices')
    #: The shared weights' second-order state to load, by owner (with ``second_order``).
    shared: dict[str, SharedState] = field(default_factory=dict)
    #: The intervals' multiplier to restore (``adaptive_intervals``; ``None``: none saved).
    stretch: IntervalStretch | None = None
    #: The refresh cap and references to restore (``stale_refresh``; ``None``: none saved).
    stale: StaleRefresh | None = None


def write_state(
    *,
    steps: int,
    world_size: int,
    grad_workers: int,
    options: KFACOptions,
    choice: BudgetChoice | None,
    blocks: Mapping[str, dict[str, object]],
    fraction: FractionChoice | None = None,
    stretch: IntervalStretch | None = None,
    stale: StaleRefresh | None = None,
) -> dict[str, Any]:
    """The state dict: see the module docstring (``blocks``: each layer's block state;
    ``stretch``: the intervals' multiplier, written when ``adaptive_intervals`` is on;
    ``stale``: the refresh cap and references, written when ``stale_refresh`` is on)."""
    state = {
        "format": STATE_FORMAT,
        "steps": steps,
        "world_size": world_size,
        "grad_workers": grad_workers,
        "options": {name: getattr(options, name) for name in STATE_OPTIONS},
        "curvature_choice": None if choice is None else choice.state_dict(),
        "grad_worker_choice": None if fraction is None else fraction.state_dict(),
        "layers": dict(blocks),
    }
    if stretch is not None and stretch.enabled:
        state["interval_stretch"] = stretch.state_dict()
    if stale is not None and stale.enabled:
        state["stale_refresh"] = stale.state_dict()
    return state


def _saved_cadence(state_dict: Mapping[str, Any], key: str, holds: str) -> Mapping[str, Any] | None:
    """A cadence's saved state (``interval_stretch``, ``stale_refresh``), or ``None``."""
    saved = state_dict.get(key)
    if saved is not None and not isinstance(saved, Mapping):
        raise TypeError(
            f"state_dict {key!r} must be a dict holding {holds}; got {type(saved).__name__}"
        )
    return saved


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


def _saved_options(saved: object) -> dict[str, object]:
    """The checkpoint's ``'options'``, checked for form (their values may differ from ours)."""
    where = "state_dict 'options'"
    if not isinstance(saved, Mapping):
        raise TypeError(f"{where} must be a dict; got {type(saved).__name__}")
    required = [name for name in STATE_OPTIONS if name not in _OPTIONAL_OPTIONS]
    missing, unexpected = key_differences(saved, required, optional=list(_OPTIONAL_OPTIONS))
    if missing or unexpected:
        raise ValueError(
            f"{where} is malformed: missing {missing}, unexpected [{', '.join(unexpected)}]"
        )
    saved = {**_OPTIONAL_OPTIONS, **saved}
    for name, allowed in STATE_OPTIONS.items():
        value = saved[name]
        if type(value) is not type(allowed[0]):
            raise TypeError(f"{where}: {name} must be one of {allowed}; got {value!r}")
        if value not in allowed:
            raise ValueError(f"{where}: {name} must be one of {allowed}; got {value!r}")
    return dict(saved)


def _saved_choice(saved: object, target: CheckpointTarget) -> BudgetChoice | None:
    """The checkpoint's automatic choice, checked against ``target`` (no change)."""
    if saved is None:
        return None
    where = "state_dict 'curvature_choice'"
    choice = BudgetChoice.from_state(saved, where)
    specs = choice.specs
    if set(specs) != {layer.name for layer in target.layers}:
        raise ValueError(f"{where} names other layers than registered")
    for layer in target.layers:
        for side, size, fixed, chosen in zip(
            "AG", (layer.a_size, layer.g_size), layer.fixed, specs[layer.name], strict=True
        ):
            SideSpec.parse(chosen).check_size(size, f"{where}: layer {layer.name!r}, {side}")
            if fixed is not None and fixed != chosen:
                raise ValueError(
                    f"state_dict holds {side} of layer {layer.name!r} as {chosen!r}, but "
                    f"curvature fixes it to {fixed!r}"
                )
    mine = target.choice
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


def _saved_fraction(
    saved: object, target: CheckpointTarget
) -> tuple[FractionChoice | None, str | None]:
    """The checkpoint's ``grad_worker_fraction='auto'`` choice to adopt, and a note to warn.

    It wins over this preconditioner's own ``'auto'`` choice when made for
    the same world size and it fits this preconditioner's memory budget
    (otherwise refused, naming both); made for another world size, this
    preconditioner's choice stands (the note says so). A preconditioner
    given its fraction keeps it.
    """
    if saved is None:
        return None, None
    where = "state_dict 'grad_worker_choice'"
    world, m = FractionChoice.from_state(saved, where)
    mine = target.fraction
    if not mine.auto or (world, m) == (mine.world_size, mine.grad_workers):
        return None, None
    if world != target.world_size:
        return None, (
            f"kaisa: the checkpoint's grad_worker_fraction='auto' choice ({m} gradient "
            f"worker(s) per layer of {world} ranks) was made for another world size; this "
            f"preconditioner keeps its own ({mine.grad_workers} of {target.world_size})"
        )
    cost = mine.cost_of(m)
    budget = mine.memory_budget
    if cost is not None and budget is not None and cost.memory_bytes > budget:
        raise ValueError(
            f"{where}: the checkpoint's choice of {m} gradient worker(s) per layer needs "
            f"{cost.memory_bytes} bytes ({format_bytes(cost.memory_bytes)}) per rank, above "
            f"this preconditioner's memory_budget of {budget:.0f} bytes "
            f"({format_bytes(budget)}); give a larger memory_budget to resume with it"
        )
    return mine.adopt(m), None


def read_state(state_dict: object, target: CheckpointTarget) -> Restore:
    """Everything a load will install, checked against ``target``; nothing is changed here.

    Raises ``TypeError`` or ``ValueError`` naming the layer, the key or the
    option (see :meth:`kaisa.KFACPreconditioner.load_state_dict`).
    """
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
    missing, unexpected = key_differences(
        state_dict,
        sorted(required),
        optional=(
            "curvature_choice",
            "format",
            "grad_worker_choice",
            "interval_stretch",
            "stale_refresh",
        ),
    )
    if missing:
        raise ValueError(
            f"state_dict is not a KFACPreconditioner state dict (format {version}): "
            f"it lacks the keys {missing}"
        )
    if unexpected:
        raise ValueError(
            f"state_dict (format {version}) holds unexpected keys {', '.join(unexpected)}"
        )
    steps = check_count(state_dict["steps"], "state_dict 'steps'")
    stretch = stale = None
    saved_stretch = _saved_cadence(state_dict, "interval_stretch", "'factor'")
    if saved_stretch is not None:
        stretch = IntervalStretch(target.options.adaptive_intervals)
        stretch.load_state_dict(dict(saved_stretch))
    saved_stale = _saved_cadence(state_dict, "stale_refresh", "'cap' and 'reference'")
    if saved_stale is not None:
        stale = StaleRefresh(target.options.stale_refresh)
        stale.load_state_dict(saved_stale)
    world_size = check_count(state_dict["world_size"], "state_dict 'world_size'", low=1)
    grad_workers = check_count(state_dict["grad_workers"], "state_dict 'grad_workers'", low=1)
    saved_options = None if legacy else _saved_options(state_dict["options"])
    layers = state_dict["layers"]
    if not isinstance(layers, Mapping):
        raise TypeError(
            f"state_dict 'layers' must be a dict of layer states; got {type(layers).__name__}"
        )
    missing_layers, unexpected_layers = key_differences(
        layers, sorted({layer.name for layer in target.layers})
    )
    if missing_layers or unexpected_layers:
        raise ValueError(
            "state_dict layers do not match the registered layers: "
            f"missing {missing_layers}, unexpected [{', '.join(unexpected_layers)}]"
        )
    choice = _saved_choice(state_dict.get("curvature_choice"), target)
    adopt = choice if choice is not None and target.pending else None
    fraction, note = _saved_fraction(state_dict.get("grad_worker_choice"), target)
    if adopt is not None:
        specs = {layer.name: adopt.specs[layer.name] for layer in target.layers}
    else:
        specs = {layer.name: layer.specs for layer in target.layers}
    if adopt is not None or fraction is not None:
        plan = target.make_plan(specs, (fraction or target.fraction).grad_workers)
    else:
        plan = target.plan
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
        f"{layer.name}.{side}"
        for layer in target.layers
        for side, value in zip("AG", layer.fixed, strict=True)
        if value is None
    ]
    # A well-formed positive counter (a bad one is refused below, by name).
    folded = legacy or any(
        isinstance(entry, Mapping) and type(entry.get("updates")) is int and entry["updates"] > 0
        for entry in layers.values()
    )
    if choice is None and target.pending and auto_sides and folded:
        raise ValueError(
            "state_dict has no automatic curvature choice but holds folded factors (it was "
            "written with fixed curvature), while this preconditioner leaves "
            f"{', '.join(auto_sides)} to curvature='auto', whose choice at the first factor "
            "update would replace them; construct it with the checkpoint's curvature "
            "(each layer's 'representation')"
        )
    options = target.options
    converted = []
    if saved_options is not None:
        for name in _CONVERTIBLE:
            if saved_options[name] != getattr(options, name):
                converted.append(
                    f"{name}={saved_options[name]!r} (this preconditioner: "
                    f"{getattr(options, name)!r})"
                )
    same_plan = world_size == target.world_size and grad_workers == plan.grad_workers
    keep = same_plan and not legacy and not converted
    recompute = not keep
    blocks: dict[str, CheckedBlockState] = {}
    load_second_order: set[str] = set()
    shared: dict[str, SharedState] = {}
    for layer in target.layers:
        saved = layers[layer.name]
        saved_shared = None
        if isinstance(saved, Mapping) and "shared" in saved:
            if layer.shared is None:
                raise ValueError(
                    f"layer {layer.name!r}: its state holds a shared weight's state ('shared'), "
                    "but this layer shares no weight"
                )
            saved_shared = layer.shared(saved["shared"], f"layer {layer.name!r}", specs)
            saved = {key: value for key, value in saved.items() if key != "shared"}
        if saved_options is not None:
            method, outer = (
                saved_options["compute_method"],
                saved_options["compute_eigenvalue_outer_product"],
            )
            correction = saved_options["eigenvalue_correction"] != "off"
        else:
            method, outer = _legacy_method(saved, options.compute_method)
            correction = False
        layout = BlockLayout(
            layer.name,
            layer.a_size,
            layer.g_size,
            (SideSpec.parse(specs[layer.name][0]), SideSpec.parse(specs[layer.name][1])),
            method,  # type: ignore[arg-type]
            bool(outer),
            device=layer.device,
            factor_dtype=target.factor_dtype,
            inv_dtype=target.inv_dtype,
            correction=correction,
        )
        works_here = plan.is_grad_worker(layer.name, target.rank)
        checked = check_block_state(saved, layout, legacy=legacy, second_order=keep and works_here)
        blocks[layer.name] = checked
        if keep and works_here:
            if checked.second_order is not None and (
                layer.shared is None or saved_shared is not None
            ):
                load_second_order.add(layer.name)
                if saved_shared is not None:
                    shared[layer.name] = saved_shared
            else:
                # Written by a rank of another column. Every rank of this column
                # sees the same checkpoint and decides alike, and the recompute
                # only talks inside the column, so ranks need not agree on this.
                recompute = True
    if converted:
        warn(
            "kaisa: the checkpoint was written with "
            + ", ".join(converted)
            + "; its factors are loaded and the second-order state is recomputed from "
            "them at the next step()"
        )
    if note:
        warn(note)
    return Restore(
        adopt,
        blocks,
        load_second_order,
        steps,
        recompute,
        converted,
        fraction=fraction,
        plan=plan,
        shared=shared,
        stretch=stretch,
        stale=stale,
    )
