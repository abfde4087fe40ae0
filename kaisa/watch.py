"""What ``step()`` tells the user about the loop around it, each thing once.

Reports kaisa gives once per preconditioner (``once``), and the checks that
find them at the start of a ``step()``: the model changed after the
preconditioner was built (:class:`~kaisa.attachment.Structure`), a
``GradScaler`` that has unscaled nothing yet, and gradients computed with the
model in evaluation mode. They warn at the user's line (:mod:`kaisa.warn`) and
change nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from kaisa.attachment import Structure
from kaisa.curvature.block import HELD_FACTOR_WARNING, OUTLIER_RATIO, RESCALE_RATIO
from kaisa.curvature.fold import SKIPPED_IN_A_ROW, FoldOutcome
from kaisa.engines.base import LossScale
from kaisa.roster import Layer
from kaisa.warn import warn

__all__ = ["Watch"]

log = logging.getLogger("kaisa")


class Watch:
    """The once-only reports of one preconditioner and the checks of its loop."""

    def __init__(self, model: nn.Module, modules: Iterable[nn.Module]) -> None:
        self.model = model
        self.structure = Structure(model, list(modules))
        self.reported: set[str] = set()
        #: Factor updates skipped (not finite) since the last one folded.
        self.skipped_in_a_row = 0

    def once(self, what: str) -> bool:
        """True the first time ``what`` is to be reported, then never again."""
        first = what not in self.reported
        self.reported.add(what)
        return first

    @property
    def evaluation_reported(self) -> bool:
        """Whether the model's evaluation mode was reported (a layer's then is not)."""
        return "eval mode" in self.reported

    def before_step(self, loss_scale: LossScale, thorough: bool) -> None:
        """The model's changes since construction and a still-scaled ``GradScaler``."""
        changes = self.structure.changes(thorough=thorough)
        if changes:
            warn(
                "kaisa: the model changed after the preconditioner was built: "
                + "; ".join(changes)
                + ". kaisa keeps preconditioning the layers it registered that still run; "
                "build a new preconditioner for the new model (call remove_hooks() on this "
                "one first). Each change is reported once",
                UserWarning,
            )
        if loss_scale.still_scaled() and self.once("scaled"):
            warn(
                "kaisa: the grad_scaler has unscaled no optimizer's gradients this iteration: "
                "call scaler.unscale_(optimizer) before preconditioner.step() (KL clipping on "
                "gradients still multiplied by the loss scale shrinks every step to nearly "
                "nothing); reported once"
            )

    def evaluation_mode(self, layers: Iterable[Layer], began: bool) -> None:
        """``step()`` in an iteration with no training forward: is the model evaluating?

        With the model (or every registered layer) in evaluation mode kaisa
        captures nothing, so gradients that exist were computed in evaluation
        mode and are left raw (with several ranks, preconditioned with the
        other ranks' curvature). Warned about once; ``step()`` with no
        gradient (after ``zero_grad()``) or in training mode says nothing here.
        """
        if self.evaluation_reported:
            return
        layers = list(layers)
        evaluating = (not began and not self.model.training) or not any(
            layer.handler.module.training for layer in layers
        )
        if not evaluating or not any(layer.has_local_gradient() for layer in layers):
            return
        self.once("eval mode")
        warn(
            "kaisa: step() found gradients on the registered layers, but they were computed "
            "with the model in evaluation mode (model.eval()): kaisa captures curvature in "
            "training mode only, so none was captured (in one process the gradients are left "
            "raw; with several ranks they take the other ranks' curvature). Call model.train() "
            "before the training forward pass (reported once)"
        )

    def folded(
        self,
        outcome: FoldOutcome,
        payloads: Mapping[str, Mapping[Any, tuple[torch.Tensor, float]]],
        product_dtype: torch.dtype,
    ) -> None:
        """A factor update's outcome: outlier batches (once per layer), lasting changes of
        scale (logged), and skips that keep coming (once)."""
        for name in outcome.outliers:
            if self.once(f"outlier {name}"):
                warn(
                    f"kaisa: layer {name!r}: a batch factor over {OUTLIER_RATIO:g}x its "
                    "running average was not folded: the next factor update was back within "
                    f"{RESCALE_RATIO:.3g}x the average, so it was an outlier batch (a scale "
                    "still beyond that at the next update is taken in; reported once per layer)"
                )
        for name in outcome.rescaled:
            log.info(
                "kaisa: layer %r: after a batch factor over %gx the running average, the next "
                "is still over %.3gx it; the scale changed (e.g. a LayerScale growing, attention "
                "starting to learn): the average restarts from it",
                name,
                OUTLIER_RATIO,
                RESCALE_RATIO,
            )
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if outcome.skipped else 0
        if self.skipped_in_a_row >= SKIPPED_IN_A_ROW:
            self.skipped(self.skipped_in_a_row, payloads, product_dtype)

    def skipped(
        self,
        in_a_row: int,
        payloads: Mapping[str, Mapping[Any, tuple[torch.Tensor, float]]],
        product_dtype: torch.dtype,
    ) -> None:
        """Factor updates skipped ``in_a_row`` times (not finite): say why, once."""
        if not self.once("skipped in a row"):
            return
        overflowed = [
            name
            for name, payload in payloads.items()
            if not all(bool(torch.isfinite(t).all()) for t, _ in payload.values())
        ]
        if overflowed and product_dtype == torch.float16:
            cause = (
                f"the factor products overflow float16 (factor_product_dtype=torch.float16; "
                f"largest value 65504, e.g. layer {overflowed[0]!r}): activations or output "
                "gradients around 100 already overflow their sums of squares. Use "
                "factor_product_dtype=torch.bfloat16 (float32's range) or torch.float32"
            )
        elif overflowed:
            cause = (
                f"the captured inputs or output gradients hold NaN or Inf (e.g. layer "
                f"{overflowed[0]!r}): a diverging loss, or AMP overflow (pass grad_scaler= so "
                "that kaisa unscales the output gradients)"
            )
        else:
            cause = (
                "the gradients hold NaN or Inf: a diverging loss, or AMP without "
                "scaler.unscale_(optimizer) before preconditioner.step() (the GradScaler then "
                "skips those optimizer steps)"
            )
        warn(
            f"kaisa: {in_a_row} factor updates in a row were skipped because "
            f"something was not finite, so no curvature is being gathered; likely cause: "
            f"{cause} (telemetry.skipped_factor_updates counts them; reported once)"
        )

    def refined(
        self,
        name: str,
        redone: Mapping[Any, float],
        damping: float,
        step: int,
        factor_dtype: torch.dtype,
    ) -> None:
        """Sides of a layer decomposed again in float64 (``KroneckerBlock.refine``)."""
        sides = "/".join(str(which).upper() for which in redone)
        if self.once(f"float64 {name}"):
            log.info(
                "kaisa: layer %r: factor(s) %s decomposed in float64 at step %d: in float32 "
                "the damped solve would be inaccurate (an ill-conditioned factor, damping %g)",
                name,
                sides,
                step,
                damping,
            )
        left = max(redone.values())
        if left > HELD_FACTOR_WARNING and self.once(f"factor dtype {name}"):
            # (A bound: past 100% it says only that nothing of the solve is sure.)
            how_far = f"up to about {left:.0%}" if left < 1.0 else "more than 100%"
            warn(
                f"kaisa: layer {name!r}: factor(s) {sides} are so ill-conditioned at damping "
                f"{damping:g} that, although kaisa decomposes them in float64, their running "
                f"averages held in {str(factor_dtype).removeprefix('torch.')} "
                f"(factor_dtype) may leave the preconditioned gradient {how_far} off a "
                "float64 run. Pass factor_dtype=torch.float64 (and inv_dtype=torch.float64) "
                "or a larger damping (reported once per layer)"
            )
