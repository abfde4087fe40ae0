"""One parameter used by several layers (a tied embedding and head): the sum of their curvatures.

A weight ``W`` that several registered layers use (GPT-2's ``lm_head.weight``
*is* ``wte.weight``) gets one gradient, the sum of every use's contribution,
and one block of curvature: the sum ``F = Σ_u F_u`` of the uses' K-FAC blocks
(the Fisher of the tied parameter when the uses' cross terms are dropped, as
K-FAC drops those between layers). ``docs/shared-parameters.md`` derives it;
in short:

* The gradient is held as one matrix ``M`` (``m × n``), in the orientation of
  the *owner*, one of the uses (the one with a bias if any, else the first).
  A use whose gradient matrix is ``M`` (same orientation) contributes
  ``F_u(M) = G_u M A_u``; one whose matrix is ``Mᵀ`` (the embedding's
  ``(dim, vocab)`` against the head's ``(vocab, dim)``) contributes
  ``(G_u Mᵀ A_u)ᵀ = A_u M G_u``. So every use is ``L_u M R_u``: ``F = Σ_u R_u ⊗ L_u``,
  with ``L_u`` on the owner's ``G`` side (``m``) and ``R_u`` on its ``A`` side
  (``n``). A use without the owner's bias has one row or column less: its
  factor is padded with zeros there (the bias gets no gradient from it).
* ``F`` is not one Kronecker product, and its exact inverse is out of reach
  (``(mn)³``). It is solved in one Kronecker eigenbasis ``Q_L ⊗ Q_R``: the
  eigenbases of the partial traces ``Σ_u tr(R_u) L_u`` and
  ``Σ_u tr(L_u) R_u``, with ``F``'s exact diagonal in that basis,
  ``Λ = Σ_u λ_u ρ_uᵀ`` (``λ_u = diag(Q_Lᵀ L_u Q_L)``, ``ρ_u = diag(Q_Rᵀ R_u Q_R)``):
  ``P = Q_L [(Q_Lᵀ ∇ Q_R) ⊘ (Λ / s + γ)] Q_Rᵀ`` (``s = mean(Λ)`` under
  relative damping, 1 otherwise). With one use this is K-FAC's exact eigen
  solve; when the uses' factors commute it is ``(F/s + γI)⁻¹`` exactly.
* The vocabulary side stays affordable: a side is held *diagonal*
  (``Q = I``, ``O(n)``) unless some use holds its factor there ``'exact'``
  (the embedding's token counts are diagonal; of a head's ``'diagonal'``,
  ``'kvec'`` or ``'lowrank'`` ``G`` the diagonal is taken); it is decomposed
  (``n³``) only where the budget chose an exact factor as affordable.

* With ``eigenvalue_correction`` on, ``Λ`` gives way to the measured second
  moments of the rotated gradient, as in any corrected layer
  (:mod:`kaisa.curvature.eigencorrection`): ``S``, the running average of
  ``(Q_Lᵀ ∇ Q_R)²``, divides it, rescaled to ``mean(Λ)/s`` for ``'ekfac'``.
  ``Λ`` is the best diagonal of ``F`` in a basis that diagonalises neither
  use's block; ``S`` is measured in that basis, whatever it is.

The uses keep their own blocks, captures and running averages (folded as any
layer's); this object holds only the shared second-order state, on the owner's
gradient workers: per side ``[Q, ρ_1 … ρ_U]`` (exact) or ``[ρ_1 … ρ_U]``
(diagonal), and ``S`` when corrected. Nothing here knows modules, hooks or ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kaisa.choices import EigenCorrection
from kaisa.curvature.block import Factor, KroneckerBlock
from kaisa.curvature.costs import SideSpec
from kaisa.curvature.eigencorrection import EigenScales
from kaisa.curvature.linalg import (
    DecompositionError,
    all_finite,
    compute_dtype,
    held_basis,
    mean_scale,
    symmetric_eigen,
)
from kaisa.validation import check_tensor
from kaisa.warn import warn

__all__ = ["SharedCurvature", "SharedState", "Use"]

_OTHER: dict[Factor, Factor] = {"a": "g", "g": "a"}
#: The keys of a corrected shared weight's ``S`` in its state dict.
_SCALE_KEYS = ("scales", "scale_updates")


@dataclass(frozen=True)
class Use:
    """One use of a shared weight: its layer's name, and whether its gradient matrix is
    the owner's transposed."""

    name: str
    transposed: bool = False


@dataclass(frozen=True)
class SharedState:
    """A shared weight's checked second-order state: each side's tensors and, when
    saved, the eigenvalue correction's ``(S, updates)``."""

    sides: dict[Factor, list[torch.Tensor]]
    scales: tuple[torch.Tensor, int] | None = None


class SharedCurvature:
    """The summed curvature of the uses of one shared weight (see the module docstring).

    Args:
        name: the owner's layer name (messages).
        uses: each use, the owner first (its sizes are its block's:
            ``g_size × a_size``).
        block_of: each use's current block, by name (blocks are re-made when
            the automatic choice changes a representation).
        inv_dtype: the dtype the second-order state is stored in (solved in
            at least float32).
        relative: relative damping (``Λ`` divided by its mean).
        correction: the eigenvalue correction (``'off'``, ``'ekfac'`` or
            ``'adam'``, see the module docstring).
        correction_decay: ``S``'s running-average decay.
        basis_tolerance: ``eigenbasis_tolerance``: a refresh of an exact side
            keeps the held basis while it diagonalises the uses' weighted sum
            to within this share (:func:`~kaisa.curvature.linalg.held_basis`).
    """

    def __init__(
        self,
        name: str,
        uses: Sequence[Use],
        block_of: Callable[[str], KroneckerBlock],
        *,
        inv_dtype: torch.dtype,
        relative: bool,
        correction: EigenCorrection = "off",
        correction_decay: float = 0.99,
        basis_tolerance: float | None = None,
    ) -> None:
        if len(uses) < 2 or uses[0].transposed:
            raise ValueError("a shared weight needs its owner first and at least one more use")
        self.name = name
        self.uses = list(uses)
        self.block_of = block_of
        owner = block_of(uses[0].name)
        self.sizes: dict[Factor, int] = {"a": owner.a_size, "g": owner.g_size}
        for use in uses:
            block = block_of(use.name)
            sizes = (block.g_size, block.a_size)
            if use.transposed:
                sizes = sizes[::-1]
            if not (0 <= self.sizes["g"] - sizes[0] <= 1 and 0 <= self.sizes["a"] - sizes[1] <= 1):
                raise ValueError(
                    f"shared weight of {name!r}: use {use.name!r} has sides {sizes}, the owner "
                    f"{(self.sizes['g'], self.sizes['a'])}"
                )
        self.inv_dtype = inv_dtype
        self.work_dtype = compute_dtype(inv_dtype)
        self.relative = relative
        self.device = owner.a.device
        self.state: dict[Factor, list[torch.Tensor]] = {}
        self.correction: EigenCorrection = correction
        self.correction_decay = correction_decay
        self.basis_tolerance = basis_tolerance
        #: Per side: whether its last refresh kept the held basis (``basis_tolerance``).
        self.kept: dict[Factor, bool] = {"a": False, "g": False}
        #: ``S`` of the corrected solve (``m × n``), on the owner's gradient workers.
        self.scales: EigenScales | None = None

    @property
    def names(self) -> list[str]:
        return [use.name for use in self.uses]

    # -- the uses' factors on one side ---------------------------------------------
    def _side_of(self, use: Use, which: Factor) -> Factor:
        """The use's own side that lies on the owner's side ``which``."""
        return _OTHER[which] if use.transposed else which

    def _pieces(self, which: Factor) -> list[tuple[torch.Tensor, bool]]:
        """Each use's factor on the owner's side ``which``: ``(tensor, full)``.

        ``full``: an ``n × n`` matrix (an exact side); otherwise the ``n``
        diagonal (of a low-rank side's running average, or a moments side's
        mean squared row). Padded with zeros to ``n``. A use whose factors no
        update has reached (a module holding the weight that never runs: an
        encoder-decoder's ``shared`` embedding) contributes zeros, not its
        starting factor.
        """
        n = self.sizes[which]
        pieces = []
        for use in self.uses:
            block = self.block_of(use.name)
            side = block.sides[self._side_of(use, which)]
            factor = side.factor
            if block.updates == 0:
                full = side.spec.kind == "exact"
                pieces.append((factor.new_zeros((n, n) if full else (n,)), full))
            elif side.spec.kind == "exact":
                padded = factor.new_zeros(n, n)
                padded[: factor.shape[0], : factor.shape[1]] = factor
                pieces.append((padded, True))
            else:  # its diagonal: of the gram (low-rank), or the mean squared row
                diagonal = factor.diagonal() if side.spec.capture == "gram" else factor[1]
                padded = factor.new_zeros(n)
                padded[: diagonal.shape[0]] = diagonal
                pieces.append((padded, False))
        return pieces

    def can_keep_basis(self, which: Factor) -> bool:
        """Whether a refresh of side ``which`` may keep its eigenbasis (decomposed, with
        ``basis_tolerance``)."""
        return self.basis_tolerance is not None and self.kind(which) != "diagonal"

    def kind(self, which: Factor, specs: Mapping[str, tuple[str, str]] | None = None) -> str:
        """``'exact'`` (decomposed) when some use holds side ``which`` exact, else
        ``'diagonal'``; for the uses' representations ``specs``
        (``(A, G)`` by name; default: their blocks')."""
        for use in self.uses:
            side = self._side_of(use, which)
            if specs is None:
                kind = self.block_of(use.name).sides[side].spec.kind
            else:
                kind = SideSpec.parse(specs[use.name][0 if side == "a" else 1]).kind
            if kind == "exact":
                return "exact"
        return "diagonal"

    def shapes(
        self, which: Factor, specs: Mapping[str, tuple[str, str]] | None = None
    ) -> list[tuple[int, ...]]:
        """The shapes of side ``which``'s state tensors (``[Q,] ρ_1 … ρ_U``)."""
        n = self.sizes[which]
        basis: list[tuple[int, ...]] = [(n, n)] if self.kind(which, specs) == "exact" else []
        return basis + [(n,)] * len(self.uses)

    def dense_factors(self, which: Factor) -> list[torch.Tensor]:
        """Each use's factor on side ``which`` as an ``n × n`` matrix (tests, inspection)."""
        return [p if full else torch.diag(p) for p, full in self._pieces(which)]

    # -- second-order state ----------------------------------------------------------
    def _identity_state(self, which: Factor) -> list[torch.Tensor]:
        n = self.sizes[which]
        ones = [torch.ones(n, dtype=self.inv_dtype, device=self.device) for _ in self.uses]
        if self.kind(which) == "exact":
            return [torch.eye(n, dtype=self.inv_dtype, device=self.device), *ones]
        return ones

    def allocate(self) -> None:
        """State on this rank, that of identity factors, where a side has none (or of
        another form: the uses' representations changed)."""
        sides: tuple[Factor, Factor] = ("a", "g")
        for which in sides:
            held = self.state.get(which)
            if held is None or [tuple(t.shape) for t in held] != self.shapes(which):
                self.state[which] = self._identity_state(which)
                # A new basis (a side turned exact or diagonal): S was measured in the old one.
                self.scales = None
        if self.correction != "off" and self.scales is None:
            self.scales = EigenScales.zeros(
                self.sizes["g"], self.sizes["a"], self.device, self.work_dtype
            )

    def state_tensors(self, which: Factor) -> list[torch.Tensor]:
        """The tensors a refresh writes and the column broadcast sends."""
        self.allocate()
        return self.state[which]

    def _compute(self, which: Factor) -> list[torch.Tensor]:
        self.kept[which] = False
        pieces = self._pieces(which)
        if not all_finite(*(p for p, _ in pieces)):
            raise DecompositionError("a use's factor holds NaN or Inf")
        if self.kind(which) == "diagonal":
            return [p.to(self.inv_dtype) for p, _ in pieces]
        dtype = compute_dtype(pieces[0][0].dtype)
        # The partial trace over the other side: each use weighted by its other
        # factor's trace (K-FAC's eigenbasis when there is one use).
        weights = [
            p.to(dtype).sum() if not full else p.to(dtype).trace()
            for p, full in self._pieces(_OTHER[which])
        ]
        mats = [p.to(dtype) if full else torch.diag(p.to(dtype)) for p, full in pieces]
        total = sum((w * m for w, m in zip(weights, mats, strict=True)), torch.zeros_like(mats[0]))
        held = None
        if self.basis_tolerance is not None:
            held = held_basis(total, self.state[which][0], self.basis_tolerance)
        self.kept[which] = held is not None
        q = held[0].to(dtype) if held is not None else symmetric_eigen(total, dtype)[0]
        rho = [((m @ q) * q).sum(dim=0).clamp_(min=0.0) for m in mats]
        return [q.to(self.inv_dtype), *(r.to(self.inv_dtype) for r in rho)]

    def decompose(self, which: Factor, damping: float) -> bool:
        """Refresh side ``which`` from the uses' running averages; ``False`` (state kept) on
        failure, warned about."""
        self.allocate()
        try:
            new = self._compute(which)
        except DecompositionError as error:
            warn(
                f"kaisa: shared weight of {self.name!r} ({', '.join(self.names)}): side "
                f"{which.upper()} could not be decomposed ({error}); keeping its previous "
                "second-order state"
            )
            return False
        for old, value in zip(self.state[which], new, strict=True):
            old.copy_(value)
        return True

    def _basis_and_values(self, which: Factor) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        state = [t.to(self.work_dtype) for t in self.state_tensors(which)]
        if len(state) > len(self.uses):
            return state[0], state[1:]
        return None, state

    def eigenvalues(self) -> torch.Tensor:
        """``Λ = Σ_u λ_u ρ_uᵀ`` (``m × n``): ``F``'s diagonal in the shared eigenbasis."""
        _, lam = self._basis_and_values("g")
        _, rho = self._basis_and_values("a")
        return sum(
            (torch.outer(g, a) for g, a in zip(lam, rho, strict=True)),
            torch.zeros(
                self.sizes["g"], self.sizes["a"], dtype=self.work_dtype, device=self.device
            ),
        )

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        """``Q_L [(Q_Lᵀ ∇ Q_R) ⊘ (Λ/s + γ)] Q_Rᵀ`` for the owner's ``(m, n)`` gradient.

        Corrected (``correction`` not ``'off'``): this step's rotated gradient
        is folded into ``S``, which replaces ``Λ/s`` (``'ekfac'``: rescaled to
        its mean, 1 under relative damping; ``'adam'``: its square root).
        """
        q_g, _ = self._basis_and_values("g")
        q_a, _ = self._basis_and_values("a")  # (state_tensors allocated S, when corrected)
        if self.scales is not None:
            # μ = mean(Λ) as the damping sees it: 1 under relative damping.
            kron_mean = 1.0 if self.relative else self.eigenvalues().mean()
            return self.scales.solve(
                grad,
                q_a,
                q_g,
                damping,
                self.correction_decay,
                self.correction,
                self.relative,
                kron_mean,
            ).contiguous()
        values = self.eigenvalues()
        if self.relative:
            values = values / mean_scale(values)
        m = grad.to(self.work_dtype)
        if q_g is not None:
            m = q_g.t() @ m
        if q_a is not None:
            m = m @ q_a
        m = m / values.add_(damping)
        if q_g is not None:
            m = q_g @ m
        if q_a is not None:
            m = m @ q_a.t()
        return m.to(grad.dtype).contiguous()

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        """Each side's tensors (``'a'``, ``'g'``) and, when corrected, ``'scales'``
        (``S``) and ``'scale_updates'``."""
        state: dict[str, object] = {
            which: [t.clone() for t in tensors] for which, tensors in self.state.items()
        }
        if self.scales is not None:
            state["scales"] = self.scales.scales.clone()
            state["scale_updates"] = self.scales.updates
        return state

    def check_state(
        self, saved: object, where: str, specs: Mapping[str, tuple[str, str]] | None = None
    ) -> SharedState:
        """A saved :meth:`state_dict`, checked for the uses' representations ``specs``
        (shapes, finite, non-negative values); raises ``TypeError``/``ValueError``,
        changes nothing. Saved ``S`` is kept only when this weight is corrected."""
        keys = {"a", "g"}
        if not isinstance(saved, Mapping) or not keys <= set(saved) <= keys | set(_SCALE_KEYS):
            raise TypeError(
                f"{where}: 'shared' must be a dict of the sides 'a' and 'g' (and, when "
                "eigenvalue-corrected, 'scales' and 'scale_updates')"
            )
        checked: dict[Factor, list[torch.Tensor]] = {}
        sides: tuple[Factor, Factor] = ("a", "g")
        for which in sides:
            tensors = saved[which]
            shapes = self.shapes(which, specs)
            if not isinstance(tensors, (list, tuple)) or len(tensors) != len(shapes):
                raise ValueError(
                    f"{where}: shared second-order state of {which.upper()} must be "
                    f"{len(shapes)} tensors of shapes {shapes} (uses {', '.join(self.names)})"
                )
            what = f"{where}: shared second-order state of {which.upper()}"
            out = [
                check_tensor(t, what, s, self.device, self.inv_dtype)
                for t, s in zip(tensors, shapes, strict=True)
            ]
            values = out[1:] if len(shapes) > len(self.uses) else out
            if any(v.numel() and float(v.min()) < 0.0 for v in values):
                raise ValueError(
                    f"{what} has negative eigenvalues (a sum of factors is positive semi-definite)"
                )
            checked[which] = out
        return SharedState(checked, self._check_scales(saved, where))

    def _check_scales(
        self, saved: Mapping[str, object], where: str
    ) -> tuple[torch.Tensor, int] | None:
        held = [key for key in _SCALE_KEYS if key in saved]
        if not held:
            return None
        what = f"{where}: shared eigenvalue-corrected scales"
        if len(held) != len(_SCALE_KEYS):
            raise ValueError(f"{what}: the state must hold both 'scales' and 'scale_updates'")
        updates = saved["scale_updates"]
        if isinstance(updates, bool) or not isinstance(updates, int) or updates < 0:
            raise ValueError(f"{what}: 'scale_updates' must be an int >= 0, got {updates!r}")
        shape = (self.sizes["g"], self.sizes["a"])
        scales = check_tensor(saved["scales"], what, shape, self.device, self.work_dtype)
        if scales.numel() and float(scales.min()) < 0.0:
            raise ValueError(f"{what} are negative (a running average of squares has none)")
        return (scales, updates) if self.correction != "off" else None

    def load(self, checked: SharedState | None) -> None:
        """Install a :meth:`check_state` result, or go back to the identity's state (``None``;
        ``S`` starts again, as it does when none was saved)."""
        self.state = {}
        self.scales = None
        self.allocate()
        if checked is None:
            return
        for which, tensors in checked.sides.items():
            for target, value in zip(self.state[which], tensors, strict=True):
                target.copy_(value)
        if self.scales is not None and checked.scales is not None:
            self.scales.scales.copy_(checked.scales[0])
            self.scales.updates = checked.scales[1]

    def state_bytes(self) -> int:
        held = sum(t.numel() * t.element_size() for ts in self.state.values() for t in ts)
        return held + (self.scales.nbytes() if self.scales is not None else 0)
