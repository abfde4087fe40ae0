"""The registered layers: each layer's handler, curvature block and captures, and where it stands.

A :class:`Roster` holds one :class:`Layer` per registered layer, in
registration order (the order every rank shares): the handler that reads the
module's traffic and gradient (:mod:`kaisa.layers`), the
:class:`~kaisa.curvature.block.KroneckerBlock` that holds its curvature, this
iteration's :class:`~kaisa.capture.LayerCaptures`, whether this rank is one of
its gradient workers (KAISA's plan) and whether it is dormant (it captured
nothing on the last factor-update step: its state is kept, its gradient left
raw). It makes the blocks, re-makes them when the automatic choice changes a
representation, places them by a plan, and answers what the layers hold
(memory, coverage, the read-only views); the front door decides when.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kaisa.autochoice import FixedSides
from kaisa.capture import LayerCaptures
from kaisa.checkpoint import LayerSlot
from kaisa.curvature.block import CheckedBlockState, Factor, KroneckerBlock
from kaisa.curvature.costs import SideSpec
from kaisa.curvature.shared import SharedCurvature, SharedState, Use
from kaisa.distributed.comm import PayloadKey
from kaisa.distributed.plan import WorkPlan
from kaisa.layers import LayerHandler
from kaisa.layers.registry import Coverage, Tie, Treatment, coverage_of
from kaisa.options import KFACOptions
from kaisa.views import BlockView, RegisteredLayer
from kaisa.warn import warn

__all__ = ["Layer", "Roster"]

log = logging.getLogger("kaisa")

#: At most this many layers are named in the eigenvalue correction's warning.
MAX_LISTED = 8

#: What a layer captures, given its name and its block's representations.
KeysFor = Callable[[str, Sequence[SideSpec]], tuple[PayloadKey, ...]]


@dataclass
class Layer:
    """One registered layer: its handler, its curvature block and this iteration's captures."""

    name: str
    handler: LayerHandler
    block: KroneckerBlock
    captures: LayerCaptures
    #: Captured nothing on the last factor-update step (on any rank): its
    #: factors and second-order state are kept, not folded or refreshed, and
    #: its gradient is left raw until it captures again.
    dormant: bool = False
    #: This rank preconditions the layer's gradient (KAISA's plan; set with the plan).
    grad_worker: bool = True
    #: The owner of a weight shared with other layers: its summed curvature
    #: (:mod:`kaisa.curvature.shared`), which preconditions the shared gradient.
    shared: SharedCurvature | None = None
    #: Another use of a shared weight: the owner this layer's captures serve
    #: (it folds its factors, but neither decomposes nor preconditions).
    tied_to: str | None = None
    #: A shared weight's use (owner or other) whose summed curvature is eigenvalue-corrected.
    tie_corrected: bool = False

    @property
    def active(self) -> bool:
        """Whether the layer decomposes and preconditions: not dormant, not another's use."""
        return not self.dormant and self.tied_to is None

    # -- second-order work: the block's, or the shared weight's ---------------------
    def decompose(self, which: Factor, damping: float) -> bool:
        if self.shared is not None:
            return self.shared.decompose(which, damping)
        return self.block.decompose(which, damping)

    def basis_kept(self, which: Factor) -> bool:
        """Whether side ``which``'s last refresh kept its held eigenbasis
        (``eigenbasis_tolerance``)."""
        if self.shared is not None:
            return self.shared.kept[which]
        return self.block.basis_kept(which)

    def can_keep_basis(self, which: Factor) -> bool:
        """Whether a refresh of side ``which`` may keep its eigenbasis (the block's, or the
        shared weight's: a decomposed side with ``eigenbasis_tolerance``)."""
        if self.shared is not None:
            return self.shared.can_keep_basis(which)
        return self.block.can_keep_basis(which)

    def refine(self, done: Sequence[Factor], damping: float) -> dict[Factor, float]:
        """The block's float64 redo (:meth:`KroneckerBlock.refine`); none for a shared weight."""
        return {} if self.shared is not None else self.block.refine(done, damping)

    def state_tensors(self, which: Factor) -> list[torch.Tensor]:
        if self.shared is not None:
            return self.shared.state_tensors(which)
        return self.block.state_tensors(which)

    def finish_update(self, damping: float) -> None:
        if self.shared is None:
            self.block.finish_update(damping)

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        if self.shared is not None:
            return self.shared.precondition(grad, damping)
        return self.block.precondition(grad, damping)

    def allocate_second_order(self) -> None:
        self.block.allocate_second_order()
        if self.shared is not None:
            self.shared.allocate()

    def state_dict(self) -> dict[str, object]:
        """The block's state dict; a shared weight's owner adds its state as ``'shared'``."""
        state = self.block.state_dict()
        if self.shared is not None and self.shared.state:
            state["shared"] = self.shared.state_dict()
        return state

    def load_checked(
        self,
        checked: CheckedBlockState,
        *,
        second_order: bool,
        shared: SharedState | None,
    ) -> None:
        """Install a checked block state (and a shared weight's, ``None``: the identity's)."""
        self.block.load_checked(checked, second_order=second_order)
        if self.shared is not None and (self.shared.state or shared is not None):
            self.shared.load(shared if second_order else None)

    @property
    def specs(self) -> tuple[str, str]:
        return str(self.block.specs[0]), str(self.block.specs[1])

    def slot(self, fixed: FixedSides) -> LayerSlot:
        handler = self.handler
        shared = None if self.shared is None else self.shared.check_state
        return LayerSlot(
            self.name,
            handler.a_size,
            handler.g_size,
            handler.weight.device,
            self.specs,
            fixed,
            shared=shared,
        )

    def view(self) -> RegisteredLayer:
        handler = self.handler
        return RegisteredLayer(
            name=self.name,
            module=handler.module,
            kind=handler.kind,
            a_size=handler.a_size,
            g_size=handler.g_size,
            curvature=self.specs,
            grad_worker=self.grad_worker,
            dormant=self.dormant,
            handler=handler,
            block=BlockView(self.block),
            capture_keys=self.captures.keys,
            micro_batches=self.captures.micro_batches,
            pending_passes=self.captures.pending,
            captured_rows=dict(self.captures.rows),
            corrected=self.correction_gap() is None,
        )

    def correction_gap(self) -> str | None:
        """Why ``eigenvalue_correction`` (when on) leaves this layer out; ``None`` if it does not.

        A Kronecker-vector side has no explicit eigenbasis. A tied
        weight is corrected in its summed curvature's eigenbasis
        (:mod:`kaisa.curvature.shared`), whatever its uses' sides, by the owner.
        """
        if self.tied_to is not None or self.shared is not None:
            return None if self.tie_corrected else "eigenvalue_correction 'off'"
        if self.block.correction == "off":
            a, g = self.block.specs
            return f"A {a}, G {g}"
        return None

    def has_local_gradient(self) -> bool:
        """Whether a parameter of the layer has a non-zero local ``.grad`` on this rank.

        Read from ``.grad`` itself, not through the engine: a staged engine's
        first read gathers on every rank, and only some ranks may ask. (Under
        ZeRO or FSDP2 ``.grad`` is not a plain tensor: nothing is reported.)
        """
        for p in self.handler.parameters():
            grad = p.grad
            if type(grad) is torch.Tensor and bool(grad.any()):
                return True
        return False


class Roster:
    """The registered layers of one preconditioner, in registration order.

    Args:
        found: ``(name, handler)`` of every registered layer.
        specs: each layer's representations to start with.
        keys: what a layer captures, for its name and representations.
        options, factor_dtype, inv_dtype: how blocks are made.
    """

    def __init__(
        self,
        found: Sequence[tuple[str, LayerHandler]],
        specs: Mapping[str, tuple[str, str]],
        keys: KeysFor,
        *,
        options: KFACOptions,
        factor_dtype: torch.dtype,
        inv_dtype: torch.dtype,
        ties: Sequence[Tie] = (),
    ) -> None:
        self.options = options
        self.factor_dtype = factor_dtype
        self.inv_dtype = inv_dtype
        self.layers: list[Layer] = []
        for name, handler in found:
            block = self.make_block(name, handler, specs[name])
            captures = LayerCaptures(name, handler, keys(name, block.specs))
            self.layers.append(Layer(name, handler, block, captures))
        by_name = self._by_name = {layer.name: layer for layer in self.layers}
        for tie in ties:
            owner = by_name[tie.uses[0][0]]
            owner.shared = SharedCurvature(
                owner.name,
                [Use(name, transposed) for name, transposed in tie.uses],
                lambda name: by_name[name].block,
                inv_dtype=inv_dtype,
                relative=options.damping_mode == "relative",
                correction=options.eigenvalue_correction,
                correction_decay=options.eigenvalue_decay,
                basis_tolerance=options.eigenbasis_tolerance,
            )
            for name, _ in tie.uses[1:]:
                by_name[name].tied_to = owner.name
            for name, _ in tie.uses:
                by_name[name].tie_corrected = options.eigenvalue_correction != "off"

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def captures(self) -> list[LayerCaptures]:
        return [layer.captures for layer in self.layers]

    def block_of(self, name: str) -> KroneckerBlock:
        return self._by_name[name].block

    def uses_of(self, layer: Layer) -> list[str]:
        """The layers sharing ``layer``'s weight, itself included (``[layer.name]`` if none)."""
        owner = self._by_name[layer.tied_to] if layer.tied_to is not None else layer
        return owner.shared.names if owner.shared is not None else [layer.name]

    def called(self) -> list[bool]:
        """Per layer, whether it ran this iteration; a shared weight's owner when any use did
        (it preconditions the weight's gradient, which every use's call adds to)."""
        return [
            any(self._by_name[name].captures.called for name in self.uses_of(layer))
            if layer.shared is not None
            else layer.captures.called
            for layer in self.layers
        ]

    @property
    def handlers(self) -> dict[str, LayerHandler]:
        return {layer.name: layer.handler for layer in self.layers}

    def keys(self) -> dict[str, tuple[PayloadKey, ...]]:
        """What each layer captures on a factor-update step."""
        return {layer.name: layer.captures.keys for layer in self.layers}

    def parameters(self) -> list[torch.Tensor]:
        """Each registered parameter once (attention projections share theirs)."""
        params = {id(p): p for layer in self.layers for p in layer.handler.parameters()}
        return list(params.values())

    # -- blocks and placement ----------------------------------------------------------
    def make_block(
        self, name: str, handler: LayerHandler, specs: tuple[str, str]
    ) -> KroneckerBlock:
        o = self.options
        return KroneckerBlock(
            name,
            handler.a_size,
            handler.g_size,
            device=handler.weight.device,
            factor_dtype=self.factor_dtype,
            inv_dtype=self.inv_dtype,
            method=o.compute_method,
            eigen_outer_product=o.compute_eigenvalue_outer_product,
            damping_mode=o.damping_mode,
            factor_init=o.factor_init,
            a_spec=specs[0],
            g_spec=specs[1],
            correction=o.eigenvalue_correction,
            correction_decay=o.eigenvalue_decay,
            basis_tolerance=o.eigenbasis_tolerance,
        )

    def install(self, specs: Mapping[str, tuple[str, str]], keys: KeysFor) -> None:
        """Re-make the blocks whose representations change; every layer captures anew."""
        for layer in self.layers:
            wanted = specs[layer.name]
            if layer.specs != tuple(wanted):
                layer.block = self.make_block(layer.name, layer.handler, wanted)
        self.rekey(keys)

    def rekey(self, keys: KeysFor) -> None:
        for layer in self.layers:
            layer.captures.keys = keys(layer.name, layer.block.specs)

    def uncorrected(self) -> list[tuple[str, str]]:
        """``(name, why)`` of every layer the eigenvalue correction, when on, does not reach."""
        if self.options.eigenvalue_correction == "off":
            return []
        gaps = [(layer.name, layer.correction_gap()) for layer in self.layers]
        return [(name, why) for name, why in gaps if why is not None]

    def uncorrected_message(self) -> str | None:
        """The warning for layers the eigenvalue correction, when on, leaves out (or None)."""
        left = self.uncorrected()
        if not left:
            return None
        shown = ", ".join(f"{name!r} ({why})" for name, why in left[:MAX_LISTED])
        more = f" and {len(left) - MAX_LISTED} more" if len(left) > MAX_LISTED else ""
        return (
            f"kaisa: eigenvalue_correction={self.options.eigenvalue_correction!r} reaches "
            f"{len(self) - len(left)} of {len(self)} layers; the others keep K-FAC's solve: "
            f"{shown}{more} (a Kronecker-vector side has no explicit eigenbasis). "
            "curvature='exact', a curvature rule for these layers, or for sides left to the "
            "automatic choice a larger time_budget, lets it reach them; "
            "layers[i].corrected says which it reaches"
        )

    def place(self, plan: WorkPlan, rank: int) -> None:
        """Who preconditions what (decided here, read everywhere else); state for this rank's."""
        for layer in self.layers:
            layer.grad_worker = plan.is_grad_worker(layer.name, rank)
            if layer.grad_worker and not layer.dormant:
                layer.allocate_second_order()

    # -- a factor-update step's idle layers ------------------------------------------
    def check_idle(
        self,
        payloads: Mapping[str, Mapping[PayloadKey, tuple[Any, float]]],
        *,
        began: bool,
        step: int,
        once: Callable[[str], bool],
        removed: Collection[int] = (),
        quiet_eval: bool = False,
    ) -> bool:
        """Mark the layers that captured nothing this factor-update step dormant (rows agree).

        Such a layer (it did not run, was frozen, saw a 0-row batch, a block
        LayerDrop skipped, a second ``step()`` after one backward pass) keeps
        its factors and second-order state: it is *dormant*, neither folded
        nor decomposed, and its gradient is left raw until it captures again.
        One whose parameters have a gradient though it was not called in an
        iteration that ran forward (``began``) is reported once: in evaluation
        mode inside a training model (unless ``quiet_eval``: the whole model's
        evaluation mode was reported), or used outside the module call kaisa
        hooks. Modules in ``removed`` (ids; reported elsewhere) are not.
        Returns whether a layer woke with second-order state that no factor
        update has reached yet (it must be recomputed now).
        """
        refresh = False
        captured = {
            layer.name: (payload := payloads.get(layer.name)) is not None
            and all(rows > 0 for _, rows in payload.values())
            for layer in self.layers
        }
        for layer in self.layers:
            uses = self.uses_of(layer)
            if layer.shared is not None:
                # A shared weight is preconditioned by its owner whenever one of its
                # uses captured: a use that never runs (the holder of an
                # encoder-decoder's shared embedding, T5's and BART's `shared`)
                # must not leave the summed curvature of the others raw.
                woke = any(captured[name] for name in uses)
                unreached = all(self.block_of(name).updates == 0 for name in uses)
            else:
                woke, unreached = captured[layer.name], layer.block.updates == 0
            if woke:
                if layer.dormant:
                    layer.dormant = False
                    if layer.grad_worker:
                        layer.allocate_second_order()
                    # Second-order state that no factor update has reached yet (a
                    # layer idle from the start, or re-made by the automatic choice
                    # while idle) is recomputed now; kept state waits for its turn.
                    refresh |= unreached
                continue
            if not layer.dormant:
                layer.dormant = True
                if once(f"idle {layer.name}"):
                    log.info(
                        "kaisa: layer %r captured nothing on factor-update step %d: its "
                        "factors and second-order state are kept, its gradient left raw "
                        "until it captures again",
                        layer.name,
                        step,
                    )
            if (
                not began
                or layer.captures.called
                or any(captured[name] for name in uses)  # a shared weight's other use ran
                or id(layer.handler.module) in removed
                or not layer.has_local_gradient()
            ):
                continue
            if not layer.handler.module.training:
                if not quiet_eval and once(f"eval {layer.name}"):
                    warn(
                        f"kaisa: layer {layer.name!r} is in evaluation mode while the model "
                        "runs a training forward: kaisa captures nothing from it and leaves "
                        "its gradient raw; call .train() on it to precondition it (reported "
                        "once per layer)"
                    )
            elif once(f"outside {layer.name}"):
                why = layer.handler.uncaptured_reason or (
                    "its weight was used outside the module call kaisa hooks (e.g. "
                    "F.linear(x, layer.weight))"
                )
                warn(
                    f"kaisa: layer {layer.name!r} captured nothing on factor-update step "
                    f"{step} in training mode, yet its parameters have a gradient: "
                    f"{why}; its gradient is left raw until it captures "
                    "(its factors are kept; reported once)"
                )
        return refresh

    # -- what the layers hold ----------------------------------------------------------
    def coverage(self, treatments: Sequence[Treatment]) -> Coverage:
        # A shared weight is as its owner is: preconditioned while any use runs,
        # whichever of them (an idle holder) captured nothing.
        def dormant(layer: Layer) -> bool:
            owner = self._by_name[layer.tied_to] if layer.tied_to is not None else layer
            return owner.dormant

        return coverage_of(
            treatments, {layer.name: (dormant(layer), "/".join(layer.specs)) for layer in self}
        )

    def memory(self) -> dict[str, int]:
        """Bytes of factors, second-order state and captures held on this rank."""
        return {
            "factors": sum(layer.block.factor_bytes() for layer in self),
            "second_order": sum(
                layer.block.second_order_bytes()
                + (layer.shared.state_bytes() if layer.shared else 0)
                for layer in self
            ),
            "captures": sum(layer.captures.capture_bytes() for layer in self),
        }
